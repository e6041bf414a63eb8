"""`omnirl export`: an adapter merged into its base model is a plain folder that diffusers / transformers
load without peft, and computes what the base model with the adapter computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, fails, run

from stages.models.diffusion import FlowPolicy
from stages.models.folders import ADAPTER_CONFIG, LORA_WEIGHTS

# family → (resolution, guidance, frames) its tiny build samples at (tests/test_families.py,
# tests/test_family_wan.py); Wan 2.2 A14B has two trained experts, each with its LoRA
FAMILIES = {
    "flux": (32, 3.5, 1),
    "qwen_image": (32, 4.0, 1),
    "sd3": (32, 3.0, 1),
    "z_image": (32, 3.0, 1),
    "wan2_1": (32, 3.0, 5),
    "wan2_2_a14b": (32, 3.0, 5),
}


def _randomise_lora(module: torch.nn.Module, seed: int) -> int:
    """Give every LoRA B a random value (a fresh adapter's B is 0, a no-op); returns the LoRA layers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return sum(1 for name, _ in module.named_parameters() if "lora_A" in name)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny model of the family and a LoRA adapter on it, saved as `omnirl update` saves one."""
    from stages.models.factory import init_model

    root = tmp_path_factory.mktemp(f"export-{request.param}")
    init_model(request.param, root / "model", size="tiny", seed=0)
    policy = FlowPolicy.load(root / "model")
    policy.add_lora(rank=4, alpha=8)
    layers = _randomise_lora(policy.module, seed=1)
    policy.save_adapter(root / "adapter", kind="lora", extra={"step": 1})
    return {
        "family": request.param,
        "root": root,
        "model": root / "model",
        "adapter": root / "adapter",
        "layers": layers,
    }


def _velocity(policy: FlowPolicy, family: str) -> torch.Tensor:
    """The guided velocity of two prompts at each σ of a 3-step schedule (text encoders included; both
    of Wan 2.2 A14B's experts)."""
    resolution, guidance, frames = FAMILIES[family]
    x = policy.initial_noise([1, 2], resolution, frames)
    with torch.no_grad():
        cond = policy.encode(PROMPTS[:2], None, True)
        return torch.stack([policy.velocity(x, s, cond, guidance) for s in policy.sigmas(3, resolution)[:-1]])


def test_a_merged_diffusion_export_equals_the_adapter_applied(trained: dict, tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    out = tmp_path / "merged"
    result = run("export", str(trained["adapter"]), "--out", str(out))
    assert result["kind"] == "lora" and result["merged_layers"] == trained["layers"] > 0
    assert result["base_model"] == str(trained["model"].resolve())
    # stock diffusers loads it, with no LoRA layer left anywhere and no adapter files
    pipe = DiffusionPipeline.from_pretrained(out)
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            assert not getattr(module, "peft_config", None), name
            assert not any("lora" in k for k in module.state_dict()), name
    assert not (out / LORA_WEIGHTS).exists() and not (out / ADAPTER_CONFIG).exists()
    assert (out / "omnirl_model.json").read_bytes() == (trained["model"] / "omnirl_model.json").read_bytes()
    assert not list(tmp_path.glob(".merged.tmp-*"))
    applied = _velocity(FlowPolicy.load(trained["model"], adapter=trained["adapter"]), trained["family"])
    merged = _velocity(FlowPolicy.load(out), trained["family"])
    base = _velocity(FlowPolicy.load(trained["model"]), trained["family"])
    assert (applied - base).abs().max() > 1e-3  # the adapter changes the model
    torch.testing.assert_close(merged, applied, rtol=0, atol=1e-5)


@pytest.mark.parametrize("trained", ["flux"], indirect=True)
def test_dtype_casts_every_exported_weight_once_after_an_fp32_merge(trained: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run("export", str(trained["adapter"]), "--out", str(tmp_path / "bf16"), "--dtype", "bf16")
    for path in (tmp_path / "bf16").rglob("*.safetensors"):
        assert {t.dtype for t in load_file(path).values()} == {torch.bfloat16}, path
    saved = load_file(tmp_path / "bf16" / "transformer" / "diffusion_pytorch_model.safetensors")
    held = dict(FlowPolicy.load(trained["model"], adapter=trained["adapter"]).module.named_parameters())
    name = "transformer_blocks.0.attn.to_q"
    lora = held[f"{name}.lora_B.default.weight"] @ held[f"{name}.lora_A.default.weight"]
    # W + (alpha / r)·B·A in fp32, rounded to bf16 once
    expected = (held[f"{name}.base_layer.weight"] + 2.0 * lora).to(torch.bfloat16)
    assert torch.equal(saved[f"{name}.weight"], expected)


def test_a_merged_vlm_export_loads_in_transformers_and_equals_the_adapter_applied(
    tiny_vlm: Path, tmp_path: Path
) -> None:
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from stages.models.vlm import VLMPolicy

    policy = VLMPolicy.load(tiny_vlm)
    policy.add_lora(rank=4, alpha=8)
    layers = _randomise_lora(policy.module, seed=2)
    policy.save_adapter(tmp_path / "adapter", kind="lora", extra={"step": 1})
    result = run("export", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged"))
    assert result["merged_layers"] == layers > 0 and result["kind"] == "lora"
    plain = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
    assert type(plain).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert not any("lora" in k for k in plain.state_dict()) and not getattr(plain, "peft_config", None)
    applied = VLMPolicy.load(tiny_vlm, adapter=tmp_path / "adapter")
    # text only, and a prompt with an image, through the exported processor
    exported = VLMPolicy.load(tmp_path / "merged")
    red = Image.new("RGB", (56, 56), (220, 20, 20))
    inputs = exported.chat_inputs(["What colour is the square?", "Say hello."], [[red], []])
    with torch.no_grad():
        ours = plain(**inputs).logits
        theirs = applied.module(**inputs).logits
        base = VLMPolicy.load(tiny_vlm).module(**inputs).logits
    assert (theirs - base).abs().max() > 1e-3
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_bad_input_is_one_line_with_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    from stages.models.factory import init_model

    init_model("sd3", tmp_path / "base", size="tiny", seed=0)
    init_model("sd3", tmp_path / "other", size="tiny", seed=1)
    policy = FlowPolicy.load(tmp_path / "base")
    policy.add_lora(rank=2, alpha=4)
    policy.save_adapter(tmp_path / "adapter", kind="lora", extra={"step": 1})
    adapter = str(tmp_path / "adapter")
    # an existing --out is never replaced, whatever it holds
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    fails(["export", adapter, "--out", str(tmp_path / "taken")], "--out", "exists")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    out = str(tmp_path / "out")
    # an adapter of another base model than --model
    fails(["export", adapter, "--out", out, "--model", str(tmp_path / "other")], "trained from", "--model")
    # a missing adapter, and a folder that is not one
    fails(["export", str(tmp_path / "nope"), "--out", out], "ADAPTER", "no such folder")
    fails(["export", str(tmp_path / "base"), "--out", out], "ADAPTER", "omnirl_adapter.json")
    # an adapter whose recorded base is gone, and a LoRA folder another tool wrote (no record)
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    (tmp_path / "adapter" / ADAPTER_CONFIG).write_text(
        json.dumps({**config, "base_model": str(tmp_path / "gone")})
    )
    fails(["export", adapter, "--out", out], "gone", "does not exist", "--model")
    (tmp_path / "adapter" / ADAPTER_CONFIG).unlink()
    fails(["export", adapter, "--out", out], "records no base model", "--model")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    # with --model it exports (the record gone, the base given)
    run("export", adapter, "--out", out, "--model", str(tmp_path / "base"))
    assert (tmp_path / "out" / "model_index.json").is_file()


def test_a_failed_export_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stages.export import stage
    from stages.models.factory import init_model

    init_model("sd3", tmp_path / "base", size="tiny", seed=0)
    FlowPolicy.load(tmp_path / "base").save_adapter(tmp_path / "adapter", kind="full", extra={"step": 1})

    def half_written(base: Path, adapter: Path, tmp: Path, dtype: torch.dtype, device: object) -> int:
        (tmp / "model_index.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(stage, "_save_pipeline", half_written)
    with pytest.raises(OSError, match="disk full"):
        stage.export_adapter(tmp_path / "adapter", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]
    # unbroken, a full adapter's weights are the exported transformer's, bit for bit
    monkeypatch.undo()
    result = stage.export_adapter(tmp_path / "adapter", tmp_path / "out")
    assert result["kind"] == "full" and result["merged_layers"] == 0
    from safetensors.torch import load_file

    name = "transformer/diffusion_pytorch_model.safetensors"
    saved, held = load_file(tmp_path / "out" / name), load_file(tmp_path / "adapter" / name)
    assert saved.keys() == held.keys() and all(torch.equal(saved[k], held[k]) for k in held)
