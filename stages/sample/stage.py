"""The `sample` stage: prompts × group size → trajectory shard set.

Rows are laid out group by group; a shard holds whole groups, and a batch never crosses a shard,
so `logprob` can replay every batch exactly as it was sampled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.dist import writes_outputs
from stages.errors import UserInputError
from stages.media import FRAMES_COLUMN
from stages.sample.engines import RolloutEngine
from stages.sample.prompts import Prompt
from stages.sample.rollout import SampleConfig, derive_seed
from stages.shards.writer import ShardSetWriter

KINDS = {"image": "image", "video": "video", FRAMES_COLUMN: "image_list", "prompt_meta": "json"}


@dataclass
class Row:
    sample_id: str
    group_id: str
    prompt: Prompt
    seed: int
    init_seed: int
    prompt_index: int  # the prompt's index in the prompt file: keys the group's SDE window


def plan_rows(prompts: list[tuple[int, Prompt]], group_size: int, cfg: SampleConfig) -> list[Row]:
    """Every sample to draw: `group_size` members per prompt, with per-sample seeds.

    Ids are local to the plan (group `g000003`, sample `g000003-001`); `in_rollout` prefixes the
    written ones with the rollout id, so they are unique across rollouts.
    """
    if group_size < 1:
        raise UserInputError(f"-n {group_size}: the group size must be at least 1")
    rows = []
    for index, prompt in prompts:
        group = f"g{index:06d}"
        for m in range(group_size):
            init_key = "shared" if cfg.same_noise else m
            rows.append(
                Row(
                    sample_id=f"{group}-{m:03d}",
                    group_id=group,
                    prompt=prompt,
                    seed=derive_seed(cfg.seed, index, m),
                    init_seed=derive_seed(cfg.seed, "init", index, init_key),
                    prompt_index=index,
                )
            )
    return rows


def rollout_id(writer: ShardSetWriter) -> str:
    """The short id that prefixes every sample and group id of the rollout `writer` records.

    It is the first 8 hex digits of the writer's content id (options, prompts, weights; not the
    directory, format or sharding), so a resumed or identical re-run gives the same ids and bytes, and
    another rollout other ids.
    """
    return writer.content_id[:8]


def in_rollout(columns: dict[str, Any], rollout: str) -> dict[str, Any]:
    """A shard's columns with ids unique across rollouts: `sample_id` and `group_id` prefixed by the
    rollout id (`g000003-001` → `<rollout>-g000003-001`); the other columns are left as they are."""
    return {
        **columns,
        "sample_id": [f"{rollout}-{i}" for i in columns["sample_id"]],
        "group_id": [f"{rollout}-{g}" for g in columns["group_id"]],
    }


def split_groups(groups: list[Any], num_shards: int) -> list[list[Any]]:
    """`num_shards` contiguous, near-equal runs of prompt groups (a shard never splits a group)."""
    if num_shards > len(groups):
        raise UserInputError(f"--num-shards {num_shards}: more shards than prompt groups ({len(groups)})")
    return [
        groups[s * len(groups) // num_shards : (s + 1) * len(groups) // num_shards] for s in range(num_shards)
    ]


def shard_rows(rows: list[Row], group_size: int, num_shards: int) -> list[list[Row]]:
    """Split rows into `num_shards` contiguous runs of whole groups."""
    groups = [rows[i : i + group_size] for i in range(0, len(rows), group_size)]
    return [[r for g in shard for r in g] for shard in split_groups(groups, num_shards)]


def sample_shard(
    engine: RolloutEngine,
    cfg: SampleConfig,
    rows: list[Row],
    policy_version: int,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Roll out one shard's rows in batches of --batch-size on `engine`; returns the shard's columns."""
    import torch

    from stages.shards.reader import concat_batches

    if any(r.prompt.images for r in rows) and not engine.takes_condition_images:
        raise UserInputError(
            f"--engine {engine.name}: it sends no condition images (the prompts' 'image'/'images' column); "
            "sample an editing model with --engine diffusers"
        )
    batches = []
    for start in range(0, len(rows), cfg.batch_size):
        chunk = rows[start : start + cfg.batch_size]
        out = engine.rollout(
            cfg,
            [r.prompt.text for r in chunk],
            [r.prompt.negative for r in chunk],
            [r.seed for r in chunk],
            [r.init_seed for r in chunk],
            groups=[r.prompt_index for r in chunk],
            sample_ids=[r.sample_id for r in chunk],
            **({"images": [r.prompt.images for r in chunk]} if any(r.prompt.images for r in chunk) else {}),
        )
        out.update(
            sample_id=[r.sample_id for r in chunk],
            group_id=[r.group_id for r in chunk],
            prompt=[r.prompt.text for r in chunk],
            negative_prompt=[r.prompt.negative for r in chunk],
            prompt_meta=[r.prompt.meta for r in chunk],
            seed=torch.tensor([r.seed for r in chunk], dtype=torch.int64),
        )
        # an engine the run pushes weights to reports the version each sample used (`push_weights`)
        out.setdefault("policy_version", torch.full((len(chunk),), policy_version, dtype=torch.int64))
        batches.append(out)
        if on_batch:
            on_batch(len(chunk))
    return concat_batches(batches)


