"""`omnirl score`: rewards for every sample, written as their own column group."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer

from ..choices import REWARD_ENTRY_POINTS, REWARDS, OnError, complete
from ..config import resolve
from ..console import emit_json, print_result
from ..errors import handle_errors
from ..options import (
    WEIGHTS_FROM,
    WEIGHTS_METAVAR,
    ConfigOpt,
    FormatOpt,
    InOpt,
    JsonOpt,
    OutOpt,
    OverwriteOpt,
    ReportToOpt,
    RunNameOpt,
    SetOpt,
    mixed_precision_opt,
)
from ..runtime import (
    check_format,
    device,
    finalize,
    map_shards,
    open_inputs,
    plugin_files,
    report_complete,
    run_config,
)

DEFERRED = "Deferred media"


@handle_errors
def score(
    ctx: typer.Context,
    inputs: InOpt = None,
    out: OutOpt = None,
    reward: Annotated[
        list[str] | None,
        typer.Option(
            "--reward",
            "-r",
            autocompletion=complete(REWARDS, REWARD_ENTRY_POINTS),
            metavar="NAME[@frames=AGG][=WEIGHT]",
            help="A built-in image reward (jpeg_compressibility, "
            "jpeg_incompressibility, ocr, pickscore, clipscore, image_similarity, aesthetic, hpsv2, imagereward, "
            "geneval, geneval_strict, geneval_exact, geneval_shapes, geneval_shapes_strict, geneval_shapes_exact, "
            "vlm_judge), for video rollouts an image "
            "reward on the frames with @frames=mean|min|first|last (e.g. pickscore@frames=mean=0.5) or a video "
            "reward (temporal_consistency: CLIP cosine of consecutive frames; video_ocr: flow_grpo's Wan OCR "
            "over every 4th frame), or a text reward for VLM rollouts "
            "(format_think_answer, format_boxed, accuracy, bleu, rouge_1, rouge_l, rouge_l_recall, meteor, "
            "text_similarity, length_penalty, repetition_penalty, omnirl_accuracy, omnirl_length), remote:http://HOST:PORT/NAME (a reward served by `omnirl "
            "serve-reward`), module:function or path/file.py:function, or an 'omnirl.rewards' entry point. The "
            "total is the weighted sum.",
        ),
    ] = None,
    reward_args: Annotated[
        list[str] | None,
        typer.Option(
            "--reward-arg",
            metavar="NAME.KEY=VALUE",
            help="An argument of reward NAME (YAML: score: reward_args: "
            "{NAME: {KEY: VALUE}}). The CLIP rewards take model=PATH (a local folder, or a Hub id in the local "
            "HF cache; required), processor=PATH (default: model), device=, dtype=fp32|bf16|fp16, batch_size=N. "
            "pickscore: exp(logit_scale)*cos(text, image)/26 with model=PickScore_v1 and processor=the "
            "CLIP-ViT-H-14 folder (~0.8-0.9). clipscore: CLIP logits_per_image/100 with model=openai "
            "clip-vit-large-patch14 (the cosine, ~0.2-0.35). image_similarity: CLIP image-image cosine to the "
            "prompt row's reference_image file, or to reference=IMAGE. aesthetic: LAION MLP on the normalised "
            "CLIP ViT-L/14 image embedding, mlp=sac+logos+ava1-l14-linearMSE.pth or .safetensors (~1-10). "
            "hpsv2: HPS v2.1, cos(image, text) of the ViT-H-14 in model=HPS_v2.1_compressed.pt (read with "
            "weights_only=True), image letterboxed to 224 as hpsv2 does, tokenizer=a CLIP tokenizer folder "
            "(default: laion/CLIP-ViT-H-14-laion2B-s32B-b79K in the HF cache) (~0.2-0.35). imagereward: "
            "ImageReward v1.0's normalised score (MLP on BLIP's image-grounded [CLS] - 0.1672)/1.0333 with "
            "model=ImageReward.pt, tokenizer=a bert-base-uncased folder (default: google-bert/bert-base-uncased "
            "in the HF cache) (~-2..2). "
            "temporal_consistency takes the CLIP arguments; video_ocr frame_interval=N (4). NAME@frames=AGG uses "
            "NAME's arguments. "
            "Model paths are part of the output's identity (with their content digests). omnirl_accuracy: "
            "bleu=, rouge=, meteor= (metric weights, OmniRL 0.5/0.5/0), require_answer=true; omnirl_length: "
            "target= (500 characters), decay= (0.9), scale= (500).",
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Samples per scorer call.")] = 32,
    on_error: Annotated[
        OnError,
        typer.Option(
            "--on-error",
            help="fail (default): stop on a failed/NaN score; zero: record 0 and flag the row in the "
            "column reward_failed, counted as reward_failed (--json, manifest): reward statistics leave it "
            "out, advantage gives it 0 and leaves it out of every group/batch statistic, update skips it. "
            "There is no nan mode: score never writes NaN; a NaN reward in a set from another tool is "
            "treated as a flagged one.",
        ),
    ] = "fail",
    mixed_precision: mixed_precision_opt(
        "the rewards' model forwards on this process's device (CLIP rewards, vlm_judge); recorded for "
        "rewards that are not torch models or run remotely"
    ) = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            metavar=WEIGHTS_METAVAR,
            help=f"Deferred media (`sample --defer-decode`): the pipeline whose VAE decodes the final latents, "
            f"{WEIGHTS_FROM} (default: the model folder the rollout's manifest records; ignored for a rollout "
            "that stores its media).",
            rich_help_panel=DEFERRED,
        ),
    ] = None,
    keep_media: Annotated[
        bool,
        typer.Option(
            "--keep-media",
            help="Deferred media: also write the decoded media (image PNG / video MP4, and frames where the "
            "rollout asked for --save-frames) in this command's output, where `omnirl report` finds them.",
            rich_help_panel=DEFERRED,
        ),
    ] = False,
    vae_tiling: Annotated[
        bool,
        typer.Option(
            "--vae-tiling",
            help="Deferred media: decode in overlapping spatial tiles (as `sample --vae-tiling`); ignored for a "
            "rollout that stores its media.",
            rich_help_panel=DEFERRED,
        ),
    ] = False,
    vae_slicing: Annotated[
        bool,
        typer.Option(
            "--vae-slicing",
            help="Deferred media: decode one sample at a time (as `sample --vae-slicing`); ignored for a rollout "
            "that stores its media.",
            rich_help_panel=DEFERRED,
        ),
    ] = False,
    fmt: FormatOpt = "parquet",
    report_to: ReportToOpt = None,
    run_name: RunNameOpt = None,
    overwrite: OverwriteOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
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
    them as "truncated").

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
    c = resolve(ctx, "score", required=("out",))
    from stages.dist import world_and_rank
    from stages.precision import resolve_mixed_precision
    from stages.reporting import reward_statistics
    from stages.sample.stage import KINDS
    from stages.score.registry import check_reward_args, parse_reward_args, parse_reward_spec
    from stages.score.scoring import FAILED_COLUMN, failed_rewards
    from stages.score.stage import needed_columns, score_shard, text_columns, truncated_rows
    from stages.shards.reader import rollout_modality
    from stages.shards.writer import ShardSetWriter
    from stages.tracking import held_out, open_tracking, run_location

    c["mixed_precision"] = resolve_mixed_precision(c["mixed_precision"])  # the launcher's enters the identity
    tracking = open_tracking(c["report_to"], c["out"], c["run_name"])
    specs = [parse_reward_spec(s) for s in c["reward"] or []]
    if not specs:
        from stages.errors import UserInputError

        raise UserInputError("--reward: give at least one reward, e.g. --reward jpeg_compressibility")
    reward_args = check_reward_args([name for name, _ in specs], parse_reward_args(c["reward_args"]))
    c["reward_args"] = reward_args or None
    src = open_inputs(c["inputs"])
    modality = rollout_modality(src.manifests)
    open_decoder, keep = _deferred(c, src, modality)
    decoder = None
    writer = ShardSetWriter(
        c["out"],
        num_shards=src.num_shards,
        format=check_format(c["fmt"]),
        command="score",
        config=_identity(c, specs),
        parents=[*src.paths, *plugin_files([name for name, _ in specs])],
        policy=src.manifests[0].policy,
        kinds=KINDS if keep else None,
        overwrite=c["overwrite"],
    )
    seconds: dict[str, float] = {}  # per reward, this process's scoring time
    scored = [0]

    def score_one(shard: dict, advance: Callable[[int], None]) -> dict:
        out = score_shard(
            shard,
            specs,
            modality=modality,
            batch_size=c["batch_size"],
            on_error=c["on_error"],
            on_batch=advance,
            reward_args=reward_args,
            seconds=seconds,
            mixed_precision=c["mixed_precision"],
            decoder=decoder,
            keep_media=keep,
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
            else needed_columns(modality, src.columns, deferred=decoder is not None)
        )
        map_shards(src, writer, "scoring", columns, score_one)
        if world_and_rank()[1] == 0:  # the rank that writes the manifest
            extra = {FAILED_COLUMN: _failed_count(writer)}
    if not finalize(writer, extra):
        return
    from stages.shards.reader import ShardSet

    rewards = ShardSet(c["out"]).read_all()
    meta = src.read_all(["prompt_meta"])["prompt_meta"] if "prompt_meta" in src.columns else None
    result = {
        "out": str(c["out"]),
        "rows": len(rewards["sample_id"]),
        FAILED_COLUMN: int(failed_rewards(rewards, len(rewards["sample_id"])).sum()),
        **reward_statistics(rewards, meta),
    }
    if modality == "text":  # responses cut at the sampling cap: their format rewards are 0
        result["truncated"] = sum(truncated_rows(src.read_all(text_columns(list(src.columns)))))
    with tracking:
        tracking.log_rewards(run_location(c["out"])[1] or 0, rewards, meta, held_out=held_out(c["out"]))
    # this process's scoring speed per reward (images are decoded once per batch for all of them)
    result.update({f"perf/{name}/samples_per_s": scored[0] / t for name, t in seconds.items() if t > 0})
    if skipped:
        report_complete(c["out"], json_, result)
    elif json_:
        emit_json({**result, "skipped": False})
    else:
        print_result(
            f"[green]scored[/] {result['rows']} samples → {c['out']}  reward {result['reward/mean']:.4f} "
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


def _identity(c: dict, specs: list[tuple[str, float]]) -> dict:
    """`run_config` plus the content digests of the files the rewards' arguments name (model folders,
    MLP weights), so re-scoring under replaced weights redoes the work."""
    from stages.score.registry import reward_files
    from stages.shards.digest import content_digest

    config = run_config(c)
    digests = {
        f"{name}.{key}": content_digest(path, f"--reward-arg {name}.{key}")
        for name, _ in specs
        for key, path in reward_files(name, (c["reward_args"] or {}).get(name)).items()
    }
    if digests:
        config["reward_args_sha256"] = digests
    return config


def _deferred(
    c: dict, src: Any, modality: str
) -> tuple[Callable[[], Any] | None, Callable[[list], dict] | None]:
    """For a rollout whose media is deferred (`stages.media.deferred`): a function loading the
    `LatentDecoder` of its final latents (called only when there is scoring left to do, so a finished
    run loads no VAE) and, with --keep-media, the function making a batch's media columns; (None, None)
    for a rollout that stores its media. There --keep-media is refused, and --model, --vae-tiling and
    --vae-slicing (names a preset's top-level keys share with other commands) are left out of `c`."""
    from stages.errors import UserInputError
    from stages.media import MEDIA_COLUMNS, media_columns
    from stages.media.deferred import LatentDecoder, deferred_media
    from stages.models.diffusion import load_decoder
    from stages.sample.rollout import sample_config_of

    record = deferred_media(src.manifests)
    if record is None or any(col in src.columns for col in MEDIA_COLUMNS):
        if c["keep_media"]:
            raise UserInputError("--keep-media: --in stores its media already (nothing to decode); drop it")
        c.update(model=None, vae_tiling=False, vae_slicing=False)
        return None, None
    model = c["model"] or Path(record["model"])
    cfg = sample_config_of(src.manifests)
    tiling, slicing = c["vae_tiling"], c["vae_slicing"]

    def open_decoder() -> LatentDecoder:
        if c["model"] is None and not Path(model).is_dir():
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

    keep = partial(media_columns, fps=cfg.fps, save_frames=cfg.save_frames) if c["keep_media"] else None
    return open_decoder, keep
