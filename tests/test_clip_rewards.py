"""CLIP rewards (pickscore, clipscore, image_similarity, aesthetic) on a tiny random CLIP, and reward
arguments (registry, `score --reward-arg`, the YAML `score: reward_args:` section)."""

from __future__ import annotations

import io
import logging
import math
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import fails, run
from PIL import Image
from safetensors.torch import load_file

from stages.errors import UserInputError
from stages.models.clip import AESTHETIC_MLP_FILE, CLIP_MEAN, CLIP_STD, build_tiny_clip
from stages.score import registry
from stages.score.registry import (
    check_reward_args,
    get_reward,
    parse_reward_args,
    resolve_reward_args,
    reward_files,
    reward_kind,
)

PROMPTS = ["a photo of a cat", "a red apple on a table", 'a sign that says "hello"', "a blue sky"]


def _noise(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


IMAGES = [_noise(0, 48, 40), _noise(1, 32, 64), _noise(2, 50, 50), _noise(3, 33, 31)]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("clip") / "clip-tiny"
    build_tiny_clip(out, seed=0)
    return out


@pytest.fixture(scope="module")
def reference(tiny_clip: Path):
    """The model and processor as `from_pretrained` gives them, and CLIP's own forward on a batch."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(tiny_clip, local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(tiny_clip, local_files_only=True)

    def forward(prompts, images):
        inputs = processor(text=prompts, images=images, padding=True, return_tensors="pt")
        with torch.no_grad():
            return model(**inputs)

    return model, processor, forward


@pytest.fixture
def scratch_registry(monkeypatch):
    registry.available_rewards()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_PLUGINS", {})


# --- the tiny model ---------------------------------------------------------------------------------


def test_tiny_clip_processor_is_clips_published_preprocessing(tiny_clip, reference):
    """Shortest side bicubic-resized to the image size, centre crop, /255, CLIP mean/std."""
    _, processor, _ = reference
    image = IMAGES[0]  # 48x40 → 38x32 (shortest side 32), crop x 3..35
    size = processor.image_processor.crop_size["height"]
    resized = image.resize((round(48 * size / 40), size), Image.Resampling.BICUBIC)
    left = (resized.width - size) // 2
    cropped = np.asarray(resized.crop((left, 0, left + size, size)), dtype=np.float32) / 255
    expected = (cropped - np.array(CLIP_MEAN)) / np.array(CLIP_STD)
    got = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
    assert torch.allclose(got, torch.from_numpy(expected).permute(2, 0, 1).float(), atol=1e-5)


def test_tiny_clip_builds_the_same_weights_for_a_seed(tiny_clip, tmp_path):
    again = tmp_path / "again"
    summary = build_tiny_clip(again, seed=0)
    assert summary["projection_dim"] == 16
    for name in ("model.safetensors", AESTHETIC_MLP_FILE):
        first, second = load_file(str(tiny_clip / name)), load_file(str(again / name))
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first)
    mlp = load_file(str(tiny_clip / AESTHETIC_MLP_FILE))  # LAION's layout with a 16-wide input
    assert {k: tuple(v.shape) for k, v in mlp.items() if k.endswith("weight")} == {
        "layers.0.weight": (1024, 16),
        "layers.2.weight": (128, 1024),
        "layers.4.weight": (64, 128),
        "layers.6.weight": (16, 64),
        "layers.7.weight": (1, 16),
    }
    with pytest.raises(UserInputError, match="not an empty directory"):
        build_tiny_clip(again, seed=1)


# --- formulas against CLIP's own forward ------------------------------------------------------------


def test_pickscore_and_clipscore_are_scaled_logits_per_image(tiny_clip, reference):
    model, _, forward = reference
    logits = forward(PROMPTS, IMAGES).logits_per_image.diagonal()
    pick = get_reward("pickscore", {"model": str(tiny_clip)})(IMAGES, PROMPTS, [{}] * 4)
    clip = get_reward("clipscore", {"model": str(tiny_clip)})(IMAGES, PROMPTS, [{}] * 4)
    assert pick == pytest.approx((logits / 26).tolist(), abs=1e-5)
    assert clip == pytest.approx((logits / 100).tolist(), abs=1e-5)
    assert len(set(pick)) == 4  # the scores tell the samples apart
    # logits = exp(logit_scale)·cos: with the tiny model's scale exp(2.6592) ≈ 14.3, not CLIP's 100
    assert float(model.logit_scale.detach().exp()) == pytest.approx(1 / 0.07, rel=1e-4)


def test_image_similarity_is_the_image_embedding_cosine(tiny_clip, reference, tmp_path):
    _, _, forward = reference
    paths = []
    for i, image in enumerate(IMAGES[:2]):
        paths.append(tmp_path / f"ref{i}.png")
        image.save(paths[-1])
    embeds = forward(PROMPTS[:1], IMAGES).image_embeds  # normalised [4, D]
    meta = [{"reference_image": str(paths[0])}, {"reference_image": str(paths[1])}, {}, {}]
    scorer = get_reward("image_similarity", {"model": str(tiny_clip), "reference": str(paths[1])})
    got = scorer(IMAGES, PROMPTS, meta)
    expected = [embeds[0] @ embeds[0], embeds[1] @ embeds[1], embeds[2] @ embeds[1], embeds[3] @ embeds[1]]
    assert got == pytest.approx([float(e) for e in expected], abs=1e-5)
    assert got[0] == pytest.approx(1.0, abs=1e-5)  # an image is its own best match
    bare = get_reward("image_similarity", {"model": str(tiny_clip)})
    with pytest.raises(UserInputError, match=r"no reference_image.*image_similarity\.reference"):
        bare(IMAGES[:1], PROMPTS[:1], [{}])
    with pytest.raises(UserInputError, match="is not a file"):
        bare(IMAGES[:1], PROMPTS[:1], [{"reference_image": str(tmp_path / "missing.png")}])


class Unpicklable:
    """An arbitrary class: `torch.load(weights_only=True)` must refuse to build it."""


def _laion_mlp(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """LAION's MLP in eval mode by hand: five affine maps, no activations (dropouts are the identity)."""
    for index in (0, 2, 4, 6, 7):
        x = x @ state[f"layers.{index}.weight"].T + state[f"layers.{index}.bias"]
    return x.squeeze(-1)


def test_aesthetic_is_laion_mlp_of_the_normalised_embedding(tiny_clip, reference, tmp_path):
    _, _, forward = reference
    state = load_file(str(tiny_clip / AESTHETIC_MLP_FILE))
    expected = _laion_mlp(state, forward(PROMPTS[:1], IMAGES).image_embeds)
    args = {"model": str(tiny_clip), "mlp": str(tiny_clip / AESTHETIC_MLP_FILE)}
    got = get_reward("aesthetic", args)(IMAGES, PROMPTS, [{}] * 4)
    assert got == pytest.approx(expected.tolist(), abs=1e-5)
    # the published form: a .pth state dict, read with torch.load(weights_only=True)
    torch.save(state, tmp_path / "mlp.pth")
    from_pth = get_reward("aesthetic", {**args, "mlp": str(tmp_path / "mlp.pth")})(IMAGES, PROMPTS, [{}] * 4)
    assert from_pth == pytest.approx(got, abs=1e-6)


def test_aesthetic_refuses_unsafe_or_mismatched_weights(tiny_clip, tmp_path):
    torch.save({"layers.0.weight": Unpicklable()}, tmp_path / "pickled.pth")  # refused by weights_only
    scorer = get_reward("aesthetic", {"model": str(tiny_clip), "mlp": str(tmp_path / "pickled.pth")})
    with pytest.raises(UserInputError, match="not a tensor state dict"):
        scorer(IMAGES[:1], PROMPTS[:1], [{}])
    wide = {k: v for k, v in load_file(str(tiny_clip / AESTHETIC_MLP_FILE)).items()}
    wide["layers.0.weight"] = torch.zeros(1024, 768)
    torch.save(wide, tmp_path / "wide.pth")
    scorer = get_reward("aesthetic", {"model": str(tiny_clip), "mlp": str(tmp_path / "wide.pth")})
    with pytest.raises(UserInputError, match="768-wide embeddings but model"):
        scorer(IMAGES[:1], PROMPTS[:1], [{}])


@pytest.mark.parametrize("name", ["pickscore", "clipscore", "aesthetic"])
def test_batched_equals_one_by_one(tiny_clip, name):
    args = {"model": str(tiny_clip)}
    if name == "aesthetic":
        args["mlp"] = str(tiny_clip / AESTHETIC_MLP_FILE)
    whole = get_reward(name, args)(IMAGES, PROMPTS, [{}] * 4)
    chunked = get_reward(name, {**args, "batch_size": 3})(IMAGES, PROMPTS, [{}] * 4)
    single = [get_reward(name, args)([im], [p], [{}])[0] for im, p in zip(IMAGES, PROMPTS)]
    assert chunked == pytest.approx(whole, abs=1e-5)
    assert single == pytest.approx(whole, abs=1e-5)


def test_dtype_and_device_arguments(tiny_clip):
    full = get_reward("clipscore", {"model": str(tiny_clip)})
    half = get_reward("clipscore", {"model": str(tiny_clip), "dtype": "bf16", "device": "cpu"})
    model = half.load()[0]
    assert model.dtype == torch.bfloat16 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    got, expected = half(IMAGES, PROMPTS, [{}] * 4), full(IMAGES, PROMPTS, [{}] * 4)
    assert got == pytest.approx(expected, abs=0.02) and got != expected  # bf16 rounding, same numbers


def test_a_cached_hub_id_loads_without_the_network(tiny_clip, tmp_path, monkeypatch, offline):
    import huggingface_hub.constants

    commit = "0" * 40
    snapshot = tmp_path / "hub" / "models--omnirl--clip-tiny" / "snapshots" / commit
    shutil.copytree(tiny_clip, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    by_id = get_reward("clipscore", {"model": "omnirl/clip-tiny"})
    assert by_id.weight_paths["model"] == snapshot
    by_path = get_reward("clipscore", {"model": str(tiny_clip)})
    assert by_id(IMAGES, PROMPTS, [{}] * 4) == pytest.approx(by_path(IMAGES, PROMPTS, [{}] * 4), abs=1e-6)
    with pytest.raises(UserInputError, match="nor a Hub id in the local Hugging Face cache"):
        get_reward("clipscore", {"model": "omnirl/not-cached"})


# --- reward arguments -------------------------------------------------------------------------------


def test_parse_reward_args_from_flags_and_yaml():
    assert parse_reward_args(None) == {}
    assert parse_reward_args(["pickscore.model=/m/a=b", "pickscore.batch_size=8", "pkg.mod:Cls.k= v "]) == {
        "pickscore": {"model": "/m/a=b", "batch_size": "8"},
        "pkg.mod:Cls": {"k": "v"},
    }
    assert parse_reward_args(["x.k=1", "x.k=2"]) == {"x": {"k": "2"}}  # the last one wins
    assert parse_reward_args({"aesthetic": {"model": "/c", "batch_size": 4}}) == {
        "aesthetic": {"model": "/c", "batch_size": 4}
    }
    for bad in ["pickscore", "model=/x", "pickscore.=x", ".model=x", "pickscore.bad-key=1"]:
        with pytest.raises(UserInputError, match=r"--reward-arg .*NAME\.KEY=VALUE"):
            parse_reward_args([bad])
    with pytest.raises(UserInputError, match=r"reward_args\.pickscore: must be a mapping"):
        parse_reward_args({"pickscore": "/models/x"})


def test_reward_args_are_checked_converted_and_instances_shared(tiny_clip, scratch_registry):
    args = {"model": str(tiny_clip), "batch_size": "8", "dtype": "fp32"}
    assert resolve_reward_args(registry._REGISTRY["clipscore"], "clipscore", args) == {
        "batch_size": 8,
        "dtype": "fp32",
        "model": str(tiny_clip),
    }
    first = get_reward("clipscore", args)
    assert first.batch_size == 8
    assert get_reward("clipscore", {**args, "batch_size": 8}) is first  # one model per process
    assert get_reward("clipscore", {**args, "batch_size": 4}) is not first
    with pytest.raises(UserInputError) as error:
        get_reward("clipscore", {**args, "modle": "x"})
    assert str(error.value) == (
        "reward 'clipscore' has no argument 'modle'; valid arguments: batch_size, device, dtype, model, processor"
    )
    with pytest.raises(UserInputError, match=r"batch_size='many' is not of type int"):
        get_reward("clipscore", {**args, "batch_size": "many"})
    with pytest.raises(UserInputError, match=r"dtype=fp64 is not one of fp32, bf16, fp16"):
        get_reward("clipscore", {**args, "dtype": "fp64"})
    with pytest.raises(
        UserInputError, match=r"reward 'ocr' takes no arguments .*remove --reward-arg ocr\.model"
    ):
        get_reward("ocr", {"model": "x"})
    with pytest.raises(UserInputError) as error:
        get_reward("pickscore")
    assert "pass --reward-arg pickscore.model=PATH" in str(error.value)
    assert reward_kind("pickscore") == reward_kind("aesthetic") == "image"  # known without a model


def test_a_plugin_class_takes_reward_args(tmp_path, monkeypatch, scratch_registry):
    (tmp_path / "omnirl_test_clip_plugin.py").write_text(
        textwrap.dedent(
            """
            class Offset:
                def __init__(self, offset: float = 0.0, weights: str = ""):
                    self.offset = offset
                    self.weights = weights

                def __call__(self, images, prompts, meta):
                    return [self.offset] * len(images)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"abc")
    name = "omnirl_test_clip_plugin:Offset"
    scorer = get_reward(name, {"offset": "0.5", "weights": str(weights)})
    assert scorer([None, None], ["", ""], [{}, {}]) == [0.5, 0.5]
    assert reward_files(name, {"offset": "0.5", "weights": str(weights)}) == {"weights": weights}
    with pytest.raises(UserInputError, match=r"has no argument 'scale'; valid arguments: offset, weights"):
        get_reward(name, {"scale": 1})


def test_check_reward_args_builds_scorers_and_ignores_other_rewards(tiny_clip, caplog):
    with caplog.at_level(logging.WARNING):
        resolved = check_reward_args(
            ["jpeg_compressibility", "clipscore"],
            {"clipscore": {"model": str(tiny_clip), "batch_size": "2"}, "pickscore": {"model": "/x"}},
        )
    assert resolved == {"clipscore": {"batch_size": 2, "model": str(tiny_clip)}}
    assert "'pickscore' is not a --reward of this run" in caplog.text
    with pytest.raises(UserInputError, match=r"pass --reward-arg aesthetic\.mlp=PATH"):
        check_reward_args(["aesthetic"], {"aesthetic": {"model": str(tiny_clip)}})


# --- through the CLI ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-row, 2-shard image rollout as `omnirl sample` records one (PNG images, prompts, meta)."""
    from stages.shards.writer import ShardSetWriter

    out = tmp_path_factory.mktemp("clip_set") / "samples"
    writer = ShardSetWriter(
        out, num_shards=2, command="sample", config={}, kinds={"image": "image", "prompt_meta": "json"}
    )
    for s in range(2):
        rows = range(2 * s, 2 * s + 2)
        blobs = []
        for r in rows:
            buffer = io.BytesIO()
            IMAGES[r].save(buffer, format="PNG")
            blobs.append(buffer.getvalue())
        writer.write_shard(
            s,
            {
                "sample_id": [f"s{r}" for r in rows],
                "prompt": [PROMPTS[r] for r in rows],
                "prompt_meta": [{} for _ in rows],
                "image": blobs,
            },
        )
    writer.finalize(extra={"modality": "image"})
    return out


def test_score_cli_with_reward_args_flags_and_yaml(tiny_clip, image_set, tmp_path):
    from stages.shards.reader import ShardSet

    expected = get_reward("pickscore", {"model": str(tiny_clip)})(IMAGES, PROMPTS, [{}] * 4)
    flags = ["score", "--in", str(image_set), "--reward", "pickscore"]
    result = run(*flags, "--reward-arg", f"pickscore.model={tiny_clip}", "--out", str(tmp_path / "r1"))
    rewards = ShardSet(tmp_path / "r1").read_all()
    assert rewards["sample_id"] == ["s0", "s1", "s2", "s3"]
    assert rewards["reward.pickscore"].tolist() == pytest.approx(expected, abs=1e-5)
    assert result["reward/mean"] == pytest.approx(sum(expected) / 4, abs=1e-5)
    config = ShardSet(tmp_path / "r1").manifest.config
    assert config["reward_args"] == {"pickscore": {"model": str(tiny_clip)}}
    assert set(config["reward_args_sha256"]) == {"pickscore.model", "pickscore.processor"}

    preset = tmp_path / "preset.yaml"
    preset.write_text(
        yaml.safe_dump(
            {"score": {"reward": ["pickscore"], "reward_args": {"pickscore": {"model": str(tiny_clip)}}}}
        )
    )
    run("score", "--in", str(image_set), "--config", str(preset), "--out", str(tmp_path / "r2"))
    assert (
        ShardSet(tmp_path / "r2").read_all()["reward.pickscore"].tolist()
        == rewards["reward.pickscore"].tolist()
    )


def test_score_identity_follows_the_reward_model_content(tiny_clip, image_set, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_clip, model)
    args = [
        "score",
        "--in",
        str(image_set),
        "--reward",
        "clipscore",
        "--reward-arg",
        f"clipscore.model={model}",
    ]
    first = run(*args, "--out", str(tmp_path / "r"))
    assert run(*args, "--out", str(tmp_path / "r"))["reward/mean"] == first["reward/mean"]  # same run
    shutil.rmtree(model)
    build_tiny_clip(model, seed=1)  # same path, other weights
    fails([*args, "--out", str(tmp_path / "r")], "already holds a finished output")
    monkeypatch.setattr(registry, "_PLUGINS", {})  # a new process: scorers load their model once per process
    other = run(*args, "--out", str(tmp_path / "r"), "--overwrite")
    assert not math.isclose(other["reward/mean"], first["reward/mean"], abs_tol=1e-7)


def test_score_cli_reward_arg_errors_are_one_line(tiny_clip, image_set, tmp_path):
    base = ["score", "--in", str(image_set), "--reward", "pickscore", "--out", str(tmp_path / "r")]
    fails(base, "reward 'pickscore' needs its model", "--reward-arg pickscore.model=PATH")
    fails(
        [*base, "--reward-arg", "pickscore.model=/no/such/folder"],
        "/no/such/folder",
        "--reward-arg pickscore.model",
    )
    fails(
        [*base, "--reward-arg", f"pickscore.model={tiny_clip}", "--reward-arg", "pickscore.modle=x"],
        "reward 'pickscore' has no argument 'modle'",
        "valid arguments: batch_size, device, dtype, model, processor",
    )
    fails([*base, "--reward-arg", "pickscore"], "--reward-arg 'pickscore'", "NAME.KEY=VALUE")
    assert not (tmp_path / "r").exists()  # refused before any output


def test_online_scores_with_reward_args_as_score_does(tiny_clip, tiny_sd3, tmp_path):
    """The online scorer worker gets the reward arguments: its it0/rewards equal `omnirl score` on its
    it0/samples with the same arguments, and the model's digest is part of the run's identity."""
    from helpers import online_args

    from stages.shards.reader import ShardSet

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        yaml.safe_dump(
            {
                "sample": {"steps": 2, "guidance": 1.0, "resolution": 32, "group_size": 2, "batch_size": 4},
                "score": {"reward": ["clipscore"], "reward_args": {"clipscore": {"model": str(tiny_clip)}}},
                "update": {"lr": 1.0e-3, "lora_rank": 4, "lora_alpha": 8},
            }
        )
    )
    out = tmp_path / "run"
    paths = {"model": tiny_sd3, "prompts": prompts}
    fails(online_args(preset, paths, out, "--reward-arg", "clipscore.modle=x"), "has no argument 'modle'")
    run(*online_args(preset, paths, out, "--iterations", "1", "--save-trajectories"))
    it0 = out / "it0"
    run("score", "--in", str(it0 / "samples"), "--config", str(preset), "--out", str(tmp_path / "rescored"))
    online = ShardSet(it0 / "rewards").read_all()["reward.clipscore"]
    staged = ShardSet(tmp_path / "rescored").read_all()["reward.clipscore"]
    assert online.tolist() == pytest.approx(staged.tolist(), abs=1e-6)
    identity = yaml.safe_load((out / "online_run.json").read_text())
    assert identity["settings"]["reward_args"] == {"clipscore": {"model": str(tiny_clip)}}
    assert "reward clipscore.model" in identity["inputs"]
