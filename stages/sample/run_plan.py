"""What both kinds of sample run (a diffusion pipeline's, a VLM's) share around the sampling itself:
the memory check before any model loads, the shard count and the shards this run writes, the run's
identity and output writer, and the counts of every rank's shards combined into one result."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from stages.errors import UserInputError
from stages.outputs import check_format, policy_info, resolve_num_shards, run_config
from stages.sample.config import SampleRun

if TYPE_CHECKING:
    from stages.shards.writer import ShardSetWriter


def memory_limit() -> int | None:
    """Bytes this process may use: the least of physical memory and its address-space limit
    (`ulimit -v`); None where neither is known."""
    import contextlib
    import os

    limits = []
    with contextlib.suppress(AttributeError, ValueError, OSError):  # sysconf is POSIX-only
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    with contextlib.suppress(ImportError):  # no `resource` module on Windows
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    return min(limits, default=None)


def check_memory(c: SampleRun, samples: int, bytes_each: int, what: str) -> None:
    """Refuse a group size whose samples cannot fit in memory before any model is loaded: a mistyped
    `-n 100000000` would otherwise end in MemoryError after minutes of work."""
    limit = memory_limit()
    need = samples * bytes_each
    if limit is not None and need > limit:
        raise UserInputError(
            f"-n/--group-size {c.group_size}: {what} would need at least {need / 2**30:.1f} GiB of "
            f"memory, more than the {limit / 2**30:.1f} GiB this process may use; lower it"
        )


def num_shards(c: SampleRun, groups: int) -> int:
    """--num-shards, else about --shard-rows rows per shard over the launcher's ranks
    (`stages.outputs.resolve_num_shards`), for `groups` prompt groups of --group-size rows."""
    return resolve_num_shards(
        {"num_shards": c.num_shards, "shard_rows": c.shard_rows, "shard_index": c.shard_index},
        groups,
        c.group_size,
    )


def shard_indices(c: SampleRun) -> list[int]:
    """The shards this run writes: --shard-index, else every one (`c.num_shards` resolved)."""
    shards = list(range(c.num_shards)) if c.shard_index is None else [c.shard_index]
    if any(not 0 <= s < c.num_shards for s in shards):
        raise UserInputError(f"--shard-index {c.shard_index}: must lie in [0, --num-shards={c.num_shards})")
    return shards


def rollout_writer(
    c: SampleRun, identity: dict[str, Any], kinds: dict[str, str], source: Any
) -> ShardSetWriter:
    """The output writer of the run whose settings are `identity` (`source`, the prompts, in its
    lineage); a bad --shard-index fails here, before any model is loaded."""
    from stages.shards.writer import ShardSetWriter

    shard_indices(c)
    return ShardSetWriter(
        c.out,
        num_shards=c.num_shards,
        format=check_format(c.fmt),
        command="sample",
        config=identity,
        parents=[source],
        policy=policy_info(c.model, c.adapter),
        kinds=kinds,
        overwrite=c.overwrite,
    )


def identity(c: SampleRun, exclude: tuple[str, ...] = (), **shown: Any) -> dict[str, Any]:
    """The run's identity (`stages.outputs.run_config`) of `c`'s settings, the recorded-only ones left
    out (the model's text length follows from its digest), with `shown` replacing how some are written."""
    from stages.knobs import knobs

    settings = asdict(c)
    return run_config({f.name: settings[f.name] for f, _ in knobs(type(c))} | shown, exclude)


def combine(results: list[dict], unit: str) -> dict:
    """Every rank's sampling counts (`stages.sample.stage.write_shards`'s: rows, rows_written, shards_written,
    shards_resumed, seconds, `<unit>_per_s`) as one: counts added, the longest time, the ranks' rates
    added (they sample at once)."""
    if len(results) == 1:
        return results[0]
    rates = [r[f"{unit}_per_s"] for r in results if r[f"{unit}_per_s"] is not None]
    counts = ("rows", "rows_written", "shards_written", "shards_resumed")
    combined = {k: sum(r[k] for r in results) for k in counts}
    combined.update(
        {"seconds": max(r["seconds"] for r in results), f"{unit}_per_s": sum(rates) if rates else None}
    )
    return combined
