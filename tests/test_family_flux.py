"""What is particular to FLUX.1 (stages/models/flux.py): the adapter reproduces `FluxPipeline`'s own
denoising loop and schedule exactly, the tiny build loads with the stock pipeline and carries the
reference trainer's LoRA layout, and the inputs FLUX cannot take are one-line errors. The invariants
every family shares (replay, LoRA/full round trips, every --algo) run in tests/test_families.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PROMPTS, fails, run
from transformers.utils import logging as transformers_logging

from stages.models.diffusion import FlowPolicy
from stages.models.flux import FLUX_LORA_TARGETS
from stages.models.packing import pack, unpack
from stages.sample.rollout import SampleConfig, rollout_batch

# transformers was imported before the CLI could silence its loading bars (a real `omnirl` process sets
# the variables first); turn them off so stderr holds only omnirl's own lines.
transformers_logging.disable_progress_bar()


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.1-dev-like build (guidance embedding), through the CLI."""
    out = tmp_path_factory.mktemp("models") / "flux-tiny"
    summary = run("init-model", "--family", "flux", "--size", "tiny", str(out))
    assert summary["family"] == "flux" and summary["pipeline_class"] == "FluxPipeline"
    return out


@pytest.fixture(scope="module")
def guidance_free_flux(tiny_flux: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model without a guidance embedding (as FLUX.1-schnell is built)."""
    from diffusers import FluxTransformer2DModel

    out = tmp_path_factory.mktemp("models") / "flux-no-guidance"
    shutil.copytree(tiny_flux, out)
    transformer = FluxTransformer2DModel.from_pretrained(tiny_flux / "transformer", guidance_embeds=False)
    transformer.save_pretrained(out / "transformer")
    return out


def stock_pipeline(
    model: Path, x_t: torch.Tensor, steps: int, guidance: float, resolution: int, output_type: str
):
    """`FluxPipeline.__call__` from the unpacked noise x_t: (its output, the pipeline)."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        list(PROMPTS[:2]),
        latents=pack(x_t),
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=resolution,
        width=resolution,
        output_type=output_type,
        max_sequence_length=128,
    ).images
    return images, pipe


def stock_final_latents(model: Path, x_t: torch.Tensor, steps: int, guidance: float, resolution: int):
    """The stock pipeline's final latents, unpacked [B, 16, h, w], and the pipeline."""
    packed, pipe = stock_pipeline(model, x_t, steps, guidance, resolution, "latent")
    return unpack(packed, *x_t.shape[-2:]), pipe


def ode_rollout(policy: FlowPolicy, steps: int, guidance: float, resolution: int) -> torch.Tensor:
    cfg = SampleConfig(steps=steps, guidance=guidance, resolution=resolution, sampler="ode", batch_size=2)
    return rollout_batch(
        policy, cfg, PROMPTS[:2], ["", ""], [1, 2], [1, 2], groups=[0, 1], sample_ids=["a", "b"]
    )["final_latent"]


@pytest.mark.parametrize("guidance", [3.5, 1.0])
def test_ode_rollout_equals_the_stock_pipeline_with_distilled_guidance(
    tiny_flux: Path, guidance: float
) -> None:
    policy = FlowPolicy.load(tiny_flux)
    ours = ode_rollout(policy, 3, guidance, 32)
    theirs, _ = stock_final_latents(tiny_flux, policy.initial_noise([1, 2], 32), 3, guidance, 32)
    assert ours.shape == (2, 16, 8, 8)
    assert (ours - theirs).abs().max().item() == 0.0
    other = ode_rollout(policy, 3, 2.0, 32)
    assert (other - ours).abs().max().item() > 1e-4  # the guidance embedding acts


def test_ode_rollout_equals_the_stock_pipeline_without_guidance_embedding(guidance_free_flux: Path) -> None:
    policy = FlowPolicy.load(guidance_free_flux)
    assert not policy.module.config.guidance_embeds
    ours = ode_rollout(policy, 2, 1.0, 32)
    theirs, _ = stock_final_latents(guidance_free_flux, policy.initial_noise([1, 2], 32), 2, 1.0, 32)
    assert (ours - theirs).abs().max().item() == 0.0


