"""Wan image-to-video (stages/models/wan_i2v.py): the adapter's velocity is `WanImageToVideoPipeline`'s own
(first-frame VAE condition cut from 81 frames to the sample's, CLIP image embeddings, true CFG; Wan 2.2 I2V
A14B's two experts with their own guidance), the rollout replays exactly from the stored first frames, the
LoRA is Flow-Factory's layout and round-trips through the stock loader, and the inputs the model cannot
take are one-line errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PROMPTS, fails, ins, run
from PIL import Image
from safetensors.torch import load_file
from transformers.utils import logging as transformers_logging

from stages.models.diffusion import FlowPolicy
from stages.models.folders import LORA_WEIGHTS
from stages.sample.rollout import SampleConfig, rollout_batch

transformers_logging.disable_progress_bar()


def frame(seed: int, size: tuple[int, int] = (32, 32)) -> Image.Image:
    """A random RGB image (width, height)."""
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype(np.uint8))


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "wan-i2v"
    summary = run("init-model", "--family", "wan2_1_i2v", "--size", "tiny", str(out))
    assert summary["family"] == "wan2_1_i2v" and summary["pipeline_class"] == "WanImageToVideoPipeline"
    return out


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("i2v-prompts")
    rows = []
    for i, prompt in enumerate(PROMPTS):
        frame(i).save(folder / f"first{i}.png")
        rows.append({"prompt": prompt, "image": f"first{i}.png"})
    path = folder / "i2v.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("frames", [5, 9])
def test_ode_rollout_equals_the_stock_pipeline(tiny: Path, frames: int) -> None:
    from diffusers import WanImageToVideoPipeline, WanPipeline

    policy = FlowPolicy.load(tiny)
    cfg = SampleConfig(
        steps=3,
        guidance=4.0,
        resolution=32,
        frames=frames,
        sampler="ode",
        batch_size=2,
        max_sequence_length=64,
    )

    def ours(image: Image.Image) -> torch.Tensor:
        return rollout_batch(
            policy, cfg, PROMPTS[:2], ["", ""], [1, 2], [1, 2], groups=[0, 1], sample_ids=["a", "b"],
            images=[[png(image)]] * 2,
        )["final_latent"]  # fmt: skip

    pipe = WanImageToVideoPipeline.from_pretrained(tiny)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():  # diffusers 0.42's I2V text cleaning needs ftfy: its (identical) T2V encoding
        embeds = WanPipeline._get_t5_prompt_embeds(pipe, prompt=list(PROMPTS[:2]), max_sequence_length=64)
        negative = WanPipeline._get_t5_prompt_embeds(pipe, prompt=["", ""], max_sequence_length=64)
    x_t = policy.initial_noise([1, 2], 32, frames)
    theirs = pipe(
        image=frame(0), prompt_embeds=embeds, negative_prompt_embeds=negative, latents=x_t.clone(),
        num_inference_steps=3, guidance_scale=4.0, height=32, width=32, num_frames=frames, output_type="latent",
    ).frames  # fmt: skip
    mine = ours(frame(0))
    assert mine.shape == (2, 16, (frames - 1) // 4 + 1, 4, 4)
    # the condition encoded once for 81 frames and cut equals the pipeline's for this frame count
    assert (mine - theirs).abs().max().item() == 0.0
    assert (ours(frame(7)) - mine).abs().max().item() > 1e-4  # the first frame acts


def test_rollout_replays_exactly_and_trains(tiny: Path, table: Path, tmp_path: Path) -> None:
    from diffusers import WanImageToVideoPipeline

    run(
        "sample", "--model", str(tiny), "--prompts", str(table), "-n", "2", "--steps", "4", "--batch-size", "3",
        "--resolution", "32", "--frames", "5", "--guidance", "4", "--sde-window", "2", "--out", str(tmp_path / "s"),
    )  # fmt: skip
    replay = run("logprob", "--model", str(tiny), "--in", str(tmp_path / "s"), "--out", str(tmp_path / "lp"))
    assert replay["abs_delta_count"] > 0 and replay["abs_delta_max"] == 0.0
    run(
        "score",
        "--in",
        str(tmp_path / "s"),
        "--reward",
        "jpeg_compressibility@frames=mean",
        "--out",
        str(tmp_path / "r"),
    )
    run("advantage", *ins(tmp_path / "s", tmp_path / "r"), "--out", str(tmp_path / "a"))
    out = tmp_path / "policy"
    result = run(
        "update", "--model", str(tiny), *ins(tmp_path / "s", tmp_path / "lp", tmp_path / "a"), "--lora-rank", "4",
        "--lora-alpha", "8", "--lr", "1e-3", "--out", str(out),
    )  # fmt: skip
    assert result["optimizer_steps"] >= 1 and result["conditioning"] == "stored"
    trained = load_file(out / LORA_WEIGHTS)
    assert max(v.abs().max().item() for k, v in trained.items() if "lora_B" in k) > 0  # it moved
    pipe = WanImageToVideoPipeline.from_pretrained(tiny)
    pipe.load_lora_weights(str(out), adapter_name="default")
    ours = FlowPolicy.load(tiny, adapter=out)
    loaded = {n: p for n, p in ours.module.named_parameters() if "lora_" in n}
    stock = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert loaded.keys() == stock.keys() and all(torch.equal(v, stock[n]) for n, v in loaded.items())


def test_the_lora_is_flow_factorys_layout(tiny: Path) -> None:
    policy = FlowPolicy.load(tiny)
    policy.add_lora(rank=4, alpha=8)
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.module.named_parameters() if ".lora_A." in n}
    # per block: self- and cross-attention q/k/v/out and the two feed-forward layers; not the image add_k/v
    assert len(wrapped) == 10 * policy.module.config.num_layers
    assert not any("add_" in n for n in wrapped)


def test_bad_first_frames_exit_2_with_one_line(tiny: Path, table: Path, tmp_path: Path) -> None:
    def sample(prompts: Path, resolution: str = "32") -> list[str]:
        return [
            "sample", "--model", str(tiny), "--prompts", str(prompts), "-n", "2", "--steps", "2",
            "--resolution", resolution, "--frames", "5", "--out", str(tmp_path / "out"),
        ]  # fmt: skip

    def rows(*records: dict) -> Path:
        path = table.parent / f"t{len(list(table.parent.glob('t*.jsonl')))}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path

    frame(1, (40, 32)).save(table.parent / "odd.png")
    fails(sample(rows({"prompt": "x"})), "wan2_1_i2v edits a source image", "none")
    fails(
        sample(rows({"prompt": "x", "images": ["first0.png", "first1.png"]})), "2 condition images", "takes 1"
    )
    fails(sample(rows({"prompt": "x", "image": "odd.png"})), "40x32 px", "multiple of 16")
    fails(sample(table, "64"), "--resolution 64x64", "32x32 px", "at the output size")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def a14b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "wan-a14b-i2v"
    summary = run("init-model", "--family", "wan2_2_a14b_i2v", "--size", "tiny", str(out))
    assert summary["family"] == "wan2_2_a14b_i2v" and summary["pipeline_class"] == "WanImageToVideoPipeline"
    return out


def test_a14b_i2v_equals_the_stock_pipeline_across_the_expert_switch(a14b: Path) -> None:
    from diffusers import WanImageToVideoPipeline, WanPipeline

    policy = FlowPolicy.load(a14b)
    assert policy.family.name == "wan2_2_a14b_i2v" and policy.family.trained_modules() == (
        "transformer",
        "transformer_2",
    )
    cfg = SampleConfig(
        steps=4, guidance=4.0, guidance_2=2.5, resolution=32, frames=5, sampler="ode", batch_size=2,
        max_sequence_length=64,
    )  # fmt: skip
    mine = rollout_batch(
        policy, cfg, PROMPTS[:2], ["", ""], [1, 2], [1, 2], groups=[0, 1], sample_ids=["a", "b"],
        images=[[png(frame(3))]] * 2,
    )["final_latent"]  # fmt: skip
    pipe = WanImageToVideoPipeline.from_pretrained(a14b)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        embeds = WanPipeline._get_t5_prompt_embeds(pipe, prompt=list(PROMPTS[:2]), max_sequence_length=64)
        negative = WanPipeline._get_t5_prompt_embeds(pipe, prompt=["", ""], max_sequence_length=64)
    sigmas = policy.sigmas(4, 32)
    assert (sigmas[:-1] * 1000 >= 900).any() and (sigmas[:-1] * 1000 < 900).any()  # both experts run
    theirs = pipe(
        image=frame(3), prompt_embeds=embeds, negative_prompt_embeds=negative,
        latents=policy.initial_noise([1, 2], 32, 5), num_inference_steps=4, guidance_scale=4.0,
        guidance_scale_2=2.5, height=32, width=32, num_frames=5, output_type="latent",
    ).frames  # fmt: skip
    assert (mine - theirs).abs().max().item() == 0.0


def test_a14b_i2v_replays_exactly_with_a_window_across_the_switch(
    a14b: Path, table: Path, tmp_path: Path
) -> None:
    window = ("--sde-window", "3", "--window-strategy", "fixed", "--window-start", "0")
    run(
        "sample", "--model", str(a14b), "--prompts", str(table), "-n", "2", "--steps", "4", "--batch-size", "3",
        "--resolution", "32", "--frames", "5", "--guidance", "4", "--guidance-2", "2.5", *window,
        "--out", str(tmp_path / "s"),
    )  # fmt: skip
    replay = run("logprob", "--model", str(a14b), "--in", str(tmp_path / "s"), "--out", str(tmp_path / "lp"))
    assert replay["abs_delta_count"] > 0 and replay["abs_delta_max"] == 0.0
