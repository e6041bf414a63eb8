"""What is particular to Wan 2.1 / 2.2 (stages/models/wan.py): the adapter reproduces `WanPipeline`'s own
denoising loop for the three variants (2.1; 2.2 TI2V-5B with its 48-channel VAE and per-token timesteps;
2.2 A14B with two experts switching at the boundary), rollouts on 5-D latents replay exactly through
`omnirl logprob`, including an SDE window across the expert switch, and a LoRA trained on both A14B
experts reloads through diffusers' own loaders and reproduces the frames."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PROMPTS, fails, ins, online_preset, run
from safetensors.torch import load_file, save_file

from stages.errors import UserInputError
from stages.models.diffusion import FlowPolicy
from stages.models.folders import LORA_WEIGHTS
from stages.sample.rollout import SampleConfig, rollout_batch
from stages.shards.reader import ShardSet

# init-model family → its tiny build's side in pixels (5 frames: 2 latent frames of 4×4)
SIDES = {"wan2_1": 32, "wan2_2_5b": 64, "wan2_2_a14b": 32}
FRAMES = 5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wan")
    built = {}
    for family in SIDES:
        summary = run("init-model", "--family", family, "--size", "tiny", str(root / family))
        assert summary["pipeline_class"] == "WanPipeline" and summary["family"] == family
        built[family] = root / family
    return built


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wan-prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def stock_pipe(model: Path):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stock_call(pipe, prompts, negatives, x_t, steps, guidance, side, output_type="latent", **kwargs):
    """`WanPipeline.__call__` from the noise x_t [B, C, F', h, w] (copies of the prompt lists); `side` is
    one side or (height, width)."""
    height, width = side if isinstance(side, tuple) else (side, side)
    return pipe(
        list(prompts),
        negative_prompt=list(negatives),
        height=height,
        width=width,
        num_frames=FRAMES,
        num_inference_steps=steps,
        guidance_scale=guidance,
        latents=x_t.clone(),
        output_type=output_type,
        max_sequence_length=64,
        **kwargs,
    ).frames


def ode_rollout(
    policy: FlowPolicy,
    side: int | tuple[int, int],
    steps: int,
    guidance: float,
    negatives: list[str],
    **cfg_kw,
) -> dict:
    n = len(negatives)
    cfg = SampleConfig(
        steps=steps,
        guidance=guidance,
        resolution=side,
        frames=FRAMES,
        sampler="ode",
        batch_size=n,
        max_sequence_length=64,
        **cfg_kw,
    )
    seeds = list(range(1, n + 1))
    return rollout_batch(
        policy,
        cfg,
        PROMPTS[:n],
        negatives,
        seeds,
        seeds,
        groups=list(range(n)),
        sample_ids=[str(s) for s in seeds],
    )


@pytest.mark.parametrize("family", sorted(SIDES))
def test_ode_rollout_equals_the_stock_pipeline(models: dict[str, Path], family: str) -> None:
    side = SIDES[family]
    policy = FlowPolicy.load(models[family])
    assert policy.family.name == family and policy.family.media == "video"
    negatives = ["", "blurry, low quality"]
    ours = ode_rollout(policy, side, 8, 5.0, negatives)
    pipe = stock_pipe(models[family])
    x_t = policy.initial_noise([1, 2], side, FRAMES)
    channels = 48 if family == "wan2_2_5b" else 16
    assert x_t.shape == (2, channels, 2, 4, 4)
    theirs = stock_call(pipe, PROMPTS[:2], negatives, x_t, 8, 5.0, side)
    assert (ours["final_latent"] - theirs).abs().max().item() == 0.0
    # decoding is the pipeline's: per sample a list of FRAMES PIL frames, pixel for pixel
    frames = policy.decode(ours["final_latent"])
    stock = stock_call(pipe, PROMPTS[:2], negatives, x_t, 8, 5.0, side, output_type="pil")
    assert [len(f) for f in frames] == [FRAMES, FRAMES] and frames[0][0].size == (side, side)
    for video, reference in zip(frames, stock):
        for frame, expected in zip(video, reference):
            assert np.array_equal(np.asarray(frame), np.asarray(expected))


@pytest.mark.parametrize("family", ["wan2_1", "wan2_2_5b"])
def test_a_non_square_clip_equals_the_stock_pipeline(models: dict[str, Path], family: str) -> None:
    """--resolution HxW: height 1×, width 2× the tiny side (flow_grpo's Wan samples 240x416), latents
    [C, F', h, 2h], the stock pipeline's final latent and frames exactly."""
    side = SIDES[family]
    size = (side, 2 * side)
    policy = FlowPolicy.load(models[family])
    negatives = ["", "blurry"]
    ours = ode_rollout(policy, f"{side}x{2 * side}", 4, 5.0, negatives)
    x_t = policy.initial_noise([1, 2], size, FRAMES)
    assert x_t.shape[-2:] == (4, 8)
    pipe = stock_pipe(models[family])
    theirs = stock_call(pipe, PROMPTS[:2], negatives, x_t, 4, 5.0, size)
    assert (ours["final_latent"] - theirs).abs().max().item() == 0.0
    frames = policy.decode(ours["final_latent"])
    stock = stock_call(pipe, PROMPTS[:2], negatives, x_t, 4, 5.0, size, output_type="pil")
    assert frames[0][0].size == (2 * side, side)  # PIL: (width, height)
    for video, reference in zip(frames, stock):
        for frame, expected in zip(video, reference):
            assert np.array_equal(np.asarray(frame), np.asarray(expected))


def test_a14b_low_noise_guidance_equals_the_stock_pipelines_guidance_scale_2(models: dict[str, Path]) -> None:
    """--guidance-2: the low-noise expert combines u + w₂(c − u), as `WanPipeline(guidance_scale_2=)`; unset,
    it is --guidance, the pipeline's own default."""
    model = models["wan2_2_a14b"]
    policy = FlowPolicy.load(model)
    negatives = ["", "blurry"]
    x_t = policy.initial_noise([1, 2], 32, FRAMES)
    pipe = stock_pipe(model)
    ours = ode_rollout(policy, 32, 8, 5.0, negatives, guidance_2=2.0)["final_latent"]
    theirs = stock_call(pipe, PROMPTS[:2], negatives, x_t, 8, 5.0, 32, guidance_scale_2=2.0)
    assert (ours - theirs).abs().max().item() == 0.0
    same = ode_rollout(policy, 32, 8, 5.0, negatives)["final_latent"]
    assert torch.equal(same, stock_call(pipe, PROMPTS[:2], negatives, x_t, 8, 5.0, 32, guidance_scale_2=5.0))
    assert (same - ours).abs().max().item() > 1e-3  # the second scale matters


def test_the_experts_switch_at_the_boundary(models: dict[str, Path]) -> None:
    """A14B: steps with σ·1000 ≥ 0.875·1000 run `transformer`, the rest `transformer_2` (with 8 steps of
    shift 3: the first three); a batch whose rows straddle the switch runs each row on its own expert."""
    policy = FlowPolicy.load(models["wan2_2_a14b"])
    assert policy.family.trained_modules() == ("transformer", "transformer_2")
    sigmas = policy.sigmas(8, 32)
    assert ((sigmas[:-1] * 1000) >= 875).tolist() == [True] * 3 + [False] * 5
    x = policy.initial_noise([3, 4], 32, FRAMES)
    cond = policy.encode(PROMPTS[:2], None, cfg=True, max_sequence_length=64)
    mixed = torch.stack([sigmas[2], sigmas[3]])
    with torch.no_grad():
        v = policy.velocity(x, mixed, cond, 4.0)
        high = policy.velocity(x[:1], sigmas[2], cond.select([0]), 4.0)
        low = policy.velocity(x[1:], sigmas[3], cond.select([1]), 4.0)
        torch.testing.assert_close(v, torch.cat([high, low]), rtol=0, atol=1e-6)
        # the experts differ: the low-noise row through the high-noise expert is another velocity
        with_high = policy.family._guided(
            policy.parts["transformer"], x[1:], sigmas[3:4] * 1000, cond.select([1]), 4.0, True
        )
    assert (with_high - low).abs().max().item() > 1e-3


def test_latent_shapes_and_bad_inputs_are_one_line(
    models: dict[str, Path], prompts: Path, tmp_path: Path
) -> None:
    policy = FlowPolicy.load(models["wan2_1"])
    assert policy.latent_shape(32, 1) == (16, 1, 4, 4)
    assert policy.latent_shape(64, 9) == (16, 3, 8, 8)
    assert FlowPolicy.load(models["wan2_2_5b"]).latent_shape(128, 13) == (48, 4, 8, 8)
    # one-frame clips encode back through the VAE (offline data, `omnirl encode`): the frames=1 latent
    frames = policy.decode(policy.initial_noise([5, 6], 32, 1) * 0.5)
    assert [len(f) for f in frames] == [1, 1] and frames[0][0].size == (32, 32)
    back = policy.encode_images([f[0] for f in frames], 32)
    assert back.shape == (2, 16, 1, 4, 4) and torch.isfinite(back).all()
    assert torch.equal(policy.encode_images([f[0] for f in frames], 32), back)  # the posterior mode
    card = json.loads((models["wan2_2_5b"] / "omnirl_model.json").read_text())
    assert card["details"]["latent_shape"] == [48, 2, 4, 4] and card["details"]["image_size"] == 64
    sample = [
        "sample", "--model", str(models["wan2_1"]), "--prompts", str(prompts), "-n", "1", "--steps", "2",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    fails([*sample, "--resolution", "32", "--frames", "4"], "--frames 4", "multiple of 4")
    fails([*sample, "--resolution", "24", "--frames", "5"], "--resolution 24", "16")
    fails([*sample, "--resolution", "32x40", "--frames", "5"], "--resolution 32x40", "multiple of 16")
    fails([*sample, "--resolution", "32by40"], "--resolution '32by40'", "HEIGHTxWIDTH")
    assert policy.latent_shape("64x32", 5) == (16, 2, 8, 4)
    assert not (tmp_path / "out").exists()


def test_an_image_family_refuses_frames(tiny_sd3: Path, prompts: Path, tmp_path: Path) -> None:
    fails(
        ["sample", "--model", str(tiny_sd3), "--prompts", str(prompts), "-n", "1", "--steps", "2",
         "--resolution", "32", "--frames", "5", "--out", str(tmp_path / "out")],
        "--frames 5", "images",
    )  # fmt: skip


def staged(model: Path, prompts: Path, root: Path, *window: str, resolution: str | None = None) -> dict:
    """sample (SDE, 5 frames, the tiny side unless `resolution`) → logprob; returns the replay summary."""
    run(
        "sample", "--model", str(model), "--prompts", str(prompts), "-n", "2", "--steps", "8",
        "--batch-size", "3", "--resolution", resolution or str(SIDES[model.name]), "--frames", str(FRAMES),
        "--guidance", "4", *window, "--out", str(root / "samples"),
    )  # fmt: skip
    return run(
        "logprob", "--model", str(model), "--in", str(root / "samples"), "--out", str(root / "logprobs")
    )


@pytest.mark.parametrize("family", ["wan2_1", "wan2_2_5b"])
def test_rollout_replays_exactly(models: dict[str, Path], prompts: Path, tmp_path: Path, family: str) -> None:
    replay = staged(models[family], prompts, tmp_path, "--sde-window", "2")
    assert replay["abs_delta_max"] == 0.0 and replay["rows"] == 6
    latents = ShardSet(tmp_path / "samples").columns["latents"]
    channels = 48 if family == "wan2_2_5b" else 16
    assert latents.shape == (3, channels, 2, 4, 4)  # [K+1, C, F', h, w]


def test_a_non_square_rollout_replays_exactly(models: dict[str, Path], prompts: Path, tmp_path: Path) -> None:
    replay = staged(models["wan2_1"], prompts, tmp_path, "--sde-window", "2", resolution="64x32")
    assert replay["abs_delta_max"] == 0.0 and replay["rows"] == 6
    samples = ShardSet(tmp_path / "samples")
    assert samples.columns["latents"].shape == (3, 16, 2, 8, 4)  # [K+1, C, F', h, w]: 64 high, 32 wide
    assert samples.manifest.extra["sample_config"]["resolution"] == [64, 32]


def test_a14b_low_noise_guidance_replays_exactly_and_is_recorded(
    models: dict[str, Path], prompts: Path, tmp_path: Path
) -> None:
    window = ("--sde-window", "3", "--window-strategy", "fixed", "--window-start", "1")  # across the switch
    replay = staged(models["wan2_2_a14b"], prompts, tmp_path, *window, "--guidance-2", "2.5")
    assert replay["abs_delta_max"] == 0.0 and replay["rows"] == 6
    assert ShardSet(tmp_path / "samples").manifest.extra["sample_config"]["guidance_2"] == 2.5


def test_low_noise_guidance_needs_two_experts_and_cfg(
    models: dict[str, Path], prompts: Path, tmp_path: Path
) -> None:
    sample = [
        "sample", "--prompts", str(prompts), "-n", "1", "--steps", "2", "--resolution", "32", "--frames", "5",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    fails([*sample, "--model", str(models["wan2_1"]), "--guidance-2", "3"], "--guidance-2 3", "two-expert")
    line = fails(
        [*sample, "--model", str(models["wan2_2_a14b"]), "--guidance", "1", "--guidance-2", "3"],
        "--guidance-2",
    )
    assert "--guidance" in line and "> 1" in line
    assert not (tmp_path / "out").exists()


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(models: dict[str, Path]) -> None:
    """`update --gradient-checkpointing` (diffusers' per-block recompute on every trained expert) changes
    memory, not numbers: the same loss and the same gradient of every A14B weight, for a batch whose rows
    straddle the expert switch, with two guidance scales."""
    policy = FlowPolicy.load(models["wan2_2_a14b"])
    params = policy.trainable_parameters(full=True)
    sigmas = policy.sigmas(8, 32)
    x = policy.initial_noise([3, 4], "32x64", FRAMES)
    cond = policy.encode(PROMPTS[:2], None, cfg=True, max_sequence_length=64)
    sigma = torch.stack([sigmas[2], sigmas[3]])

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        loss = policy.velocity(x, sigma, cond, 4.0, 2.0).pow(2).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    plain_loss, plain = loss_and_grads()
    policy.gradient_checkpointing()
    assert all(part.gradient_checkpointing for part in policy.parts.values())
    ckpt_loss, ckpt = loss_and_grads()
    torch.testing.assert_close(ckpt_loss, plain_loss)
    assert len(plain) == len(params) > 0 and sum(bool(g.abs().sum()) for g in plain) > len(params) // 2
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(b, a)


@pytest.fixture(scope="module")
def a14b_run(
    models: dict[str, Path], prompts: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """An A14B rollout whose SDE window over steps 1-3 spans the switch (σ·1000 947, 883 | 801), replayed,
    scored and given advantages."""
    root = tmp_path_factory.mktemp("a14b-run")
    model = models["wan2_2_a14b"]
    window = ("--sde-window", "3", "--window-strategy", "fixed", "--window-start", "1")
    replay = staged(model, prompts, root, *window)
    assert replay["abs_delta_max"] == 0.0
    run(
        "score",
        "--in",
        str(root / "samples"),
        "--reward",
        "jpeg_compressibility@frames=mean",
        "--out",
        str(root / "rewards"),
    )
    run("advantage", *ins(root / "samples", root / "rewards"), "--out", str(root / "advantages"))
    return {"model": model, **{k: root / k for k in ("samples", "logprobs", "rewards", "advantages")}}


def test_a14b_lora_on_both_experts_reloads_through_diffusers(
    a14b_run: dict[str, Path], tmp_path: Path
) -> None:
    """Replay across the switch is exact (the fixture), a flow_grpo step moves the LoRA of both experts, and
    diffusers' loaders (the second expert's LoRA with load_into_transformer_2) rebuild the policy's frames
    exactly."""
    model = a14b_run["model"]
    sigmas = ShardSet(a14b_run["samples"]).read_all(columns=["sigmas"])["sigmas"]
    assert ((sigmas[:, :-1] * 1000) >= 875).tolist() == [[True, True, False]] * 6
    out = tmp_path / "policy"
    result = run(
        "update", "--model", str(model), *ins(*(a14b_run[k] for k in ("samples", "logprobs", "advantages"))),
        "--algo", "flow_grpo", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3", "--out", str(out),
    )  # fmt: skip
    assert result["optimizer_steps"] >= 1
    for weights in (out / LORA_WEIGHTS, out / "transformer_2" / LORA_WEIGHTS):
        trained = load_file(weights)
        assert all(k.startswith("transformer.") for k in trained)
        assert max(v.abs().max().item() for k, v in trained.items() if "lora_B" in k) > 0  # it moved

    ours = FlowPolicy.load(model, adapter=out)
    pipe = stock_pipe(model)
    pipe.load_lora_weights(str(out), adapter_name="default")
    pipe.load_lora_weights(str(out / "transformer_2"), adapter_name="default", load_into_transformer_2=True)
    for name in ("transformer", "transformer_2"):
        loaded = {n: p for n, p in ours.parts[name].named_parameters() if "lora_" in n}
        stock = {n: p for n, p in getattr(pipe, name).named_parameters() if "lora_" in n}
        assert loaded.keys() == stock.keys() and len(loaded) == 2 * 8 * 2  # 2 blocks × attn1/attn2 q,k,v,out
        assert all(torch.equal(v, stock[n]) for n, v in loaded.items())
    x_t = ours.initial_noise([1, 2], 32, FRAMES)
    mine = ode_rollout(ours, 32, 8, 4.0, ["", ""])["final_latent"]
    theirs = stock_call(pipe, PROMPTS[:2], ["", ""], x_t, 8, 4.0, 32)
    assert (mine - theirs).abs().max().item() == 0.0
    base = ode_rollout(FlowPolicy.load(model), 32, 8, 4.0, ["", ""])["final_latent"]
    assert (mine - base).abs().max().item() > 0  # the adapter changes the frames

    # a second expert's LoRA that fits none of its layers is refused in one line, never left bare
    stray = tmp_path / "stray"
    shutil.copytree(out, stray)
    second = stray / "transformer_2" / LORA_WEIGHTS
    save_file({k.replace(".blocks.", ".elsewhere."): v for k, v in load_file(second).items()}, second)
    with pytest.raises(UserInputError, match=r"do not load onto --model .*Target modules .*elsewhere"):
        FlowPolicy.load(model, adapter=stray)


def test_a14b_full_weights_of_both_experts_reload(a14b_run: dict[str, Path], tmp_path: Path) -> None:
    """--full trains and saves both experts (with a KL reference: the frozen copies of both), and loading
    the adapter puts both in place (diffusers would load an optional component from the model folder)."""
    out = tmp_path / "full"
    run(
        "update", "--model", str(a14b_run["model"]), *ins(*(a14b_run[k] for k in ("samples", "logprobs", "advantages"))),
        "--full", "--beta", "0.01", "--lr", "1e-4", "--out", str(out),
    )  # fmt: skip
    trained = FlowPolicy.load(a14b_run["model"], adapter=out)
    for name in ("transformer", "transformer_2"):
        saved = load_file(out / name / "diffusion_pytorch_model.safetensors")
        base = load_file(a14b_run["model"] / name / "diffusion_pytorch_model.safetensors")
        assert max((saved[k] - base[k]).abs().max().item() for k in saved) > 0  # it moved
        loaded = dict(trained.parts[name].named_parameters())
        assert all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_a_checkpoint_without_a_card_encodes_wans_512_tokens(models: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from stages.models.factory import default_text_length

    assert default_text_length(models["wan2_1"]) == 64  # the tiny build's card
    bare = tmp_path / "bare"
    shutil.copytree(models["wan2_1"], bare)
    (bare / "omnirl_model.json").unlink()
    assert default_text_length(bare) == 512  # WanPipeline's own max_sequence_length


@pytest.fixture(scope="module")
def wan_run(
    models: dict[str, Path], prompts: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """One staged Wan 2.1 iteration (every step stochastic and stored) for the algorithms."""
    root = tmp_path_factory.mktemp("wan-run")
    model = models["wan2_1"]
    run(
        "sample", "--model", str(model), "--prompts", str(prompts), "-n", "2", "--steps", "3",
        "--batch-size", "3", "--resolution", "32", "--frames", str(FRAMES), "--guidance", "4",
        "--out", str(root / "samples"),
    )  # fmt: skip
    run(
        "score",
        "--in",
        str(root / "samples"),
        "--reward",
        "jpeg_compressibility@frames=mean",
        "--out",
        str(root / "rewards"),
    )
    run(
        "logprob",
        "--model",
        str(model),
        "--in",
        str(root / "samples"),
        "--means",
        "--out",
        str(root / "logprobs"),
    )
    run("advantage", *ins(root / "samples", root / "rewards"), "--out", str(root / "advantages"))
    return {"model": model, **{k: root / k for k in ("samples", "rewards", "logprobs", "advantages")}}


@pytest.mark.parametrize("algo", ["flow_grpo", "dance_grpo", "mix_grpo", "grpo_guard", "nft", "awm", "dpo"])
def test_every_algorithm_trains_on_video_latents(wan_run: dict[str, Path], tmp_path: Path, algo: str) -> None:
    inputs = ("samples", "rewards") if algo == "dpo" else ("samples", "logprobs", "advantages")
    result = run(
        "update", "--model", str(wan_run["model"]), *ins(*(wan_run[k] for k in inputs)), "--algo", algo,
        "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3", "--out", str(tmp_path / "policy"),
    )  # fmt: skip
    assert result["optimizer_steps"] >= 1
    assert all(np.isfinite(v) for v in result["last"].values() if isinstance(v, float))


# A14B with an SDE window over steps 1-3, across the expert switch
ONLINE_PRESET = online_preset(
    steps=8, guidance=4.0, frames=5, sde_window=3, window_strategy="fixed", window_start=1, batch_size=3
)


def test_online_trains_both_a14b_experts(models: dict[str, Path], prompts: Path, tmp_path: Path) -> None:
    preset = tmp_path / "preset.yaml"
    preset.write_text(ONLINE_PRESET)
    out = tmp_path / "online"
    result = run(
        "online", "--config", str(preset), "--model", str(models["wan2_2_a14b"]), "--prompts", str(prompts),
        "--out", str(out), "--iterations", "1", "--reward", "jpeg_compressibility@frames=mean", "--save-trajectories",
    )  # fmt: skip
    first = result["iterations"][0]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy up to batching rounding
    samples = ShardSet(out / "it0" / "samples")
    assert samples.columns["latents"].shape == (4, 16, 2, 4, 4)
    assert (
        samples.columns["video"].kind == "video" and "image" not in samples.columns
    )  # MP4s, scored per frame
    for weights in (
        out / "it1" / "policy" / LORA_WEIGHTS,
        out / "it1" / "policy" / "transformer_2" / LORA_WEIGHTS,
    ):
        assert max(v.abs().max().item() for k, v in load_file(weights).items() if "lora_B" in k) > 0


@pytest.mark.distributed
def test_two_ranks_train_both_experts_as_one_process(a14b_run: dict[str, Path], tmp_path: Path) -> None:
    """DDP over the experts module (each micro-batch runs one or both experts; the other's LoRA gets no
    gradient on that rank) adds the same gradients as one process."""
    from helpers import torchrun

    args = [
        "update", "--model", str(a14b_run["model"]), *ins(*(a14b_run[k] for k in ("samples", "logprobs", "advantages"))),
        "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3", "--no-shuffle", "--micro-batch", "1",
    ]  # fmt: skip
    run(*args, "--grad-accum", "2", "--out", str(tmp_path / "one"))
    torchrun(*args, "--grad-accum", "1", "--out", str(tmp_path / "two"))
    for weights in (LORA_WEIGHTS, f"transformer_2/{LORA_WEIGHTS}"):
        one, two = load_file(tmp_path / "one" / weights), load_file(tmp_path / "two" / weights)
        assert one.keys() == two.keys()
        for k in one:
            torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5)


def test_a_published_unipc_scheduler_gives_its_own_flow_sigmas(models: dict[str, Path]) -> None:
    """Published Wan checkpoints ship UniPC with flow sigmas: samples step on that σ table (as flow_grpo's
    Wan trainer does): shift·s/(1 + (shift − 1)·s) on s = linspace(1, 1/1000, N+1)[:-1], then 0, starting
    at exactly 1 (UniPC's own 1 − 1e-6 would defeat the SDE's σ = 1 guard); a UniPC without flow sigmas
    is a one-line error."""
    from diffusers import UniPCMultistepScheduler

    policy = FlowPolicy.load(models["wan2_1"])
    policy.pipe.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    sigmas = policy.sigmas(8, 32)
    s = np.linspace(1, 1 / 1000, 9)[:-1]
    expected = [*(3 * s / (1 + 2 * s)), 0.0]
    assert sigmas[0].item() == 1.0
    torch.testing.assert_close(sigmas, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-6)
    policy.pipe.scheduler = UniPCMultistepScheduler()
    with pytest.raises(UserInputError, match="use_flow_sigmas"):
        policy.sigmas(8, 32)


def column_bytes(shard_set: Path, name: str) -> int:
    """Bytes a column takes in a Parquet shard set's files (compressed, as stored)."""
    import pyarrow.parquet as pq

    total = 0
    for path in shard_set.glob("*.parquet"):
        meta = pq.ParquetFile(path).metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for c in range(group.num_columns):
                if group.column(c).path_in_schema.split(".")[0] == name:
                    total += group.column(c).total_compressed_size
    return total


@pytest.mark.parametrize("family", ["wan2_1", "sd3"])
def test_bf16_latents_replay_exactly_in_half_the_bytes(
    models: dict[str, Path], tiny_sd3: Path, prompts: Path, tmp_path: Path, family: str
) -> None:
    """`--latent-dtype bf16` stores bf16 latents whose own log-probs replay with |Δlogp| = 0; the window
    starts at x_T, so its first latent is the fp32 run's x_T rounded to bf16."""
    model = tiny_sd3 if family == "sd3" else models[family]
    frames = ("--frames", str(FRAMES)) if family != "sd3" else ()
    data = {}
    for dtype in ("fp32", "bf16"):
        root = tmp_path / dtype
        run(
            "sample", "--model", str(model), "--prompts", str(prompts), "-n", "2", "--steps", "4",
            "--batch-size", "3", "--resolution", "32", *frames, "--guidance", "1",
            "--latent-dtype", dtype, "--out", str(root / "samples"),
        )  # fmt: skip
        replay = run(
            "logprob", "--model", str(model), "--in", str(root / "samples"), "--out", str(root / "logprobs")
        )
        assert replay["abs_delta_max"] == 0.0 and replay["rows"] == 6
        samples = ShardSet(root / "samples")
        assert samples.manifest.extra["sample_config"]["latent_dtype"] == dtype
        data[dtype] = samples.read_all(["latents", "final_latent", "log_probs"])
    columns = ShardSet(tmp_path / "bf16" / "samples").columns
    assert columns["latents"].dtype == columns["final_latent"].dtype == "bfloat16"
    fp32, bf16 = data["fp32"], data["bf16"]
    assert bf16["latents"].dtype == torch.bfloat16 and bf16["latents"].shape == fp32["latents"].shape
    assert bf16["latents"].nbytes * 2 == fp32["latents"].nbytes
    # on disk too: Parquet keeps bf16 bits in 4-byte INT32, which zstd brings below half of fp32's
    on_disk = {d: column_bytes(tmp_path / d / "samples", "latents") for d in data}
    assert on_disk["bf16"] < 0.5 * on_disk["fp32"] and on_disk["fp32"] >= fp32["latents"].nbytes
    assert torch.equal(bf16["latents"][:, 0], fp32["latents"][:, 0].bfloat16())
    # rounding each step moves the trajectory by about bf16's resolution, not more
    assert 0 < (bf16["final_latent"].float() - fp32["final_latent"]).abs().max() < 0.1
    assert not torch.equal(bf16["log_probs"], fp32["log_probs"])


def test_an_unknown_latent_dtype_is_one_line(tiny_sd3: Path, prompts: Path, tmp_path: Path) -> None:
    fails(
        ["sample", "--model", str(tiny_sd3), "--prompts", str(prompts), "--latent-dtype", "fp16",
         "--out", str(tmp_path / "s")],
        "--latent-dtype",
    )  # fmt: skip


def test_vae_slicing_decodes_each_sample_alone(
    models: dict[str, Path], prompts: Path, tmp_path: Path
) -> None:
    """--vae-slicing --vae-tiling reach the VAE and leave the trajectory as it is; sliced frames are each
    sample's own batch-of-1 decode, and differ from the batched decode by float rounding only (measured:
    ≤ 1 level in about 2e-5 of the values). Tiling's 256 px tiles do not split a 32 px frame."""
    from io import BytesIO

    from PIL import Image

    from stages.sample.engines import DiffusersEngine, EngineOptions

    model = models["wan2_1"]
    engine = DiffusersEngine.open(
        EngineOptions(model, vae_tiling=True, vae_slicing=True), torch.device("cpu")
    )
    assert engine.policy.pipe.vae.use_tiling and engine.policy.pipe.vae.use_slicing
    plain = FlowPolicy.load(model)
    assert not (plain.pipe.vae.use_tiling or plain.pipe.vae.use_slicing)
    data = {}
    for name, flags in (("plain", ()), ("sliced", ("--vae-slicing", "--vae-tiling"))):
        run(
            "sample", "--model", str(model), "--prompts", str(prompts), "-n", "2", "--steps", "3",
            "--batch-size", "3", "--resolution", "32", "--frames", str(FRAMES), "--guidance", "1",
            "--save-frames", *flags, "--out", str(tmp_path / name),
        )  # fmt: skip
        data[name] = ShardSet(tmp_path / name).read_all(["final_latent", "frames"])
    assert torch.equal(data["plain"]["final_latent"], data["sliced"]["final_latent"])

    def pixels(rows: list[list[bytes]]) -> np.ndarray:
        return np.stack([[np.asarray(Image.open(BytesIO(png)), float) for png in row] for row in rows])

    sliced = pixels(data["sliced"]["frames"])
    alone = np.stack(
        [[np.asarray(f, float) for f in plain.decode(x[None])[0]] for x in data["sliced"]["final_latent"]]
    )
    assert np.array_equal(sliced, alone)
    assert np.abs(sliced - pixels(data["plain"]["frames"])).max() <= 1


def test_vae_options_a_vae_or_engine_cannot_take_are_one_line(
    models: dict[str, Path], prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import AutoencoderKLWan

    args = [
        "sample",
        "--model",
        str(models["wan2_1"]),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "s"),
    ]
    fails([*args, "--engine", "remote", "--vae-slicing"], "--vae-slicing", "remote")
    monkeypatch.setattr(AutoencoderKLWan, "enable_tiling", None)
    fails(
        [*args, "--vae-tiling", "--resolution", "32", "--frames", str(FRAMES)],
        "--vae-tiling",
        "AutoencoderKLWan",
    )
