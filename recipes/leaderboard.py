"""The leaderboard's table and plot (recipes/leaderboard.mk): the runs ROOT/<algo> of several algorithms
on one task, compared on the held-out evaluation of each iteration's policy.

Every number is `omnirl report`'s (`stages.reporting.collect`: the reward mean ± standard error and each
named reward's mean of it<K>/eval/rewards); this script only lays them side by side. It prints a
Markdown table on stdout, one row per algorithm and a column per iteration, each cell the accuracy
(the mean of the 0/1 reward --accuracy) and the reward mean ± standard error, and writes ROOT/leaderboard.png:
the held-out reward (±1 standard-error whiskers) and the accuracy per iteration, a curve per algorithm.
--json prints the rows instead of the table. An algorithm without an evaluated iteration yet is left
out with a line on stderr.

    python recipes/leaderboard.py runs/leaderboard nft flow_grpo --accuracy geneval_shapes_strict
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.reporting import CURVE_COLOURS, collect, curve_image

PANEL = (640, 480)  # each of the two panels of leaderboard.png, in pixels


def held_out(root: Path, algos: list[str], accuracy: str) -> dict[str, list[dict[str, Any]]]:
    """Per algorithm, its evaluated iterations' rows: iteration, samples, reward_mean, reward_se and
    accuracy (the mean of `reward.<accuracy>`), as `collect` summarises ROOT/<algo>."""
    key = f"reward.{accuracy}_mean"
    board = {}
    for algo in algos:
        run = root / algo
        rows = [r for r in collect(run) if "eval" in r] if run.is_dir() else []
        if not rows:
            print(f"{run}: no evaluated iteration yet, left out", file=sys.stderr)
            continue
        missing = [r["iteration"] for r in rows if key not in r["eval"]]
        if missing:
            raise UserInputError(
                f"{run}/it{missing[0]}/eval/rewards: no {key} column; score with --reward {accuracy}=0 or "
                "pass the --accuracy reward it has"
            )
        board[algo] = [
            {
                "iteration": r["iteration"],
                "samples": r["eval"]["samples"],
                "reward_mean": r["eval"]["reward_mean"],
                "reward_se": r["eval"]["reward_se"],
                "accuracy": r["eval"][key],
            }
            for r in rows
        ]
    return board


def table(board: dict[str, list[dict[str, Any]]], accuracy: str) -> str:
    """The Markdown table: a row per algorithm, a column per iteration, cells `ACC% · MEAN ± SE`."""
    its = sorted({r["iteration"] for rows in board.values() for r in rows})
    lines = [
        f"| algorithm | {' | '.join(f'it{k}' for k in its)} |",
        f"|---|{'---|' * len(its)}",
    ]
    for algo, rows in board.items():
        by_it = {r["iteration"]: r for r in rows}
        cells = [
            f"{r['accuracy']:.1%} · {r['reward_mean']:.3f} ± {r['reward_se']:.3f}"
            if (r := by_it.get(k))
            else ""
            for k in its
        ]
        lines.append(f"| {algo} | {' | '.join(cells)} |")
    n = sorted({r["samples"] for rows in board.values() for r in rows})
    lines.append(
        f"\nEach cell: held-out {accuracy} accuracy · reward mean ± standard error "
        f"(n = {', '.join(map(str, n))} per cell)."
    )
    return "\n".join(lines)


def plot(board: dict[str, list[dict[str, Any]]], accuracy: str, path: Path) -> Path:
    """leaderboard.png: the held-out reward (±1 se whiskers) and accuracy per iteration, side by side."""
    from PIL import Image

    colours = {algo: CURVE_COLOURS[i % len(CURVE_COLOURS)] for i, algo in enumerate(board)}
    reward = [
        (algo, [(r["iteration"], r["reward_mean"], r["reward_se"]) for r in rows], colours[algo], None)
        for algo, rows in board.items()
    ]
    strict = [
        (algo, [(r["iteration"], r["accuracy"], 0.0) for r in rows], colours[algo], None)
        for algo, rows in board.items()
    ]
    figure = Image.new("RGB", (2 * PANEL[0], PANEL[1]), "white")
    figure.paste(
        curve_image(reward, title="held-out reward (whiskers: ±1 standard error)", size=PANEL), (0, 0)
    )
    figure.paste(curve_image(strict, title=f"held-out {accuracy} accuracy", size=PANEL), (PANEL[0], 0))
    figure.save(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the folder holding a run per algorithm, ROOT/<algo>")
    parser.add_argument("algos", nargs="+", help="the algorithms (run folders) to compare, in this order")
    parser.add_argument(
        "--accuracy", default="geneval_shapes_strict", help="the 0/1 reward reported as accuracy"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = parser.parse_args()
    try:
        board = held_out(args.root, args.algos, args.accuracy)
        if not board:
            raise UserInputError(
                f"{args.root}: none of {', '.join(args.algos)} has an evaluated iteration yet"
            )
    except UserInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    path = plot(board, args.accuracy, args.root / "leaderboard.png")
    if args.json:
        print(json.dumps({"algorithms": board, "plot": str(path)}))
    else:
        print(table(board, args.accuracy))
        print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
