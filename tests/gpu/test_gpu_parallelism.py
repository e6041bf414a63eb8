"""The GPU suite's sequence parallelism and kernels (`make test-gpu`; stages/parallelism.py,
stages/models/kernels.py), on the small FLUX: ring attention over 2 ranks, sp with FSDP2, the flash
backend, --compile, tensor parallelism (FLUX and Qwen-Image), and a throughput line for sp=1 vs sp=2 at a
long sequence.

Skipped without an accelerator; the tests that launch 2 ranks need 2 accelerators (one per rank: NCCL
runs no two ranks on one device) and are skipped with that reason on a 1-device machine.
`OMNIRL_GPU_SUITE_ON_CPU=1` rehearses what a CPU can run (Ulysses, FSDP2, tensor parallelism, compile,
the throughput line; 2 gloo ranks stand in for 2 devices) on the tiny FLUX in fp32; ring, cuDNN and flash need an accelerator.

Tolerances, all relative (‖Δ‖ / ‖reference‖, or of the reference's largest entry), and why:
- ring sp=2 vs one process, both bf16 on cuDNN attention: velocity ≤ 2e-2, LoRA gradient ≤ 5e-2. Both
  sides round every layer to bf16 (2⁻⁸ ≈ 3.9e-3); ring only changes the order of the fp32 softmax merge,
  so the two differ by a few bf16 roundings, while a ring that drops or double-counts a block of keys
  moves the output by O(10%) or more.
- sp=2 with FSDP2 vs one process, fp32: grad norm and loss per step ≤ 1e-4, trained LoRA ≤ 1e-4 of its
  largest entry (the CPU suite holds 1e-5 on gloo; accelerator GEMMs pick other kernels per shape).
- flash vs native attention, bf16: velocity ≤ 2e-2 (two exact kernels, each rounding to bf16).
- tp=2 vs one process, fp32: velocity ≤ 1e-4 (the row-parallel all-reduce reorders fp32 sums).
- compiled vs eager, fp32 (TF32 off, torch's default): velocity ≤ 1e-4 (inductor reorders reductions;
  the CPU gives 3.6e-7).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import PROMPTS, ins, run, torchrun

ACCELERATOR = torch.accelerator.is_available()
ON = ACCELERATOR or os.environ.get("OMNIRL_GPU_SUITE_ON_CPU") == "1"
# 2 ranks need 2 accelerators; a CPU rehearsal runs them as 2 gloo processes
DEVICES = torch.accelerator.device_count() if ACCELERATOR else 2
SIZE, RESOLUTION = ("small", "256") if ACCELERATOR else ("tiny", "32")
LONG_SIDE = 1024 if ACCELERATOR else 256  # pixels: 16384 image tokens of the small FLUX, 1024 of the tiny
PROBE = Path(__file__).parent / "sp_probe.py"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON, reason="no accelerator (set OMNIRL_GPU_SUITE_ON_CPU=1 to rehearse)"),
]
two_devices = pytest.mark.skipif(
    DEVICES < 2, reason=f"sp=2 runs one rank per device and this machine has {DEVICES} accelerator"
)
accelerator_only = pytest.mark.skipif(
    not ACCELERATOR, reason="cuDNN and flash attention (and so ring attention) run on accelerators only"
)


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small FLUX (tiny in a CPU rehearsal), built offline: 6 heads of 64, so Ulysses 2 splits them."""
    from stages.models.factory import init_model

    path = tmp_path_factory.mktemp("gpu-sp") / "model"
    init_model("flux", path, size=SIZE, seed=0)
    return path


@two_devices
@accelerator_only
def test_ring_attention_over_two_ranks_equals_one_process(flux: Path) -> None:
    """Ring (keys and values passed round, partial results merged by their log-sum-exp) on cuDNN
    attention in bf16: the velocity and the group's summed LoRA gradient equal one process's."""
    [report] = torchrun(
        str(flux), "--sp-kind", "ring", "--attention-backend", "_native_cudnn", "--dtype", "bf16",
        "--resolution", RESOLUTION, ranks=2, program=(str(PROBE),),
    )  # fmt: skip
    print(f"\n[gpu] ring sp=2 vs one process (bf16, cuDNN): {report}")
    assert report["world"] == 2 and report["grad_norm"] > 0
    assert report["velocity_rel"] <= 2e-2 and report["grad_rel"] <= 5e-2


