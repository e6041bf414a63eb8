"""The `sample` stage: prompts × group size → trajectory shard set.

Rows are laid out group by group; a shard holds whole groups, and a batch never crosses a shard,
so `logprob` can replay every batch exactly as it was sampled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.errors import UserInputError
from stages.models.diffusion import FlowPolicy
from stages.sample.prompts import Prompt
from stages.sample.rollout import SampleConfig, derive_seed, rollout_batch
from stages.shards.writer import ShardSetWriter

KINDS = {"image": "image", "prompt_meta": "json"}


@dataclass
class Row:
    sample_id: str
    group_id: str
    prompt: Prompt
    seed: int
    init_seed: int


def plan_rows(prompts: list[tuple[int, Prompt]], group_size: int, cfg: SampleConfig) -> list[Row]:
    """Every sample to draw: `group_size` members per prompt, with per-sample seeds."""
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
                )
            )
    return rows


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
    policy: FlowPolicy,
    cfg: SampleConfig,
    rows: list[Row],
    shard_index: int,
    policy_version: int,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Roll out one shard's rows in batches; returns the shard's columns."""
    import torch

    from stages.shards.reader import concat_batches

    batches = []
    for b, start in enumerate(range(0, len(rows), cfg.batch_size)):
        chunk = rows[start : start + cfg.batch_size]
        out = rollout_batch(
            policy,
            cfg,
            [r.prompt.text for r in chunk],
            [r.prompt.negative for r in chunk],
            [r.seed for r in chunk],
            [r.init_seed for r in chunk],
            batch_key=(shard_index, b),
        )
        out.update(
            sample_id=[r.sample_id for r in chunk],
            group_id=[r.group_id for r in chunk],
            prompt=[r.prompt.text for r in chunk],
            negative_prompt=[r.prompt.negative for r in chunk],
            prompt_meta=[r.prompt.meta for r in chunk],
            seed=torch.tensor([r.seed for r in chunk], dtype=torch.int64),
            policy_version=torch.full((len(chunk),), policy_version, dtype=torch.int64),
        )
        batches.append(out)
        if on_batch:
            on_batch(len(chunk))
    return concat_batches(batches)


def run_sample(
    policy: FlowPolicy,
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
    return write_shards(
        writer,
        [len(rows) for rows in shards],
        shard_indices,
        lambda s: sample_shard(policy, cfg, shards[s], s, policy_version, on_batch),
        unit="images",
        on_batch=on_batch,
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
    """Write `make_shard(s)` for every listed shard not already done (`sizes[s]` rows each).

    Returns rows, shards written/resumed, seconds and `<unit>_per_s` over the shards made here.
    """
    done = written = made = 0
    t0 = time.perf_counter()
    for s in shard_indices:
        if writer.shard_done(s):
            done += 1
            if on_batch:
                on_batch(sizes[s])
            continue
        writer.write_shard(s, make_shard(s))
        written += 1
        made += sizes[s]
    seconds = time.perf_counter() - t0
    return {
        "rows": sum(sizes[s] for s in shard_indices),
        "shards_written": written,
        "shards_resumed": done,
        f"{unit}_per_s": made / seconds if seconds > 0 and made else None,
        "seconds": seconds,
    }
