"""Wan image-to-video (stages/models/wan_i2v.py): the adapter's velocity is `WanImageToVideoPipeline`'s own
(first-frame VAE condition cut from 81 frames to the sample's, CLIP image embeddings, true CFG; Wan 2.2 I2V
A14B's two experts with their own guidance; TI2V-5B's image as latent frame 0 with per-token timesteps), the
rollout replays exactly from the stored first frames, the LoRA is Flow-Factory's layout and round-trips
through the stock loader, and the inputs the model cannot take are one-line errors."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PROMPTS, fails, ins, run, torchrun
from PIL import Image
from safetensors.torch import load_file
from transformers.utils import logging as transformers_logging

from stages.models.diffusion import FlowPolicy
from stages.models.folders import LORA_WEIGHTS
from stages.sample.rollout import SampleConfig, rollout_batch
from stages.shards import ShardSet, read_manifest

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


def first_frames(folder: Path, side: int) -> Path:
    """A prompt table of PROMPTS, each with its own random first frame of `side` px."""
    rows = []
    for i, prompt in enumerate(PROMPTS):
        frame(i, (side, side)).save(folder / f"first{i}.png")
        rows.append({"prompt": prompt, "image": f"first{i}.png"})
    path = folder / "i2v.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return first_frames(tmp_path_factory.mktemp("i2v-prompts"), 32)


def ours_and_stock(
    model: Path, resolution: int, frames: int, image: Image.Image
) -> tuple[Callable[[Image.Image], torch.Tensor], torch.Tensor]:
    """omnirl's ODE rollout of `model` (2 prompts, 3 steps, CFG 4) as a function of the condition image,
    and the stock `WanImageToVideoPipeline.__call__`'s final latents for `image` from the same noise."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    policy = FlowPolicy.load(model)
    cfg = SampleConfig(
        steps=3, guidance=4.0, resolution=resolution, frames=frames, sampler="ode", batch_size=2,
        max_sequence_length=64,
    )  # fmt: skip

    def ours(condition: Image.Image) -> torch.Tensor:
        return rollout_batch(
            policy, cfg, PROMPTS[:2], ["", ""], [1, 2], [1, 2], groups=[0, 1], sample_ids=["a", "b"],
            images=[[png(condition)]] * 2,
        )["final_latent"]  # fmt: skip

    pipe = WanImageToVideoPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():  # diffusers 0.42's I2V text cleaning needs ftfy: its (identical) T2V encoding
        embeds = WanPipeline._get_t5_prompt_embeds(pipe, prompt=list(PROMPTS[:2]), max_sequence_length=64)
        negative = WanPipeline._get_t5_prompt_embeds(pipe, prompt=["", ""], max_sequence_length=64)
    theirs = pipe(
        image=image, prompt_embeds=embeds, negative_prompt_embeds=negative,
        latents=policy.initial_noise([1, 2], resolution, frames), num_inference_steps=3, guidance_scale=4.0,
        height=resolution, width=resolution, num_frames=frames, output_type="latent",
    ).frames  # fmt: skip
    return ours, theirs


