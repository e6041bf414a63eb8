"""Rollout identity end to end: sample ids unique per rollout, and `--in` sets of different rollouts refused."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from helpers import PROMPTS, ins, run, runner, sample_args

from omnirl_cli.app import app
from stages.shards.reader import ShardSet

UPDATE = ("--lr", "1e-3", "--lora-rank", "4", "--lora-alpha", "8")


@pytest.fixture(scope="module")
def rollouts(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Two rollouts of one command that differ only in --seed (a: 0, b: 7), each scored and advantaged; a's replayed."""
    root = tmp_path_factory.mktemp("lineage")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    found: dict[str, dict[str, Path]] = {}
    for name, seed in (("a", "0"), ("b", "7")):
        p = {k: root / name / k for k in ("samples", "rewards", "advantages", "logprobs")}
        run(*sample_args(tiny_sd3, prompts, p["samples"], "--seed", seed))
        run(
            "score", "--in", str(p["samples"]), "--reward", "jpeg_compressibility", "--out", str(p["rewards"])
        )
        run("advantage", *ins(p["samples"], p["rewards"]), "--out", str(p["advantages"]))
        found[name] = p
    run(
        "logprob",
        "--model",
        str(tiny_sd3),
        "--in",
        str(found["a"]["samples"]),
        "--out",
        str(found["a"]["logprobs"]),
    )
    found["run"] = {"model": tiny_sd3, "prompts": prompts}
    return found


def _ids(samples: Path) -> tuple[list[str], list[str]]:
    data = ShardSet(samples).read_all(columns=["sample_id", "group_id"])
    return data["sample_id"], data["group_id"]


def test_ids_are_unique_per_rollout_and_stable_across_reruns(rollouts: dict, tmp_path: Path) -> None:
    ids_a, groups_a = _ids(rollouts["a"]["samples"])
    ids_b, groups_b = _ids(rollouts["b"]["samples"])
    assert not set(ids_a) & set(ids_b) and not set(groups_a) & set(groups_b)
    local = [f"g{k:06d}-{m:03d}" for k in range(3) for m in range(2)]
    for ids, groups in ((ids_a, groups_a), (ids_b, groups_b)):
        rollout = ids[0].split("-")[0]
        assert re.fullmatch("[0-9a-f]{8}", rollout)
        assert ids == [f"{rollout}-{x}" for x in local]
        assert groups == [f"{rollout}-{x[:7]}" for x in local]

    # the same command again (after the output was deleted) gives the same ids and the same shard bytes
    out = tmp_path / "samples"
    args = sample_args(rollouts["run"]["model"], rollouts["run"]["prompts"], out, "--num-shards", "2")
    run(*args)
    ids, shards = _ids(out), [s.sha256 for s in ShardSet(out).manifest.shards]
    shutil.rmtree(out)
    run(*args)
    assert _ids(out) == ids and [s.sha256 for s in ShardSet(out).manifest.shards] == shards


def _refused(args: list[str], first: Path, second: Path) -> None:
    """The command exits 2 with one line naming both inputs as coming from different rollouts."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "come from different rollouts" in lines[0]
    assert f"{first} and {second}" in lines[0]


def test_advantage_refuses_rewards_of_another_rollout(rollouts: dict, tmp_path: Path) -> None:
    a, b = rollouts["a"], rollouts["b"]
    out = tmp_path / "advantages"
    _refused(["advantage", *ins(a["samples"], b["rewards"]), "--out", str(out)], a["samples"], b["rewards"])
    assert not (out / "_manifest.json").exists()
    _refused(
        ["score", *ins(b["samples"], a["logprobs"]), "--reward", "jpeg_compressibility", "--out", str(out)],
        b["samples"],
        a["logprobs"],
    )
    # the legitimate chain still zips
    run("advantage", *ins(a["samples"], a["rewards"]), "--out", str(out))
    assert ShardSet(out).num_rows == 6


def test_update_refuses_advantages_of_another_rollout(rollouts: dict, tmp_path: Path) -> None:
    a, b = rollouts["a"], rollouts["b"]
    model = str(rollouts["run"]["model"])
    out = tmp_path / "policy"
    bad = ins(a["samples"], a["logprobs"], b["advantages"])
    _refused(["update", "--model", model, *bad, *UPDATE, "--out", str(out)], a["samples"], b["advantages"])
    assert not out.exists()
    good = ins(a["samples"], a["logprobs"], a["advantages"])
    assert run("update", "--model", model, *good, *UPDATE, "--out", str(out))["step"] >= 1
