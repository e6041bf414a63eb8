"""Tiny-model factory: SD3 folders load offline through diffusers, generate, and are reproducible."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stages.errors import UserInputError
from stages.models.factory import (
    MODEL_CARD_NAME,
    available_families,
    component_seed,
    folder_bytes,
    init_model,
    make_model,
    make_model_on,
    read_model_card,
    seeded,
)
from stages.models.sd3 import SIZES
from stages.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

OCR_PROMPT = 'a sign that says "omnirl 2026"'
WEIGHT_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae")


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A tiny SD3 pipeline folder built once for this module (seed 0)."""
    out = tmp_path_factory.mktemp("models") / "sd3-tiny"
    return out, init_model("sd3", out, size="tiny", seed=0)


def weight_hashes(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*.safetensors"))
    }


def load_pipeline(folder: Path):
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(folder)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def test_folder_holds_every_sd3_component_and_a_model_card(tiny_sd3: tuple[Path, dict]) -> None:
    folder, summary = tiny_sd3
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModelWithProjection"]
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"]
    assert index["tokenizer"][1] == index["tokenizer_2"][1] == "CLIPTokenizer"
    assert index["tokenizer_3"][1] in ("T5Tokenizer", "T5TokenizerFast")
    assert set(weight_hashes(folder)) == {
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
        "text_encoder_2/model.safetensors",
        "text_encoder_3/model.safetensors",
    }

    card = read_model_card(folder)
    assert card is not None
    assert (card["family"], card["size"], card["seed"]) == ("sd3", "tiny", 0)
    assert card["pipeline_class"] == "StableDiffusion3Pipeline"
    assert set(card["parameters"]) == set(WEIGHT_COMPONENTS)
    assert summary["out_dir"] == str(folder)
    assert summary["bytes"] == folder_bytes(folder)
    assert summary["bytes"] < 8 * 2**20
    assert {key: summary[key] for key in card} == card


