"""End to end: the staged Make recipe runs Flow-GRPO on the tiny model, the reward rises, and the
recipe's file dependencies re-run exactly what an edit invalidates (Make and Snakemake)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stages.shards.reader import ShardSet

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 3
pytestmark = pytest.mark.slow


def make(run: Path, model: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        "make",
        "--no-print-directory",
        "-f",
        str(ROOT / "recipes" / "flow_grpo.mk"),
        f"OMNIRL={sys.executable} -m omnirl_cli",
        f"CONFIG={ROOT / 'recipes/configs/demo_tiny.yaml'}",
        f"MODEL={model}",
        f"PROMPTS={ROOT / 'recipes/demo_prompts.txt'}",
        f"RUN={run}",
        f"ITERATIONS={ITERATIONS}",
        "SEED=0",
        *extra,
    ]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=check,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture(scope="module")
def demo_run(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("e2e") / "run"
    make(run, tiny_sd3)
    return run


def test_reward_rises_over_iterations(demo_run: Path) -> None:
    """The demo preset, fixed prompts and seeds: the last policy beats the base model clearly."""
    first = ShardSet(demo_run / "it0" / "rewards").read_all()["reward"].double()
    last = ShardSet(demo_run / f"it{ITERATIONS}" / "rewards").read_all()["reward"].double()
    standard_error = math.sqrt(first.var() / len(first) + last.var() / len(last))
    assert last.mean() - first.mean() > 2 * standard_error, (float(first.mean()), float(last.mean()))
    steps = json.loads((demo_run / f"it{ITERATIONS}" / "policy" / "omnirl_adapter.json").read_text())["step"]
    assert steps == ITERATIONS * 8  # 64 samples per iteration in micro-batches of 8


def test_the_recipe_skips_the_replay_of_its_in_process_rollouts(demo_run: Path) -> None:
    """REPLAY=auto (the default): every rollout was drawn in process under the update's weights and
    numerics, so logprob ran no model and update trained on the rollout's own log-probs."""
    from stages.shards.manifest import read_manifest

    for k in range(ITERATIONS):
        extra = read_manifest(demo_run / f"it{k}" / "logprobs").extra
        assert extra["replayed"] is False and extra["rows_replayed"] == 0, extra
        assert "diffusers engine" in extra["replay_reason"]


def test_report_writes_curve_and_grids(demo_run: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "omnirl_cli", "report", str(demo_run), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(out.stdout)
    assert [r["iteration"] for r in info["iterations"]] == list(range(ITERATIONS + 1))
    assert (demo_run / "reward_curve.png").stat().st_size > 1000
    assert all(Path(g).is_file() for g in info["grids"]) and len(info["grids"]) == ITERATIONS + 1


def test_make_rerun_does_nothing_and_a_deleted_artifact_reruns_only_its_dependents(
    demo_run: Path, tiny_sd3: Path
) -> None:
    assert make(demo_run, tiny_sd3, "-q", check=False).returncode == 0  # up to date
    shutil.rmtree(demo_run / "it1" / "rewards")
    plan = make(demo_run, tiny_sd3, "-n").stdout
    ran = {
        line.split()[3] + " " + line.split("--out ")[1].split()[0].split("/run/")[1]
        for line in plan.splitlines()
        if "omnirl_cli" in line and "--out " in line
    }
    assert "score it1/rewards" in ran and "advantage it1/advantages" in ran and "update it2/policy" in ran
    assert not any(r.endswith(("it0/samples", "it1/samples", "it1/logprobs", "it0/rewards")) for r in ran)
    lines = [line.split("--iteration ")[1].split()[0] for line in plan.splitlines() if " report " in line]
    assert lines == ["1", "2", "3"]  # the lines of the iterations that change; it0's stays as it was
    make(demo_run, tiny_sd3)
    assert make(demo_run, tiny_sd3, "-q", check=False).returncode == 0


@pytest.mark.skipif(
    shutil.which("snakemake") is None and not (Path(sys.executable).parent / "snakemake").exists(),
    reason="snakemake is a dev extra",
)
def test_snakefile_sees_the_same_dependencies(demo_run: Path, tiny_sd3: Path) -> None:
    snakemake = str(Path(sys.executable).parent / "snakemake")
    base = [
        snakemake,
        "-s",
        str(ROOT / "recipes" / "Snakefile"),
        "-n",
        "--cores",
        "1",
        "--config",
        f"run={demo_run}",
        f"model={tiny_sd3}",
        f"prompts={ROOT / 'recipes/demo_prompts.txt'}",
        f"preset={ROOT / 'recipes/configs/demo_tiny.yaml'}",
        f"iterations={ITERATIONS}",
    ]
    out = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, check=True)
    assert "Nothing to be done" in out.stdout + out.stderr
    (demo_run / "it2" / "advantages" / "_manifest.json").touch()  # an artifact changed
    out = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    assert (
        f"{demo_run}/it3/policy/omnirl_adapter.json" in text
        and f"{demo_run}/it3/samples/_manifest.json" in text
    )
    assert f"{demo_run}/it2/samples/_manifest.json" not in text.split("Building DAG")[1]
    assert "rule update" in text and "rule sample" in text and "rule score" in text
