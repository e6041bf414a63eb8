"""`omnirl report`: a run's reward table, reward curve and image grids."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..console import emit_json, err, progress
from ..errors import handle_errors
from ..options import JsonOpt


@handle_errors
def report(
    run: Annotated[Path, typer.Argument(help="Run directory holding it<K>/ iterations.")],
    grids: Annotated[
        bool, typer.Option("--grids/--no-grids", help="Write an image grid per iteration.")
    ] = True,
    json_: JsonOpt = False,
) -> None:
    """Summarise a run: per-iteration reward table, RUN/reward_curve.png and RUN/it<K>/grid.png
    (for a VLM run RUN/it<K>/responses.md: each group's responses with their rewards, best first).

    Example: [bold]omnirl report runs/demo[/]
    """
    from stages.reporting import collect, image_grid, iterations, response_sheet, reward_curve
    from stages.shards.manifest import read_manifest
    from stages.shards.reader import rollout_modality

    with progress(not json_) as bar:
        task = bar.add_task(f"report {run}", total=None, rate="")
        rows = collect(run)
        curve = reward_curve(rows, run / "reward_curve.png")
        grid_paths = []
        found = iterations(run) if grids else []
        bar.update(task, total=len(found))
        for _, it in found:
            bar.advance(task)
            samples = it / "samples"
            if not (samples / "_manifest.json").is_file():
                continue
            if rollout_modality([read_manifest(samples)]) == "text":
                grid_paths.append(str(response_sheet(samples, it / "rewards", it / "responses.md")))
            else:
                grid_paths.append(str(image_grid(samples, it / "rewards", it / "grid.png")))
    if json_:
        emit_json({"iterations": rows, "reward_curve": str(curve), "grids": grid_paths})
        return
    from rich.table import Table

    table = Table(title=f"{run}: reward per iteration")
    cols = [
        ("iteration", "it"),
        ("samples", "n"),
        ("reward_mean", "reward mean"),
        ("reward_std", "std"),
        ("zero_std_ratio", "zero-std"),
        ("pg_loss", "pg_loss"),
        ("ratio_mean", "ratio"),
        ("clipfrac", "clipfrac"),
    ]
    for _, title in cols:
        table.add_column(title, justify="right")
    for r in rows:
        table.add_row(
            *(
                ("" if r.get(k) is None else f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]))
                for k, _ in cols
            )
        )
    err.print(table)
    shown = f"; per iteration: {run}/it<K>/{Path(grid_paths[-1]).name}" if grid_paths else ""
    err.print(f"reward curve: {curve}{shown}")
