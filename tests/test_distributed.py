"""Two gloo ranks under torchrun compute the same update as one process (gradient parity), and the
data-parallel stages write the very bytes of one process.

One process and two ranks given one preset with samples_per_step 2 (grad_accum 2 on one process, 1 on
each of two ranks) see the same micro-batches per optimizer step; gradients are averaged over ranks
as DDP does, so the adapters must agree, and each rank reads only its micro-batches' latents. A
non-finite loss on one rank stops every rank with exit 2 instead of leaving the others in a collective.
`sample`, `score`, `logprob` and `encode` split the shards over the ranks (shard s on rank s % world);
rank 0 writes the manifest and reports once every rank, even one without a shard, is done.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ins, run, sample_args, torchrun
from safetensors.torch import load_file

from stages.shards.manifest import MANIFEST_NAME

pytestmark = pytest.mark.distributed


def test_two_ranks_equal_one_process(staged: dict[str, Path], tmp_path: Path) -> None:
    preset = tmp_path / "preset.yaml"  # the optimizer step's size over all ranks, as the shipped presets
    preset.write_text("update:\n  samples_per_step: 2\n")
    common = [
        "--config",
        str(preset),
        "--model",
        str(staged["model"]),
        *ins(staged["samples"], staged["logprobs"], staged["advantages"]),
        "--no-shuffle",
        "--micro-batch",
        "1",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lr",
        "1e-3",
        "--beta",
        "0.04",
    ]
    alone = run("update", *common, "--out", str(tmp_path / "one"))
    (rank0,) = torchrun("update", *common, "--out", str(tmp_path / "two"))
    # each rank reads the latents of its own micro-batches only: rows 0, 2, 4 on rank 0
    assert (alone["rows_read"], rank0["rows_read"]) == (6, 3)
    one = load_file(tmp_path / "one" / "pytorch_lora_weights.safetensors")
    two = load_file(tmp_path / "two" / "pytorch_lora_weights.safetensors")
    assert one.keys() == two.keys()
    moved = max(one[k].abs().max().item() for k in one if "lora_B" in k)
    assert moved > 1e-4  # the update did something
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)
    m1 = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1, 2, 3]  # 6 samples, 2 per step
    for a, b in zip(m1, m2, strict=True):
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-4, abs=1e-8)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)


# Rank 1's policy-gradient losses turn NaN (as a NaN advantage in its micro-batch would); rank 0's stay finite.
POISON_RANK_1 = """
import os, sys
if os.environ["RANK"] == "1":
    from stages.update import policy_gradient
    replay = policy_gradient.PolicyGradient.losses
    def poisoned(self, idx):
        for loss, values in replay(self, idx):
            yield loss * float("nan"), values
    policy_gradient.PolicyGradient.losses = poisoned
from omnirl_cli.app import app
app(sys.argv[1:], prog_name="omnirl")
"""


def test_a_nan_loss_on_one_rank_stops_every_rank_with_exit_2(staged: dict[str, Path], tmp_path: Path) -> None:
    script = tmp_path / "poisoned_omnirl.py"
    script.write_text(POISON_RANK_1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }
    args = [
        "update",
        "--model",
        str(staged["model"]),
        *ins(staged["samples"], staged["logprobs"], staged["advantages"]),
        "--no-shuffle",
        "--micro-batch",
        "1",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--out",
        str(tmp_path / "p"),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        errors = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [2, 2], errors
    assert "loss is not finite at epoch 0, micro-batch 1, trained step 0 (rank 1)" in errors[1]
    assert "loss is not finite on rank 1 at epoch 0, optimizer step 1" in errors[0]
    assert not (tmp_path / "p").exists()


def files(out: Path) -> dict[str, bytes]:
    """Every file of a shard set but its manifest, by name (hidden completion records included)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != MANIFEST_NAME}


