"""The `score` stage: rewards for every sample of a shard set, written as their own column group.

An image rollout's scorers get the decoded images; a video rollout's get each sample's frames (a list
of RGB PIL images: the lossless `frames` column when `sample --save-frames` wrote one, else the decoded
MP4); a rollout whose media is deferred (`sample --defer-decode`) has its final latents decoded here
(`stages.media.deferred`); a text-response rollout's (VLM `sample`) get the response strings, with
`response_length` (tokens) and `truncated` (`truncated_rows`) added to each row's meta for length and
format rewards. Each reward's declared kind (`registry.reward_kind`) must match the rollout.

A conditioned rollout (an editing or image-to-video model's, `stages.models.condition_images`) gives
every scorer its rows' condition images too: ``meta[i]["condition_images"]`` is the list of sample i's
source images (RGB PIL images, looked up by the row's `group_id`), which the edit rewards
(`stages.score.edit_rewards`, `vlm_judge preset=edit`) compare the result with.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

from stages.errors import CorruptRowError, UserInputError
from stages.media import FRAMES_COLUMN
from stages.media.deferred import LatentDecoder
from stages.media.video import MediaDecodeError, decode_mp4
from stages.models.condition_images import RECORD as CONDITION_IMAGES
from stages.models.condition_images import decode_images as decode_condition_images
from stages.sample.vlm_data import decode_image
from stages.score.config import ScoreConfig
from stages.score.registry import RewardArgs, reward_kind
from stages.score.scoring import FAILED_COLUMN, failed_rewards, score_batch

BASE = ("sample_id", "prompt", "prompt_meta")
RERUN = "re-run `omnirl sample` for this rollout (or fix the file)"


def needed_columns(
    modality: str, available: Collection[str] = (), *, deferred: bool = False, conditioned: bool = False
) -> list[str]:
    """The input columns `score_shard` reads from a rollout of `modality` ("image", "video" or "text")
    whose shard sets hold the columns `available`; a `deferred` rollout's final latents instead of media;
    a `conditioned` one's `group_id` too (its condition images are stored per group)."""
    base = [*BASE, "group_id"] if conditioned else list(BASE)
    if modality == "text":
        return [*base, "response_text", "response_length"]
    if deferred:
        return [*base, "final_latent"]
    if modality == "video":
        return [*base, FRAMES_COLUMN if FRAMES_COLUMN in available else "video"]
    return [*base, "image"]


def text_columns(available: Sequence[str]) -> list[str]:
    """The columns a text rollout's scoring reads, with `truncated` where the rollout has it."""
    return needed_columns("text") + (["truncated"] if "truncated" in available else [])


def truncated_rows(shard: dict[str, Any]) -> list[bool]:
    """Per row, whether the response was cut at the sampling cap: the rollout's `truncated` column, or
    in rollouts written before it, a response as long as its meta's max_response_length."""
    if "truncated" in shard:
        return [bool(t) for t in shard["truncated"].tolist()]
    caps = [(m or {}).get("max_response_length") for m in shard["prompt_meta"]]
    return [cap is not None and n >= cap for n, cap in zip(shard["response_length"].tolist(), caps)]


def decode_images(blobs: Sequence[bytes], sample_ids: Sequence[str]) -> list[Any]:
    """PNG/JPEG bytes → RGB PIL images; an undecodable blob names its sample."""
    return [decode_image(blob, f"sample {sid!r}") for blob, sid in zip(blobs, sample_ids)]


def decode_videos(shard: dict[str, Any], start: int, stop: int) -> list[list[Any]]:
    """The frames (RGB PIL images) of rows [start, stop) of a video rollout's shard: its `frames` column
    when it has one, else its MP4s decoded. An undecodable row is a `CorruptRowError` naming the row."""
    ids = shard["sample_id"]
    if FRAMES_COLUMN in shard:
        return [
            [
                decode_image(png, f"column '{FRAMES_COLUMN}' row {row} (sample {ids[row]!r})")
                for png in shard[FRAMES_COLUMN][row]
            ]
            for row in range(start, stop)
        ]
    out = []
    for row in range(start, stop):
        try:
            out.append(decode_mp4(shard["video"][row]).frames)
        except MediaDecodeError as exc:
            raise CorruptRowError(
                "video",
                row,
                f"column 'video' row {row} (sample {ids[row]!r}) is not a readable MP4: {exc}; {RERUN}",
            ) from None
    return out


def check_reward_kinds(specs: list[tuple[str, float]], modality: str) -> None:
    """Every reward of `specs` scores outputs of `modality` ("image", "video" or "text"); else a
    one-line error naming the reward (and, for an image reward on videos, its `@frames=` form)."""
    for name, _ in specs:
        kind = reward_kind(name)
        if kind != modality:
            hint = (
                f"; score its frames with {name}@frames=mean (or min, first, last)"
                if (modality == "video" and kind == "image")
                else "; pick a reward of the matching kind"
            )
            raise UserInputError(
                f"--reward {name}: it scores {kind}s but this rollout has {modality} outputs{hint}"
            )


