"""`omnirl pairs`: turn a preference table into a shard set of two-sample groups."""

from __future__ import annotations

from stages.offline.config import PairsConfig

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
    from stages.offline.pairs import run_pairs

    with progress() as bar:
        result = run_pairs(c, bar)
    if json_:
        emit_json(result)
    else:
        print_result(
            f"[green]wrote[/] {result['pairs']} pairs ({result['ties_skipped']} ties skipped) to {c.out}"
        )


pairs = config_command(PairsConfig, "pairs", run)