def manifest_view(out: Path) -> dict:
    """The manifest without what differs between two runs of the same work: the creation time and the
    parents' paths relative to --out (their manifest hashes and sha256 stay)."""
    m = json.loads((out / MANIFEST_NAME).read_text())
    m.pop("created")
    for parent in m["parents"]:
        parent.pop("path")
    return m


def same_output(one: Path, two: Path) -> dict:
    """Assert two shard sets hold the same bytes and an equivalent manifest; return the manifest."""
    assert files(two) == files(one)
    assert manifest_view(two) == manifest_view(one)
    return manifest_view(one)


@pytest.mark.parametrize("num_shards", [2, 3])
def test_sample_score_logprob_on_two_ranks_write_the_bytes_of_one_process(
    staged: dict[str, Path], tmp_path: Path, num_shards: int
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    shards = ("--num-shards", str(num_shards))
    run(*sample_args(staged["model"], staged["prompts"], one / "samples", *shards))
    reports = torchrun(*sample_args(staged["model"], staged["prompts"], two / "samples", *shards))
    manifest = same_output(one / "samples", two / "samples")
    assert [s["rows"] for s in manifest["shards"]] == {2: [2, 4], 3: [2, 2, 2]}[num_shards]
    # rank 0 alone reports, for every rank: 3 prompts × 2 images over all shards
    assert len(reports) == 1
    assert reports[0]["rows"] == 6 and reports[0]["shards_written"] == num_shards and reports[0]["complete"]

    # both runs read the same input set, so their lineage (manifest sha256) agrees too
    score = ["score", "--in", str(one / "samples"), "--reward", "jpeg_compressibility"]
    run(*score, "--out", str(one / "rewards"))
    reports = torchrun(*score, "--out", str(two / "rewards"))
    assert same_output(one / "rewards", two / "rewards")["num_rows"] == 6
    assert len(reports) == 1 and reports[0]["rows"] == 6

    # under another adapter the replay differs from the rollout, so the |Δlogp| summary is not 0 and
    # must be the very float one process sums over the shards in order
    logprob = ["logprob", "--model", str(staged["model"]), "--adapter", str(staged["policy1"])]
    logprob += ["--in", str(one / "samples")]
    single = run(*logprob, "--out", str(one / "logprobs"))
    reports = torchrun(*logprob, "--out", str(two / "logprobs"))
    assert same_output(one / "logprobs", two / "logprobs")["extra"]["abs_delta_mean"] > 1e-6
    assert reports == [{**single, "out": str(two / "logprobs")}]


def test_logprob_replays_under_the_launchers_mixed_precision_on_two_ranks_as_one_process(
    staged: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.shards.reader import ShardSet

    logprob = ["logprob", "--model", str(staged["model"]), "--adapter", str(staged["policy1"])]
    logprob += ["--in", str(staged["samples"])]
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    run(*logprob, "--out", str(tmp_path / "fp32"))
    run(*logprob, "--mixed-precision", "bf16", "--out", str(tmp_path / "one"))
    monkeypatch.setenv(
        "ACCELERATE_MIXED_PRECISION", "bf16"
    )  # what `accelerate launch --mixed_precision bf16` sets
    torchrun(*logprob, "--out", str(tmp_path / "two"))
    assert same_output(tmp_path / "one", tmp_path / "two")["config"]["mixed_precision"] == "bf16"
    bf16, fp32 = (ShardSet(tmp_path / d).read_all()["old_log_probs"] for d in ("one", "fp32"))
    assert not torch.equal(bf16, fp32)  # the launcher's autocast took effect
    # within bf16's relative rounding (2^-8) of these log-probs, which are of order 1 (mean |logp| 1.75)
    torch.testing.assert_close(bf16, fp32, rtol=0, atol=2.0**-8)


def test_a_slurm_task_on_two_ranks_leaves_one_idle_and_the_array_completes(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    def args(out: Path, *extra: str) -> list[str]:
        return sample_args(staged["model"], staged["prompts"], out, "--num-shards", "3", *extra)

    run(*args(tmp_path / "one"))
    out = tmp_path / "two"
    # task 1 of 3 launched on 2 ranks: rank 1 samples shard 1, rank 0 has none but waits and reports
    reports = torchrun(*args(out, "--shard-index", "1"))
    assert reports == [{**reports[0], "rows": 2, "shards_written": 1, "complete": False}]
    assert not (out / MANIFEST_NAME).exists()
    assert not run(*args(out, "--shard-index", "0"))["complete"]
    assert run(*args(out, "--shard-index", "2"))["complete"]
    same_output(tmp_path / "one", out)


def test_encode_on_more_ranks_than_shards_writes_the_bytes_of_one_process(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    # under a launcher, sample's default shard count is a multiple of the ranks: none is idle
    reports = torchrun(*sample_args(staged["model"], staged["prompts"], tmp_path / "spread"))
    assert reports[0]["shards_written"] == 2
    manifest = json.loads((tmp_path / "spread" / MANIFEST_NAME).read_text())
    assert [s["rows"] for s in manifest["shards"]] == [2, 4]

    samples = tmp_path / "samples"
    run(*sample_args(staged["model"], staged["prompts"], samples, "--num-shards", "1"))
    encode = ["encode", "--model", str(staged["model"]), "--in", str(samples), "--resolution", "32"]
    run(*encode, "--out", str(tmp_path / "one"))
    logs: list[str] = []
    reports = torchrun(*encode, "--out", str(tmp_path / "two"), stderr=logs)  # rank 1 has no shard
    stored = "in --in: its rollout stores it"  # the prompt conditioning: encode stores none of its own
    assert reports == [{"out": str(tmp_path / "two"), "rows": 6, "conditioning": stored}]
    assert "rank 1 of 2 has none of the 1 input shards of encoding" in logs[0], logs[0]
    assert "final_latent" in [c["name"] for c in same_output(tmp_path / "one", tmp_path / "two")["columns"]]


def test_shards_go_round_robin_over_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from stages import dist

    monkeypatch.setattr(dist, "join", lambda: None)  # no process group: the launch's (world, rank) below
    monkeypatch.setattr(dist, "world_and_rank", lambda: (2, 1))
    assert dist.rank_shards(range(5)) == [1, 3]
    monkeypatch.setattr(dist, "world_and_rank", lambda: (3, 0))
    assert dist.rank_shards([0, 1, 2, 3, 4, 5, 6]) == [0, 3, 6]
    monkeypatch.setattr(dist, "world_and_rank", lambda: (3, 2))
    assert dist.rank_shards([0, 1]) == []  # a rank without a shard (it still joins the barrier)


def test_metric_sums_cross_ranks_in_float64_on_the_named_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from stages import dist

    seen = []

    def all_reduce(t: torch.Tensor, group: object = None) -> None:  # two ranks holding the same values
        seen.append((t.device, t.dtype))
        t.mul_(2)

    monkeypatch.setattr(dist, "world_and_rank", lambda: (2, 0))
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    cpu = torch.device("cpu")
    values = torch.tensor([1.0 + 2**-30, 3.0], dtype=torch.float64)  # float32 would round 2**-30 away
    summed = dist.all_reduce_sum(values, cpu)
    assert seen == [(cpu, torch.float64)]
    assert summed.dtype == torch.float64 and summed.tolist() == [2.0 + 2**-29, 6.0]
    assert dist.all_reduce_sum(values.float(), cpu).dtype == torch.float32
    assert seen[-1] == (cpu, torch.float64)  # float32 values are summed in float64 too
    monkeypatch.setattr(dist, "_holds_float64", lambda on: False)  # a device without float64
    assert dist.all_reduce_sum(values, cpu).tolist() == [2.0, 6.0]
    assert seen[-1] == (cpu, torch.float32)
