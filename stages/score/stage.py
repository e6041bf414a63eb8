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
from typing import Any

from stages.errors import CorruptRowError, UserInputError
from stages.media import FRAMES_COLUMN
from stages.media.deferred import LatentDecoder
from stages.media.video import MediaDecodeError, decode_mp4
from stages.models.condition_images import RECORD as CONDITION_IMAGES
from stages.models.condition_images import decode_images as decode_condition_images
from stages.sample.vlm_data import decode_image
from stages.score.registry import RewardArgs, reward_kind
from stages.score.scoring import score_batch

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
