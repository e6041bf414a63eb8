"""What both kinds of `omnirl sample` share: the memory check before any model loads, the output
writer, and sampling this process's shards with a progress bar, then reporting."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from stages.errors import UserInputError
from stages.outputs import check_format, policy_info, policy_version, resolve_num_shards, run_config
from stages.sample.config import SampleRun

from ..console import emit_json, print_result, progress
from ..runtime import report_complete


def _memory_limit() -> int | None:
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
    limit = _memory_limit()
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


def open_writer(
    c: SampleRun, identity: dict[str, Any], kinds: dict[str, str], json_: bool, source: Any
) -> Any:
    """The output writer (the prompt source in its lineage) of the run whose settings are `identity`,
    or None (after saying so) when the output is already complete."""
    shard_indices(c)  # a bad --shard-index fails before any model is loaded
    from stages.shards.writer import ShardSetWriter

    writer = ShardSetWriter(
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
    if writer.complete:
        report_complete(c.out, json_)
        return None
    return writer


def identity(c: SampleRun, exclude: tuple[str, ...] = (), **shown: Any) -> dict[str, Any]:
    """The run's identity (`stages.outputs.run_config`) of `c`'s settings, the recorded-only ones left out (the
    model's text length follows from its digest), with `shown` replacing how some are written."""
    from stages.knobs import knobs

    settings = asdict(c)
    return run_config({f.name: settings[f.name] for f, _ in knobs(type(c))} | shown, exclude)


def run_shards(
    c: SampleRun,
    json_: bool,
    writer: Any,
    num_prompts: int,
    unit: str,
    extra: dict | Callable[[list], dict],
    sample_fn: Callable[..., dict],
) -> None:
    """Sample this process's shards with a progress bar, write the manifest once every shard exists,
    then report. `sample_fn(group_size, writer, num_shards=, shard_indices=, policy_version=, on_batch=)`.
    `extra` is the manifest's extra, or a function of the written columns giving it (the rollout's
    modality follows from its media columns).

    Under a launcher (torchrun, `accelerate launch`) rank r samples the shards s with s % world == r;
    after every rank is done (one without a shard too), rank 0 writes the manifest and reports for all.
    """
    from stages.dist import gather, join, rank_shards, replicas

    shards = rank_shards(shard_indices(c))
    t0, done = time.perf_counter(), [0]
    with progress() as bar:
        task = bar.add_task("sampling", total=num_prompts * c.group_size * len(shards) // c.num_shards)

        def advance(n: int) -> None:
            done[0] += n
            bar.update(task, advance=n, rate=f"{done[0] / (time.perf_counter() - t0):.2f} {unit}/s")

        mine = sample_fn(
            c.group_size,
            writer,
            num_shards=c.num_shards,
            shard_indices=shards,
            policy_version=policy_version(c.adapter),
            on_batch=advance,
        )
    # every replica's counts (a model-parallel group's ranks count the same); also waits for every shard
    results = replicas(gather(mine))
    if join()[1] != 0:
        return
    result = _combine(results, unit)
    manifest = None
    if all(writer.shard_done(s) for s in range(c.num_shards)):
        manifest = writer.finalize(extra=extra(writer.columns) if callable(extra) else extra)
    result.update(out=str(c.out), complete=manifest is not None, skipped=False)
    if json_:
        emit_json(result)
    else:
        speed = result.get(f"{unit}_per_s")
        rate = f", {speed:.2f} {unit}/s" if speed else ""
        state = "complete" if manifest else "partial (other shards pending)"
        resumed = result["rows"] - result["rows_written"]
        kept = f"; {resumed} already there" if resumed else ""
        print_result(f"[green]wrote[/] {result['rows_written']} samples to {c.out} ({state}{kept}{rate})")


def _combine(results: list[dict], unit: str) -> dict:
    """The counts of every rank's `sample_fn` result as one: rows and shards added, the longest time,
    the ranks' rates added (they sample at once)."""
    if len(results) == 1:
        return results[0]
    rates = [r[f"{unit}_per_s"] for r in results if r[f"{unit}_per_s"] is not None]
    counts = ("rows", "rows_written", "shards_written", "shards_resumed")
    combined = {k: sum(r[k] for r in results) for k in counts}
    combined.update(
        {"seconds": max(r["seconds"] for r in results), f"{unit}_per_s": sum(rates) if rates else None}
    )
    return combined