@pytest.mark.parametrize("frames", [5, 9])
def test_ode_rollout_equals_the_stock_pipeline(tiny: Path, frames: int) -> None:
    ours, theirs = ours_and_stock(tiny, 32, frames, frame(0))
    mine = ours(frame(0))
    assert mine.shape == (2, 16, (frames - 1) // 4 + 1, 4, 4)
    # the condition encoded once for 81 frames and cut equals the pipeline's for this frame count
    assert (mine - theirs).abs().max().item() == 0.0
    assert (ours(frame(7)) - mine).abs().max().item() > 1e-4  # the first frame acts


def staged_run(model: Path, table: Path, root: Path, resolution: int) -> dict[str, Path]:
    """One staged iteration: sample (SDE, a 2-step window) → score → logprob (with means) → advantage."""
    paths = {k: root / k for k in ("samples", "rewards", "logprobs", "advantages")}
    run(
        "sample", "--model", str(model), "--prompts", str(table), "-n", "2", "--steps", "4", "--batch-size", "3",
        "--resolution", str(resolution), "--frames", "5", "--guidance", "4", "--sde-window", "2",
        "--out", str(paths["samples"]),
    )  # fmt: skip
    run("score", "--in", str(paths["samples"]), "--reward", "jpeg_compressibility@frames=mean",
        "--out", str(paths["rewards"]))  # fmt: skip
    replay = run("logprob", "--model", str(model), "--in", str(paths["samples"]), "--means",
                 "--out", str(paths["logprobs"]))  # fmt: skip
    assert replay["abs_delta_count"] > 0 and replay["abs_delta_max"] == 0.0  # the replay is exact
    run("advantage", *ins(paths["samples"], paths["rewards"]), "--out", str(paths["advantages"]))
    return {"model": model, **paths}


@pytest.fixture(scope="module")
def i2v_run(tiny: Path, table: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return staged_run(tiny, table, tmp_path_factory.mktemp("i2v-run"), 32)


def update(
    i2v_run: dict[str, Path], out: Path, *extra: str, inputs=("samples", "logprobs", "advantages")
) -> dict:
    return run(
        "update", "--model", str(i2v_run["model"]), *ins(*(i2v_run[k] for k in inputs)), "--lora-rank", "4",
        "--lora-alpha", "8", "--lr", "1e-3", "--out", str(out), *extra,
    )  # fmt: skip


def test_the_lora_round_trips_through_the_stock_loader(
    i2v_run: dict[str, Path], table: Path, tmp_path: Path
) -> None:
    from diffusers import WanImageToVideoPipeline

    out = tmp_path / "policy"
    result = update(i2v_run, out)
    assert result["optimizer_steps"] >= 1 and result["conditioning"] == "stored"
    trained = load_file(out / LORA_WEIGHTS)
    assert max(v.abs().max().item() for k, v in trained.items() if "lora_B" in k) > 0  # it moved
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_run["model"])
    pipe.load_lora_weights(str(out), adapter_name="default")
    ours = FlowPolicy.load(i2v_run["model"], adapter=out)
    loaded = {n: p for n, p in ours.module.named_parameters() if "lora_" in n}
    stock = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert loaded.keys() == stock.keys() and all(torch.equal(v, stock[n]) for n, v in loaded.items())
    # the trained policy samples its own clips: a re-sample under it replays exactly
    run(
        "sample", "--model", str(i2v_run["model"]), "--adapter", str(out), "--prompts", str(table), "-n", "2",
        "--steps", "4", "--resolution", "32", "--frames", "5", "--guidance", "4", "--out", str(tmp_path / "again"),
    )  # fmt: skip
    replay = run(
        "logprob", "--model", str(i2v_run["model"]), "--adapter", str(out), "--in", str(tmp_path / "again"),
        "--out", str(tmp_path / "lp"),
    )  # fmt: skip
    assert replay["abs_delta_max"] == 0.0


def test_full_weights_reload(i2v_run: dict[str, Path], tmp_path: Path) -> None:
    update(i2v_run, tmp_path / "full", "--full")
    trained = FlowPolicy.load(i2v_run["model"], adapter=tmp_path / "full")
    base = dict(FlowPolicy.load(i2v_run["model"]).module.named_parameters())
    assert any(not torch.equal(p, base[n]) for n, p in trained.module.named_parameters())


@pytest.mark.parametrize("staged", ["i2v_run", "ti2v_run"])
@pytest.mark.parametrize("algo", ["flow_grpo", "dance_grpo", "mix_grpo", "grpo_guard", "nft", "awm", "dpo"])
def test_every_algorithm_trains(
    request: pytest.FixtureRequest, staged: str, tmp_path: Path, algo: str
) -> None:
    inputs = {"dpo": ("samples", "rewards"), "grpo_guard": ("samples", "advantages", "logprobs")}
    result = update(
        request.getfixturevalue(staged),
        tmp_path / "policy",
        "--algo",
        algo,
        inputs=inputs.get(algo, ("samples", "logprobs", "advantages")),
    )
    assert result["optimizer_steps"] >= 1
    assert all(np.isfinite(v) for v in result["last"].values() if isinstance(v, float))


@pytest.mark.distributed
def test_two_ranks_equal_one_process(i2v_run: dict[str, Path], tmp_path: Path) -> None:
    common = ["--no-shuffle", "--micro-batch", "1"]
    update(i2v_run, tmp_path / "one", *common, "--grad-accum", "2")
    torchrun(
        "update", "--model", str(i2v_run["model"]),
        *ins(i2v_run["samples"], i2v_run["logprobs"], i2v_run["advantages"]), "--lora-rank", "4", "--lora-alpha",
        "8", "--lr", "1e-3", "--out", str(tmp_path / "two"), *common, "--grad-accum", "1",
    )  # fmt: skip
    one, two = load_file(tmp_path / "one" / LORA_WEIGHTS), load_file(tmp_path / "two" / LORA_WEIGHTS)
    assert one.keys() == two.keys()
    for k in one:  # as tests/test_families.py: DDP sums the same gradients in another order
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5)