def test_pipeline_loads_offline_and_generates_an_image(tiny_sd3: tuple[Path, dict], offline: None) -> None:
    folder, summary = tiny_sd3
    pipeline = load_pipeline(folder)
    expected_parameters = {
        name: sum(p.numel() for p in getattr(pipeline, name).parameters()) for name in WEIGHT_COMPONENTS
    }
    assert expected_parameters == summary["parameters"]

    images = pipeline(
        OCR_PROMPT,
        height=32,
        width=64,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=16,
        generator=torch.Generator().manual_seed(0),
    ).images
    assert len(images) == 1
    assert images[0].size == (64, 32)
    assert images[0].mode == "RGB"
    pixels = np.asarray(images[0], dtype=np.float64)
    assert pixels.std() > 5.0

    again = pipeline(
        OCR_PROMPT,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=16,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert again.size == (summary["details"]["image_size"],) * 2 == (64, 64)


def test_architecture_matches_sd3_conventions(tiny_sd3: tuple[Path, dict], offline: None) -> None:
    pipeline = load_pipeline(tiny_sd3[0])
    transformer, vae = pipeline.transformer.config, pipeline.vae.config
    assert vae.latent_channels == transformer.in_channels == transformer.out_channels == 16
    assert (vae.scaling_factor, vae.shift_factor) == (1.5305, 0.0609)
    assert transformer.joint_attention_dim == pipeline.text_encoder_3.config.d_model
    clip_projections = (
        pipeline.text_encoder.config.projection_dim + pipeline.text_encoder_2.config.projection_dim
    )
    assert transformer.pooled_projection_dim == clip_projections
    assert (
        transformer.caption_projection_dim == transformer.num_attention_heads * transformer.attention_head_dim
    )
    assert transformer.qk_norm == "rms_norm"
    assert pipeline.tokenizer.model_max_length == pipeline.text_encoder.config.max_position_embeddings == 77

    with torch.no_grad():
        embeds, _, pooled, _ = pipeline.encode_prompt(
            OCR_PROMPT, None, None, do_classifier_free_guidance=False, max_sequence_length=16
        )
        other, _, other_pooled, _ = pipeline.encode_prompt(
            "a photo of a cat", None, None, do_classifier_free_guidance=False, max_sequence_length=16
        )
    assert embeds.shape == (1, 77 + 16, transformer.joint_attention_dim)
    assert pooled.shape == (1, transformer.pooled_projection_dim)
    assert not torch.allclose(embeds, other)
    assert not torch.allclose(pooled, other_pooled)


def test_scheduler_reproduces_sd3_sigmas(tiny_sd3: tuple[Path, dict], offline: None) -> None:
    scheduler = load_pipeline(tiny_sd3[0]).scheduler
    assert (scheduler.config.shift, scheduler.config.num_train_timesteps) == (3.0, 1000)
    assert not scheduler.config.use_dynamic_shifting

    def shift(sigma: np.ndarray) -> np.ndarray:
        return 3.0 * sigma / (1.0 + 2.0 * sigma)

    sigma_min = shift(np.float64(1.0 / 1000))
    expected = shift(np.linspace(1.0, sigma_min, 10))
    scheduler.set_timesteps(10)
    assert scheduler.sigmas[-1].item() == 0.0
    np.testing.assert_allclose(scheduler.sigmas[:-1].double().numpy(), expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(expected[:3], [1.0, 0.960129, 0.913349], atol=1e-6)


def test_same_seed_same_bytes_other_seed_other_weights(tiny_sd3: tuple[Path, dict], tmp_path: Path) -> None:
    folder, _ = tiny_sd3
    reference = weight_hashes(folder)
    init_model("sd3", tmp_path / "same", size="tiny", seed=0)
    init_model("sd3", tmp_path / "other", size="tiny", seed=1)
    assert weight_hashes(tmp_path / "same") == reference
    other = weight_hashes(tmp_path / "other")
    assert set(other) == set(reference)
    assert all(other[name] != reference[name] for name in reference)
    for tokenizer in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        assert (tmp_path / "other" / tokenizer / "tokenizer.json").read_bytes() == (
            folder / tokenizer / "tokenizer.json"
        ).read_bytes()


def test_tokenizers_are_identical_in_a_fresh_process() -> None:
    script = (
        "import hashlib\n"
        "from stages.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer\n"
        "for tokenizer in (build_clip_tokenizer(), build_t5_tokenizer()):\n"
        "    print(hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "HF_HUB_OFFLINE": "1"}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root, check=True
    )
    here = [
        hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
        for tokenizer in (build_clip_tokenizer(), build_t5_tokenizer())
    ]
    assert result.stdout.split() == here


def test_saved_tokenizers_split_ocr_prompts_into_known_pieces(
    tiny_sd3: tuple[Path, dict], offline: None
) -> None:
    pipeline = load_pipeline(tiny_sd3[0])
    for clip in (pipeline.tokenizer, pipeline.tokenizer_2):
        ids = clip(OCR_PROMPT).input_ids
        assert ids[0] == clip.bos_token_id
        assert ids[-1] == clip.eos_token_id
        inner = ids[1:-1]
        assert clip.unk_token_id not in inner
        assert len(inner) >= 10
        tokens = clip.convert_ids_to_tokens(inner)
        assert tokens[:5] == ["a</w>", "sign</w>", "that</w>", "says</w>", '"</w>']
        assert tokens[-5:] == ["2</w>", "0</w>", "2</w>", "6</w>", '"</w>']
        assert "".join(tokens).replace("</w>", "") == OCR_PROMPT.replace(" ", "")
        padded = clip(OCR_PROMPT, padding="max_length", max_length=77).input_ids
        assert len(padded) == 77
        assert padded[len(ids) :] == [clip.pad_token_id] * (77 - len(ids))

    t5 = pipeline.tokenizer_3
    ids = t5(OCR_PROMPT).input_ids
    assert ids[-1] == t5.eos_token_id
    assert t5.unk_token_id not in ids
    assert len(ids) - 1 >= 8
    assert t5.convert_ids_to_tokens(ids[:4]) == ["▁a", "▁sign", "▁that", "▁says"]
    assert t5.decode(ids, skip_special_tokens=True) == OCR_PROMPT
    assert t5.decode(t5("Hello World, 42!").input_ids, skip_special_tokens=True) == "Hello World, 42!"


def test_tokenizers_cover_every_printable_character() -> None:
    clip, t5 = build_clip_tokenizer(), build_t5_tokenizer()
    text = "".join(chr(code) for code in range(33, 127))
    assert clip.unk_token_id not in clip(text, add_special_tokens=False).input_ids
    assert t5.unk_token_id not in t5(text).input_ids


def test_unknown_names_and_bad_destinations_are_user_errors(tmp_path: Path) -> None:
    assert "sd3" in available_families()
    assert available_families() == sorted(available_families())
    with pytest.raises(UserInputError, match=r"unknown model family 'sd9'.*sd3"):
        init_model("sd9", tmp_path / "a")
    with pytest.raises(UserInputError, match=r"unknown size 'huge'.*tiny, small"):
        init_model("sd3", tmp_path / "b", size="huge")
    with pytest.raises(UserInputError, match="seed"):
        init_model("sd3", tmp_path / "c", seed=-1)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(UserInputError, match="not an empty directory"):
        init_model("sd3", tmp_path / "busy")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_model_card_reader(tmp_path: Path) -> None:
    assert read_model_card(tmp_path) is None
    (tmp_path / MODEL_CARD_NAME).write_text("{not json")
    with pytest.raises(UserInputError, match=MODEL_CARD_NAME):
        read_model_card(tmp_path)
    (tmp_path / MODEL_CARD_NAME).write_text('{"format": "other"}')
    with pytest.raises(UserInputError, match="not an omnirl model card"):
        read_model_card(tmp_path)


def test_seeded_builds_are_independent_of_and_invisible_to_the_global_rng() -> None:
    torch.manual_seed(7)
    plain = torch.rand(3)
    torch.manual_seed(7)
    with seeded(0, "transformer"):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), plain)
    torch.manual_seed(123)
    with seeded(0, "transformer"):
        assert torch.equal(torch.rand(3), inside)
    assert component_seed(0, "transformer") != component_seed(0, "vae")
    assert component_seed(0, "vae") != component_seed(1, "vae")
    assert 0 <= component_seed(2**62, "vae") < 2**63


