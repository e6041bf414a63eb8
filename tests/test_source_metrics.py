"""Reward and accuracy per data source (verl's data_source) and per media kind, in `report` and the
trackers, on a hand-made VLM rollout whose per-subset means are computed here independently."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import run
from typer.testing import CliRunner

from omnirl_cli.app import app
from stages.reporting import collect
from stages.sample.vlm_stage import KINDS
from stages.score.scoring import FAILED_COLUMN
from stages.shards.writer import ShardSetWriter

IMAGE, VIDEO, AUDIO = ({"type": kind} for kind in ("image", "video", "audio"))
TEXT = {"type": "text", "text": "how many?"}
# one row per response: (data source, the prompt's media parts, reward, accuracy, failed)
ROWS = [
    ("geo3k", [IMAGE], 0.9, 1.0, False),
    ("geo3k", [IMAGE], 0.1, 0.0, False),
    ("geo3k", [IMAGE, IMAGE], 0.8, 1.0, False),
    ("geo3k", [IMAGE, IMAGE], 5.0, 1.0, True),  # a failed reward: left out everywhere
    ("clevr", [VIDEO], 0.4, 0.0, False),
    ("clevr", [VIDEO], 0.7, 1.0, False),
    ("gsm8k", [], 0.3, 0.0, False),
    ("gsm8k", [], 0.6, 1.0, False),
    ("avqa", [IMAGE, AUDIO], 1.0, 1.0, False),
    ("avqa", [IMAGE, AUDIO], 0.2, 0.0, False),
]


def _write(path: Path, columns: dict, kinds: dict | None = None) -> None:
    writer = ShardSetWriter(path, num_shards=1, command="test", config={}, kinds=kinds)
    writer.write_shard(0, columns)
    writer.finalize()


def _rollout(it: Path) -> None:
    ids = [f"s{i}" for i in range(len(ROWS))]
    _write(
        it / "samples",
        {
            "sample_id": ids,
            "group_id": [f"g{i // 2}" for i in range(len(ROWS))],
            "prompt": ["how many?"] * len(ROWS),
            "prompt_meta": [{"data_source": s, "ground_truth": "1"} for s, *_ in ROWS],
            "messages": [[{"role": "user", "content": [*parts, TEXT]}] for _, parts, *_ in ROWS],
        },
        KINDS,
    )
    _write(
        it / "rewards",
        {
            "sample_id": ids,
            "reward": torch.tensor([r for _, _, r, _, _ in ROWS]),
            "reward.accuracy": torch.tensor([a for _, _, _, a, _ in ROWS]),
            FAILED_COLUMN: torch.tensor([f for *_, f in ROWS]),
        },
    )


def _expected(keep) -> dict[str, float]:
    """Samples, reward mean, its standard error and the accuracy over the scored rows `keep` picks."""
    picked = [(r, a) for row in ROWS if keep(row) and not row[4] for r, a in [(row[2], row[3])]]
    n = len(picked)
    mean = sum(r for r, _ in picked) / n
    se = math.sqrt(sum((r - mean) ** 2 for r, _ in picked) / (n - 1) / n)
    return {"samples": n, "reward_mean": mean, "reward_se": se, "accuracy": sum(a for _, a in picked) / n}


SOURCES = {s: (lambda row, s=s: row[0] == s) for s in ("geo3k", "clevr", "gsm8k", "avqa")}
MEDIA = {
    "image": lambda row: IMAGE in row[1],
    "video": lambda row: VIDEO in row[1],
    "audio": lambda row: AUDIO in row[1],
    "text": lambda row: not row[1],
}


def test_report_breaks_reward_and_accuracy_down_by_source_and_media_kind(tmp_path: Path) -> None:
    _rollout(tmp_path / "run" / "it0")
    (row,) = collect(tmp_path / "run")
    assert row["samples"] == 9 and row["reward_failed"] == 1
    for group, subsets in (("sources", SOURCES), ("media", MEDIA)):
        assert sorted(row[group]) == sorted(subsets)
        for name, keep in subsets.items():
            want, got = _expected(keep), row[group][name]
            assert got["samples"] == want["samples"], (group, name)
            assert got["reward_mean"] == pytest.approx(want["reward_mean"]), (group, name)
            assert got["reward_se"] == pytest.approx(want["reward_se"]), (group, name)
            assert got["reward.accuracy_mean"] == pytest.approx(want["accuracy"]), (group, name)
    # the table: one row per subset, the accuracy column beside the reward
    table = CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--no-grids"], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    lines = {line.split("│")[1].strip(): line for line in table.stdout.splitlines() if "│ source " in line}
    geo = _expected(SOURCES["geo3k"])
    assert f"{geo['reward_mean']:.4g} ± {geo['reward_se']:.2g}" in lines["source geo3k"]


def test_trackers_log_the_means_per_source_and_media_kind(tmp_path: Path) -> None:
    from test_tracking import events, f32, scalars

    _rollout(tmp_path / "exp" / "it0")
    run("report", str(tmp_path / "exp"), "--no-grids", "--report-to", "tensorboard")
    logged = scalars(events(tmp_path / "exp", "exp"))
    for prefix, subsets in (("source", SOURCES), ("media", MEDIA)):
        for name, keep in subsets.items():
            want = _expected(keep)
            # the rewards are float32: their mean is the decimal one to float32 rounding
            ((step, mean),) = logged[f"reward/{prefix}/{name}/mean"]
            assert step == 0 and mean == pytest.approx(want["reward_mean"], rel=1e-6)
            assert logged[f"reward.accuracy/{prefix}/{name}/mean"] == [(0, f32(want["accuracy"]))]