@two_devices
def test_ulysses_over_two_ranks_equals_one_process_on_the_device(flux: Path) -> None:
    """The same probe with Ulysses (all-to-alls over the device's collective backend) on the default
    attention, fp32: as close as the CPU suite's gloo ranks."""
    [report] = torchrun(str(flux), "--resolution", RESOLUTION, ranks=2, program=(str(PROBE),))
    assert report["world"] == 2 and report["grad_norm"] > 0
    assert report["velocity_rel"] <= 1e-4 and report["grad_rel"] <= 1e-4


@two_devices
@pytest.mark.parametrize("family, guidance", [("flux", "3.5"), ("qwen_image", "4.0")])
def test_tensor_parallel_rollout_over_two_ranks_equals_one_process(
    family: str, guidance: str, flux: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--tp-degree 2 (diffusers' `_tp_plan`: column- then row-parallel linears, an all-reduce per block)
    on the device's collectives, on the small FLUX and Qwen-Image, fp32, with each family's own guidance:
    one rollout step's velocity equals one process's within 1e-4 relative (the all-reduce only reorders
    fp32 sums; a mis-sharded projection would be off by O(1))."""
    model = flux
    if family != "flux":
        from stages.models.factory import init_model

        model = tmp_path_factory.mktemp(f"gpu-tp-{family}") / "model"
        init_model(family, model, size=SIZE, seed=0)
    [report] = torchrun(
        str(model), "--tp", "--guidance", guidance, "--resolution", RESOLUTION, ranks=2, program=(str(PROBE),)
    )
    print(f"\n[gpu] tp=2 vs one process ({family}, fp32): {report}")
    assert report["world"] == 2 and report["norm"] > 0
    assert report["velocity_rel"] <= 1e-4


@pytest.fixture(scope="module")
def rollout(flux: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process's rollout of the FLUX (3 prompts × 2, 3 SDE steps), its rewards, replay and advantages."""
    root = tmp_path_factory.mktemp("gpu-sp-rollout")
    p = {k: root / k for k in ("samples", "rewards", "logprobs", "advantages")}
    (root / "prompts.txt").write_text("\n".join(PROMPTS[:3]) + "\n")
    run(
        "sample", "--model", str(flux), "--prompts", str(root / "prompts.txt"), "-n", "2", "--steps", "3",
        "--resolution", RESOLUTION, "--guidance", "3.5", "--batch-size", "2", "--out", str(p["samples"]),
    )  # fmt: skip
    run("score", "--in", str(p["samples"]), "--reward", "jpeg_compressibility", "--out", str(p["rewards"]))
    run("logprob", "--model", str(flux), "--in", str(p["samples"]), "--out", str(p["logprobs"]))
    run("advantage", *ins(p["samples"], p["rewards"]), "--out", str(p["advantages"]))
    return p


@two_devices
def test_sp_with_fsdp2_trains_as_one_process(flux: Path, rollout: dict[str, Path], tmp_path: Path) -> None:
    """update --sp-degree 2 --strategy fsdp2 on 2 ranks (FSDP2 shards the LoRA'd transformer over both,
    the sp group's gradients add up) against one process's update of the same inputs, fp32."""
    args = [
        "update", "--model", str(flux), *ins(rollout["samples"], rollout["logprobs"], rollout["advantages"]),
        "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3", "--no-shuffle", "--micro-batch", "1",
    ]  # fmt: skip
    one = run(*args, "--out", str(tmp_path / "one"))
    [sp] = torchrun(*args, "--sp-degree", "2", "--strategy", "fsdp2", "--out", str(tmp_path / "sp"), ranks=2)
    assert one["step"] == sp["step"] == 6

    def metrics(policy: Path) -> list[dict]:
        return [json.loads(line) for line in (policy / "metrics.jsonl").read_text().splitlines()]

    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "sp"), strict=True):
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-4, abs=1e-9)
    from safetensors.torch import load_file

    from stages.models.diffusion import LORA_WEIGHTS

    ref, got = load_file(tmp_path / "one" / LORA_WEIGHTS), load_file(tmp_path / "sp" / LORA_WEIGHTS)
    scale = max(float(v.abs().max()) for v in ref.values())
    assert ref.keys() == got.keys() and scale > 0
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-4 * scale)


