"""FSDP2 (`update --strategy fsdp2`, torch fully_shard on a gloo CPU mesh) computes the update of one
process, holds a share of the weights and AdamW state per rank, and writes whole adapters and trainer
state that a plain process resumes from; gradient checkpointing changes memory, not numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import fails, run, staged_update_args, torchrun
from safetensors.torch import load_file

LORA = "pytorch_lora_weights.safetensors"
FULL = Path("transformer") / "diffusion_pytorch_model.safetensors"


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _same_update(one: Path, two: Path, weights: Path) -> None:
    a, b = load_file(one / weights), load_file(two / weights)
    assert a.keys() == b.keys()
    for k in a:  # rank sums in another order; Adam may amplify a ~0 gradient's rounding (test_families)
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    for x, y in zip(_metrics(one), _metrics(two), strict=True):
        assert y["actor/grad_norm"] == pytest.approx(x["actor/grad_norm"], rel=1e-5)
        assert y["actor/pg_loss"] == pytest.approx(x["actor/pg_loss"], rel=1e-6, abs=1e-8)


@pytest.mark.distributed
def test_fsdp2_lora_on_two_ranks_equals_one_process(staged: dict[str, Path], tmp_path: Path) -> None:
    common = ("--no-shuffle", "--micro-batch", "1", "--beta", "0.04")
    run(*staged_update_args(staged, tmp_path / "one", *common, "--grad-accum", "2"))
    torchrun(
        *staged_update_args(staged, tmp_path / "two", *common, "--grad-accum", "1", "--strategy", "fsdp2")
    )
    _same_update(tmp_path / "one", tmp_path / "two", Path(LORA))
    state = json.loads((tmp_path / "two" / "omnirl_adapter.json").read_text())
    assert state["update_config"]["strategy"] == "fsdp2" and state["step"] == 3


@pytest.mark.distributed
def test_fsdp2_full_fine_tune_shards_weights_and_optimizer_state(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    common = ("--no-shuffle", "--micro-batch", "1", "--full", "--lr", "1e-4")
    run(*staged_update_args(staged, tmp_path / "one", *common, "--grad-accum", "2"))
    torchrun(
        *staged_update_args(staged, tmp_path / "two", *common, "--grad-accum", "1", "--strategy", "fsdp2")
    )
    _same_update(tmp_path / "one", tmp_path / "two", FULL)
    one, two = _metrics(tmp_path / "one")[-1], _metrics(tmp_path / "two")[-1]
    # rank 0's shard of the weights and of AdamW's two moments: about half of one process's
    assert two["memory/param_bytes"] <= 0.6 * one["memory/param_bytes"]
    assert two["memory/optimizer_bytes"] <= 0.6 * one["memory/optimizer_bytes"]
    assert one["memory/optimizer_bytes"] >= 2 * one["memory/param_bytes"]  # exp_avg and exp_avg_sq

    # The trainer state is whole: a single process resumes from the sharded run's adapter exactly as
    # from the single-process one.
    resumed = []
    for name in ("one", "two"):
        out = tmp_path / f"{name}-next"
        run(*staged_update_args(staged, out, *common, "--grad-accum", "2", "--adapter", str(tmp_path / name)))
        resumed.append(load_file(out / FULL))
    for k in resumed[0]:
        torch.testing.assert_close(resumed[1][k], resumed[0][k], rtol=0, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_update(staged: dict[str, Path], tmp_path: Path) -> None:
    common = ("--no-shuffle", "--micro-batch", "2")
    run(*staged_update_args(staged, tmp_path / "plain", *common))
    run(*staged_update_args(staged, tmp_path / "ckpt", *common, "--gradient-checkpointing"))
    a, b = load_file(tmp_path / "plain" / LORA), load_file(tmp_path / "ckpt" / LORA)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    cfg = json.loads((tmp_path / "ckpt" / "omnirl_adapter.json").read_text())["update_config"]
    assert cfg["gradient_checkpointing"] is True


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_fsdp2_nft_with_ema_keeps_the_old_policy_and_ema_whole(
    staged: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    # The old policy runs between the trained forward and its backward, on weights copied into the shards.
    full = ("--full", "--lr", "1e-4") if kind == "full" else ()
    common = ("--no-shuffle", "--micro-batch", "1", "--algo", "nft", "--ema", *full)
    run(*staged_update_args(staged, tmp_path / "one", *common, "--grad-accum", "2"))
    torchrun(
        *staged_update_args(staged, tmp_path / "two", *common, "--grad-accum", "1", "--strategy", "fsdp2")
    )
    weights = FULL if full else Path(LORA)
    a, b = load_file(tmp_path / "one" / weights), load_file(tmp_path / "two" / weights)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    for name in ("ema.safetensors", "old_weights.safetensors"):
        x, y = (load_file(tmp_path / d / "trainer_state" / name) for d in ("one", "two"))
        assert x.keys() == y.keys() and x
        for k in x:
            torch.testing.assert_close(y[k], x[k], rtol=0, atol=1e-5)


def test_fsdp2_refuses_no_launcher_and_weight_swapping_without_reshard_after_forward(
    staged: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = staged_update_args(staged, tmp_path / "p", "--strategy", "fsdp2", "--algo", "nft")
    fails(args, "--strategy fsdp2 needs a launcher", "torchrun")  # no process group to shard over
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under a launcher; refused before any process group is made
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")  # the gathered weights would be stale
    fails(args, "fsdp_reshard_after_forward", "old/EMA policy")
