"""Two gloo ranks under torchrun compute the same update as one process (gradient parity).

One process with --grad-accum 2 and two ranks with --grad-accum 1 see the same micro-batches per
optimizer step; gradients are averaged over ranks as DDP does, so the adapters must agree.
"""

from __future__ import annotations

import json
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
