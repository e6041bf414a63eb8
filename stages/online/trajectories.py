"""An online iteration's trajectories saved as the shard sets the staged commands write.

With `--save-trajectories` the driver writes it<K>/samples, rewards and advantages, as `sample`, `score`
and `advantage` would have, so a run can be inspected, scored again or replayed with the staged commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.media import MEDIA_COLUMNS
from stages.models.conditioning import Entries
from stages.online.config import TENSORS, OnlineConfig, stores_media


def save_trajectories(
    cfg: OnlineConfig,
    k: int,
    data: dict[str, Any],
    rewards: dict[str, Any],
    adv: dict[str, Any],
    stats: dict[str, Any],
    family: Any,
    group_images: dict[str, list[bytes]],
    conditioning: Entries,
) -> None:
    """The shard sets the staged commands would have written for iteration k (`family`: the policy's
    `FamilyAdapter`); its samples hold media only when `stores_media(cfg, k)` (the sampler sends it to the
    driver only then), else the manifest records it as deferred (`stages.media.deferred`). An editing
    model's samples also store their groups' condition images (`group_images`), and the samples store the
    prompt conditioning the sampler encoded (`conditioning`, empty when its engine returns none), as
    `sample` does: the staged replay of them loads no text encoder and is exact."""
    from stages.media.deferred import deferred_record
    from stages.sample.stage import KINDS
    from stages.shards.writer import ShardSetWriter

    it = cfg.out / f"it{k}"
    columns = ("sample_id", "group_id", "prompt", "negative_prompt", "prompt_meta", *MEDIA_COLUMNS, *TENSORS)
    deferred = {} if stores_media(cfg, k) else deferred_record(cfg.model, cfg.dtype)
    parts = {
        "samples": (
            {c: data[c] for c in columns if c in data},
            {
                "sample_config": cfg.sampling(k).record(),
                "family": family.name,
                "modality": family.media,
                **deferred,
            },
        ),
        "rewards": ({key: v for key, v in rewards.items() if key != "k"}, {}),
        "advantages": (adv, {"stats": stats}),
    }
    parents: list[Path] = []
    for name, (batch, extra) in parts.items():
        writer = ShardSetWriter(
            it / name,
            num_shards=1,
            command=f"online:{name}",
            config={"iteration": k},
            parents=parents,
            kinds=KINDS if name == "samples" else None,
            overwrite=True,
        )
        if not writer.complete:
            if name == "samples":
                extra = {
                    **extra,
                    **_store_condition_images(writer, data["group_id"], group_images),
                    **_store_conditioning(writer, conditioning, cfg, k),
                }
            writer.write_shard(0, batch)
            writer.finalize(extra=extra)
        parents = [it / "samples"]


def _store_conditioning(writer: Any, entries: Entries, cfg: OnlineConfig, k: int) -> dict:
    """Write iteration k's prompt conditioning `entries` beside the saved samples' one shard and return the
    manifest record (`stages.models.conditioning`); {} when the sampler sent none."""
    from stages.models.conditioning import conditioning_file, conditioning_record, write_conditioning

    if not entries:
        return {}
    writer.out_dir.mkdir(parents=True, exist_ok=True)
    write_conditioning(writer.out_dir / conditioning_file(0, 1), entries, writer.content_id)
    record = conditioning_record(
        writer.out_dir,
        1,
        writer.content_id,
        model=cfg.model,
        dtype=cfg.dtype,
        max_sequence_length=cfg.sampling(k).max_sequence_length,
    )
    return record or {}


def _store_condition_images(writer: Any, group_ids: list[str], group_images: dict[str, list[bytes]]) -> dict:
    """Write the condition images of the groups among `group_ids` beside the saved samples' one shard (as
    `sample` does) and return the manifest record; {} for groups without any."""
    from stages.models.condition_images import (
        condition_images_file,
        condition_images_record,
        write_condition_images,
    )

    groups = {g: group_images.get(g, []) for g in dict.fromkeys(group_ids)}
    if not any(groups.values()):
        return {}
    writer.out_dir.mkdir(parents=True, exist_ok=True)
    write_condition_images(writer.out_dir / condition_images_file(0, 1), groups, writer.content_id)
    return condition_images_record(writer.out_dir, 1, writer.content_id) or {}
