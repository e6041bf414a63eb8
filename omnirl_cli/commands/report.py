"""`omnirl report`: a run's reward table, reward curve and image grids."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..console import emit_json, err, progress
from ..errors import handle_errors
from ..options import JsonOpt, ReportToOpt, RunNameOpt


@handle_errors
def report(
    run: Annotated[Path, typer.Argument(help="Run directory holding it<K>/ iterations.")],
    grids: Annotated[
        bool, typer.Option("--grids/--no-grids", help="Write an image grid per iteration.")
    ] = True,
    report_to: ReportToOpt = None,
    run_name: RunNameOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Summarise a run: per-iteration reward table, RUN/reward_curve.png and RUN/it<K>/grid.png
    (for a VLM run RUN/it<K>/responses.md: each group's responses with their rewards, best first).

    --report-to replays the run into trackers: each iteration's reward statistics, every metrics.jsonl
    record and the grids / response sheets. Points a stage or an earlier report already sent to that
    tracker run (RUN/tracking/sent.jsonl) are skipped, so a replay never duplicates a step.

    Example: [bold]omnirl report runs/demo --report-to tensorboard[/]
    """
    from stages.reporting import collect, image_grid, iterations, response_sheet, reward_curve
    from stages.shards.manifest import read_manifest
    from stages.shards.reader import rollout_modality
    from stages.tracking import Tracking, parse_report_to, replay

    tracking = Tracking(parse_report_to(report_to), run, run_name)
    sheets = []
    with progress(not json_) as bar:
        task = bar.add_task(f"report {run}", total=None, rate="")
        rows = collect(run)
        curve = reward_curve(rows, run / "reward_curve.png")
        found = iterations(run) if grids else []
        bar.update(task, total=len(found))
        for k, it in found:
            bar.advance(task)
            samples = it / "samples"
            if not (samples / "_manifest.json").is_file():
                continue
            if rollout_modality([read_manifest(samples)]) == "text":
                sheets.append((k, response_sheet(samples, it / "rewards", it / "responses.md")))
            else:
                sheets.append((k, image_grid(samples, it / "rewards", it / "grid.png")))
    grid_paths = [str(path) for _, path in sheets]
    with tracking:
        sent = replay(tracking, run, sheets)
    if json_:
        tracked = {"trackers": tracking.names, "points_sent": sent} if tracking else {}
        emit_json({"iterations": rows, "reward_curve": str(curve), "grids": grid_paths, **tracked})
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
    if tracking:
        err.print(f"sent {sent} new points to {', '.join(tracking.names)} (run {tracking.run_id})")
