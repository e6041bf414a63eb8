"""`omnirl online` under torchrun (gloo CPU ranks, tiny FLUX): every rank trains, as `omnirl update`'s
ranks do (dp × sp, or tp), while rank 0 alone samples, scores and hands each iteration's training columns
to the others. Two iterations each, so the second one samples with the weights the ranks published."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import online_args, run, torchrun_commands, torchrun_fails
from safetensors.torch import load_file

from stages.shards.reader import ShardSet


def _args(flux_run: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return online_args(
        flux_run["preset"],
        flux_run,
        out,
        "--reward",
        "jpeg_compressibility",
        "--iterations",
        "2",
        "--save-trajectories",
        *extra,
    )


def _weights(policy: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(policy.rglob("*.safetensors")) for k, v in load_file(f).items()}


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest |Δ| between two weight sets of the same names, relative to the largest weight."""
    assert got.keys() == want.keys()
    scale = max(float(v.abs().max()) for v in want.values())
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want) / scale


def _samples(out: Path, k: int) -> dict:
    return ShardSet(out / f"it{k}" / "samples").read_all()


@pytest.mark.distributed
@pytest.mark.slow
def test_dp2_by_sp2_online_equals_one_process(flux_run: dict[str, Path], tmp_path: Path) -> None:
    """4 ranks as 2 dp × 2 sp == one process taking both dp replicas' micro-batches (grad_accum 2):
    the same rewards and update metrics, iteration 1 sampled with the same published LoRA, the same
    checkpoints (measured: LoRA weights 1.3e-7 of scale apart after 2 iterations)."""
    one = run(*_args(flux_run, tmp_path / "one", "--set", "update.grad_accum=2"))["iterations"]
    (launched,) = torchrun_commands(_args(flux_run, tmp_path / "sp", "--sp-degree", "2"), ranks=4)
    got = launched["iterations"]  # rank 0's report alone
    assert [it["ranks"] for it in got] == [4, 4] and [it["ranks"] for it in one] == [1, 1]
    for a, b in zip(got, one, strict=True):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["ratio_mean"] == pytest.approx(b["ratio_mean"], abs=1e-6)
        assert a["step"] == b["step"] and a["conditioning"] == "from the sampler"
    for k in (0, 1):  # iteration 1: drawn with the weights the 4 ranks trained and published
        sp, base = _samples(tmp_path / "sp", k), _samples(tmp_path / "one", k)
        # the same rows (ids begin with a digest of the run's settings, whose grad_accum differs)
        assert [i.split("-", 1)[1] for i in sp["sample_id"]] == [
            i.split("-", 1)[1] for i in base["sample_id"]
        ]
        for column in ("latents", "log_probs", "final_latent"):
            torch.testing.assert_close(sp[column], base[column], rtol=0, atol=1e-5)
    for k in (1, 2):
        policy = tmp_path / "sp" / f"it{k}" / "policy"
        assert _worst(_weights(policy), _weights(tmp_path / "one" / f"it{k}" / "policy")) < 1e-5
        assert (policy / "trainer_state").is_dir()


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_full_online_equals_one_process(flux_run: dict[str, Path], tmp_path: Path) -> None:
    """2 ranks of tp (full fine-tuning: diffusers' plan shards no LoRA) == one process: the first
    update's weights to 1e-6 of scale (measured 7.5e-9), the sampler's second iteration, drawn with the
    weights gathered whole from both ranks (the fused single-block projection put back in its own
    order), to 1e-5; after that Adam's normalised steps on near-zero gradients amplify rounding, so the
    second update is held to its gradient norm (measured 1.5e-5 relative)."""
    full = ("--set", "update.full=true", "--set", "update.lr=1e-5")
    one = run(*_args(flux_run, tmp_path / "one", *full))["iterations"]
    (launched,) = torchrun_commands(_args(flux_run, tmp_path / "tp", *full, "--tp-degree", "2"))
    got = launched["iterations"]
    assert [it["ranks"] for it in got] == [2, 2]
    first = _weights(tmp_path / "one" / "it1" / "policy")
    assert _worst(_weights(tmp_path / "tp" / "it1" / "policy"), first) < 1e-6
    for k in (0, 1):
        tp, base = _samples(tmp_path / "tp", k), _samples(tmp_path / "one", k)
        for column in ("latents", "log_probs", "final_latent"):
            torch.testing.assert_close(tp[column], base[column], rtol=0, atol=1e-5)
    assert got[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-6)
    assert got[1]["grad_norm"] == pytest.approx(one[1]["grad_norm"], rel=1e-4)


@pytest.mark.distributed
def test_fsdp2_with_a_remote_engine_is_one_line_on_every_rank(
    flux_run: dict[str, Path], tmp_path: Path
) -> None:
    """The driver pushes its LoRA whole from rank 0, which FSDP2 shards over the ranks: every rank
    refuses the run in the same line, before any server is contacted or anything is written."""
    remote = ("--engine", "remote", "--server-url", "http://127.0.0.1:9", "--set", "update.strategy=fsdp2")
    line = torchrun_fails(*_args(flux_run, tmp_path / "run", *remote))
    assert "--engine remote: FSDP2 shards the LoRA" in line and "update.strategy ddp" in line
    assert not (tmp_path / "run").exists()