def test_online_trains_on_policy_on_the_first_frames(tiny: Path, table: Path, tmp_path: Path) -> None:
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        "sample: {steps: 4, guidance: 4.0, resolution: 32, frames: 5, sampler: sde, sde_window: 2, group_size: 2,"
        " batch_size: 3}\n"
        "update: {algo: flow_grpo, lr: 1.0e-3, clip_range: 0.2, lora_rank: 4, lora_alpha: 8}\n"
    )
    run(
        "online", "--config", str(preset), "--model", str(tiny), "--prompts", str(table),
        "--reward", "jpeg_compressibility@frames=mean", "--iterations", "1", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    metrics = [
        json.loads(x)
        for x in (tmp_path / "run" / "it1" / "policy" / "metrics.jsonl").read_text().splitlines()
    ]
    # the trainer conditions each row on its group's first frame, as the sampler did: on-policy
    assert metrics[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)


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


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "wan-ti2v"
    summary = run("init-model", "--family", "wan2_2_5b_i2v", "--size", "tiny", str(out))
    assert summary["family"] == "wan2_2_5b_i2v" and summary["pipeline_class"] == "WanImageToVideoPipeline"
    return out


@pytest.fixture(scope="module")
def ti2v_table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return first_frames(tmp_path_factory.mktemp("ti2v-prompts"), 64)


@pytest.fixture(scope="module")
def ti2v_run(ti2v: Path, ti2v_table: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return staged_run(ti2v, ti2v_table, tmp_path_factory.mktemp("ti2v-run"), 64)


def test_ti2v_equals_the_stock_pipeline(ti2v: Path) -> None:
    """TI2V-5B with an image: the image's latent as frame 0, timestep 0 on its tokens (`expand_timesteps`)."""
    assert FlowPolicy.load(ti2v).family.name == "wan2_2_5b_i2v"
    ours, theirs = ours_and_stock(ti2v, 64, 9, frame(0, (64, 64)))
    mine = ours(frame(0, (64, 64)))
    assert mine.shape == (2, 48, 3, 4, 4)
    assert (mine - theirs).abs().max().item() == 0.0
    other = ours(frame(7, (64, 64)))
    assert (other[:, :, 1:] - mine[:, :, 1:]).abs().max().item() > 1e-4  # the image conditions the rest


def test_ti2v_given_frame_is_no_action_of_the_policy(ti2v: Path) -> None:
    """The given frame's velocity is 0 whatever x holds there, and the other frames do not read x's frame 0."""
    policy = FlowPolicy.load(ti2v)
    cond = policy.encode(PROMPTS[:1], None, True, 64, [[png(frame(0, (64, 64)))]])
    x = policy.initial_noise([3], 64, 9)
    moved = x.clone()
    moved[:, :, 0] += 5.0
    v, w = (policy.velocity(z, torch.tensor(0.6), cond, 4.0) for z in (x, moved))
    assert v[:, :, 0].abs().max().item() == 0.0 and v[:, :, 1:].abs().max().item() > 0
    assert torch.equal(v, w)


def test_ti2v_lora_round_trips_through_the_stock_loader(ti2v_run: dict[str, Path], tmp_path: Path) -> None:
    from diffusers import WanImageToVideoPipeline

    out = tmp_path / "policy"
    assert update(ti2v_run, out)["optimizer_steps"] >= 1
    trained = load_file(out / LORA_WEIGHTS)
    assert max(v.abs().max().item() for k, v in trained.items() if "lora_B" in k) > 0  # it moved
    pipe = WanImageToVideoPipeline.from_pretrained(ti2v_run["model"])
    pipe.load_lora_weights(str(out), adapter_name="default")
    ours = FlowPolicy.load(ti2v_run["model"], adapter=out)
    loaded = {n: p for n, p in ours.module.named_parameters() if "lora_" in n}
    stock = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert (
        loaded and loaded.keys() == stock.keys() and all(torch.equal(v, stock[n]) for n, v in loaded.items())
    )


def test_ti2v_bad_first_frames_exit_2_with_one_line(ti2v: Path, ti2v_table: Path, tmp_path: Path) -> None:
    def sample(prompts: Path, resolution: str = "64") -> list[str]:
        return [
            "sample", "--model", str(ti2v), "--prompts", str(prompts), "-n", "2", "--steps", "2",
            "--resolution", resolution, "--frames", "5", "--out", str(tmp_path / "out"),
        ]  # fmt: skip

    def rows(name: str, *records: dict) -> Path:
        path = ti2v_table.parent / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path

    frame(1, (48, 64)).save(ti2v_table.parent / "odd.png")
    # checked before the model loads, naming the family its model_index.json makes it
    fails(sample(rows("none.jsonl", {"prompt": "x"})), "wan2_2_5b_i2v edits a source image", "none")
    fails(sample(rows("odd.jsonl", {"prompt": "x", "image": "odd.png"})), "48x64 px", "multiple of 32")
    fails(sample(ti2v_table, "128"), "--resolution 128x128", "64x64 px", "at the output size")
    assert not (tmp_path / "out").exists()


def test_a14b_i2v_row_without_its_image_names_a14b(a14b: Path, ti2v_table: Path, tmp_path: Path) -> None:
    rows = ti2v_table.parent / "a14b-none.jsonl"
    rows.write_text(json.dumps({"prompt": "x"}) + "\n")
    line = fails(
        ["sample", "--model", str(a14b), "--prompts", str(rows), "-n", "2", "--resolution", "32", "--frames",
         "5", "--out", str(tmp_path / "out")],
        "wan2_2_a14b_i2v edits a source image",
    )  # fmt: skip
    assert "wan2_1_i2v" not in line


@pytest.fixture(scope="module")
def ti2v_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny TI2V-5B as Wan-AI/Wan2.2-TI2V-5B-Diffusers ships it: model_index.json names WanPipeline."""
    out = tmp_path_factory.mktemp("models") / "wan-ti2v-release"
    run("init-model", "--family", "wan2_2_5b", "--size", "tiny", str(out))
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True
    return out


def test_the_ti2v_release_folder_says_how_to_sample_from_images(
    ti2v_release: Path, ti2v: Path, ti2v_table: Path, tmp_path: Path
) -> None:
    """Rows with an image on the released folder (WanPipeline) are refused in one line that gives the step
    that makes its image-to-video pipeline; that step's folder samples from the images as wan2_2_5b_i2v,
    with the weights of `init-model --family wan2_2_5b_i2v` (the same seed builds the same transformer)."""
    import re
    import shutil
    import subprocess
    import sys

    def sample(model: Path, out: str) -> list[str]:
        return [
            "sample", "--model", str(model), "--prompts", str(ti2v_table), "-n", "2", "--steps", "2",
            "--resolution", "64", "--frames", "5", "--sampler", "ode", "--out", str(tmp_path / out),
        ]  # fmt: skip

    line = fails(
        sample(ti2v_release, "refused"), "wan2_2_5b generates from text alone", "WanImageToVideoPipeline"
    )
    assert not (tmp_path / "refused").exists()
    step = re.search(r'python -c "([^"]+)"', line).group(1)
    converted = tmp_path / "ti2v-i2v"
    subprocess.run(
        [sys.executable, "-c", step.replace("MODEL", str(ti2v_release)).replace("OUT", str(converted))],
        check=True,
    )
    assert (
        json.loads((converted / "model_index.json").read_text())["_class_name"] == "WanImageToVideoPipeline"
    )
    assert FlowPolicy.load(converted).family.name == "wan2_2_5b_i2v"
    # the tiny build's model card (its text length, 64; a release has none) is omnirl's, not diffusers'
    shutil.copy(ti2v_release / "omnirl_model.json", converted)
    for model in (converted, ti2v):
        run(*sample(model, model.name))
    ours, built = (ShardSet(tmp_path / m.name) for m in (converted, ti2v))
    assert read_manifest(ours.path).extra["family"] == "wan2_2_5b_i2v"
    mine, theirs = (s.read_all(["final_latent"])["final_latent"] for s in (ours, built))
    assert mine.shape == (2 * len(PROMPTS), 48, 2, 4, 4) and torch.equal(mine, theirs)
