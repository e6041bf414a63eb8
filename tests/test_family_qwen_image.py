"""What is particular to Qwen-Image (stages/models/qwen_image.py): the adapter reproduces
`QwenImagePipeline`'s own denoising loop (padded, masked text; norm-rescaled true CFG) and its dynamic-shift
schedule exactly, the tiny build loads with the stock pipeline, drops exactly its system template and carries
verl-omni's LoRA layout, and a resolution it cannot take is a one-line error. The invariants every family
shares (replay, LoRA/full round trips, every --algo) run in tests/test_families.py."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PROMPTS, fails, run
from PIL import Image

from stages.models.diffusion import FlowPolicy
from stages.models.packing import pack, unpack
from stages.models.qwen_image import QWEN_IMAGE_LORA_TARGETS
from stages.sample.rollout import SampleConfig, rollout_batch

LONG = "a photo of a cat and a dog on a bench next to a tall tree"  # longer than PROMPTS: the batch pads


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "qwen-image-tiny"
    summary = run("init-model", "--family", "qwen_image", "--size", "tiny", str(out))
    assert summary["family"] == "qwen_image" and summary["pipeline_class"] == "QwenImagePipeline"
    return out


def stock_pipe(model: Path):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stock_call(pipe, prompts, negatives, x_t, steps, guidance, output_type="latent"):
    """`QwenImagePipeline.__call__` from the unpacked noise x_t [B, 16, h, w] (copies of the prompt lists)."""
    side = x_t.shape[-1] * pipe.vae_scale_factor
    return pipe(
        list(prompts),
        negative_prompt=None if negatives is None else list(negatives),
        true_cfg_scale=guidance,
        latents=pack(x_t),
        num_inference_steps=steps,
        height=side,
        width=side,
        output_type=output_type,
        max_sequence_length=128,
    ).images


def ode_rollout(policy: FlowPolicy, prompts, negatives, steps: int, guidance: float) -> dict:
    n = len(prompts)
    cfg = SampleConfig(steps=steps, guidance=guidance, resolution=32, sampler="ode", batch_size=n)
    seeds = list(range(1, n + 1))
    return rollout_batch(
        policy,
        cfg,
        prompts,
        negatives,
        seeds,
        seeds,
        groups=list(range(n)),
        sample_ids=[str(s) for s in seeds],
    )


@pytest.mark.parametrize(
    ("guidance", "negatives"),
    [
        (4.0, ["", "blurry, low quality", "", ""]),  # CFG, both branches padded and masked
        (4.0, ["", "", "", ""]),  # CFG, negatives of one length: the pipeline passes no mask for them
        (1.0, None),  # no CFG: one conditional forward
    ],
)
def test_ode_rollout_equals_the_stock_pipeline(tiny_qwen: Path, guidance: float, negatives) -> None:
    prompts = [*PROMPTS, LONG]
    policy = FlowPolicy.load(tiny_qwen)
    ours = ode_rollout(policy, prompts, negatives or [""] * 4, 3, guidance)
    pipe = stock_pipe(tiny_qwen)
    x_t = policy.initial_noise([1, 2, 3, 4], 32)
    theirs = unpack(stock_call(pipe, prompts, negatives, x_t, 3, guidance), 8, 8)
    assert ours["final_latent"].shape == (4, 16, 8, 8)
    assert (ours["final_latent"] - theirs).abs().max().item() == 0.0
    # decoding is the pipeline's too: the same PNG pixels
    images = stock_call(pipe, prompts, negatives, x_t, 3, guidance, output_type="pil")
    for png, image in zip(ours["image"], images):
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), np.asarray(image))


def test_guidance_is_norm_rescaled_true_cfg(tiny_qwen: Path) -> None:
    policy = FlowPolicy.load(tiny_qwen)
    x = policy.initial_noise([7, 8], 32)
    sigma = policy.sigmas(3, 32)[1]
    cond = policy.encode(PROMPTS[:2], ["", "blurry"], cfg=True)
    with torch.no_grad():
        guided = policy.velocity(x, sigma, cond, 4.0)
        c = policy.velocity(x, sigma, cond, 1.0)
        u = policy.velocity(x, sigma, policy.encode(["", "blurry"], None, cfg=False), 1.0)
    combined = pack(u + 4.0 * (c - u))
    expected = combined * pack(c).norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(guided, unpack(expected, 8, 8), rtol=0, atol=1e-6)
    # each packed token keeps the conditional prediction's norm
    torch.testing.assert_close(pack(guided).norm(dim=-1), pack(c).norm(dim=-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize(("resolution", "steps"), [(32, 3), (64, 2), (256, 10)])
def test_sigmas_are_the_pipelines_own_schedule(tiny_qwen: Path, resolution: int, steps: int) -> None:
    policy = FlowPolicy.load(tiny_qwen)
    ours = policy.sigmas(steps, resolution)
    pipe = stock_pipe(tiny_qwen)
    stock_call(pipe, PROMPTS[:1], None, policy.initial_noise([1], resolution), steps, 1.0)
    assert torch.equal(ours, pipe.scheduler.sigmas)
    # the published formula: mu linear in the packed length L (0.5 at 256 tokens, 0.9 at 8192), the
    # exponential shift e^mu / (e^mu + 1/t − 1) on t = linspace(1, 1/N, N), stretched so the last is 0.02
    length = (resolution // 4 // 2) ** 2
    mu = 0.5 + (length - 256) * (0.9 - 0.5) / (8192 - 256)
    shifted = [math.exp(mu) / (math.exp(mu) + 1 / t - 1) for t in np.linspace(1, 1 / steps, steps)]
    scale = (1 - shifted[-1]) / (1 - 0.02)
    expected = [1 - (1 - s) / scale for s in shifted] + [0.0]
    torch.testing.assert_close(ours, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-6)


def test_two_steps_end_at_the_terminal_shift(tiny_qwen: Path) -> None:
    sigmas = FlowPolicy.load(tiny_qwen).sigmas(2, 32)
    assert sigmas.tolist() == pytest.approx([1.0, 0.02, 0.0], abs=1e-7)


def test_init_model_loads_with_the_stock_pipeline_and_drops_exactly_the_template(tiny_qwen: Path) -> None:
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    pipe = stock_pipe(tiny_qwen)
    assert isinstance(pipe.transformer, QwenImageTransformer2DModel)
    assert isinstance(pipe.vae, AutoencoderKLQwenImage) and pipe.vae_scale_factor == 4
    assert not pipe.text_encoder.training
    config = pipe.scheduler.config
    assert config.use_dynamic_shifting and config.shift_terminal == 0.02
    assert config.time_shift_type == "exponential" and (config.max_image_seq_len, config.max_shift) == (
        8192,
        0.9,
    )
    card = json.loads((tiny_qwen / "omnirl_model.json").read_text())
    assert card["details"]["latent_shape"] == [16, 8, 8] and card["details"]["image_size"] == 32
    # the system template is the 34 tokens the pipeline drops: what is left is the prompt and the
    # assistant header <|im_end|>\n<|im_start|>assistant\n (5 tokens)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    embeds, _ = pipe.encode_prompt(["a red apple"], device="cpu")
    assert embeds.shape[1] == len(pipe.tokenizer("a red apple").input_ids) + 5 == 8


def test_lora_targets_are_verl_omnis(tiny_qwen: Path) -> None:
    policy = FlowPolicy.load(tiny_qwen)
    policy.add_lora(rank=4, alpha=8)
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.module.named_parameters() if ".lora_A." in n}
    # 12 per block: both streams' q/k/v/out and both MLPs' two linears
    assert len(wrapped) == 12 * policy.module.config.num_layers == 24
    assert {t for t in QWEN_IMAGE_LORA_TARGETS if any(n.endswith(t) for n in wrapped)} == set(
        QWEN_IMAGE_LORA_TARGETS
    )


def test_image_round_trip_through_the_vae(tiny_qwen: Path) -> None:
    policy = FlowPolicy.load(tiny_qwen)
    x0 = policy.initial_noise([5, 6], 32) * 0.5
    images = policy.decode(x0)
    assert images[0].size == (32, 32)
    back = policy.encode_images(images, 32)
    assert back.shape == x0.shape and torch.isfinite(back).all()
    assert torch.equal(policy.encode_images(images, 32), back)  # the posterior mode, not a draw


def test_pack_is_the_pipelines_layout(tiny_qwen: Path) -> None:
    from diffusers import QwenImagePipeline

    x = torch.randn(2, 16, 8, 6)
    assert torch.equal(pack(x), QwenImagePipeline._pack_latents(x, 2, 16, 8, 6))
    assert torch.equal(unpack(pack(x), 8, 6), x)


def test_bad_inputs_exit_2_with_one_line(tiny_qwen: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    sample = [
        "sample", "--model", str(tiny_qwen), "--prompts", str(prompts), "-n", "2", "--steps", "2",
        "--batch-size", "2", "--guidance", "4", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    fails([*sample, "--resolution", "36"], "--resolution 36", "8")
    fails([*sample, "--resolution", "4"], "--resolution 4", "8")
    assert not (tmp_path / "out").exists()
    fails(["init-model", "--family", "qwen_image", "--size", "huge", str(tmp_path / "m")], "huge", "tiny")
