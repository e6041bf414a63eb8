"""What a recipe run shows and keeps: one iteration of recipes/flow_grpo.mk on the tiny model (with the
held-out evaluation of recipes/eval.mk) prints one line per finished iteration on stdout, each stage's
progress on stderr, keeps each stage's --json result in it<K>/<stage>.json, and leaves a run folder that
`datasets.load_dataset(RUN, "samples")` reads (recipes/report.mk, stages/shards/run_card.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fails

from stages.reporting import reward_stats
from stages.shards.reader import ShardSet

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
# the tiniest rollout the recipe can train on: 2 prompts × 4 samples of 2 steps at 32 px
PRESET = """\
sample: {steps: 2, guidance: 1.0, resolution: 32, sampler: sde, noise_level: 0.7, group_size: 4,
         num_prompts: 2, batch_size: 4}
update: {algo: flow_grpo, lr: 1.0e-3}
"""
LINE = re.compile(r"^it(\d+)  reward \S+ ± \S+ \(se, n \d+\)")


def make(run: Path, model: Path, preset: Path, heldout: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "-f", str(ROOT / "recipes/flow_grpo.mk"),
         f"OMNIRL={sys.executable} -m omnirl_cli", f"CONFIG={preset}", f"MODEL={model}",
         f"PROMPTS={ROOT / 'recipes/demo_prompts.txt'}", f"RUN={run}", "ITERATIONS=1", "SEED=0",
         # a second reward weighted 0: a named reward of its own on the line, as a strict accuracy is
         "REWARD=--reward jpeg_compressibility --reward jpeg_incompressibility=0",
         f"EVAL_PROMPTS={heldout}", "EVAL_ITERS=1", "EVAL_FLAGS=--sampler ode --group-size 2 --num-prompts 2"],
        cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def recipe(
    tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("recipe")
    (tmp / "preset.yaml").write_text(PRESET)
    (tmp / "heldout.txt").write_text("a red circle\na blue square\n")
    run = tmp / "run"
    return run, make(run, tiny_sd3, tmp / "preset.yaml", tmp / "heldout.txt")


def test_one_line_per_finished_iteration_on_stdout(recipe: tuple[Path, subprocess.CompletedProcess]) -> None:
    run, done = recipe
    lines = [line for line in done.stdout.splitlines() if line.startswith("it")]
    assert [LINE.match(line).group(1) for line in lines] == ["0", "1"], done.stdout
    for k, line in enumerate(lines):
        stats = reward_stats(run / f"it{k}" / "rewards")
        assert line.startswith(
            f"it{k}  reward {stats['reward_mean']:.4g} ± {stats['reward_se']:.2g} (se, n 8)  "
        )
        strict = stats["reward.jpeg_incompressibility_mean"]
        assert f"  jpeg_incompressibility {strict:.4g}" in line
    assert "pg_loss " in lines[0] and "clipfrac " in lines[0] and "held-out" not in lines[0]
    held_out = reward_stats(run / "it1" / "eval" / "rewards")
    assert (
        f"held-out reward {held_out['reward_mean']:.4g} ± {held_out['reward_se']:.2g} (se, n 4)" in lines[1]
    )
    assert (run / "it1" / "summary.txt").read_text() == lines[1] + "\n"


def test_progress_on_stderr(recipe: tuple[Path, subprocess.CompletedProcess]) -> None:
    progress = [line.split(" [")[0] for line in recipe[1].stderr.splitlines()]
    for shown in ("sampling: 8/8", "scoring: 8/8", "listing: 8/8", "advantages: 8/8", "sampling: 4/4"):
        assert any(line.startswith(shown) for line in progress), (shown, recipe[1].stderr)
    assert any(line.startswith("updating: 2 loss ") for line in progress), recipe[1].stderr


def test_each_stage_keeps_its_json_result(recipe: tuple[Path, subprocess.CompletedProcess]) -> None:
    run = recipe[0]
    found = [*run.glob("it*/*.json"), *run.glob("it*/eval/*.json")]
    results = {path.relative_to(run).as_posix(): json.loads(path.read_text()) for path in found}
    assert set(results) == {
        *(f"it0/{stage}.json" for stage in ("sample", "score", "logprob", "advantage", "update")),
        "it1/sample.json", "it1/score.json", "it1/eval/sample.json", "it1/eval/score.json",
    }  # fmt: skip
    assert results["it0/sample.json"]["out"] == str(run / "it0" / "samples")
    assert results["it0/score.json"]["reward/mean"] == pytest.approx(
        reward_stats(run / "it0" / "rewards")["reward_mean"]
    )
    assert results["it0/advantage.json"]["num_samples"] == 8
    assert (
        results["it0/update.json"]["out"] == str(run / "it1" / "policy")
        and results["it0/update.json"]["step"] == 2
    )
    assert results["it1/eval/score.json"]["rows"] == 4
    assert not list(run.rglob("*.tmp"))


def test_the_run_folder_loads_as_a_dataset(
    recipe: tuple[Path, subprocess.CompletedProcess], tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    run = recipe[0]
    samples = datasets.load_dataset(str(run), "samples", cache_dir=str(tmp_path))
    assert sorted(samples) == ["it0", "it1"]
    for k in (0, 1):
        assert samples[f"it{k}"]["sample_id"] == ShardSet(run / f"it{k}" / "samples").read_all()["sample_id"]
    held_out = datasets.load_dataset(str(run), "eval_rewards", split="it1", cache_dir=str(tmp_path))
    assert held_out["reward"] == pytest.approx(
        ShardSet(run / "it1" / "eval" / "rewards").read_all()["reward"].tolist()
    )


def test_a_rerun_prints_nothing_and_a_missing_iteration_is_one_line(
    recipe: tuple[Path, subprocess.CompletedProcess], tiny_sd3: Path
) -> None:
    run = recipe[0]
    again = make(run, tiny_sd3, run.parent / "preset.yaml", run.parent / "heldout.txt")
    assert not [line for line in again.stdout.splitlines() if line.startswith("it") or "omnirl_cli" in line]
    assert "no scored samples yet" in fails(["report", str(run), "--iteration", "2"], f"{run}/it2")
