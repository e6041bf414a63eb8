"""`omnirl advantage`: group-normalised advantages from rewards."""

from __future__ import annotations

from stages.advantage.config import AdvantageConfig

from ..console import emit_json, print_result, progress
from ..generate import config_command


def run(c: AdvantageConfig, json_: bool) -> None:
    """Normalise rewards within each prompt group and broadcast over the stored steps.

    Reports zero_std_ratio (groups whose rewards are all equal, whose advantages are 0).

    A failed reward (flagged in reward_failed by `score --on-error zero`, or NaN/±inf in a set from
    another tool) is left out of every statistic (group and batch) and gets advantage 0; a group left
    with fewer than two scored samples gets 0 for all of them. The rows stay flagged in reward_failed,
    so `update` skips them; their count is reported as reward_failed (stats in the manifest, --json).

    Example: [bold]omnirl advantage --in run/it0/samples --in run/it0/rewards --out run/it0/advantages[/]
    """
    from stages.advantage.stage import run_advantage
    from stages.score.scoring import FAILED_COLUMN

    with progress() as bar:
        stats = run_advantage(c, bar)
    if json_:
        emit_json(stats)
    else:
        print_result(
            f"[green]advantages[/] → {c.out}  reward {stats['reward_mean']:.4f} ± {stats['reward_std']:.4f} "
            "(mean ± sd), "
            f"zero_std_ratio {stats['zero_std_ratio']:.3f}, {stats['num_groups']} groups, "
            f"{stats[FAILED_COLUMN]} failed rewards left out"
        )


advantage = config_command(AdvantageConfig, "advantage", run)