def score_shard(
    shard: dict[str, Any],
    specs: list[tuple[str, float]],
    *,
    modality: str = "image",
    batch_size: int = 32,
    on_error: str = "fail",
    on_batch: Callable[[int], None] | None = None,
    reward_args: RewardArgs | None = None,
    seconds: dict[str, float] | None = None,
    mixed_precision: str = "no",
    decoder: LatentDecoder | None = None,
    keep_media: Callable[[list[Any]], dict[str, list]] | None = None,
    condition_images: Mapping[str, Sequence[bytes]] | None = None,
) -> dict[str, Any]:
    """Columns sample_id, reward [N] and reward.<name> [N] for one shard's rows of a rollout of
    `modality` (its manifest's: images, or VLM text responses); `reward_args[name]` configures a
    reward (`registry.get_reward`); `seconds[name]` accumulates each reward's time (`score_batch`).
    The scorers run under `mixed_precision`'s autocast on this process's device (`stages.precision`):
    it changes torch-model rewards (CLIP, VLM judge); other rewards compute as they would without it.

    A deferred rollout (`stages.media.deferred`) is scored from its final latents, which `decoder`
    decodes batch by batch; `keep_media` (`stages.media.media_columns` at the rollout's fps) then turns
    each batch's outputs into media columns added to the result.

    `condition_images` (group_id → encoded source images, `stored_condition_images`) puts each row's
    decoded sources in its meta as ``meta[i]["condition_images"]`` (module docstring)."""
    import torch

    from stages.precision import autocast

    conditioned = bool(condition_images)
    wanted = needed_columns(modality, shard, deferred=decoder is not None, conditioned=conditioned)
    missing = [c for c in wanted if c not in shard]
    if missing:
        raise UserInputError(
            f"--in: column '{missing[0]}' is missing; score reads the output of `omnirl sample`"
        )
    text = modality == "text"
    check_reward_kinds(specs, modality)
    n = len(shard["sample_id"])
    truncated = truncated_rows(shard) if text else []
    if mixed_precision != "no":  # the device is only asked for when it is needed (scorer workers)
        from stages.dist import device

        on = device()
    else:
        on = torch.device("cpu")
    parts: list[dict[str, Any]] = []
    kept: list[dict[str, list]] = []
    decoded = decoder.rows(shard["final_latent"]) if decoder is not None else None
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        ids = list(shard["sample_id"][start:stop])
        meta = [dict(m) if isinstance(m, dict) else {} for m in shard["prompt_meta"][start:stop]]
        if text:
            lengths = shard["response_length"][start:stop].tolist()
            for row, length, cut in zip(meta, lengths, truncated[start:stop]):
                row["response_length"] = int(length)
                row["truncated"] = cut
        if conditioned:
            for row, sid, group in zip(meta, ids, shard["group_id"][start:stop]):
                row[CONDITION_IMAGES] = decode_condition_images(
                    (condition_images or {}).get(group, []), f"sample {sid!r}"
                )
        if text:
            outputs = list(shard["response_text"][start:stop])
        elif decoded is not None:
            outputs = decoded(start, stop)
            if keep_media is not None:
                kept.append(keep_media(outputs))
        elif modality == "video":
            outputs = decode_videos(shard, start, stop)
        else:
            outputs = decode_images(shard["image"][start:stop], ids)
        with autocast(mixed_precision, on):
            parts.append(
                score_batch(
                    specs,
                    outputs,
                    list(shard["prompt"][start:stop]),
                    meta,
                    sample_ids=ids,
                    on_error=on_error,
                    reward_args=reward_args,
                    seconds=seconds,
                )
            )
        if on_batch:
            on_batch(stop - start)
    out: dict[str, Any] = {"sample_id": list(shard["sample_id"])}
    for key in parts[0] if parts else ():
        out[key] = torch.cat([p[key] for p in parts])
    for key in kept[0] if kept else ():
        out[key] = [blob for part in kept for blob in part[key]]
    return out


def run_score(c: ScoreConfig, display: Any) -> dict[str, Any] | None:
    """Score every sample of `c.inputs` with `c.reward` into `c.out` (reward [N], reward.<name> [N],
    reward_failed [N] under --on-error zero; media columns with --keep-media), advancing the progress
    `display` (`stages.outputs.map_shards`) and logging the statistics to --report-to; a finished
    `c.out` is left as it is. Returns the result this process reports (rows, failed count, reward
    statistics overall and per subset, truncated responses, scoring speed per reward; skipped), or None
    on a rank of a launch that does not report."""
    from stages.dist import world_and_rank
    from stages.models.condition_images import stored_condition_images
    from stages.outputs import check_format, finalize, map_shards, open_inputs, plugin_files
    from stages.precision import resolve_mixed_precision
    from stages.reporting import reward_statistics
    from stages.sample.stage import KINDS
    from stages.score.registry import check_reward_args, parse_reward_args, parse_reward_spec
    from stages.shards.reader import rollout_modality
    from stages.shards.writer import ShardSetWriter
    from stages.tracking import held_out, open_tracking, run_location

    c = replace(
        c, mixed_precision=resolve_mixed_precision(c.mixed_precision)
    )  # the launcher's enters the identity
    tracking = open_tracking(c.report_to, c.out, c.run_name)
    specs = [parse_reward_spec(s) for s in c.reward or []]
    if not specs:
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
        map_shards(src, writer, "scoring", columns, score_one, display=display)
        if world_and_rank()[1] == 0:  # the rank that writes the manifest
            extra = {FAILED_COLUMN: _failed_count(writer)}
    if not finalize(writer, extra):
        return None
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
    return {**result, "skipped": skipped}


def _failed_count(writer: Any) -> int:
    """How many rows of the shards `writer` holds (all written, manifest not yet) are flagged in
    reward_failed: the count recorded in the manifest's extra."""
    if FAILED_COLUMN not in {column.name for column in writer.columns or ()}:
        return 0
    return sum(
        int(writer.read_shard(s, [FAILED_COLUMN])[FAILED_COLUMN].sum()) for s in range(writer.num_shards)
    )


def _identity(c: ScoreConfig, specs: list[tuple[str, float]], reward_args: dict[str, dict[str, Any]]) -> dict:
    """`run_config` (with the reward arguments as parsed) plus the content digests of the files the
    rewards' arguments name (model folders, MLP weights), so re-scoring under replaced weights redoes
    the work."""
    from stages.outputs import run_config
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
    from stages.dist import device
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
