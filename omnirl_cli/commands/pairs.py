"""`omnirl pairs`: turn a preference table into a shard set of two-sample groups."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..config import resolve
from ..console import emit_json, print_result, progress
from ..errors import handle_errors
from ..options import (
    REQUIRED,
    ConfigOpt,
    FormatOpt,
    JsonOpt,
    NumShardsOpt,
    OutOpt,
    OverwriteOpt,
    SetOpt,
    ShardRowsOpt,
)
from ..runtime import check_format, resolve_num_shards, run_config


@handle_errors
def pairs(
    ctx: typer.Context,
    table: Annotated[
        Path | None,
        typer.Option(
            "--pairs",
            help="Parquet/JSONL: prompt, chosen, rejected (+ scores), or "
            f"Pick-a-Pic's caption, jpg_0, jpg_1, label_0. {REQUIRED}",
        ),
    ] = None,
    out: OutOpt = None,
    num_shards: NumShardsOpt = None,
    shard_rows: ShardRowsOpt = 256,
    fmt: FormatOpt = "parquet",
    overwrite: OverwriteOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Convert preference pairs into a shard set: each pair is a group of two rows, reward 1 (preferred) and 0.

    Ties (Pick-a-Pic label 0.5) are skipped. No model is loaded. Follow with `omnirl encode` (VAE
    latents; it also stores the prompts' text conditioning, so the update loads no text encoder) and
    `omnirl update --algo dpo`.

    Example: [bold]omnirl pairs --pairs pickapic.parquet --out data/pairs && omnirl encode --model M \\
    --in data/pairs --out data/latents && omnirl update --model M --in data/pairs --in data/latents --algo dpo --out policy[/]
    """
    c = resolve(ctx, "pairs", required=("table", "out"))
    from stages.offline.pairs import pairs_batch, read_pairs
    from stages.sample.stage import in_rollout, rollout_id
    from stages.shards.reader import slice_batch
    from stages.shards.writer import ShardSetWriter

    with progress() as bar:
        task = bar.add_task("pairs", total=None, rate="")
        found, ties = read_pairs(c["table"])
        shards = min(resolve_num_shards(c, len(found), 2), len(found))
        writer = ShardSetWriter(
            c["out"],
            num_shards=shards,
            format=check_format(c["fmt"]),
            command="pairs",
            config=run_config(c),
            parents=[c["table"]],
            kinds={"image": "image", "prompt_meta": "json"},
            overwrite=c["overwrite"],
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
    result = {"out": str(c["out"]), "pairs": len(found), "ties_skipped": ties, "rows": 2 * len(found)}
    if json_:
        emit_json(result)
    else:
        print_result(f"[green]wrote[/] {len(found)} pairs ({ties} ties skipped) to {c['out']}")
