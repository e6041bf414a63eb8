"""`update` under mixed precision and an LR schedule (issue 12, "Training on Accelerate").

A bf16 run really runs the trained forward under bf16 autocast while the trained LoRA weights and
AdamW's state stay fp32 (diffusers' cast_training_params rule, also under `--dtype bf16`); the
launcher's ACCELERATE_MIXED_PRECISION takes effect and launcher settings update cannot honour
(FSDP, DeepSpeed) are refused in one line. The LR schedule is checked against transformers' formulas.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import test_vlm_stages
import torch
from helpers import fails, ins, run, staged_update_args
from safetensors.torch import load_file

from stages.models.diffusion import FlowPolicy
from stages.models.folders import LORA_WEIGHTS
from stages.models.vlm import VLMPolicy
from stages.update.config import UpdateConfig

vlm_run = test_vlm_stages.vlm_run  # the staged VLM iteration (a module fixture)
BF16_EPS = 2.0**-8  # bf16 keeps 8 significant bits: relative rounding up to 2^-8 per operation
FP16_EPS = 2.0**-11  # fp16 keeps 11


def _inputs(staged: dict[str, Path]) -> list[str]:
    return [*ins(staged["samples"], staged["logprobs"]), "--in", str(staged["advantages"])]


def _update(staged: dict[str, Path], out: Path, *extra: str) -> list[dict[str, Any]]:
    """The staged fixture's first update (same options as its policy1) plus `extra`; its metrics."""
    run(*staged_update_args(staged, out, "--lr", "1e-3", *extra))
    return _metrics(out)


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _update_config(out: Path) -> dict[str, Any]:
    return json.loads((out / "omnirl_adapter.json").read_text())["update_config"]