def run_sample(
    engine: RolloutEngine,
    cfg: SampleConfig,
    prompts: list[tuple[int, Prompt]],
    group_size: int,
    writer: ShardSetWriter,
    *,
    num_shards: int,
    shard_indices: list[int],
    policy_version: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Sample the shards in `shard_indices` (all of them in a single-process run); resumes finished shards."""
    cfg.validate()
    shards = shard_rows(plan_rows(prompts, group_size, cfg), group_size, num_shards)
    rollout = rollout_id(writer)

    def make_shard(s: int) -> dict[str, Any]:
        columns = in_rollout(sample_shard(engine, cfg, shards[s], policy_version, on_batch), rollout)
        store_condition_images(shards[s], rollout, writer, s)
        store_conditioning(engine, cfg, shards[s], writer, s)
        return columns

    return write_shards(
        writer, [len(rows) for rows in shards], shard_indices, make_shard, unit="images", on_batch=on_batch
    )


def store_condition_images(rows: list[Row], rollout: str, writer: ShardSetWriter, shard: int) -> None:
    """Write the condition images of shard `shard`'s prompt groups, once per group, beside the shard and
    before it (`stages.models.condition_images`); nothing for prompts without any, nor on a rank that does
    not write."""
    from stages.models.condition_images import condition_images_file, write_condition_images

    groups = {f"{rollout}-{r.group_id}": r.prompt.images for r in rows}
    if not writes_outputs() or not any(groups.values()):
        return
    writer.out_dir.mkdir(parents=True, exist_ok=True)
    write_condition_images(
        writer.out_dir / condition_images_file(shard, writer.num_shards), groups, writer.content_id
    )


def store_conditioning(
    engine: RolloutEngine, cfg: SampleConfig, rows: list[Row], writer: ShardSetWriter, shard: int
) -> None:
    """Write the conditioning of shard `shard`'s unique prompts, as the engine encoded them, beside the
    shard and before it (`stages.models.conditioning`): a finished shard always has its file. An engine
    that cannot return it writes none, nor does a rank that does not write (`dist.writes_outputs`)."""
    from stages.models.conditioning import conditioning_file, write_conditioning

    if not writes_outputs():
        return
    from stages.models.condition_images import images_digest

    keys = list(
        dict.fromkeys(
            (r.prompt.text, r.prompt.negative, cfg.max_sequence_length, images_digest(r.prompt.images))
            for r in rows
        )
    )
    entries = engine.conditioning(keys)
    if entries is None or len(entries) != len(keys):
        return
    writer.out_dir.mkdir(parents=True, exist_ok=True)
    write_conditioning(
        writer.out_dir / conditioning_file(shard, writer.num_shards), entries, writer.content_id
    )


def write_shards(
    writer: ShardSetWriter,
    sizes: list[int],
    shard_indices: list[int],
    make_shard: Callable[[int], dict[str, Any]],
    *,
    unit: str,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write `make_shard(s)` for every listed shard not already done (`sizes[s]` rows each); a rank that
    does not write (`dist.writes_outputs`) makes them alone.

    Returns rows (of the listed shards), rows_written (made here), shards written/resumed, seconds and
    `<unit>_per_s` over the shards made here.
    """
    done = written = made = 0
    t0 = time.perf_counter()
    for s in shard_indices:
        if writer.shard_done(s):
            done += 1
            if on_batch:
                on_batch(sizes[s])
            continue
        columns = make_shard(s)
        if writes_outputs():  # one rank of a model-parallel group writes what the group computed
            writer.write_shard(s, columns)
        written += 1
        made += sizes[s]
    seconds = time.perf_counter() - t0
    return {
        "rows": sum(sizes[s] for s in shard_indices),
        "rows_written": made,
        "shards_written": written,
        "shards_resumed": done,
        f"{unit}_per_s": made / seconds if seconds > 0 and made else None,
        "seconds": seconds,
    }
