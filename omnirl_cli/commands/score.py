"""`omnirl score`: rewards for every sample, written as their own column group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

from stages.outputs import check_format, finalize, map_shards, open_inputs, plugin_files, run_config
from stages.score.config import ScoreConfig

from ..console import emit_json, print_result, progress
from ..generate import config_command
from ..runtime import device, report_complete


def run(c: ScoreConfig, json_: bool) -> None:
    """Score each sample's image (or VLM response) with one or more rewards; writes reward and reward.<name>.

    A scorer that fails or returns NaN stops the run naming the sample, unless --on-error zero
    (a dead `serve-reward` mid-run fails its batches: their rows are flagged and counted as failed).
    Plugins take (images: list[PIL.Image], prompts: list[str], meta: list[dict]) and return one float
    (or None) per sample; video plugins set `reward_kind = "video"` and take one list of frames
    (PIL images) per sample instead of an image; text plugins take the response strings instead and set `reward_kind = "text"`
    (wrap verl `compute_score` or trl reward functions with stages.score.text_rewards.verl_compute_score
    / trl_reward). Meta holds the prompt row's ground_truth, data_source, extra_info,
    max_response_length, response_length and truncated (the response hit --max-new-tokens, OmniRL's
    max_output_token_length, without a stop token: every format reward scores it 0; the result counts
    them as "truncated"). In a conditioned rollout (an editing or image-to-video model's) meta also
    holds condition_images: the row's source images as PIL images (the edit rewards compare with them).

    --report-to logs reward/mean, reward/std and reward.<name>/mean, /std at the iteration K of --out
    RUN/it<K>/rewards (0 outside that layout); a held-out evaluation, --out RUN/it<K>/eval/rewards
    (recipes/eval.mk), logs them as eval/reward/mean ... on a series of its own, never the training curve.

    A re-run skips shards that are complete and verified; over a finished --out it scores nothing, says
    so, and reports that output's statistics (`"skipped": true` with --json).

    A rollout sampled with --defer-decode holds final latents, no media: score decodes them with the VAE
    of the rollout's model (or --model) on this process's device, in the rollout's batches and under its
    --dtype and --mixed-precision, so the rewards equal those of the decoded rollout's PNGs (frames).

    VLM: [bold]omnirl score --in run/it0/samples --reward accuracy=0.9 --reward format_boxed=0.1 --out run/it0/rewards[/]

    Example: [bold]omnirl score --in run/it0/samples --reward ocr --reward jpeg_compressibility=0.1 --out run/it0/rewards[/]

    CLIP: [bold]omnirl score --in run/it0/samples --reward pickscore --reward-arg pickscore.model=/models/PickScore_v1 \\
    --reward-arg pickscore.processor=/models/CLIP-ViT-H-14-laion2B-s32B-b79K --out run/it0/rewards[/]
    """
    from stages.dist import world_and_rank
    from stages.models.condition_images import stored_condition_images
    from stages.precision import resolve_mixed_precision
    from stages.reporting import reward_statistics
    from stages.sample.stage import KINDS
    from stages.score.registry import check_reward_args, parse_reward_args, parse_reward_spec
    from stages.score.scoring import FAILED_COLUMN, failed_rewards
    from stages.score.stage import needed_columns, score_shard, text_columns, truncated_rows
    from stages.shards.reader import rollout_modality
    from stages.shards.writer import ShardSetWriter
    from stages.tracking import held_out, open_tracking, run_location

    c = replace(
        c, mixed_precision=resolve_mixed_precision(c.mixed_precision)
    )  # the launcher's enters the identity
    tracking = open_tracking(c.report_to, c.out, c.run_name)
    specs = [parse_reward_spec(s) for s in c.reward or []]
    if not specs:
        from stages.errors import UserInputError

        raise UserInputError("--reward: give at least one reward, e.g. --reward jpeg_compressibility")
    reward_args = check_reward_args([name for name, _ in specs], parse_reward_args(c.reward_args))
    src = open_inputs(c.inputs)
    modality = rollout_modality(src.manifests)
    sources = stored_condition_images(src.paths, src.manifests)  # an editing / I2V rollout's, per group
    c, open_decoder, keep = _deferred(c, src, modality)
    decoder = None
    writer = ShardSetWriter(
        c.out,
        num_shards=src.num_shards,
        format=check_format(c.fmt),
        command="score",
        config=_identity(c, specs, reward_args),
        parents=[*src.paths, *plugin_files([name for name, _ in specs])],
        policy=src.manifests[0].policy,
        kinds=KINDS if keep else None,
        overwrite=c.overwrite,
    )
    seconds: dict[str, float] = {}  # per reward, this process's scoring time
    scored = [0]

    def score_one(shard: dict, advance: Callable[[int], None]) -> dict:
        out = score_shard(
            shard,
            specs,
            modality=modality,
            batch_size=c.batch_size,
            on_error=c.on_error,
            on_batch=advance,
            reward_args=reward_args,
            seconds=seconds,
            mixed_precision=c.mixed_precision,
            decoder=decoder,
            keep_media=keep,
            condition_images=sources,
        )
        scored[0] += len(out["sample_id"])
        return out

    extra = None
    skipped = writer.complete
    if not skipped:
        decoder = open_decoder() if open_decoder else None
        columns = (
            text_columns(list(src.columns))
            if modality == "text"
            else needed_columns(
                modality, src.columns, deferred=decoder is not None, conditioned=bool(sources)
            )
        )
        with progress() as bar:
            map_shards(src, writer, "scoring", columns, score_one, display=bar)
        if world_and_rank()[1] == 0:  # the rank that writes the manifest
            extra = {FAILED_COLUMN: _failed_count(writer)}
    if not finalize(writer, extra):
        return
    from stages.shards.reader import ShardSet

    rewards = ShardSet(c.out).read_all()
    # the prompts' data source, tag and (VLM) media kinds, for the per-subset statistics
    prompts = src.read_all([c for c in ("prompt_meta", "messages") if c in src.columns])
    meta, messages = prompts.get("prompt_meta"), prompts.get("messages")
    result = {
        "out": str(c.out),
        "rows": len(rewards["sample_id"]),
        FAILED_COLUMN: int(failed_rewards(rewards, len(rewards["sample_id"])).sum()),
        **reward_statistics(rewards, meta, messages),
    }
    if modality == "text":  # responses cut at the sampling cap: their format rewards are 0
        result["truncated"] = sum(truncated_rows(src.read_all(text_columns(list(src.columns)))))
    with tracking:
        tracking.log_rewards(run_location(c.out)[1] or 0, rewards, meta, messages, held_out=held_out(c.out))
    # this process's scoring speed per reward (images are decoded once per batch for all of them)
    result.update({f"perf/{name}/samples_per_s": scored[0] / t for name, t in seconds.items() if t > 0})
    if skipped:
        report_complete(c.out, json_, result)
    elif json_:
        emit_json({**result, "skipped": False})
    else:
        print_result(
            f"[green]scored[/] {result['rows']} samples → {c.out}  reward {result['reward/mean']:.4f} "
            f"± {result['reward/std']:.4f} (mean ± sd over the scored samples), {result[FAILED_COLUMN]} failed"
        )


def _failed_count(writer: Any) -> int:
    """How many rows of the shards `writer` holds (all written, manifest not yet) are flagged in
    reward_failed: the count recorded in the manifest's extra."""
    from stages.score.scoring import FAILED_COLUMN

    if FAILED_COLUMN not in {column.name for column in writer.columns or ()}:
        return 0
    return sum(
        int(writer.read_shard(s, [FAILED_COLUMN])[FAILED_COLUMN].sum()) for s in range(writer.num_shards)
    )


def _identity(c: ScoreConfig, specs: list[tuple[str, float]], reward_args: dict[str, dict[str, Any]]) -> dict:
    """`run_config` (with the reward arguments as parsed) plus the content digests of the files the
    rewards' arguments name (model folders, MLP weights), so re-scoring under replaced weights redoes
    the work."""
    from stages.score.registry import reward_files
    from stages.shards.digest import content_digest

    config = run_config({**asdict(c), "reward_args": reward_args or None})
    digests = {
        f"{name}.{key}": content_digest(path, f"--reward-arg {name}.{key}")
        for name, _ in specs
        for key, path in reward_files(name, reward_args.get(name)).items()
    }
    if digests:
        config["reward_args_sha256"] = digests
    return config


def _deferred(
    c: ScoreConfig, src: Any, modality: str
) -> tuple[ScoreConfig, Callable[[], Any] | None, Callable[[list], dict] | None]:
    """`c`, and for a rollout whose media is deferred (`stages.media.deferred`): a function loading the
    `LatentDecoder` of its final latents (called only when there is scoring left to do, so a finished
    run loads no VAE) and, with --keep-media, the function making a batch's media columns; (c, None,
    None) for a rollout that stores its media. There --keep-media is refused, and --model, --vae-tiling
    and --vae-slicing (names a preset's top-level keys share with other commands) are left out of `c`."""
    from stages.errors import UserInputError
    from stages.media import MEDIA_COLUMNS, media_columns
    from stages.media.deferred import LatentDecoder, deferred_media
    from stages.models.diffusion import load_decoder
    from stages.sample.rollout import sample_config_of

    record = deferred_media(src.manifests)
    if record is None or any(col in src.columns for col in MEDIA_COLUMNS):
        if c.keep_media:
            raise UserInputError("--keep-media: --in stores its media already (nothing to decode); drop it")
        return replace(c, model=None, vae_tiling=False, vae_slicing=False), None, None
    model = c.model or Path(record["model"])
    cfg = sample_config_of(src.manifests)
    tiling, slicing = c.vae_tiling, c.vae_slicing

    def open_decoder() -> LatentDecoder:
        if c.model is None and not Path(model).is_dir():
            raise UserInputError(
                f"--in: its media is deferred and the model folder it records, {model}, is gone; pass "
                "--model with the pipeline it was sampled with"
            )
        on = device()
        family = load_decoder(model, device=on, dtype=record["dtype"], tiling=tiling, slicing=slicing)
        if family.media != modality:
            raise UserInputError(
                f"--model {model}: its {family.name} VAE decodes {family.media}s but --in is a {modality} "
                "rollout; pass the pipeline it was sampled with"
            )
        return LatentDecoder(
            family.decode, batch_size=cfg.batch_size, mixed_precision=cfg.mixed_precision, device=on
        )

    keep = partial(media_columns, fps=cfg.fps, save_frames=cfg.save_frames) if c.keep_media else None
    return c, open_decoder, keep


score = config_command(ScoreConfig, "score", run)
