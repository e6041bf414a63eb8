"""`omnirl pairs`: turn a preference table into a shard set of two-sample groups."""

from __future__ import annotations

from dataclasses import asdict

from stages.offline.config import PairsConfig
from stages.outputs import check_format, resolve_num_shards, run_config

from ..console import emit_json, print_result, progress
from ..generate import config_command


def run(c: PairsConfig, json_: bool) -> None:
    """Convert preference pairs into a shard set: each pair is a group of two rows, reward 1 (preferred) and 0.

    Ties (Pick-a-Pic label 0.5) are skipped. No model is loaded. Follow with `omnirl encode` (VAE
    latents; it also stores the prompts' text conditioning, so the update loads no text encoder) and
    `omnirl update --algo dpo`.

    Example: [bold]omnirl pairs --pairs pickapic.parquet --out data/pairs && omnirl encode --model M \\
    --in data/pairs --out data/latents && omnirl update --model M --in data/pairs --in data/latents --algo dpo --out policy[/]
    """
    from stages.offline.pairs import pairs_batch, read_pairs
    from stages.sample.stage import in_rollout, rollout_id
    from stages.shards.reader import slice_batch
    from stages.shards.writer import ShardSetWriter

    with progress() as bar:
        task = bar.add_task("pairs", total=None, rate="")
        found, ties = read_pairs(c.table)
        shards = min(resolve_num_shards(asdict(c), len(found), 2), len(found))
        writer = ShardSetWriter(
            c.out,
            num_shards=shards,
            format=check_format(c.fmt),
            command="pairs",
            config=run_config(asdict(c)),
            parents=[c.table],
            kinds={"image": "image", "prompt_meta": "json"},
            overwrite=c.overwrite,
        )
        bar.update(task, total=len(found))
        if not writer.complete:
            batch = in_rollout(pairs_batch(found), rollout_id(writer))
            for s in range(shards):
                lo, hi = s * len(found) // shards, (s + 1) * len(found) // shards
                if not writer.shard_done(s):
                    writer.write_shard(s, slice_batch(batch, 2 * lo, 2 * hi))
                bar.advance(task, hi - lo)
            writer.finalize(extra={"modality": "image"})
    result = {"out": str(c.out), "pairs": len(found), "ties_skipped": ties, "rows": 2 * len(found)}
    if json_:
        emit_json(result)
    else:
        print_result(f"[green]wrote[/] {len(found)} pairs ({ties} ties skipped) to {c.out}")


pairs = config_command(PairsConfig, "pairs", run)
