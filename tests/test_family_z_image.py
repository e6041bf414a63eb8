"""What is particular to Z-Image: the adapter's denoising loop is the stock `ZImagePipeline.__call__` (list
inputs, reversed timestep, negated output, `pos + w·(pos − neg)` CFG), its σ schedule is the pipeline's
(a linspace list shifted by the scheduler, dynamic `mu` from the patch count), the tiny build loads with
`from_pretrained`, and the inputs it cannot take are one-line errors. The shared invariants (replay,
LoRA, every --algo, 2 ranks) run in tests/test_families.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PROMPTS, fails, run
from transformers.utils import logging as transformers_logging

from stages.models.diffusion import FlowPolicy

# transformers was imported before the CLI could silence its loading bars (a real `omnirl` process sets
# the variables first); turn them off so stderr holds only omnirl's own lines.
transformers_logging.disable_progress_bar()
NEGATIVES = ["", "blurry, low quality"]


@pytest.fixture(scope="module")
def tiny_z_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stages.models.factory import init_model

    out = tmp_path_factory.mktemp("models") / "z_image-tiny"
    init_model("z_image", out, size="tiny", seed=0)
    return out


def stock_pipeline(model: Path):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("guidance", [0.0, 1.0, 3.0])
def test_ode_rollout_equals_the_stock_pipeline(tiny_z_image: Path, guidance: float) -> None:
    from stages.sample.rollout import SampleConfig, rollout_batch

    policy = FlowPolicy.load(tiny_z_image)
    cfg = SampleConfig(steps=3, guidance=guidance, resolution=32, sampler="ode", batch_size=2)
    prompts = PROMPTS[:2]  # captions of different lengths: padded and masked in one batch
    ours = rollout_batch(
        policy, cfg, prompts, NEGATIVES, [1, 2], [1, 2], groups=[0, 1], sample_ids=["a", "b"]
    )
    pipe = stock_pipeline(tiny_z_image)
    call = dict(
        latents=policy.initial_noise([1, 2], 32),
        num_inference_steps=3,
        guidance_scale=guidance,
        height=32,
        width=32,
        max_sequence_length=cfg.max_sequence_length,
    )
    # fresh lists per call: the pipeline rewrites its prompt lists in place
    theirs = pipe(list(prompts), negative_prompt=list(NEGATIVES), output_type="latent", **call).images
    assert torch.equal(ours["final_latent"], theirs.float())  # max |Δ| = 0.0 in fp32
    images = pipe(list(prompts), negative_prompt=list(NEGATIVES), output_type="np", **call).images
    decoded = np.stack([np.asarray(im) for im in policy.decode(ours["final_latent"])])
    assert np.array_equal(decoded, (images * 255).round().astype(np.uint8))


def test_guidance_runs_the_negative_branch_for_any_positive_w(tiny_z_image: Path) -> None:
    policy = FlowPolicy.load(tiny_z_image)
    assert not policy.needs_negative(0.0)
    assert policy.needs_negative(0.5) and policy.needs_negative(1.0)  # w = 1 is CFG here, not "off"
    cond = policy.encode(PROMPTS[:1], NEGATIVES[1:], cfg=True)
    x = policy.initial_noise([5], 32)
    sigma = torch.tensor(0.6)
    off, w1, w3 = (policy.velocity(x, sigma, cond, g) for g in (0.0, 1.0, 3.0))
    # v is linear in w: v(w) = v(0) + w·(v(1) − v(0))
    torch.testing.assert_close(w3, off + 3 * (w1 - off), rtol=0, atol=1e-5)
    assert (w1 - off).abs().max() > 1e-3


def test_sigmas_are_the_pipeline_schedule(tiny_z_image: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    policy = FlowPolicy.load(tiny_z_image)
    # shift 3 on linspace(1, 1/2, 2): 3σ/(1 + 2σ) at σ = 1/2 is 3/4
    torch.testing.assert_close(policy.sigmas(2, 32), torch.tensor([1.0, 0.75, 0.0]), rtol=0, atol=1e-7)
    pipe = stock_pipeline(tiny_z_image)
    for scheduler in (None, "dynamic"):
        if scheduler:  # a checkpoint whose scheduler shifts by resolution: mu from the patch count
            config = dict(pipe.scheduler.config, use_dynamic_shifting=True)
            pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
            policy.pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        for resolution, steps in ((32, 3), (64, 4)):
            sigmas = policy.sigmas(steps, resolution)
            pipe(
                "a red apple",
                num_inference_steps=steps,
                guidance_scale=0.0,
                height=resolution,
                width=resolution,
                output_type="latent",
                generator=torch.Generator().manual_seed(0),
            )
            assert torch.equal(sigmas, pipe.scheduler.sigmas)
            assert torch.equal(sigmas[:-1] * 1000, pipe.scheduler.timesteps)
    # 32 px → 8×8 latent → 16 patches: mu = 0.5 + (16 − 256)·0.65/3840; σ(1/2) = e^mu / (e^mu + 1)
    mu = 0.5 + (16 - 256) * 0.65 / 3840
    expected = math.exp(mu) / (math.exp(mu) + 1)
    assert policy.sigmas(2, 32)[1].item() == pytest.approx(expected, abs=1e-7)
    assert policy.sigmas(2, 64)[1].item() > expected  # more patches, more shift


def test_encoding_leaves_the_caller_prompts_alone(tiny_z_image: Path) -> None:
    """The pipeline's `_encode_prompt` rewrites its prompt list in place (chat template); the adapter
    hands it copies, so a caller's list (and a replay that re-encodes it) stays the raw prompts."""
    policy = FlowPolicy.load(tiny_z_image)
    prompts, negatives = list(PROMPTS[:2]), list(NEGATIVES)
    encoded = policy.family.encode_prompts(prompts, negatives, policy.device, 128)
    assert prompts == PROMPTS[:2] and negatives == NEGATIVES
    template = policy.pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=True,
    )
    assert template == f"<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n"
    length = len(policy.pipe.tokenizer(template).input_ids)
    assert encoded[0][0]["embeds"].shape == (length, policy.pipe.text_encoder.config.hidden_size)


