"""Two gloo ranks under torchrun compute the same update as one process (gradient parity).

One process with --grad-accum 2 and two ranks with --grad-accum 1 see the same micro-batches per
optimizer step; gradients are averaged over ranks as DDP does, so the adapters must agree. A
non-finite loss on one rank stops every rank with exit 2 instead of leaving the others in a collective.
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
from helpers import ins, run, torchrun
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed


def test_two_ranks_equal_one_process(staged: dict[str, Path], tmp_path: Path) -> None:
    common = [
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
    run("update", *common, "--grad-accum", "2", "--out", str(tmp_path / "one"))
    torchrun("update", *common, "--grad-accum", "1", "--out", str(tmp_path / "two"))
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
    from stages.update import objectives
    replay = objectives.PolicyGradient.losses
    def poisoned(self, idx):
        for loss, values in replay(self, idx):
            yield loss * float("nan"), values
    objectives.PolicyGradient.losses = poisoned
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
