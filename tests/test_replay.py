"""Replay only when it can differ: `stages.logprob.decide`, `logprob --replay auto`, `--fraction`, and
the recipes' plans (REPLAY=auto by default)."""

from __future__ import annotations

import copy
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fails, ins, run, sample_args
from safetensors.torch import load_file

from stages.shards.digest import content_digest
from stages.shards.manifest import read_manifest
from stages.shards.reader import ShardSet

ROOT = Path(__file__).resolve().parents[1]


def _trainer(model: Path, **changes: object) -> Any:
    """The numerics of a replay of `model`'s base weights in fp32 on the CPU, with `changes`."""
    from stages.logprob.decide import Numerics

    return replace(Numerics(content_digest(model, "--model"), None, "fp32", "no", "cpu"), **changes)


def test_decision_same_engine_weights_and_numerics_needs_no_replay(staged: dict[str, Path]) -> None:
    from stages.logprob.decide import replay_decision

    manifests = [read_manifest(staged["samples"])]
    same = replay_decision(manifests, _trainer(staged["model"]))
    assert not same.needed and "diffusers engine" in same.reason and "exactly" in same.reason

    remote = copy.deepcopy(manifests[0])
    remote.extra["engine"] = {"name": "remote", "server_url": "http://127.0.0.1:9"}
    decision = replay_decision([remote], _trainer(staged["model"]))
    assert (
        decision.needed
        and decision.reason == "sampled by the remote engine, on its own device, threads and build"
    )
    vllm = copy.deepcopy(manifests[0])
    vllm.extra["engine"] = {"name": "vllm-omni", "mode": "rl"}
    assert replay_decision([vllm], _trainer(staged["model"])).needed

    bf16 = replay_decision(manifests, _trainer(staged["model"], dtype="bf16"))
    assert bf16.needed and bf16.reason == "dtype fp32 in the rollout, bf16 here"
    autocast = replay_decision(
        manifests, _trainer(staged["model"], mixed_precision="bf16", device_type="cuda")
    )
    assert (
        autocast.reason
        == "mixed_precision no in the rollout, bf16 here; device_type cpu in the rollout, cuda here"
    )
    adapter = content_digest(staged["policy1"], "--adapter")
    other = replay_decision(manifests, _trainer(staged["model"], adapter_sha256=adapter))
    assert other.needed and other.reason == f"adapter_sha256 none in the rollout, {adapter[:12]} here"

    asked = replay_decision(manifests, _trainer(staged["model"]), computes=["--means"])
    assert asked.needed and asked.reason == "--means asks for columns only a replay computes"
    ode = copy.deepcopy(manifests[0])
    ode.columns = [c for c in ode.columns if c.name != "latents"]
    assert not replay_decision([ode], _trainer(staged["model"], dtype="bf16")).needed  # nothing stored


def test_decision_counts_an_attention_backend_that_changes_numbers_beyond_rounding(
    staged: dict[str, Path],
) -> None:
    """A quantized backend (recorded in the run identity: a sample config's attention_backend) on one
    side only is a reason to replay; the same one on both sides, or none, is not."""
    from stages.logprob.decide import replay_decision, rollout_numerics

    native = read_manifest(staged["samples"])
    sage = copy.deepcopy(native)
    sage.config["attention_backend"] = "sage"
    assert rollout_numerics(native).attention_backend == "native"
    assert rollout_numerics(sage).attention_backend == "sage"
    rolled_sage = replay_decision([sage], _trainer(staged["model"]))
    assert rolled_sage.needed and rolled_sage.reason == "attention_backend sage in the rollout, native here"
    replay_sage = replay_decision([native], _trainer(staged["model"], attention_backend="sage"))
    assert replay_sage.reason == "attention_backend native in the rollout, sage here"
    both = replay_decision([sage], _trainer(staged["model"], attention_backend="sage"))
    assert not both.needed and "sage attention" in both.reason


