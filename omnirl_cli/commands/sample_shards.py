"""What both kinds of `omnirl sample` share: the output writer (or saying the output is complete
already), and sampling this process's shards with a progress bar, then reporting. The planning
around it is `stages.sample.run_plan`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stages.outputs import policy_version
from stages.sample.config import SampleRun
from stages.sample.run_plan import combine, rollout_writer, shard_indices

from ..console import emit_json, print_result, progress
from ..runtime import report_complete


def open_writer(
    c: SampleRun, identity: dict[str, Any], kinds: dict[str, str], json_: bool, source: Any
) -> Any:
    """The output writer (`rollout_writer`), or None (after saying so) when the output is already
    complete."""
    writer = rollout_writer(c, identity, kinds, source)
    if writer.complete:
        report_complete(c.out, json_)
        return None
    return writer


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
    after every rank is done (one without a shard too), rank 0 writes the manifest and reports for all,
    and every rank returns once the manifest is written.
    """
    from stages.dist import barrier, gather, join, rank_shards, replicas

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
    lead, manifest = join()[1] == 0, None
    if lead and all(writer.shard_done(s) for s in range(c.num_shards)):
        manifest = writer.finalize(extra=extra(writer.columns) if callable(extra) else extra)
    barrier()  # every rank returns once the manifest is written: a command run next in them reads it
    if not lead:
        return
    result = combine(results, unit)
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