@pytest.mark.parametrize("resolution", [32, 64])
def test_sigmas_are_the_pipelines_own_dynamic_shift_schedule(tiny_flux: Path, resolution: int) -> None:
    policy = FlowPolicy.load(tiny_flux)
    ours = policy.sigmas(3, resolution)
    side = resolution // 4
    _, pipe = stock_final_latents(tiny_flux, policy.initial_noise([1, 2], resolution), 3, 3.5, resolution)
    assert torch.equal(ours, pipe.scheduler.sigmas)
    # the published formula: μ linear in the packed length L (0.5 at 256, 1.15 at 4096), then
    # σ ↦ e^μ / (e^μ + 1/t − 1) on t = linspace(1, 1/N, N)
    length = (side // 2) ** 2
    mu = 0.5 + (length - 256) * (1.15 - 0.5) / (4096 - 256)
    expected = [math.exp(mu) / (math.exp(mu) + 1 / t - 1) for t in (1.0, 2 / 3, 1 / 3)] + [0.0]
    torch.testing.assert_close(ours, torch.tensor(expected), rtol=0, atol=1e-6)


def test_sigmas_match_flow_grpos_golden_values(tiny_flux: Path) -> None:
    # 256 px on the tiny 4x VAE is L = 1024 packed tokens, as 512 px on FLUX.1's 8x VAE:
    # μ = 0.63, N = 6 (shared/reference/diffusion-rl.md §0)
    golden = [1, 0.903736, 0.789705, 0.652489, 0.484218, 0.273003, 0]
    torch.testing.assert_close(
        FlowPolicy.load(tiny_flux).sigmas(6, 256), torch.tensor(golden), rtol=0, atol=1e-6
    )


def test_init_model_loads_with_the_stock_pipeline_and_takes_the_reference_lora(tiny_flux: Path) -> None:
    from diffusers import FluxPipeline, FluxTransformer2DModel

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    assert isinstance(pipe.transformer, FluxTransformer2DModel) and pipe.transformer.config.guidance_embeds
    assert pipe.vae.config.scaling_factor == 0.3611 and pipe.vae.config.shift_factor == 0.1159
    assert pipe.scheduler.config.use_dynamic_shifting
    card = json.loads((tiny_flux / "omnirl_model.json").read_text())
    assert card["details"]["latent_shape"] == [16, 16, 16]
    policy = FlowPolicy.load(tiny_flux)
    policy.add_lora(rank=4, alpha=8)
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.module.named_parameters() if ".lora_A." in n}
    # flow_grpo's list: 12 projections per double-stream block, q/k/v of each single-stream block
    config = policy.module.config
    assert len(wrapped) == 12 * config.num_layers + 3 * config.num_single_layers
    assert not any(n.endswith(("proj_mlp", "proj_out")) for n in wrapped)
    assert {t for t in FLUX_LORA_TARGETS if any(n.endswith(t) for n in wrapped)} == set(FLUX_LORA_TARGETS)


def test_decode_is_the_pipelines_and_encode_inverts_its_normalisation(tiny_flux: Path) -> None:
    policy = FlowPolicy.load(tiny_flux)
    final = ode_rollout(policy, 2, 3.5, 32)
    theirs, _ = stock_pipeline(tiny_flux, policy.initial_noise([1, 2], 32), 2, 3.5, 32, "pil")
    ours = policy.decode(final)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(ours, theirs))
    # decode(encode(image)) is the VAE's own reconstruction: the (z − 0.1159)·0.3611 normalisation cancels
    vae, processor = policy.pipe.vae, policy.pipe.image_processor
    with torch.no_grad():
        z = vae.encode(processor.preprocess(theirs, height=32, width=32)).latent_dist.mode()
        reconstruction = processor.postprocess(vae.decode(z).sample, output_type="np")
    latents = policy.encode_images(theirs, 32)
    assert latents.shape == final.shape
    torch.testing.assert_close(latents, (z - 0.1159) * 0.3611)
    back = np.stack([np.asarray(im, dtype=np.float64) / 255 for im in policy.decode(latents)])
    assert np.abs(back - reconstruction).max() <= 1 / 255 + 1e-6


def test_bad_inputs_exit_2_with_one_line(tiny_flux: Path, guidance_free_flux: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")

    def sample(model: Path, prompt_file: Path, *extra: str) -> list[str]:
        return [
            "sample", "--model", str(model), "--prompts", str(prompt_file), "-n", "2", "--steps", "2",
            "--batch-size", "2", "--out", str(tmp_path / "out"), *extra,
        ]  # fmt: skip

    fails(sample(tiny_flux, prompts, "--resolution", "36", "--guidance", "3.5"), "--resolution 36", "8")
    negatives = tmp_path / "negatives.jsonl"
    negatives.write_text(json.dumps({"prompt": "a red apple", "negative_prompt": "blurry"}) + "\n")
    fails(
        sample(tiny_flux, negatives, "--resolution", "32", "--guidance", "3.5"), "negative_prompt", "blurry"
    )
    fails(sample(guidance_free_flux, prompts, "--resolution", "32", "--guidance", "3.5"), "--guidance 3.5")
    assert not (tmp_path / "out").exists()