def test_replay_auto_loads_nothing_and_update_trains_bit_identically(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    """`--replay auto` over an in-process rollout writes the sample ids only, and update on it trains the
    very weights of update on the full replay (the `staged` fixture's policy1)."""
    out = tmp_path / "logprobs"
    auto = ("logprob", "--model", str(staged["model"]), *ins(staged["samples"]), "--replay", "auto")
    result = run(*auto, "--out", str(out))
    assert (
        result["replayed"] is False and result["rows_replayed"] == 0 and "exactly" in result["replay_reason"]
    )
    written = ShardSet(out)
    assert [c.name for c in written.manifest.columns] == ["sample_id"] and written.num_rows == 6
    assert read_manifest(out).extra["replayed"] is False
    assert run(*auto, "--out", str(out))["skipped"]

    policy = tmp_path / "policy"
    run(
        "update",
        "--model",
        str(staged["model"]),
        *ins(staged["samples"], out, staged["advantages"]),
        "--lr",
        "1e-3",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--out",
        str(policy),
    )
    [expected_file] = sorted(staged["policy1"].glob("*.safetensors"))
    expected, got = load_file(expected_file), load_file(policy / expected_file.name)
    assert expected.keys() == got.keys() and expected
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_replay_auto_replays_under_other_numerics(staged: dict[str, Path], tmp_path: Path) -> None:
    result = run(
        "logprob",
        "--model",
        str(staged["model"]),
        *ins(staged["samples"]),
        "--replay",
        "auto",
        "--mixed-precision",
        "bf16",
        "--out",
        str(tmp_path / "logprobs"),
    )
    assert result["replayed"] is True and result["rows_replayed"] == 6
    assert result["replay_reason"] == "mixed_precision no in the rollout, bf16 here"
    assert result["abs_delta_max"] > 0 and result["abs_delta_count"] == 6 * 4


@pytest.fixture(scope="module")
def four_batches(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 prompts × 2 samples in 2 shards, sampled in batches of 2: 4 sampling batches."""
    root = tmp_path_factory.mktemp("fraction")
    prompts = root / "prompts.txt"
    prompts.write_text("a red apple\na blue sky\na green tree\na white cat\n")
    run(*sample_args(tiny_sd3, prompts, root / "samples", "--batch-size", "2", "--num-shards", "2"))
    return root / "samples"


def test_fraction_replays_a_seeded_half_of_the_batches_exactly(
    tiny_sd3: Path, four_batches: Path, tmp_path: Path
) -> None:
    def check(out: Path, *extra: str) -> set[str]:
        result = run(
            "logprob",
            "--model",
            str(tiny_sd3),
            *ins(four_batches),
            "--fraction",
            "0.5",
            *extra,
            "--out",
            str(out),
        )
        assert result["rows"] == 8 and result["rows_replayed"] == 4 and result["subset"]["of"] == 8
        assert (
            result["abs_delta_max"] == 0.0
            and result["abs_delta_p99"] == 0.0
            and result["abs_delta_mean"] == 0.0
        )
        assert result["abs_delta_count"] == 4 * 4  # 4 rows × 4 stored steps
        replayed = ShardSet(out).read_all()
        return set(replayed["sample_id"])

    rollout = ShardSet(four_batches).read_all(["sample_id", "log_probs"])
    first = check(tmp_path / "a")
    assert len(first) == 4
    batches = [set(rollout["sample_id"][i : i + 2]) for i in range(0, 8, 2)]  # each shard: 2 batches of 2
    assert sum(b <= first for b in batches) == 2  # whole batches
    replayed = ShardSet(tmp_path / "a").read_all()
    rows = [rollout["sample_id"].index(s) for s in replayed["sample_id"]]
    assert torch.equal(replayed["old_log_probs"], rollout["log_probs"][rows])
    assert check(tmp_path / "b") == first  # seeded: the rollout's seed, the same draw again
    assert check(tmp_path / "c", "--seed", "0") == first  # the rollout's seed is 0
    assert check(tmp_path / "d", "--seed", "3") != first


def test_update_refuses_a_partial_replay(staged: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "check"
    run(
        "logprob",
        "--model",
        str(staged["model"]),
        *ins(staged["samples"]),
        "--fraction",
        "0.4",
        "--out",
        str(out),
    )
    fails(
        [
            "update",
            "--model",
            str(staged["model"]),
            *ins(staged["samples"], out, staged["advantages"]),
            "--out",
            str(tmp_path / "policy"),
        ],
        str(out),
        "--fraction 0.4",
        "drop it from --in",
    )
    fails(
        [
            "logprob",
            "--model",
            str(staged["model"]),
            *ins(staged["samples"]),
            "--fraction",
            "0.5",
            "--replay",
            "auto",
            "--out",
            str(tmp_path / "x"),
        ],
        "--fraction 0.5",
        "--replay auto",
    )


def _planned(*variables: str) -> list[str]:
    """The omnirl commands `make -n` plans for one iteration of recipes/flow_grpo.mk."""
    cmd = [
        "make",
        "-n",
        "--no-print-directory",
        "-f",
        "recipes/flow_grpo.mk",
        "RUN=runs/plan",
        "ITERATIONS=1",
    ]
    plan = subprocess.run([*cmd, *variables], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in plan.replace("\\\n", " ").splitlines() if line.startswith("omnirl ")]


def test_make_plans_the_replay_only_as_replay_says() -> None:
    default = [c for c in _planned() if c.startswith("omnirl logprob")]
    assert len(default) == 1 and "--replay auto" in default[0]  # logprob decides from the rollout
    [forced] = [c for c in _planned("REPLAY=yes") if c.startswith("omnirl logprob")]
    assert "--replay yes" in forced
    never = _planned("REPLAY=no")
    assert not any(c.startswith("omnirl logprob") for c in never)
    [update] = [c for c in never if c.startswith("omnirl update")]
    assert "/logprobs" not in update and "runs/plan/it0/advantages" in update
    wrong = subprocess.run(
        ["make", "-n", "-f", "recipes/flow_grpo.mk", "REPLAY=maybe"], cwd=ROOT, capture_output=True, text=True
    )
    assert wrong.returncode == 2 and "REPLAY=maybe: choose auto, yes or no" in wrong.stderr