@pytest.fixture
def forwards(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What every trained forward of the transformer saw: autocast dtype, output dtype, the dtypes
    of the trained and of the frozen weights (no-grad reference forwards are left out)."""
    seen: list[dict[str, Any]] = []
    velocity = FlowPolicy.velocity

    def recording(self: FlowPolicy, *args: Any) -> torch.Tensor:
        kind = self.device.type
        outputs: list[torch.dtype] = []
        hook = self.transformer.register_forward_hook(lambda m, a, out: outputs.append(out[0].dtype))
        try:
            result = velocity(self, *args)
        finally:
            hook.remove()
        if torch.is_grad_enabled():
            params = list(self.transformer.parameters())
            seen.append(
                {
                    "autocast": torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None,
                    "outputs": set(outputs),
                    "trained": {p.dtype for p in params if p.requires_grad},
                    "frozen": {p.dtype for p in params if not p.requires_grad},
                }
            )
        return result

    monkeypatch.setattr(FlowPolicy, "velocity", recording)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    return seen


def test_bf16_runs_the_forward_in_bf16_with_fp32_lora_and_optimizer_state(
    staged: dict[str, Path], tmp_path: Path, forwards: list[dict[str, Any]]
) -> None:
    out = tmp_path / "bf16"
    _update(staged, out, "--dtype", "bf16", "--mixed-precision", "bf16")
    assert forwards, "no trained forward ran"
    for f in forwards:
        assert f["autocast"] == torch.bfloat16 and f["outputs"] == {torch.bfloat16}
        assert f["trained"] == {torch.float32} and f["frozen"] == {torch.bfloat16}
    optimizer = torch.load(out / "trainer_state" / "optimizer.pt", weights_only=True)
    moments = [v for s in optimizer["state"].values() for k, v in s.items() if k != "step"]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    assert {t.dtype for t in load_file(out / LORA_WEIGHTS).values()} == {torch.float32}
    assert _update_config(out)["mixed_precision"] == "bf16"


def test_no_mixed_precision_runs_fp32_without_autocast(
    staged: dict[str, Path], tmp_path: Path, forwards: list[dict[str, Any]]
) -> None:
    out = tmp_path / "fp32"
    metrics = _update(staged, out)
    assert forwards and all(f["autocast"] is None for f in forwards)
    assert {d for f in forwards for d in f["outputs"]} == {torch.float32}
    assert _update_config(out)["mixed_precision"] == "no"
    # the same run as the fixture's policy1 (the default): the same numbers
    for a, b in zip(metrics, _metrics(staged["policy1"]), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("perf/")} == {
            k: v for k, v in b.items() if not k.startswith("perf/")
        }


def test_bf16_metrics_are_within_bf16_tolerance_of_fp32(
    staged: dict[str, Path], tmp_path: Path, forwards: list[dict[str, Any]]
) -> None:
    # No ratio clipping (ε = 10): clipping is a step function of the ratio, so a bf16 rounding across
    # the flow_grpo bound 1e-4 would switch a sample's gradient off, which no tolerance describes.
    wide = ("--clip-range", "0.99")
    fp32 = _update(staged, tmp_path / "fp32", *wide)
    bf16 = _update(staged, tmp_path / "bf16", *wide, "--mixed-precision", "bf16")
    assert len(bf16) == len(fp32) >= 2
    for a, b in zip(bf16, fp32, strict=True):
        # a ratio of two Gaussian densities: its log is a difference of bf16-rounded velocities
        assert abs(a["actor/ratio_mean"] - b["actor/ratio_mean"]) < BF16_EPS / 8
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) < BF16_EPS * abs(b["actor/pg_loss"])
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=4 * BF16_EPS)
    assert any(a["actor/ratio_mean"] != b["actor/ratio_mean"] for a, b in zip(bf16, fp32)), "not bf16"


def test_the_launchers_mixed_precision_takes_effect(
    staged: dict[str, Path], tmp_path: Path, forwards: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "ACCELERATE_MIXED_PRECISION", "bf16"
    )  # what `accelerate launch --mixed_precision bf16` sets
    out = tmp_path / "launched"
    _update(staged, out)
    assert forwards and all(f["autocast"] == torch.bfloat16 for f in forwards)
    assert _update_config(out)["mixed_precision"] == "bf16"
    assert UpdateConfig().mixed_precision == "bf16"  # a library caller under the launcher too
    forwards.clear()
    _update(staged, tmp_path / "explicit", "--mixed-precision", "no")  # the option wins over the launcher
    assert forwards and all(f["autocast"] is None for f in forwards)


@pytest.mark.parametrize(
    ("var", "value", "names"),
    [
        ("ACCELERATE_USE_FSDP", "true", ("FSDP version 1", "FSDP_VERSION", "fsdp_version: 2")),
        ("ACCELERATE_USE_MEGATRON_LM", "true", ("Megatron-LM", "ACCELERATE_USE_MEGATRON_LM")),
        ("ACCELERATE_USE_DEEPSPEED", "true", ("DeepSpeed", "ACCELERATE_USE_DEEPSPEED")),
        ("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR", ("dynamo", "ACCELERATE_DYNAMO_BACKEND")),
        ("ACCELERATE_MIXED_PRECISION", "fp8", ("fp8", "--mixed-precision", "no, bf16")),
    ],
)
def test_launcher_settings_update_cannot_honour_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str, names: tuple[str, ...]
) -> None:
    monkeypatch.setenv(var, value)
    fails(
        ["update", "--model", str(tmp_path), "--in", str(tmp_path / "x"), "--out", str(tmp_path / "o")],
        *names,
    )


def test_impossible_precision_and_schedule_options_are_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    args = [
        "update",
        "--model",
        str(tmp_path),
        "--in",
        str(tmp_path / "x"),
        "--out",
        str(tmp_path / "o"),
    ]
    fails([*args, "--lr-scheduler", "cosine"], "--lr-scheduler cosine", "--lr-total-steps")
    fails([*args, "--lr-scheduler", "step"], "--lr-scheduler step", "constant, linear, cosine")
    fails([*args, "--lr-warmup-steps", "-1"], "--lr-warmup-steps -1")


def test_vlm_trained_weights_are_fp32_under_bf16_storage(tiny_vlm: Path) -> None:
    policy = VLMPolicy.load(tiny_vlm, dtype="bf16")
    policy.add_lora(rank=2, alpha=4)
    trained = policy.trainable_parameters()
    assert {p.dtype for p in trained} == {torch.float32}
    assert {p.dtype for p in policy.model.parameters() if not p.requires_grad} == {torch.bfloat16}


# ---------------------------------------------------------------- LR schedule


def _warmup_then(kind: str, step: int, base: float, warmup: int, total: int) -> float:
    """transformers' get_{constant,linear,cosine}_schedule_with_warmup (num_cycles 0.5), written out."""
    if step < warmup:
        return base * step / warmup
    if kind == "constant":
        return base
    progress = min((step - warmup) / (total - warmup), 1.0)
    return base * ((1 - progress) if kind == "linear" else 0.5 * (1 + math.cos(math.pi * progress)))


def test_lr_factor_golden_values() -> None:
    cosine = UpdateConfig(lr_scheduler="cosine", lr_warmup_steps=2, lr_total_steps=6)
    half = math.sqrt(0.5) / 2
    assert [cosine.lr_factor(s) for s in range(8)] == pytest.approx(
        [0.0, 0.5, 1.0, 0.5 + half, 0.5, 0.5 - half, 0.0, 0.0], abs=1e-15
    )
    linear = UpdateConfig(lr_scheduler="linear", lr_warmup_steps=1, lr_total_steps=5)
    assert [linear.lr_factor(s) for s in range(7)] == pytest.approx([0, 1, 0.75, 0.5, 0.25, 0, 0])
    assert [UpdateConfig().lr_factor(s) for s in range(3)] == [1.0, 1.0, 1.0]  # today's behaviour
    assert [UpdateConfig(lr_warmup_steps=4).lr_factor(s) for s in range(6)] == [0, 0.25, 0.5, 0.75, 1, 1]


def test_cosine_schedule_continues_across_updates(staged: dict[str, Path], tmp_path: Path) -> None:
    schedule = ["--lr-scheduler", "cosine", "--lr-warmup-steps", "2", "--lr-total-steps", "6"]
    first = _update(staged, tmp_path / "p1", "--inner-epochs", "2", *schedule)
    run(
        "update",
        "--model",
        str(staged["model"]),
        "--adapter",
        str(tmp_path / "p1"),
        *_inputs(staged),
        "--lr",
        "1e-3",
        "--inner-epochs",
        "2",
        *schedule,
        "--out",
        str(tmp_path / "p2"),
    )
    logged = [(m["step"], m["actor/lr"]) for m in [*first, *_metrics(tmp_path / "p2")]]
    assert [s for s, _ in logged] == list(range(1, 9))
    expected = [_warmup_then("cosine", s - 1, 1e-3, 2, 6) for s in range(1, 9)]
    assert [lr for _, lr in logged] == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_vlm_update_under_bf16_autocast_stays_near_the_fp32_run(
    vlm_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    seen: list[torch.dtype | None] = []
    forward = VLMPolicy.response_forward

    def recording(self: VLMPolicy, *args: Any, **kwargs: Any) -> Any:
        kind = self.device.type
        seen.append(torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(VLMPolicy, "response_forward", recording)
    args = (
        "--algo",
        "grpo",
        "--lr",
        "1e-2",
        "--lora-rank",
        "8",
        "--micro-batch",
        "12",
        "--clip-range",
        "0.99",
    )
    test_vlm_stages.update(vlm_run, tiny_vlm, tmp_path / "fp32", *args)
    assert seen and set(seen) == {None}
    seen.clear()
    test_vlm_stages.update(vlm_run, tiny_vlm, tmp_path / "bf16", *args, "--mixed-precision", "bf16")
    assert seen and set(seen) == {torch.bfloat16}
    fp32, bf16 = _metrics(tmp_path / "fp32"), _metrics(tmp_path / "bf16")
    for a, b in zip(bf16, fp32, strict=True):
        assert a["actor/ratio_mean"] != b["actor/ratio_mean"]
        assert abs(a["actor/ratio_mean"] - b["actor/ratio_mean"]) < 8 * BF16_EPS
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=16 * BF16_EPS)
    weights = load_file(tmp_path / "bf16" / "adapter_model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_full_fine_tuning_over_bf16_storage_trains_fp32_weights(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    """--full under --dtype bf16: the trained transformer is fp32 while the frozen text encoders give bf16
    conditioning, which the policy casts to the transformer's dtype (no dtype mismatch, no autocast)."""
    from safetensors.torch import load_file

    out = tmp_path / "full"
    metrics = _update(staged, out, "--full", "--dtype", "bf16")
    assert metrics and all(math.isfinite(m["actor/pg_loss"]) for m in metrics)
    from stages.models.diffusion import FlowPolicy

    saved = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    weights = [name for name, _ in FlowPolicy.load(staged["model"]).module.named_parameters()]
    assert weights and {saved[name].dtype for name in weights} == {torch.float32}  # buffers keep --dtype


def test_fp16_runs_under_a_dynamic_loss_scale_that_resumes(
    staged: dict[str, Path], tmp_path: Path, forwards: list
) -> None:
    wide = ("--clip-range", "0.99")  # no clipping switch on a rounding (see the bf16 test)
    fp32 = _update(staged, tmp_path / "fp32", *wide, "--mixed-precision", "no")
    forwards.clear()
    fp16 = _update(staged, tmp_path / "fp16", *wide, "--mixed-precision", "fp16")
    assert forwards and all(f["autocast"] == torch.float16 for f in forwards)
    assert [m["actor/grad_scale"] for m in fp16] == [65536.0] * len(
        fp16
    )  # torch's initial scale, no overflow
    for a, b in zip(fp32, fp16, strict=True):
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=4 * FP16_EPS)
    state = json.loads((tmp_path / "fp16" / "trainer_state" / "state.json").read_text())
    assert state["grad_scaler"]["scale"] == 65536.0 and state["update_config"]["mixed_precision"] == "fp16"
    assert "actor/grad_scale" not in fp32[0]


def test_an_fp16_overflow_skips_the_step_and_halves_the_scale(
    staged: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.update import trainer

    class Huge(torch.amp.GradScaler):  # a scale that overflows fp16 gradients on the first step
        def __init__(self, device: str, enabled: bool) -> None:
            super().__init__(device, init_scale=2.0**100, enabled=enabled)

    monkeypatch.setattr(trainer.torch.amp, "GradScaler", Huge)
    metrics = _update(staged, tmp_path / "p", "--mixed-precision", "fp16", "--grad-accum", "3")
    assert len(metrics) == 1 and not math.isfinite(metrics[0]["actor/grad_norm"])
    assert metrics[0]["actor/grad_scale"] == 2.0**99  # the step was skipped: no error, a lower scale
    weights = load_file(tmp_path / "p" / LORA_WEIGHTS)
    assert all(
        float(v.abs().max()) == 0 for k, v in weights.items() if "lora_B" in k
    )  # B stays at its init 0
