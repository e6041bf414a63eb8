"""`make leaderboard` (recipes/leaderboard.mk): its presets keep the demo's budget, `make -n` plans every
algorithm on the shared demo model, and a smoke run (two algorithms, one iteration, a tiny budget) gives
the table and plot of `omnirl report`'s own held-out numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "recipes" / "configs" / "leaderboard"
DEMO = yaml.safe_load((ROOT / "recipes" / "configs" / "demo_shapes.yaml").read_text())
ALGOS = ["nft", "flow_grpo", "dance_grpo", "mix_grpo", "grpo_guard", "flow_dppo", "awm", "dgpo", "dpo"]


def test_every_preset_keeps_the_demo_budget_and_optimizer() -> None:
    assert sorted(p.stem for p in PRESETS.glob("*.yaml")) == sorted(ALGOS)
    for algo in ALGOS:
        preset = yaml.safe_load((PRESETS / f"{algo}.yaml").read_text())
        assert preset["update"]["algo"] == algo
        for key in ("steps", "guidance", "resolution", "group_size", "num_prompts", "batch_size"):
            assert preset["sample"][key] == DEMO["sample"][key], (algo, key)
        for key in ("full", "lr", "samples_per_step", "micro_batch"):
            assert preset["update"][key] == DEMO["update"][key], (algo, key)
    # DiffusionNFT's run is the demo's own
    assert yaml.safe_load((PRESETS / "nft.yaml").read_text()) == DEMO


def test_make_leaderboard_plans_every_algorithm_on_the_demo_model(tmp_path: Path) -> None:
    plan = subprocess.run(
        ["make", "-n", "--no-print-directory", "leaderboard", f"LEADERBOARD_RUN={tmp_path}", "LEADERBOARD_ITERATIONS=2"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    commands = [line.strip() for line in plan.splitlines()]
    updates = [c for c in commands if c.startswith("omnirl update ")]
    assert len(updates) == 2 * len(ALGOS)
    assert all("--model recipes/models/demo-shapes " in c for c in updates)
    for algo in ALGOS:
        assert sum(f"--config recipes/configs/leaderboard/{algo}.yaml" in c for c in updates) == 2
        # the same training prompts, seeds and held-out evaluation for everyone
        samples = [c for c in commands if c.startswith("omnirl sample ") and f"{tmp_path}/{algo}/" in c]
        assert sum(f"--prompts {tmp_path}/prompts.jsonl --seed 1 --iteration 1 " in c for c in samples) == 1
        assert sum(f"--prompts {tmp_path}/heldout.jsonl --seed 0 --sampler ode" in c for c in samples) == 3
    # only the algorithms that read rollout log-probs replay them
    replayed = {c.split("--config recipes/configs/leaderboard/")[1].split(".yaml")[0] for c in commands if c.startswith("omnirl logprob ")}  # fmt: skip
    assert replayed == {"flow_grpo", "dance_grpo", "mix_grpo", "grpo_guard", "flow_dppo"}
    assert commands[-1] == f".venv/bin/python recipes/leaderboard.py {tmp_path} {' '.join(ALGOS)}"


def json_out(command: list[str]) -> dict:
    """A command's --json object."""
    return json.loads(subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout)


@pytest.mark.slow
def test_leaderboard_smoke_run_tables_report_numbers(tmp_path: Path) -> None:
    run = tmp_path / "board"
    stamp = tmp_path / "installed"  # a fresh install stamp: the virtualenv is installed, nothing is redone
    stamp.touch()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tiny = "--overwrite --set sample.num_prompts=2 --set sample.group_size=4 --set update.samples_per_step=8 --set update.micro_batch=4"
    done = subprocess.run(
        ["make", "--no-print-directory", "leaderboard", f"STAMP={stamp}", f"OMNIRL={sys.executable} -m omnirl_cli",
         f"LEADERBOARD_RUN={run}", "LEADERBOARD_ALGOS=nft flow_grpo", "LEADERBOARD_ITERATIONS=1",
         f"LEADERBOARD_FLAGS={tiny}", "DEMO_PROMPTS=8", "DEMO_EVAL=4"],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    board = json_out([sys.executable, "recipes/leaderboard.py", str(run), "nft", "flow_grpo", "--json"])
    board = board["algorithms"]
    assert list(board) == ["nft", "flow_grpo"]
    for algo, rows in board.items():
        report = json_out(
            [sys.executable, "-m", "omnirl_cli", "report", str(run / algo), "--json", "--no-grids"]
        )
        report = report["iterations"]
        assert [r["iteration"] for r in rows] == [0, 1]
        for row, reported in zip(rows, report, strict=True):  # report's numbers, unchanged
            held_out = reported["eval"]
            assert row["samples"] == held_out["samples"] == 16  # 4 held-out prompts × 4 seeds
            assert row["reward_mean"] == held_out["reward_mean"] and row["reward_se"] == held_out["reward_se"]
            assert row["accuracy"] == held_out["reward.geneval_shapes_strict_mean"]
            assert 0 <= row["accuracy"] <= 1 and row["reward_se"] > 0
        assert reported["samples"] == 8  # the tiny training budget: 2 prompts × 4
    # one base model, the same held-out prompts and noise: every algorithm starts from the same row
    assert board["nft"][0] == board["flow_grpo"][0]
    table = done.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| algorithm |"))
    assert table[header] == "| algorithm | it0 | it1 |"
    nft = board["nft"][1]
    cell = f"{nft['accuracy']:.1%} · {nft['reward_mean']:.3f} ± {nft['reward_se']:.3f}"
    assert table[header + 2].startswith("| nft | ") and table[header + 2].endswith(f" | {cell} |")
    assert table[header + 3].startswith("| flow_grpo | ")
    with Image.open(run / "leaderboard.png") as plot:
        assert plot.size == (1280, 480)
        assert len(plot.getcolors(1 << 16) or []) > 4  # curves drawn, not a blank canvas
