"""`omnirl pretrain`: rectified-flow loss, pixel VAE, determinism, the saved pipeline and its errors."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fails, run, runner
from PIL import Image

from omnirl_cli.app import app
from stages.errors import UserInputError
from stages.models.diffusion import FlowPolicy
from stages.models.families import Condition
from stages.pretrain.flow_matching import (
    PIXEL_SCALING_FACTOR,
    PretrainConfig,
    dataset_latents,
    family_shift,
    fit_pixel_vae,
    flow_matching_loss,
    pixel_latents,
    pretrain,
    shift_sigmas,
)
from stages.pretrain.images import read_image_dataset, to_signed
from stages.pretrain.resume import TrainingRun

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "recipes" / "tasks" / "shapes.py"


def weight_hashes(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*.safetensors"))
    }


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight `demo` SD3 (4 latent channels, 24 CLIP + 32 T5 tokens)."""
    from stages.models.factory import init_model

    out = tmp_path_factory.mktemp("models") / "sd3-demo"
    init_model("sd3", out, size="demo", seed=0)
    return out


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 captioned 64 px shapes images, prepared the documented way (recipes/tasks/shapes.py)."""
    spec = importlib.util.spec_from_file_location("omnirl_test_pretrain_shapes_task", TASK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = tmp_path_factory.mktemp("data") / "shapes"
    module.main(["--out", str(folder / "captions.jsonl"), "--num-prompts", "16", "--images", str(folder)])
    return folder


def test_demo_size_is_the_prototype_shape(demo: Path) -> None:
    policy = FlowPolicy.load(demo)
    transformer, vae = policy.pipe.transformer.config, policy.pipe.vae.config
    assert vae.latent_channels == transformer.in_channels == transformer.out_channels == 4
    assert transformer.pos_embed_max_size == 8 == transformer.sample_size // transformer.patch_size
    assert (vae.scaling_factor, vae.shift_factor) == (PIXEL_SCALING_FACTOR, 0.0)
    assert policy.latent_shape(64) == (4, 16, 16)
    assert (
        policy.pipe.tokenizer.model_max_length
        == policy.pipe.text_encoder.config.max_position_embeddings
        == 24
    )
    card = json.loads((demo / "omnirl_model.json").read_text())
    assert card["details"]["text_length"] == 32
    embeds = policy.encode(["a photo of a red circle"], None, False, card["details"]["text_length"]).pos[
        "embeds"
    ]
    assert embeds.shape == (1, 24 + 32, transformer.joint_attention_dim)
    assert family_shift(policy, 64) == 3.0


def test_pixel_latents_are_the_pooled_image_with_white_zero() -> None:
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (2, 3, 8, 12), generator=generator, dtype=torch.uint8)
    z = pixel_latents(to_signed(pixels), 4, 5)
    assert z.shape == (2, 5, 2, 3)
    expected = np.zeros((2, 5, 2, 3))
    unit = pixels.numpy().astype(np.float64) / 255.0
    for row in range(2):
        for col in range(3):
            block = unit[:, :, 4 * row : 4 * row + 4, 4 * col : 4 * col + 4]
            expected[:, :3, row, col] = block.mean(axis=(2, 3)) - 1.0
    np.testing.assert_allclose(z.numpy(), expected, atol=1e-6)
    white, black = (
        torch.full((1, 3, 4, 4), 255, dtype=torch.uint8),
        torch.zeros((1, 3, 4, 4), dtype=torch.uint8),
    )
    assert pixel_latents(to_signed(white), 4, 4).abs().max() == 0
    assert torch.equal(pixel_latents(to_signed(black), 4, 4)[0, :3], -torch.ones(3, 1, 1))


def test_shift_sigmas_is_sd3s_time_shift() -> None:
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    torch.testing.assert_close(shift_sigmas(t, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))
    torch.testing.assert_close(shift_sigmas(t, 1.0), t)


def test_flow_matching_loss_is_the_rectified_flow_mse(demo: Path) -> None:
    policy = FlowPolicy.load(demo)
    generator = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(3, 4, 16, 16, generator=generator), torch.randn(3, 4, 16, 16, generator=generator)
    sigma = torch.tensor([0.1, 0.5, 0.9])
    cond = policy.encode(["a photo of a circle", "", "a photo of two squares"], None, False, 32)
    loss = flow_matching_loss(policy, x0, noise, sigma, cond, 1.0)
    # Independently: the transformer as the SD3 pipeline calls it, on (1 − σ)·x0 + σ·ε, target ε − x0.
    x_sigma = (1 - sigma[:, None, None, None]) * x0 + sigma[:, None, None, None] * noise
    with torch.no_grad():
        v = policy.pipe.transformer(
            hidden_states=x_sigma,
            timestep=sigma * 1000,
            encoder_hidden_states=cond.pos["embeds"],
            pooled_projections=cond.pos["pooled"],
        ).sample
    expected = ((v - (noise - x0)) ** 2).sum() / v.numel()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_pretraining_lowers_the_loss_on_a_fixed_batch(demo: Path, shapes: Path) -> None:
    policy = FlowPolicy.load(demo)
    data = read_image_dataset(shapes)
    assert data.pixels.shape == (16, 3, 64, 64) and data.pixels.dtype == torch.uint8
    x0 = dataset_latents(policy, data, pixel=True)[:8]
    generator = torch.Generator().manual_seed(5)
    noise = torch.randn(x0.shape, generator=generator)
    sigma = shift_sigmas(torch.rand(8, generator=generator), 3.0)
    cond = policy.encode(data.captions[:8], None, False, 32)

    def fixed_batch_loss() -> float:
        with torch.no_grad():
            return float(flow_matching_loss(policy, x0, noise, sigma, Condition(cond.pos, None), 1.0))

    before = fixed_batch_loss()
    cfg = PretrainConfig(steps=40, batch_size=8, lr=2e-3, ema_decay=0.0, caption_dropout=0.0, seed=0)
    result = pretrain(policy, data, cfg)
    after = fixed_batch_loss()
    assert len(result.losses) == 40 and result.text_length == 32 and result.shift == 3.0
    assert after < 0.6 * before, (before, after)
    assert result.final_loss < result.first_loss
    assert not any(p.requires_grad for p in policy.module.parameters())


def test_pixel_vae_round_trips_rendered_shapes(demo: Path, shapes: Path) -> None:
    policy = FlowPolicy.load(demo)
    data = read_image_dataset(shapes)
    x = to_signed(data.pixels)
    z = pixel_latents(x, 4, 4)

    def round_trip_mse() -> float:
        with torch.no_grad():
            decoded = policy.pipe.vae.decode(z).sample.clamp(-1, 1)
        return float(((decoded - x) ** 2).mean())

    before = round_trip_mse()
    cfg = PretrainConfig(vae="pixel", vae_steps=200, vae_encoder_steps=100, vae_batch_size=2, vae_lr=2e-3)
    fit = fit_pixel_vae(policy.pipe.vae, data.pixels, cfg, TrainingRun(torch.Generator().manual_seed(0)))
    after = round_trip_mse()
    assert after < 0.05 and after < before / 20, (before, after)
    assert fit["decoder_steps"] == 200 and fit["encoder_mse"] < 0.01
    # The family's own encode path (posterior mean, then (z − shift)·scale) gives the scaled pixel latent.
    from PIL import Image

    images = [Image.fromarray(p.permute(1, 2, 0).numpy()) for p in data.pixels[:4]]
    encoded = policy.encode_images(images, 64)
    assert float(((encoded - PIXEL_SCALING_FACTOR * z[:4]) ** 2).mean()) < 0.1


def pretrain_args(demo: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "pretrain", "--model", str(demo), "--data", str(data), "--out", str(out), "--vae", "pixel",
        "--vae-steps", "6", "--vae-encoder-steps", "3", "--steps", "6", "--batch-size", "4", *extra,
    ]  # fmt: skip


def test_cli_saves_a_loadable_pipeline_that_samples_and_same_seed_same_bytes(
    demo: Path, shapes: Path, tmp_path: Path
) -> None:
    from diffusers import StableDiffusion3Pipeline

    result = run(*pretrain_args(demo, shapes, tmp_path / "a", "--seed", "3"))
    assert result["steps"] == 6 and result["text_length"] == 32 and result["rows"] == 16
    assert np.isfinite(result["final_loss"]) and result["vae_fit"]["decoder_steps"] == 6

    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "a")
    assert pipe.vae.config.scaling_factor == PIXEL_SCALING_FACTOR
    card = json.loads((tmp_path / "a" / "omnirl_model.json").read_text())
    record = card["details"]["pretrain"]
    assert (card["family"], card["size"], card["details"]["text_length"]) == ("sd3", "demo", 32)
    assert (
        record["base_model"] == str(demo) and record["config"]["seed"] == 3 and record["data"]["rows"] == 16
    )
    assert record["final_loss"] == result["final_loss"] and "pixel_vae" in card["details"]
    assert not list(tmp_path.glob(".*partial"))

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a red circle\na photo of two squares\n")
    sampled = run(
        "sample", "--model", str(tmp_path / "a"), "--prompts", str(prompts), "-n", "1", "--steps", "2",
        "--resolution", "64", "--out", str(tmp_path / "samples"),
    )  # fmt: skip
    assert sampled["rows"] == 2

    run(*pretrain_args(demo, shapes, tmp_path / "b", "--seed", "3"))
    run(*pretrain_args(demo, shapes, tmp_path / "c", "--seed", "4"))
    same, other = weight_hashes(tmp_path / "b"), weight_hashes(tmp_path / "c")
    assert same == weight_hashes(tmp_path / "a")
    assert (
        other["transformer/diffusion_pytorch_model.safetensors"]
        != same["transformer/diffusion_pytorch_model.safetensors"]
    )
    assert other["vae/diffusion_pytorch_model.safetensors"] != same["vae/diffusion_pytorch_model.safetensors"]

    # Continuing from a pixel-VAE output keeps its VAE byte for byte with --vae-steps 0.
    run(
        *pretrain_args(tmp_path / "a", shapes, tmp_path / "d", "--vae-steps", "0", "--vae-encoder-steps", "0")
    )
    assert (
        weight_hashes(tmp_path / "d")["vae/diffusion_pytorch_model.safetensors"]
        == (same["vae/diffusion_pytorch_model.safetensors"])
    )
    assert (
        json.loads((tmp_path / "d" / "omnirl_model.json").read_text())["details"]["pretrain"]["previous"]
        == record
    )


def test_bad_arguments_exit_2_with_one_line(demo: Path, shapes: Path, tmp_path: Path) -> None:
    fails(pretrain_args(demo, tmp_path / "missing", tmp_path / "o"), "--data", "recipes/tasks/shapes.py")
    fails(pretrain_args(demo, shapes, tmp_path / "o", "--vae", "latent"), "--vae latent", "pixel")
    fails(pretrain_args(demo, shapes, tmp_path / "o", "--caption-dropout", "1.5"), "--caption-dropout")
    fails(pretrain_args(demo, shapes, tmp_path / "o", "--steps", "0"), "--steps")
    fails(pretrain_args(demo, shapes, tmp_path / "o", "--vae-steps", "0"), "--vae-steps 0", "pixel_vae")
    fails(pretrain_args(demo, shapes, tmp_path / "o", "--batch-size", "17"), "--batch-size 17", "16 images")
    fails(
        pretrain_args(demo, shapes, tmp_path / "o", "--vae-batch-size", "17"),
        "--vae-batch-size 17",
        "at most 16",
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    fails(pretrain_args(demo, shapes, tmp_path / "full"), "--out", "not an empty directory")
    fails(pretrain_args(tmp_path, shapes, tmp_path / "o"), "--model", "model_index.json")

    uneven = tmp_path / "uneven"
    uneven.mkdir()
    for png in sorted(shapes.glob("*.png"))[:3]:
        (uneven / png.name).write_bytes(png.read_bytes())
    (uneven / "captions.jsonl").write_text('{"prompt": "a photo of a circle"}\n')
    fails(pretrain_args(demo, uneven, tmp_path / "o"), "3 PNG files", "1 caption rows")
    (uneven / "captions.jsonl").write_text("{oops\n")
    fails(pretrain_args(demo, uneven, tmp_path / "o"), "captions.jsonl:1", "not valid JSON")
    assert not (tmp_path / "o").exists()


def test_rows_may_name_their_image_files(shapes: Path, tmp_path: Path) -> None:
    folder = tmp_path / "named"
    folder.mkdir()
    files = sorted(shapes.glob("*.png"))
    (folder / "b.png").write_bytes(files[0].read_bytes())
    (folder / "a.png").write_bytes(files[1].read_bytes())
    rows = [{"file_name": "b.png", "caption": "first"}, {"file_name": "a.png", "text": "second"}]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = read_image_dataset(folder)
    assert data.captions == ["first", "second"]
    reference = read_image_dataset(shapes)
    assert torch.equal(data.pixels, reference.pixels[:2])
    (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "../x.png", "prompt": "p"}) + "\n")
    with pytest.raises(UserInputError, match="not a file in"):
        read_image_dataset(folder)


def test_sampling_encodes_the_models_text_length_and_replay_reads_it(demo: Path, tmp_path: Path) -> None:
    from stages.shards.reader import ShardSet

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\ntwo blue squares\n")
    samples, logprobs = tmp_path / "samples", tmp_path / "logprobs"
    run("sample", "--model", str(demo), "--prompts", str(prompts), "-n", "2", "--steps", "3", "--resolution", "64",
        "--guidance", "1", "--out", str(samples))  # fmt: skip
    recorded = ShardSet(samples).manifest.extra["sample_config"]
    assert recorded["max_sequence_length"] == 32  # the card's text_length, not 128
    run("logprob", "--model", str(demo), "--in", str(samples), "--out", str(logprobs))
    rolled = ShardSet(samples).read_all(columns=["log_probs"])["log_probs"]
    assert torch.equal(ShardSet(logprobs).read_all()["old_log_probs"], rolled)  # replay at the same length


def _killed_child(args: list[str], saves: int) -> None:
    """Run in a subprocess: `omnirl ARGS` on one thread, killed by SIGKILL in its `saves`-th checkpoint
    save, once the new checkpoint is written in full to its temp folder but before it is swapped in."""
    from stages.pretrain import resume

    torch.set_num_threads(1)  # as the tests (conftest): the thread count changes the float rounding
    swap, count = resume.replace_dir, 0

    def dying_swap(tmp: Path, out: Path) -> None:
        nonlocal count
        count += 1
        if count == saves:
            os.kill(os.getpid(), signal.SIGKILL)
        swap(tmp, out)

    resume.replace_dir = dying_swap
    app(args)


def kill_in_save(args: list[str], saves: int) -> None:
    code = (
        f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]; import test_pretrain as t; "
        f"t._killed_child({args!r}, {saves})"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]


def checkpoint_at(folder: Path) -> tuple[str, int]:
    state = json.loads((folder / "state.json").read_text())
    return state["phase"], state["step"]


def test_a_killed_run_resumes_to_the_bytes_of_an_uninterrupted_one(
    demo: Path, shapes: Path, tmp_path: Path
) -> None:
    whole = tmp_path / "whole"
    assert run(*pretrain_args(demo, shapes, whole))["resumed_from"] is None
    out = tmp_path / "out"
    args = pretrain_args(demo, shapes, out, "--checkpoint-every", "2")
    checkpoint = tmp_path / ".out.checkpoint"
    # checkpoints: vae decoder steps 2 4 6, vae encoder 2 3, transformer 2 4 6
    kill_in_save(args, 2)  # killed swapping in decoder step 4's: decoder step 2's stays
    assert checkpoint_at(checkpoint) == ("vae decoder", 2)
    assert len(list(tmp_path.glob("..out.checkpoint.tmp-*"))) == 1 and not out.exists()
    kill_in_save(args, 6)  # resumed; killed swapping in transformer step 4's (its 6th save)
    assert checkpoint_at(checkpoint) == ("transformer", 2)
    assert len(list(tmp_path.glob("..out.checkpoint.tmp-*"))) == 1 and not out.exists()

    fails([*args, "--lr", "0.001"], f"--out {out}", "--lr 0.002, not 0.001", "--overwrite")
    fails([*args, "--seed", "1"], "--seed 0, not 1")
    # another K is the same run: it resumes, from the middle of the transformer phase
    result = run(*args, "--checkpoint-every", "5")
    assert result["resumed_from"] == {"phase": "transformer", "step": 2} and result["steps"] == 6
    assert file_hashes(out) == file_hashes(whole)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_overwrite_discards_a_checkpoint_of_other_settings(
    demo: Path, shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.pretrain import resume

    swap = resume.replace_dir

    def interrupted_swap(tmp: Path, out: Path) -> None:
        swap(tmp, out)
        raise KeyboardInterrupt

    monkeypatch.setattr(resume, "replace_dir", interrupted_swap)
    out = tmp_path / "out"
    args = pretrain_args(demo, shapes, out, "--checkpoint-every", "2", "--steps", "3")
    assert runner.invoke(app, args).exit_code == 130
    monkeypatch.setattr(resume, "replace_dir", swap)
    assert checkpoint_at(tmp_path / ".out.checkpoint") == ("vae decoder", 2)
    fails([*args, "--steps", "4"], "--steps 3, not 4", "--overwrite")
    other = tmp_path / "other"  # the same images, one caption changed
    shutil.copytree(shapes, other)
    rows = (other / "captions.jsonl").read_text().splitlines()
    rows[0] = json.dumps({"prompt": "a photo of a pink circle"})
    (other / "captions.jsonl").write_text("\n".join(rows) + "\n")
    fails(
        pretrain_args(demo, other, out, "--checkpoint-every", "2", "--steps", "3"),
        "another --data",
        "--overwrite",
    )
    result = run(*args, "--steps", "4", "--overwrite")
    assert result["resumed_from"] is None and result["steps"] == 4
    card = json.loads((out / "omnirl_model.json").read_text())
    assert card["details"]["pretrain"]["config"]["steps"] == 4
    assert not (tmp_path / ".out.checkpoint").exists()


def test_pretrain_trains_at_the_native_resolution_the_model_card_records(
    demo: Path, shapes: Path, tmp_path: Path
) -> None:
    """The demo card records 64 px: 32 px images are resized to it (pretrain took the first image's
    width), unless --resolution says otherwise."""
    small = tmp_path / "small"
    small.mkdir()
    shutil.copy(shapes / "captions.jsonl", small / "captions.jsonl")
    for png in sorted(shapes.glob("*.png")):
        with Image.open(png) as image:
            image.resize((32, 32)).save(small / png.name)
    for extra, side in (([], 64), (["--resolution", "32"], 32)):
        out = tmp_path / f"side{side}"
        args = ["--steps", "1", "--batch-size", "2", "--checkpoint-every", "0", *extra]
        run("pretrain", "--model", str(demo), "--data", str(small), "--out", str(out), *args)
        card = json.loads((out / "omnirl_model.json").read_text())
        assert card["details"]["image_size"] == side
        assert card["details"]["latent_shape"] == [4, side // 4, side // 4]


def test_an_editing_model_pretrains_on_pairs_conditioned_on_the_source(demo: Path, tmp_path: Path) -> None:
    """Rows with an `image` column are edit pairs: flux_kontext learns the result given the source (other
    sources, other weights; the same, the same bytes); a text-to-image model refuses them and an editing
    model refuses captions without a source, each in one line."""
    data = tmp_path / "pairs"
    task = REPO / "recipes" / "tasks" / "shape_edits.py"
    subprocess.run(
        [sys.executable, str(task), "--out", str(data / "edits.jsonl"), "--num-prompts", "8", "--targets"],
        check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    kontext = tmp_path / "kontext"
    run("init-model", "--family", "flux_kontext", "--size", "tiny", str(kontext))
    args = ("--vae", "model", "--steps", "3", "--batch-size", "4", "--text-length", "8")
    first = run("pretrain", "--model", str(kontext), "--data", str(data), "--out", str(tmp_path / "a"), *args)
    assert first["rows"] == 8 and first["steps"] == 3
    run("pretrain", "--model", str(kontext), "--data", str(data), "--out", str(tmp_path / "b"), *args)
    assert weight_hashes(tmp_path / "a" / "transformer") == weight_hashes(tmp_path / "b" / "transformer")
    # the same captions and results over blank sources: another dataset, and other weights
    blank = tmp_path / "blank"
    shutil.copytree(data, blank)
    for source in (blank / "sources").iterdir():
        Image.new("RGB", (64, 64), "white").save(source)
    other = run(
        "pretrain", "--model", str(kontext), "--data", str(blank), "--out", str(tmp_path / "c"), *args
    )
    card = json.loads((tmp_path / "a" / "omnirl_model.json").read_text())["details"]["pretrain"]
    blank_card = json.loads((tmp_path / "c" / "omnirl_model.json").read_text())["details"]["pretrain"]
    assert (
        card["data"]["sha256"] != blank_card["data"]["sha256"] and other["final_loss"] != first["final_loss"]
    )
    assert weight_hashes(tmp_path / "a" / "transformer") != weight_hashes(tmp_path / "c" / "transformer")
    fails(pretrain_args(demo, data, tmp_path / "d"), "condition image")
    captions = tmp_path / "captions"
    captions.mkdir()
    for row in range(8):
        shutil.copy(data / f"{row:05d}.png", captions / f"{row:05d}.png")
    (captions / "captions.jsonl").write_text(
        "".join(
            json.dumps({"prompt": json.loads(line)["prompt"]}) + "\n"
            for line in (data / "edits.jsonl").read_text().splitlines()
        )
    )
    fails(
        ["pretrain", "--model", str(kontext), "--data", str(captions), "--out", str(tmp_path / "e"), *args],
        "edits a source image",
    )
