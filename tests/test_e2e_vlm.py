"""End to end for VLMs: `recipes/vlm_grpo.mk` with the demo preset trains the tiny Qwen2.5-VL on the
visual-counting task through files, and the reward rises (what `make demo-vlm` shows)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stages.shards.reader import ShardSet

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 2
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vlm_demo(tiny_vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("e2e_vlm") / "run"
    prompts = run.parent / "prompts.parquet"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes/tasks/visual_count.py"),
            "--out",
            str(prompts),
            "--num-prompts",
            "256",
            "--seed",
            "0",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-f",
            str(ROOT / "recipes" / "vlm_grpo.mk"),
            f"OMNIRL={sys.executable} -m omnirl_cli",
            f"CONFIG={ROOT / 'recipes/configs/vlm_demo_tiny.yaml'}",
            f"MODEL={tiny_vlm}",
            f"PROMPTS={prompts}",
            f"RUN={run}",
            f"ITERATIONS={ITERATIONS}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return run


def test_counting_reward_rises(vlm_demo: Path) -> None:
    """Fresh prompts every iteration: the trained policy beats the random base by many standard errors."""
    means = []
    for k in range(ITERATIONS + 1):
        reward = ShardSet(vlm_demo / f"it{k}" / "rewards").read_all()["reward"].double()
        means.append((float(reward.mean()), math.sqrt(float(reward.var()) / len(reward))))
    (first, se0), (last, se1) = means[0], means[-1]
    assert last - first > 10 * math.sqrt(se0**2 + se1**2), means
    assert means[1][0] > first, means
    steps = json.loads((vlm_demo / f"it{ITERATIONS}" / "policy" / "omnirl_adapter.json").read_text())["step"]
    assert steps == ITERATIONS * 8  # 128 prompts × 16 responses in micro-batches of 256


def test_report_writes_curve_and_response_sheets(vlm_demo: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "omnirl_cli", "report", str(vlm_demo), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(out.stdout)
    assert [r["iteration"] for r in info["iterations"]] == list(range(ITERATIONS + 1))
    sheets = [Path(g) for g in info["grids"]]
    assert [s.name for s in sheets] == ["responses.md"] * (ITERATIONS + 1)
    text = sheets[-1].read_text()
    assert text.count("ground truth:") == 8 and "| sample | reward | response |" in text


def test_held_out_evaluation_plans_no_diffusion_sampler(tmp_path: Path) -> None:
    """recipes/eval.mk's default EVAL_FLAGS (--sampler ode) is a diffusion option `sample` refuses for a
    VLM: the VLM recipe's evaluations sample with the preset's settings alone."""
    plan = subprocess.run(
        ["make", "-n", "--no-print-directory", "-f", str(ROOT / "recipes/vlm_grpo.mk"), "ITERATIONS=1",
         f"RUN={tmp_path / 'run'}", f"EVAL_PROMPTS={tmp_path / 'heldout.parquet'}"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    evals = [line for line in plan.splitlines() if " sample " in line and "/eval/samples" in line]
    assert len(evals) == 2 and not any("--sampler" in line for line in evals)