def _velocity(policy: Any) -> torch.Tensor:
    """The guided velocity of two prompts' seeded noise at the second of 4 σ steps, fp32 [2, ...]."""
    x, sigma = policy.initial_noise([1, 2], RESOLUTION), policy.sigmas(4, RESOLUTION)[1]
    with torch.no_grad():
        return policy.velocity(x, sigma, policy.encode(PROMPTS[:2], None, False), 3.5).float()


@accelerator_only
def test_flash_backend_agrees_with_native(flux: Path) -> None:
    from stages.dist import device
    from stages.models.diffusion import FlowPolicy
    from stages.models.kernels import Kernels, installed_backends, prepare
    from stages.parallelism import ModelParallel

    if "flash" not in installed_backends():
        pytest.skip("the flash backend needs flash-attn, which is not installed")

    native = _velocity(FlowPolicy.load(flux, device=device(), dtype="bf16"))
    policy = FlowPolicy.load(flux, device=device(), dtype="bf16")
    prepare(policy.parts, ModelParallel(), Kernels(attention_backend="flash"))
    flash = _velocity(policy)
    assert float((flash - native).norm() / native.norm()) <= 2e-2


def test_compiled_transformer_equals_eager(flux: Path) -> None:
    """--compile (regional: each repeated block) against the same weights eager, fp32; the first
    (compiling) and a later forward's time for the record."""
    from torch._dynamo.utils import counters

    from stages.dist import device
    from stages.models.diffusion import FlowPolicy
    from stages.models.kernels import Kernels, prepare
    from stages.parallelism import ModelParallel

    eager = _velocity(FlowPolicy.load(flux, device=device()))
    policy = FlowPolicy.load(flux, device=device())
    prepare(policy.parts, ModelParallel(), Kernels(compile=True))
    counters.clear()
    t0 = time.perf_counter()
    compiled = _velocity(policy)
    first = time.perf_counter() - t0
    assert counters["stats"]["unique_graphs"] >= 1  # traced and compiled, not silently left eager
    t0 = time.perf_counter()
    _velocity(policy)
    later = time.perf_counter() - t0
    print(f"\n[gpu] compile: first forward {first:.1f} s (compiling), then {later * 1e3:.1f} ms")
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4 * float(eager.abs().max()))


@two_devices
def test_sp2_throughput_at_a_long_sequence(flux: Path, tmp_path: Path) -> None:
    """One training step (forward + backward through a LoRA) of the FLUX at LONG_SIDE² pixels, one
    process vs Ulysses sp=2 on 2 ranks (benchmarks/bench_sp.py's measurement), for the record."""
    from benchmarks.bench_sp import measure
    from stages.models.flux import SIZES

    times = {sp: measure(flux, LONG_SIDE, sp, 3, tmp_path / f"sp{sp}.json") for sp in (1, 2)}
    tokens = (LONG_SIDE // (2 * SIZES[SIZE].vae_scale_factor)) ** 2  # 2×2 latent patches per token
    print(
        f"\n[gpu] sp step time, {SIZE} FLUX at {LONG_SIDE}² ({tokens} image tokens): 1 process "
        f"{times[1]:.3f} s, sp=2 {times[2]:.3f} s (sp=2 ÷ sp=1 = {times[2] / times[1]:.2f})"
    )
    assert all(0 < t < float("inf") for t in times.values())
