"""`omnirl report`: a run's reward table, reward curve and image grids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.inspection import ReportConfig

from ..console import emit_json, log, out, progress
from ..generate import config_command


def run(c: ReportConfig, json_: bool) -> None:
    """Summarise a run: per-iteration reward table (mean ± standard error; the mean of each named reward,
    e.g. a strict accuracy; the held-out evaluation in it<K>/eval when there is one), the same per data
    source (the prompts' verl data_source) and per media kind (image, video, audio, text only) where a
    rollout has several, RUN/reward_curve.png,
    RUN/it<K>/grid.png (for a VLM run RUN/it<K>/responses.md: each group's responses with their rewards,
    best first; for a video run a contact sheet, each sample as its first, middle and last frame, plus
    RUN/it<K>/preview.gif, the first samples playing together) and RUN/before_after.png: the first and last iteration's samples of the same prompts
    side by side (the held-out evaluation's, else the training samples' when the recipe re-samples the
    same prompts and seeds). Every grid row has its prompt beside it; a conditioned run's (image editing,
    image-to-video) starts with the group's source image: source → result.

    --report-to replays the run into trackers: each iteration's reward statistics (the held-out
    evaluation's on their own series, eval/reward/mean ...; per data source and media kind as
    reward/source/NAME/mean, reward.accuracy/media/image/mean ...), every metrics.jsonl record and the grids /
    response sheets. Points a stage or an earlier report already sent to that
    tracker run (RUN/tracking/sent.jsonl) are skipped, so a replay never duplicates a step.

    --iteration K prints only iteration K's row, on one line: the training reward mean ± standard error,
    the held-out one when there is one, each named reward's mean and the update's step-mean losses.

    Example: [bold]omnirl report runs/demo --report-to tensorboard[/]
    """
    if c.iteration is not None:
        _iteration_line(c.run, c.iteration, json_)
        return
    from stages.run_report import write_report
    from stages.tracking import Tracking, parse_report_to

    def no_media(k: int, modality: str) -> None:
        log(
            f"it{k}: no grid: its samples hold no {modality}s (deferred media: `omnirl score "
            "--keep-media` writes them)",
            quiet=json_,
        )

    tracking = Tracking(parse_report_to(c.report_to), c.run, c.run_name)
    with progress() as bar:
        report = write_report(c.run, tracking, grids=c.grids, display=bar, on_no_media=no_media)
    sent = report.pop("points_sent")
    if json_:
        tracked = {"trackers": tracking.names, "points_sent": sent} if tracking else {}
        emit_json({**report, **tracked})  # paths as strings
        return
    rows, curve, grid_paths, comparison = (
        report[k] for k in ("iterations", "reward_curve", "grids", "before_after")
    )
    from rich.table import Table

    def se(stats: dict) -> str:
        return f"{stats['reward_mean']:.4g} ± {stats['reward_se']:.2g}" if "reward_mean" in stats else ""

    def named(stats: list[dict]) -> list[str]:
        """The `reward.<name>` means that are not just the total (a reward weighted 1 alone)."""
        keys = sorted({k for r in stats for k in r if k.startswith("reward.") and k.endswith("_mean")})
        return [k for k in keys if any(r.get(k) != r.get("reward_mean") for r in stats)]

    train_named = named(rows)
    eval_named = named([r["eval"] for r in rows if "eval" in r])
    cols: list[tuple[str, Any]] = [
        ("it", lambda r: str(r["iteration"])),
        ("n", lambda r: str(r.get("samples", ""))),
        ("reward (mean ± se)", se),
        *((key[len("reward.") : -len("_mean")], lambda r, key=key: _num(r.get(key))) for key in train_named),
    ]
    if any("eval" in r for r in rows):
        cols += [
            ("eval n", lambda r: str(r.get("eval", {}).get("samples", ""))),
            ("eval reward (mean ± se)", lambda r: se(r.get("eval", {}))),
            *(
                (
                    f"eval {key[len('reward.') : -len('_mean')]}",
                    lambda r, key=key: _num(r.get("eval", {}).get(key)),
                )
                for key in eval_named
            ),
        ]
    cols += [
        (title, lambda r, key=key: _num(r.get(key)))
        for key, title in (
            ("zero_std_ratio", "zero-std"),
            ("pg_loss", "pg_loss"),
            ("ratio_mean", "ratio"),
            ("clipfrac", "clipfrac"),
        )
    ]
    table = Table(
        title=f"{c.run}: reward per iteration",
        caption="± is the standard error of the mean; pg_loss, ratio and clipfrac are means over the "
        "update's optimizer steps (as `omnirl update` prints them)",
    )
    for title, _ in cols:
        table.add_column(title, justify="right")
    for r in rows:
        table.add_row(*(cell(r) for _, cell in cols))
    out.print(table)
    shown = f"; per iteration: {c.run}/it<K>/{Path(grid_paths[-1]).name}" if grid_paths else ""
    out.print(f"reward curve: {curve}{shown}" + (f"; before/after: {comparison}" if comparison else ""))
    subsets = _subset_table(rows, named)
    if subsets is not None:
        out.print(subsets)
    if tracking:
        out.print(f"sent {sent} new points to {', '.join(tracking.names)} (run {tracking.run_id})")


report = config_command(ReportConfig, "report", run, presets=False)


def _num(value: Any) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _subset_table(rows: list[dict[str, Any]], named: Any) -> Any:
    """The per data source and per media kind breakdown (`reward_stats`' `sources` and `media`) of the
    last iteration that has one, beside the first's reward; None for a run without one."""
    from rich.table import Table

    broken = [r for r in rows if r.get("sources") or r.get("media")]
    if not broken:
        return None
    first, last = broken[0], broken[-1]
    subsets = [(group, name) for group in ("sources", "media") for name in last.get(group, {})]
    keys = named([last[g][n] for g, n in subsets])
    table = Table(
        title=f"reward per data source and media kind, it{last['iteration']}",
        caption="± is the standard error of the mean; a prompt with several media kinds counts under each; "
        "a 0/1 reward's mean is its accuracy",
    )
    earlier = [f"it{first['iteration']} reward"] if first is not last else []
    columns = ["subset", "n", *earlier, f"it{last['iteration']} reward (mean ± se)"]
    for title in columns + [key[len("reward.") : -len("_mean")] for key in keys]:
        table.add_column(title, justify="right")
    for group, name in subsets:
        stats = last[group][name]
        before = [_num(first.get(group, {}).get(name, {}).get("reward_mean"))] if earlier else []
        label = f"source {name}" if group == "sources" else f"media {name}"
        mean = f"{stats['reward_mean']:.4g} ± {stats['reward_se']:.2g}"
        table.add_row(label, str(stats["samples"]), *before, mean, *(_num(stats.get(k)) for k in keys))
    return table


def _iteration_line(run: Path, k: int, json_: bool) -> None:
    """Iteration k's row of the table (`stages.reporting.collect`) as one line on stdout."""
    from stages.dist import join
    from stages.errors import UserInputError
    from stages.reporting import collect

    if join()[1] != 0:  # started through the recipe's launcher (OMNIRL=torchrun ...): one line, from rank 0
        return
    rows = collect(run, iteration=k)
    if not rows:
        raise UserInputError(
            f"{run}/it{k}: no scored samples yet (neither rewards/ nor eval/rewards/ is complete)"
        )
    row = rows[0]
    if json_:
        emit_json(row)
        return

    # the named rewards that are not just the total (a reward weighted 1 alone), as the table's columns
    sets = [stats for stats in (row, row.get("eval", {})) if "reward_mean" in stats]
    keys = {key for stats in sets for key in stats if key.startswith("reward.") and key.endswith("_mean")}
    named = sorted(key for key in keys if any(key in st and st[key] != st["reward_mean"] for st in sets))

    def rewards(stats: dict[str, Any], label: str) -> list[str]:
        parts = [f"{label} {stats['reward_mean']:.4g} ± {stats['reward_se']:.2g} (se, n {stats['samples']})"]
        return parts + [
            f"{key[len('reward.') : -len('_mean')]} {stats[key]:.4g}" for key in named if key in stats
        ]

    parts = [f"it{k}"]
    if "reward_mean" in row:
        parts += rewards(row, "reward")
    if "eval" in row:
        parts += rewards(row["eval"], "held-out reward")
    for key, title, spec in (
        ("zero_std_ratio", "zero-std", ".2f"),
        ("pg_loss", "pg_loss", "+.3e"),
        ("ratio_mean", "ratio", ".4f"),
        ("clipfrac", "clipfrac", ".3f"),
    ):
        if row.get(key) is not None:
            parts.append(f"{title} {row[key]:{spec}}")
    print("  ".join(parts), flush=True)
