"""FLUX.2 [dev] and [klein] (stages/models/flux2.py): the adapters' velocity is `Flux2Pipeline`'s and
`Flux2KleinPipeline`'s own, from text alone and with reference images; references round-trip through the
rollout; the LoRA is Flow-Factory's layout; the inputs the model cannot take are one-line errors. The
invariants every family shares run in tests/test_families.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PROMPTS, fails, run
from PIL import Image
from transformers.utils import logging as transformers_logging

from stages.models.diffusion import FlowPolicy
from stages.models.flux2 import pack_tokens
from stages.sample.rollout import SampleConfig, rollout_batch

transformers_logging.disable_progress_bar()

KINDS = {"flux2": "Flux2Pipeline", "flux2_klein": "Flux2KleinPipeline"}


def picture(colour: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> Image.Image:
    """A black image (width, height) with a coloured square in the middle."""
    pixels = np.zeros((size[1], size[0], 3), np.uint8)
    pixels[size[1] // 4 : 3 * size[1] // 4, size[0] // 4 : 3 * size[0] // 4] = colour
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=sorted(KINDS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / request.param
    summary = run("init-model", "--family", request.param, "--size", "tiny", str(out))
    assert summary["family"] == request.param and summary["pipeline_class"] == KINDS[request.param]
    return out


@pytest.mark.parametrize("references", [0, 1, 2])
def test_ode_rollout_equals_the_stock_pipeline(tiny: Path, references: int) -> None:
    from diffusers import DiffusionPipeline

    policy = FlowPolicy.load(tiny)
    guidance = 4.0  # dev: the distilled scale; klein base: true CFG against ""
    cfg = SampleConfig(
        steps=3, guidance=guidance, resolution=32, sampler="ode", batch_size=2, max_sequence_length=64
    )
    # references of two sizes (one above the 64 px minimum, one not a multiple of 8: cropped as the pipeline)
    sources = [picture((255, 0, 0), (64, 64)), picture((0, 0, 255), (72, 68))][:references]

    def ours(images: list[Image.Image]) -> torch.Tensor:
        return rollout_batch(
            policy, cfg, PROMPTS[:2], ["", ""], [1, 2], [1, 2], groups=[0, 1], sample_ids=["a", "b"],
            images=[[png(i) for i in images]] * 2,
        )["final_latent"]  # fmt: skip

    pipe = DiffusionPipeline.from_pretrained(tiny)
    pipe.set_progress_bar_config(disable=True)
    x_t = policy.initial_noise([1, 2], 32)
    final = {}
    pipe(
        image=sources or None, prompt=list(PROMPTS[:2]), latents=x_t, num_inference_steps=3,
        guidance_scale=guidance, height=32, width=32, output_type="latent", max_sequence_length=64,
        callback_on_step_end=lambda p, i, t, kw: final.update(kw) or kw,
    )  # fmt: skip
    mine = ours(sources)
    assert mine.shape == (2, 128, 4, 4)
    assert (pack_tokens(mine) - final["latents"]).abs().max().item() == 0.0
    if references:  # the references act
        other = [picture((0, 200, 0), s.size) for s in sources]
        assert (ours(other) - mine).abs().max().item() > 1e-4


def test_decode_is_the_stock_pipelines(tiny: Path) -> None:
    from diffusers import DiffusionPipeline

    policy = FlowPolicy.load(tiny)
    pipe = DiffusionPipeline.from_pretrained(tiny)
    pipe.set_progress_bar_config(disable=True)
    x_t = policy.initial_noise([5], 32)
    final = {}
    (theirs,) = pipe(
        prompt=PROMPTS[0], latents=x_t, num_inference_steps=2, guidance_scale=1.0, height=32, width=32,
        max_sequence_length=64, callback_on_step_end=lambda p, i, t, kw: final.update(kw) or kw,
    ).images  # fmt: skip
    x0 = final["latents"].transpose(1, 2).reshape(1, 128, 4, 4)
    (mine,) = policy.decode(x0)
    assert np.array_equal(np.asarray(mine), np.asarray(theirs))
    # the VAE's batch-norm statistics are not the identity (the published ones are not): decode uses them
    assert float(pipe.vae.bn.running_mean.abs().max()) > 0.05
    assert policy.encode_images([mine], 32).shape == x0.shape


def test_a_step_distilled_klein_runs_one_forward_at_guidance_1(tiny: Path, tmp_path: Path) -> None:
    if tiny.name != "flux2_klein":
        pytest.skip("is_distilled is klein's")
    import shutil

    distilled = tmp_path / "klein-distilled"
    shutil.copytree(tiny, distilled)
    index = json.loads((distilled / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    policy = FlowPolicy.load(distilled)
    assert not policy.needs_negative(4.0)
    x = policy.initial_noise([1], 32)
    cond = policy.encode(PROMPTS[:1], None, False, 64)
    v = policy.velocity(x, policy.sigmas(2, 32)[0], cond, 1.0)
    assert v.shape == x.shape
    fails(
        ["sample", "--model", str(distilled), "--prompts", str(_prompts(tmp_path)), "-n", "2", "--steps", "2",
         "--resolution", "32", "--guidance", "4", "--out", str(tmp_path / "out")],
        "--guidance 4", "step-distilled", "pass --guidance 1",
    )  # fmt: skip


def _prompts(folder: Path) -> Path:
    path = folder / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def test_references_round_trip_through_the_rollout_and_replay_is_exact(tiny: Path, tmp_path: Path) -> None:
    rows = []
    for i, prompt in enumerate(PROMPTS):
        picture((80 * i, 255 - 80 * i, 40)).save(tmp_path / f"ref{i}.png")
        picture((40, 80 * i, 255 - 80 * i)).save(tmp_path / f"style{i}.png")
        rows.append({"prompt": prompt, "images": [f"ref{i}.png", f"style{i}.png"]})
    table = tmp_path / "refs.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(
        "sample", "--model", str(tiny), "--prompts", str(table), "-n", "2", "--steps", "3", "--batch-size", "2",
        "--resolution", "32", "--guidance", "4", "--out", str(tmp_path / "samples"),
    )  # fmt: skip
    replay = run(
        "logprob", "--model", str(tiny), "--in", str(tmp_path / "samples"), "--out", str(tmp_path / "lp")
    )
    assert replay["abs_delta_count"] > 0 and replay["abs_delta_max"] == 0.0


def test_the_lora_is_flow_factorys_layout(tiny: Path) -> None:
    policy = FlowPolicy.load(tiny)
    policy.add_lora(rank=4, alpha=8)
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.module.named_parameters() if ".lora_A." in n}
    config = policy.module.config
    # 12 per double-stream block; the fused QKV+MLP input projection of each single-stream block
    assert len(wrapped) == 12 * config.num_layers + config.num_single_layers
    assert {n.split(".attn.")[-1] for n in wrapped if n.startswith("single_")} == {"to_qkv_mlp_proj"}


def test_bad_references_exit_2_with_one_line(tiny: Path, tmp_path: Path) -> None:
    def sample(prompts: Path, *extra: str) -> list[str]:
        return [
            "sample", "--model", str(tiny), "--prompts", str(prompts), "-n", "2", "--steps", "2",
            "--resolution", "32", "--guidance", "4", *extra, "--out", str(tmp_path / "out"),
        ]  # fmt: skip

    def rows(*records: dict) -> Path:
        path = tmp_path / f"t{len(list(tmp_path.glob('t*.jsonl')))}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path

    picture((255, 0, 0), (32, 32)).save(tmp_path / "small.png")
    picture((255, 0, 0)).save(tmp_path / "ok.png")
    fails(
        sample(rows({"prompt": "x", "image": "small.png"})), "condition image 0 (32x32 px)", "at least 64px"
    )
    eleven = rows({"prompt": "x", "images": ["ok.png"] * 11})
    fails(sample(eleven), "11 condition images", "takes 0 to 10")
    mixed = rows({"prompt": "x", "image": "ok.png"}, {"prompt": "y"})
    fails(
        sample(mixed, "--batch-size", "4"), "2 reference-image layouts", "--batch-size 1", "--micro-batch 1"
    )
    assert not (tmp_path / "out").exists()


def test_online_trains_on_policy_on_text_and_reference_rows(tiny: Path, tmp_path: Path) -> None:
    rows = [{"prompt": PROMPTS[0]}]  # text-to-image and editing rows in one run (batch size 1)
    for i, prompt in enumerate(PROMPTS[1:]):
        picture((80 * i, 255 - 80 * i, 40)).save(tmp_path / f"ref{i}.png")
        rows.append({"prompt": prompt, "image": f"ref{i}.png"})
    table = tmp_path / "mixed.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        "sample: {steps: 3, guidance: 4.0, resolution: 32, sampler: sde, group_size: 2, batch_size: 1}\n"
        "update: {algo: flow_grpo, lr: 1.0e-3, clip_range: 0.2, lora_rank: 4, lora_alpha: 8}\n"
    )
    run(
        "online", "--config", str(preset), "--model", str(tiny), "--prompts", str(table),
        "--reward", "jpeg_compressibility", "--iterations", "1", "--save-trajectories", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    metrics = [
        json.loads(x)
        for x in (tmp_path / "run" / "it1" / "policy" / "metrics.jsonl").read_text().splitlines()
    ]
    # the trainer conditions each row on its group's references (or none), as the sampler did: on-policy
    assert metrics[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    replay = run(
        "logprob",
        "--model",
        str(tiny),
        "--in",
        str(tmp_path / "run" / "it0" / "samples"),
        "--out",
        str(tmp_path / "lp"),
    )
    assert replay["conditioning"] == "stored"  # online saved what its sampler encoded: nothing re-encoded
    assert replay["abs_delta_max"] == 0.0
