"""`--report-to`: trackers through Accelerate's tracking API, checked offline by reading TensorBoard's
event files back; one tracker run per run directory; `report` replays without duplicating a step."""

from __future__ import annotations

import json
import shutil
import sys
import types
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fails, online_args, run, staged_update_args, torchrun
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stages.reporting import reward_statistics
from stages.shards.reader import ShardSet
from stages.tracking import LEDGER, TRACKING_DIR, Tracking, parse_report_to, run_location, timing_metrics


def events(run: Path, name: str) -> EventAccumulator:
    """Every event the run's TensorBoard log dir for tracker run `name` holds (all processes' files)."""
    acc = EventAccumulator(
        str(run / TRACKING_DIR / "tensorboard" / name),
        size_guidance={"scalars": 0, "images": 0, "tensors": 0},
        purge_orphaned_data=False,
    )
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator) -> dict[str, list[tuple[int, float]]]:
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(x: float) -> float:
    """What TensorBoard stores of a float (simple_value is float32)."""
    return float(np.float32(x))


def metrics_of(policy: Path) -> list[dict]:
    return [json.loads(line) for line in (policy / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tracked(staged: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run `exp` laid out as the recipe does (it0/samples, it0/rewards, it1/policy) whose score and
    update logged to TensorBoard as they ran."""
    run_dir = tmp_path_factory.mktemp("tracking") / "exp"
    samples = run_dir / "it0" / "samples"
    shutil.copytree(staged["samples"], samples)
    score = run(
        "score",
        "--in",
        str(samples),
        "--reward",
        "jpeg_compressibility",
        "--out",
        str(run_dir / "it0" / "rewards"),
        "--report-to",
        "tensorboard",
    )
    run(*staged_update_args(staged, run_dir / "it1" / "policy", "--report-to", "tensorboard"))
    return {"run": run_dir, "score": score}


def test_update_and_score_log_what_metrics_jsonl_and_score_report(tracked: dict) -> None:
    run_dir = tracked["run"]
    logged = scalars(events(run_dir, "exp"))
    records = metrics_of(run_dir / "it1" / "policy")
    assert len(records) >= 2
    for key in ("actor/pg_loss", "actor/ratio_mean", "actor/grad_norm", "actor/lr", "epoch"):
        assert logged[key] == [(r["step"], f32(r[key])) for r in records], key
    expected_keys = {k for r in records for k in r if k != "step"}
    assert expected_keys <= set(logged)
    # the reward statistics of iteration 0, equal to what score reported and to the shard set's
    rewards = ShardSet(run_dir / "it0" / "rewards").read_all()
    stats = reward_statistics(rewards)
    assert set(stats) == {
        "reward/mean",
        "reward/std",
        "reward.jpeg_compressibility/mean",
        "reward.jpeg_compressibility/std",
    }
    for key, value in stats.items():
        assert value == tracked["score"][key]
        assert logged[key] == [(0, f32(value))], key
    assert stats["reward/std"] == pytest.approx(
        float(rewards["reward"].double().std(unbiased=False)), rel=1e-5
    )


def test_report_replays_once_and_never_duplicates_a_step(tracked: dict, tmp_path: Path) -> None:
    run_dir = tmp_path / "exp"
    shutil.copytree(tracked["run"], run_dir)
    live = scalars(events(run_dir, "exp"))
    # the live stages sent the scalars; report adds only the iteration's image grid, once
    first = run("report", str(run_dir), "--report-to", "tensorboard")
    again = run("report", str(run_dir), "--report-to", "tensorboard")
    assert (first["points_sent"], again["points_sent"]) == (1, 0)
    acc = events(run_dir, "exp")
    assert scalars(acc) == live
    assert [e.step for e in acc.Images("samples/grid")] == [0]
    grid = acc.Images("samples/grid")[0]
    from PIL import Image

    assert (grid.width, grid.height) == Image.open(run_dir / "it0" / "grid.png").size
    # a tracker run that never saw the run gets everything, once, with the same values
    sent = [
        run("report", str(run_dir), "--report-to", "tensorboard", "--run-name", "replay")["points_sent"]
        for _ in "ab"
    ]
    steps = len(metrics_of(run_dir / "it1" / "policy"))
    assert sent == [1 + steps + 1, 0]  # rewards of it0, every optimizer step, the grid
    replayed = events(run_dir, "replay")
    assert scalars(replayed) == live
    for tag, points in scalars(replayed).items():
        assert len({s for s, _ in points}) == len(points), tag
    assert [e.step for e in replayed.Images("samples/grid")] == [0]
    ledger = [json.loads(line) for line in (run_dir / TRACKING_DIR / LEDGER).read_text().splitlines()]
    assert max(Counter((r["tracker"], r["run"], r["series"], r["step"]) for r in ledger).values()) == 1


def test_a_tracker_missing_from_the_environment_is_one_line(
    tracked: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)
    fails(
        ["report", str(tracked["run"]), "--report-to", "tensorboard,wandb"],
        "--report-to wandb",
        "pip install wandb",
    )
    # checked before any work: the score inputs do not even exist
    fails(
        [
            "score",
            "--in",
            "nowhere",
            "--out",
            "r",
            "--reward",
            "jpeg_compressibility",
            "--report-to",
            "wandb",
        ],
        "pip install wandb",
    )
    fails(
        ["report", str(tracked["run"]), "--report-to", "tensorbored"],
        "--report-to tensorbored",
        "tensorboard",
    )


def test_timing_metrics_state_seconds_and_milliseconds_per_image_of_the_compute_stages() -> None:
    seconds = {"gen": 2.0, "update_actor": 0.5, "save_checkpoint": 3.0}
    assert timing_metrics(seconds, 8) == {
        "timing_s/gen": 2.0,
        "timing_s/update_actor": 0.5,
        "timing_s/save_checkpoint": 3.0,
        "timing_per_image_ms/gen": 250.0,
        "timing_per_image_ms/update_actor": 62.5,
    }


def test_report_to_names_and_run_locations() -> None:
    assert parse_report_to(["tensorboard,tensorboard", " TensorBoard ", "none"]) == ["tensorboard"]
    assert parse_report_to(None) == parse_report_to("none") == []
    assert "tensorboard" in parse_report_to("all")
    assert run_location(Path("/r/x/it3/policy")) == (Path("/r/x"), 3)
    assert run_location(Path("/r/x/it12/rewards")) == (Path("/r/x"), 12)
    assert run_location(Path("/r/x/policy")) == (Path("/r/x"), None)


def test_every_process_of_a_run_resumes_one_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B (faked: not installed here) gets one id per run directory and `resume`, and each point carries
    its axis as a value (W&B keeps one monotone step per run: iteration and optimizer step differ)."""
    import accelerate.utils

    calls: dict[str, list] = {"init": [], "log": [], "define": []}

    class FakeRun:
        def log(self, values: dict, step: int | None = None) -> None:
            calls["log"].append((values, step))

        def define_metric(self, key: str, step_metric: str) -> None:
            calls["define"].append((key, step_metric))

        def finish(self) -> None:
            pass

    def init(**kwargs: object) -> FakeRun:
        calls["init"].append(kwargs)
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Image=lambda a: a))
    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: True)
    run_dir = tmp_path / "x"
    with Tracking(parse_report_to("wandb"), run_dir) as first:
        first.log_rewards(2, {"reward": torch.tensor([1.0, 3.0])})
    with Tracking(["wandb"], run_dir) as second:  # another stage process of the same run
        second.log_update([{"step": 7, "actor/pg_loss": 0.5, "epoch": 0}])
        second.log_rewards(2, {"reward": torch.tensor([1.0, 3.0])})  # already sent: skipped
    ids = [c["id"] for c in calls["init"]]
    assert len(ids) == 2 and ids[0] == ids[1] and ids[0].startswith("x-")
    assert all(c["resume"] == "allow" and c["name"] == "x" for c in calls["init"])
    assert calls["log"] == [
        ({"reward/mean": 2.0, "reward/std": 1.0, "iteration": 2}, None),
        ({"actor/pg_loss": 0.5, "epoch": 0, "step": 7}, None),
    ]
    assert ("reward/mean", "iteration") in calls["define"] and ("actor/pg_loss", "step") in calls["define"]


