"""The files `omnirl report` draws for a run: the reward curve, each iteration's grid (a VLM run's
response sheet, a video run's contact sheet and preview GIF) and the before/after comparison of the
first and last iteration's samples of the same prompts; then the replay of the run into trackers.

The drawing itself is `stages.reporting`; this module picks what to draw from the run's layout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.report_sheets import (
    comparison_grid,
    contact_sheet,
    has_media,
    image_grid,
    response_sheet,
    video_preview,
)
from stages.reporting import collect, iterations, reward_curve
from stages.shards.manifest import read_manifest
from stages.shards.reader import rollout_modality
from stages.tracking import Tracking, replay


def write_report(
    run: Path, tracking: Tracking, *, grids: bool, display: Any, on_no_media: Callable[[int, str], None]
) -> dict[str, Any]:
    """Draw `run`'s report files (the grids only with `grids`) and replay the run into `tracking`,
    advancing the progress `display` (`add_task`, `update`, `advance`) per iteration; `on_no_media(k,
    modality)` is told of an iteration whose samples hold no media to draw (deferred media).

    Returns `iterations` (`collect`'s rows), `reward_curve`, `grids` and `previews` (paths, in
    iteration order), `no_media` (those iterations), `before_after` (a path, or None when no two
    iterations show the same kind of media) and `points_sent` (new tracker points)."""
    sheets = []
    previews = []
    skipped: list[int] = []
    # per kind of rollout: (iteration, directory holding samples/ and rewards/, its media)
    image_sets: dict[str, list[tuple[int, Path, str]]] = {"eval": [], "samples": []}
    task = display.add_task(f"report {run}", total=None, rate="")
    rows = collect(run)
    curve = reward_curve(rows, run / "reward_curve.png")
    found = iterations(run) if grids else []
    display.update(task, total=len(found))
    for k, it in found:
        display.advance(task)
        samples = it / "samples"
        evaluated = it / "eval" / "samples"
        if (evaluated / "_manifest.json").is_file():
            media = rollout_modality([read_manifest(evaluated)])
            if media == "text" or has_media(evaluated, it / "eval" / "rewards", media):
                image_sets["eval"].append((k, it / "eval", media))
        if not (samples / "_manifest.json").is_file():
            continue
        modality = rollout_modality([read_manifest(samples)])
        if modality != "text" and not has_media(samples, it / "rewards", modality):
            skipped.append(k)
            on_no_media(k, modality)
        elif modality == "text":
            sheets.append((k, response_sheet(samples, it / "rewards", it / "responses.md")))
        elif modality == "video":
            image_sets["samples"].append((k, it, modality))
            sheets.append((k, contact_sheet(samples, it / "rewards", it / "grid.png")))
            previews.append(str(video_preview(samples, it / "preview.gif", rewards=it / "rewards")))
        else:
            image_sets["samples"].append((k, it, modality))
            sheets.append((k, image_grid(samples, it / "rewards", it / "grid.png")))
    comparison = None
    for name, found_sets in image_sets.items():
        if len(found_sets) > 1 and found_sets[0][2] == found_sets[-1][2] != "text":
            (k0, first, media), (k1, last, _) = found_sets[0], found_sets[-1]
            sets = [(d / "samples", d / "rewards") for d in (first, last)]
            where = "held-out eval" if name == "eval" else "samples"
            comparison = comparison_grid(
                sets[0],
                sets[1],
                run / "before_after.png",
                headers=(f"it{k0} ({where})", f"it{k1} ({where})"),
                media=media,
            )
            if comparison is not None:
                break
    with tracking:
        sent = replay(tracking, run, sheets)
    return {
        "iterations": rows,
        "reward_curve": curve,
        "grids": [str(path) for _, path in sheets],
        "previews": previews,
        "no_media": skipped,
        "before_after": comparison,
        "points_sent": sent,
    }