def test_a_model_made_on_a_device_is_seeded_frozen_and_has_the_meta_builds_parameters() -> None:
    """`make_model_on` (bench_real_size's on-device build): the factory's seeded weights, cast and frozen,
    with every tensor on the device, RoPE tables included, and the meta build's parameter counts."""
    built = make_model_on("qwen_image", "tiny", 0, "cpu", torch.bfloat16)
    again = make_model_on("qwen_image", "tiny", 0, "cpu", torch.bfloat16)
    other = make_model_on("qwen_image", "tiny", 1, "cpu", torch.bfloat16)
    plain = make_model("qwen_image", "tiny", 0)
    with torch.device("meta"):
        meta = make_model("qwen_image", "tiny", 0)
    for name in ("text_encoder", "transformer", "vae"):
        module = getattr(built, name)
        assert sum(p.numel() for p in module.parameters()) == sum(
            p.numel() for p in getattr(meta, name).parameters()
        )
        assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
        assert not any(p.requires_grad for p in module.parameters()) and not module.training
        state, twin, own = (
            module.state_dict(),
            getattr(again, name).state_dict(),
            getattr(plain, name).state_dict(),
        )
        assert all(torch.equal(state[k], twin[k]) for k in state)
        assert all(torch.equal(state[k], own[k].to(state[k].dtype)) for k in state)
        assert all(t.device.type == "cpu" for t in state.values())
    theirs = other.transformer.state_dict()
    assert not torch.equal(built.transformer.state_dict()["proj_out.weight"], theirs["proj_out.weight"])
    rope = built.transformer.pos_embed.pos_freqs  # computed by the constructor, not a weight
    assert rope.device.type == "cpu" and torch.equal(rope, plain.transformer.pos_embed.pos_freqs)


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_size_has_consistent_widths(size: str) -> None:
    spec = SIZES[size]
    assert spec.t5_width >= sum(spec.clip_widths)
    assert spec.t5_width % spec.t5_heads == 0
    assert all(width % spec.clip_depth(i)[1] == 0 for i, width in enumerate(spec.clip_widths))
    assert all(channels % spec.vae_groups == 0 for channels in spec.vae_channels)
    assert all(0 <= layer < spec.layers for layer in spec.dual_attention_layers)
    assert spec.sample_size % 2 == 0
    assert spec.pos_embed_max_size * 2 >= spec.sample_size


@pytest.mark.slow
def test_small_builds_and_takes_a_128px_step(tmp_path: Path, offline: None) -> None:
    summary = init_model("sd3", tmp_path / "small", size="small", seed=0)
    assert summary["details"]["image_size"] == 128
    pipeline = load_pipeline(tmp_path / "small")
    image = pipeline(OCR_PROMPT, num_inference_steps=1, guidance_scale=1.0, max_sequence_length=16).images[0]
    assert image.size == (128, 128)
    assert sum(summary["parameters"].values()) > 20 * sum(
        init_model("sd3", tmp_path / "tiny", size="tiny", seed=0)["parameters"].values()
    )


def test_every_family_has_its_make_beside_its_build() -> None:
    """`make_model` (and so `omnirl plan`) finds each family's `make_X` beside its `build_X`."""
    import importlib

    from stages.models.factory import FAMILIES

    for family, target in FAMILIES.items():
        module, attribute = target.split(":")
        assert callable(
            getattr(importlib.import_module(module), "make_" + attribute.removeprefix("build_"))
        ), family