ONLINE = """\
sample:
  steps: 4
  guidance: 1.0
  resolution: 32
  sampler: sde
  group_size: 2
  batch_size: 3
update:
  lr: 1.0e-3
  lora_rank: 4
  lora_alpha: 8
"""


def test_online_logs_rewards_and_actor_metrics(staged: dict[str, Path], tmp_path: Path) -> None:
    preset = tmp_path / "preset.yaml"
    preset.write_text(ONLINE)
    out = tmp_path / "on"
    args = online_args(preset, staged, out, "--reward", "jpeg_compressibility", "--iterations", "1")
    run(*args, "--save-trajectories", "--report-to", "tensorboard")
    logged = scalars(events(out, "on"))
    records = metrics_of(out / "it1" / "policy")
    assert logged["actor/pg_loss"] == [(r["step"], f32(r["actor/pg_loss"])) for r in records]
    stats = reward_statistics(ShardSet(out / "it0" / "rewards").read_all())
    assert {k: logged[k] for k in stats} == {k: [(0, f32(v))] for k, v in stats.items()}
    # verl-omni's names: per iteration the group statistics and each stage's seconds, per step the rest
    groups = list(ShardSet(out / "it0" / "samples").read_all(columns=["group_id"])["group_id"])
    assert logged["critic/rewards/group_size"] == [(0, f32(len(groups) / len(set(groups))))]
    assert [step for step, _ in logged["critic/rewards/zero_std_ratio"]] == [0]
    assert [step for step, _ in logged["critic/rewards/std_mean"]] == [0]
    for stage in ("gen", "adv", "update_actor"):
        ((_, seconds),) = logged[f"timing_s/{stage}"]
        assert logged[f"timing_per_image_ms/{stage}"] == [
            (0, pytest.approx(seconds * 1000 / len(groups), rel=1e-5))
        ]
    assert {"timing_s/update_weights", "timing_s/save_checkpoint", "timing_s/step"} <= set(logged)
    assert "timing_per_image_ms/save_checkpoint" not in logged
    for key in ("perf/throughput", "actor/pg_clipfrac_higher", "actor/pg_clipfrac_lower"):
        assert logged[key] == [(r["step"], f32(r[key])) for r in records]
    # report afterwards adds only the grid
    assert run("report", str(out), "--report-to", "tensorboard")["points_sent"] == 1