def test_lora_targets_wrap_every_attention_projection(tiny_z_image: Path) -> None:
    policy = FlowPolicy.load(tiny_z_image)
    policy.add_lora(rank=2, alpha=4)
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.module.named_parameters() if ".lora_A." in n}
    config = policy.module.config
    blocks = config.n_layers + 2 * config.n_refiner_layers  # main, noise-refiner and context-refiner blocks
    assert len(wrapped) == 4 * blocks
    assert {n.split(".attention.")[1] for n in wrapped} == {"to_q", "to_k", "to_v", "to_out.0"}


def test_encode_images_is_the_inverse_normalisation_of_decode(tiny_z_image: Path) -> None:
    policy = FlowPolicy.load(tiny_z_image)
    images = policy.decode(policy.initial_noise([3, 4], 32))
    vae, processor = policy.pipe.vae, policy.pipe.image_processor
    with torch.no_grad():
        z = vae.encode(processor.preprocess(images, height=32, width=32)).latent_dist.mode()
    latents = policy.encode_images(images, 32)
    assert latents.shape == (2, 16, 8, 8)
    torch.testing.assert_close(latents, (z - 0.1159) * 0.3611, rtol=0, atol=1e-6)  # FLUX.1's VAE form
    # decoding them gives the VAE's own reconstruction: the normalisation cancels
    with torch.no_grad():
        reconstruction = processor.postprocess(vae.decode(z).sample, output_type="np")
    back = np.stack([np.asarray(im, dtype=np.float64) / 255 for im in policy.decode(latents)])
    assert np.abs(back - reconstruction).max() <= 1 / 255 + 1e-6


def test_init_model_folder_loads_with_from_pretrained(tmp_path: Path) -> None:
    from diffusers import ZImagePipeline

    out = tmp_path / "z"
    summary = run("init-model", "--family", "z_image", "--size", "tiny", str(out))
    assert summary["pipeline_class"] == "ZImagePipeline" and summary["details"]["resolution_multiple"] == 8
    pipe = ZImagePipeline.from_pretrained(out)
    assert type(pipe.text_encoder).__name__ == "Qwen3Model" and not pipe.text_encoder.training
    assert pipe.transformer.config.cap_feat_dim == pipe.text_encoder.config.hidden_size
    assert pipe.transformer.x_pad_token.abs().sum() > 0 and pipe.transformer.cap_pad_token.abs().sum() > 0
    assert FlowPolicy.load(out).latent_shape(32) == (16, 8, 8)


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--resolution", "36"], ["--resolution 36", "multiple of 8"]),
        (["--resolution", "32", "--guidance", "-1"], ["--guidance -1.0", ">= 0"]),
    ],
)
def test_inputs_the_family_cannot_take_exit_2(
    tiny_z_image: Path, tmp_path: Path, flags: list[str], names: list[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red apple\n")
    args = ["sample", "--model", str(tiny_z_image), "--prompts", str(prompts), "-n", "1", "--steps", "2"]
    fails([*args, *flags, "--out", str(tmp_path / "out")], *names)
    assert not (tmp_path / "out").exists()