@pytest.mark.distributed
def test_only_rank_0_logs_under_a_launcher(staged: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "dist" / "it1" / "policy"
    torchrun(*staged_update_args(staged, out, "--micro-batch", "1", "--report-to", "tensorboard"))
    logdir = tmp_path / "dist" / TRACKING_DIR / "tensorboard" / "dist"
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1  # one writer: rank 0's
    records = metrics_of(out)
    assert scalars(events(tmp_path / "dist", "dist"))["actor/pg_loss"] == [
        (r["step"], f32(r["actor/pg_loss"])) for r in records
    ]


def test_a_response_sheet_is_logged_as_text(tmp_path: Path) -> None:
    sheet = tmp_path / "r" / "it3" / "responses.md"
    sheet.parent.mkdir(parents=True)
    sheet.write_text("# Responses\n\n| sample | reward | response |\n|---|---|---|\n| s0 | 1.0000 | 4 |\n")
    with Tracking(["tensorboard"], tmp_path / "r") as tracking:
        tracking.log_responses(3, sheet)
        tracking.log_responses(3, sheet)  # sent once
    (logged,) = events(tmp_path / "r", "r").Tensors("samples/responses/text_summary")
    assert logged.step == 3 and logged.tensor_proto.string_val == [sheet.read_bytes()]


def _score(samples: Path, out: Path, reward: str, *extra: str) -> dict:
    return run("score", "--in", str(samples), "--reward", reward, "--out", str(out), *extra)


@pytest.mark.parametrize("eval_first", [True, False])
def test_held_out_evaluation_is_its_own_series(
    staged: dict[str, Path], tmp_path: Path, eval_first: bool
) -> None:
    """The training rollout and the held-out evaluation of one iteration, scored in either order (make
    demo runs them side by side): each lands on its own curve with its own value."""
    run_dir = tmp_path / "exp"
    for where in ("it3", "it3/eval"):
        shutil.copytree(staged["samples"], run_dir / where / "samples")
    training = (run_dir / "it3", "jpeg_compressibility")
    held_out = (run_dir / "it3" / "eval", "jpeg_incompressibility")  # another reward: another value
    scores = {}
    for where, reward in (held_out, training) if eval_first else (training, held_out):
        scores[where.name] = _score(
            where / "samples", where / "rewards", reward, "--report-to", "tensorboard"
        )
    assert scores["it3"]["reward/mean"] != scores["eval"]["reward/mean"]
    logged = scalars(events(run_dir, "exp"))
    assert logged["reward/mean"] == [(3, f32(scores["it3"]["reward/mean"]))]
    assert logged["eval/reward/mean"] == [(3, f32(scores["eval"]["reward/mean"]))]
    assert logged["eval/reward.jpeg_incompressibility/mean"] == [
        (3, f32(scores["eval"]["reward.jpeg_incompressibility/mean"]))
    ]
    assert "reward.jpeg_incompressibility/mean" not in logged


def test_report_replays_the_held_out_evaluation_too(staged: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "exp"
    scores = {}
    for where, reward in (("it0", "jpeg_compressibility"), ("it0/eval", "jpeg_incompressibility")):
        shutil.copytree(staged["samples"], run_dir / where / "samples")
        scores[where] = _score(run_dir / where / "samples", run_dir / where / "rewards", reward)
    sent = run("report", str(run_dir), "--no-grids", "--report-to", "tensorboard")["points_sent"]
    assert sent == 2  # the training rewards and the held-out evaluation's of it0
    logged = scalars(events(run_dir, "exp"))
    assert logged["reward/mean"] == [(0, f32(scores["it0"]["reward/mean"]))]
    assert logged["eval/reward/mean"] == [(0, f32(scores["it0/eval"]["reward/mean"]))]
