"""Prompt conditioning stored once by `sample` (stages/models/conditioning.py): `logprob` and `update` read
it and load neither text encoder, tokenizer nor VAE, with the very numbers of re-encoding the prompts; a
rollout without it is encoded as before; conditioning of another text encoder is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, fails, ins, run
from safetensors.torch import load_file

from stages.errors import UserInputError
from stages.models.conditioning import CONDITIONING, encoder_identity, stored_conditioning
from stages.models.diffusion import FlowPolicy
from stages.models.folders import LORA_WEIGHTS
from stages.shards.manifest import MANIFEST_NAME
from stages.shards.reader import ShardSet, open_inputs

# init-model --family → sampling flags of its tiny build, with CFG on where the family has it
FAMILIES = {
    "flux": ["--resolution", "32", "--guidance", "3.5"],
    "qwen_image": ["--resolution", "32", "--guidance", "4"],
    "sd3": ["--resolution", "32", "--guidance", "3"],
    "wan2_1": ["--resolution", "32", "--frames", "5", "--guidance", "3"],
    "z_image": ["--resolution", "32", "--guidance", "3"],
}
TEXT = ("text_encoder", "tokenizer")


def without_conditioning(samples: Path, out: Path) -> Path:
    """A copy of a rollout as an omnirl without stored conditioning wrote it: no files, no manifest entry."""
    shutil.copytree(samples, out, ignore=shutil.ignore_patterns("conditioning-*"))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    del manifest["extra"][CONDITIONING]
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def rollout(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path | str]:
    """A family's tiny build, a 2-prompt × 2 rollout of 2 SDE steps in 2 shards, and its copy without
    stored conditioning."""
    from stages.models.factory import init_model

    name = request.param
    root = tmp_path_factory.mktemp(f"cond-{name}")
    init_model(name, root / "model", size="tiny", seed=0)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    run(
        "sample", "--model", str(root / "model"), "--prompts", str(prompts), "-n", "2", "--steps", "2",
        "--batch-size", "2", "--num-shards", "2", *FAMILIES[name], "--out", str(root / "samples"),
    )  # fmt: skip
    return {
        "name": name,
        "root": root,
        "model": root / "model",
        "samples": root / "samples",
        "plain": without_conditioning(root / "samples", root / "plain"),
    }


def logprob(rollout: dict, samples: Path, out: Path, *extra: str) -> dict:
    return run("logprob", "--model", str(rollout["model"]), "--in", str(samples), "--out", str(out), *extra)


def test_the_rollout_stores_each_prompt_once(rollout: dict) -> None:
    manifest = ShardSet(rollout["samples"]).manifest
    record = manifest.extra[CONDITIONING]
    assert [f["file"] for f in record["files"]] == [
        "conditioning-00000-of-00002.safetensors",
        "conditioning-00001-of-00002.safetensors",
    ]
    identity = record["identity"]
    assert identity == encoder_identity(rollout["model"], "fp32", identity["max_sequence_length"])
    assert identity["components"] and all(name.startswith(TEXT) for name in identity["components"])
    # one prompt per shard (2 samples each), stored once: the positive branch has no batch dim
    for info in record["files"]:
        tensors = load_file(rollout["samples"] / info["file"])
        assert tensors and {key.split(".")[0] for key in tensors} == {"0"}


def test_replay_from_stored_conditioning_equals_re_encoding_and_loads_no_encoder(
    rollout: dict, tmp_path: Path
) -> None:
    stored = logprob(rollout, rollout["samples"], tmp_path / "stored")
    encoded = logprob(rollout, rollout["plain"], tmp_path / "encoded")  # an older rollout: still works
    assert stored["conditioning"] == "stored" and stored["loaded_components"] == ["scheduler", "transformer"]
    assert encoded["conditioning"].startswith("encoded")
    assert [c for c in encoded["loaded_components"] if c.startswith(TEXT)]
    assert "vae" not in encoded["loaded_components"]  # replay on latents never decodes
    assert stored["abs_delta_max"] == encoded["abs_delta_max"] == 0.0
    a = ShardSet(tmp_path / "stored").read_all(["sample_id", "old_log_probs"])
    b = ShardSet(tmp_path / "encoded").read_all(["sample_id", "old_log_probs"])
    assert a["sample_id"] == b["sample_id"] and torch.equal(a["old_log_probs"], b["old_log_probs"])


@pytest.mark.parametrize("name", ["sd3", "qwen_image"])
def test_update_weights_are_bit_identical_with_stored_conditioning(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """flow_grpo steps on the rollout's own log-probs; the two runs differ only in where the prompt
    conditioning comes from. One prompt (a group of 4): re-encoding a prompt batched with others differs
    from encoding it alone by float rounding (3.6e-7 on the tiny SD3's embeddings), so only a rollout
    whose encoder calls the update repeats can match bit for bit; the stored conditioning is the
    rollout's own either way."""
    root = tmp_path_factory.mktemp(f"cond-update-{name}")
    from stages.models.factory import init_model

    init_model(name, root / "model", size="tiny", seed=0)
    prompts = root / "prompts.txt"
    prompts.write_text(PROMPTS[1] + "\n")
    run(
        "sample", "--model", str(root / "model"), "--prompts", str(prompts), "-n", "4", "--steps", "2",
        "--batch-size", "4", *FAMILIES[name], "--out", str(root / "samples"),
    )  # fmt: skip
    without_conditioning(root / "samples", root / "plain")
    policies = {}
    for kind in ("samples", "plain"):
        rewards, advantages = root / f"{kind}-rewards", root / f"{kind}-advantages"
        run("score", "--in", str(root / kind), "--reward", "jpeg_compressibility", "--out", str(rewards))
        run("advantage", *ins(root / kind, rewards), "--out", str(advantages))
        policies[kind] = run(
            "update", "--model", str(root / "model"), *ins(root / kind, advantages), "--lora-rank", "4",
            "--lora-alpha", "8", "--lr", "1e-3", "--out", str(root / f"{kind}-policy"),
        )  # fmt: skip
    assert policies["samples"]["conditioning"] == "stored"
    assert policies["samples"]["loaded_components"] == ["scheduler", "transformer"]
    assert [c for c in policies["plain"]["loaded_components"] if c.startswith(TEXT)]
    assert policies["samples"]["optimizer_steps"] == policies["plain"]["optimizer_steps"] >= 1
    a = load_file(root / "samples-policy" / LORA_WEIGHTS)
    b = load_file(root / "plain-policy" / LORA_WEIGHTS)
    assert a.keys() == b.keys() and any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("rollout", ["sd3"], indirect=True)  # one family is enough
def test_conditioning_of_another_text_encoder_is_refused(rollout: dict, tmp_path: Path) -> None:
    from stages.models.factory import init_model

    other = tmp_path / "other"
    init_model("sd3", other, size="tiny", seed=1)  # same architecture, other text encoder weights
    line = fails(
        ["logprob", "--model", str(other), "--in", str(rollout["samples"]), "--out", str(tmp_path / "lp")],
        "--in",
        "stored conditioning",
        "StableDiffusion3Pipeline",
        "--model",
    )
    assert line.count("text_encoder ") == 2  # both identities are named
    # a rollout of another family, and another max length, are refused the same way
    inputs = open_inputs([rollout["samples"]])
    identity = encoder_identity(rollout["model"], "fp32", 128)
    stored = inputs.manifests[0].extra[CONDITIONING]["identity"]
    with pytest.raises(UserInputError, match=r"max length 128.*max length 77"):
        stored_conditioning(inputs.paths, inputs.manifests, {**identity, "max_sequence_length": 77})
    with pytest.raises(UserInputError, match=r"StableDiffusion3Pipeline .*FluxPipeline"):
        stored_conditioning(inputs.paths, inputs.manifests, {**stored, "pipeline": "FluxPipeline"})


@pytest.mark.parametrize("rollout", ["sd3"], indirect=True)  # one family is enough
def test_another_dtype_encodes_as_before_and_a_missing_prompt_is_one_line(
    rollout: dict, tmp_path: Path
) -> None:
    replay = logprob(rollout, rollout["samples"], tmp_path / "bf16", "--dtype", "bf16")
    assert replay["conditioning"] == "encoded: the rollout stored it at fp32, this run's --dtype is bf16"
    assert [c for c in replay["loaded_components"] if c.startswith(TEXT)]
    policy = FlowPolicy.load(rollout["model"], conditioning={}, vae=False)
    assert policy.loaded_components == ["scheduler", "transformer"]
    with pytest.raises(UserInputError, match=r"'a blue sky' .* not in the rollout's stored conditioning"):
        policy.encode(["a blue sky"], None, cfg=False)


@pytest.mark.parametrize("rollout", ["sd3"], indirect=True)  # one family is enough
def test_a_corrupt_conditioning_file_is_one_line(rollout: dict, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(rollout["samples"], broken)
    (broken / "conditioning-00001-of-00002.safetensors").write_bytes(b"not it")
    fails(
        ["logprob", "--model", str(rollout["model"]), "--in", str(broken), "--out", str(tmp_path / "lp")],
        "conditioning-00001-of-00002.safetensors",
        "sha256",
    )


def test_the_online_trainer_takes_the_samplers_conditioning(
    staged: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`online` with the in-process sampler: the driver (the trainer) loads no text encoder or VAE and
    trains on the conditioning the sampler worker hands over; the run is the staged one's (tests/test_online.py
    holds the numbers)."""
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        "sample:\n  steps: 2\n  guidance: 1.0\n  resolution: 32\n  group_size: 2\n  batch_size: 3\n"
        "update:\n  algo: flow_grpo\n  lora_rank: 4\n  lora_alpha: 8\n"
    )
    loaded: list[FlowPolicy] = []
    load = FlowPolicy.load.__func__  # the driver loads here; the sampler worker is another process

    def recording(cls: type[FlowPolicy], *args: object, **kwargs: object) -> FlowPolicy:
        loaded.append(load(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(FlowPolicy, "load", classmethod(recording))
    run(
        "online", "--config", str(preset), "--model", str(staged["model"]), "--prompts", str(staged["prompts"]),
        "--reward", "jpeg_compressibility", "--iterations", "1", "--out", str(tmp_path / "online"),
    )  # fmt: skip
    (driver,) = loaded
    assert driver.loaded_components == ["scheduler", "transformer"]
    assert {key[0] for key in driver._prompt_cache} == set(PROMPTS)  # every trained prompt, from the sampler


@pytest.mark.parametrize("rollout", ["sd3"], indirect=True)
def test_a_shard_without_its_runs_file_stores_none(rollout: dict, tmp_path: Path) -> None:
    """A rollout whose shard has no conditioning file of this very run (resumed from a run that stored
    none, or a file another run left) lists none: it is encoded downstream, never mixed."""
    from stages.models.conditioning import _metadata, conditioning_record

    record = ShardSet(rollout["samples"]).manifest.extra[CONDITIONING]
    identity = record["identity"]
    copy = tmp_path / "copy"
    shutil.copytree(rollout["samples"], copy)
    run_id = _metadata((copy / record["files"][0]["file"]).read_bytes())["run"]
    at = {"model": rollout["model"], "dtype": "fp32", "max_sequence_length": identity["max_sequence_length"]}
    assert conditioning_record(copy, 2, run_id, **at) == {CONDITIONING: record}
    assert conditioning_record(copy, 2, "another run", **at) is None
    (copy / record["files"][1]["file"]).unlink()
    assert conditioning_record(copy, 2, run_id, **at) is None


def test_offline_pairs_encode_stores_the_conditioning_and_dpo_loads_no_encoder(
    tiny_sd3: Path, tmp_path: Path
) -> None:
    """`pairs` loads no model; `encode` (which loads the pipeline for its VAE) stores the pairs' prompt
    conditioning at the text length offline `update` encodes at, and `update --algo dpo` on its output
    loads neither text encoder nor tokenizer, with the weights of re-encoding the prompts. One prompt:
    re-encoding prompts batched otherwise rounds otherwise (see the flow_grpo test above)."""
    import io
    import json as json_module

    from PIL import Image

    def png(seed: int) -> bytes:
        pixels = torch.randint(0, 256, (32, 32, 3), generator=torch.Generator().manual_seed(seed))
        buffer = io.BytesIO()
        Image.fromarray(pixels.to(torch.uint8).numpy()).save(buffer, format="PNG")
        return buffer.getvalue()

    for i in range(4):
        (tmp_path / f"{i}.png").write_bytes(png(i))
    rows = [
        {"prompt": PROMPTS[0], "chosen": f"{2 * k}.png", "rejected": f"{2 * k + 1}.png"} for k in range(2)
    ]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json_module.dumps(r) for r in rows) + "\n")
    run("pairs", "--pairs", str(tmp_path / "pairs.jsonl"), "--out", str(tmp_path / "pairs"))
    encoded = run(
        "encode", "--model", str(tiny_sd3), "--in", str(tmp_path / "pairs"), "--resolution", "32",
        "--out", str(tmp_path / "latents"),
    )  # fmt: skip
    assert encoded["conditioning"] == "stored"
    record = ShardSet(tmp_path / "latents").manifest.extra[CONDITIONING]
    assert record["identity"] == encoder_identity(tiny_sd3, "fp32", 128)  # offline update's text length
    for info in record["files"]:  # the one prompt, stored once per shard
        assert {key.split(".")[0] for key in load_file(tmp_path / "latents" / info["file"])} == {"0"}
    without_conditioning(tmp_path / "latents", tmp_path / "plain")
    policies = {}
    for kind in ("latents", "plain"):
        policies[kind] = run(
            "update", "--model", str(tiny_sd3), *ins(tmp_path / "pairs", tmp_path / kind), "--algo", "dpo",
            "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3", "--out", str(tmp_path / f"{kind}-policy"),
        )  # fmt: skip
    assert policies["latents"]["conditioning"] == "stored"
    assert policies["latents"]["loaded_components"] == ["scheduler", "transformer"]
    assert policies["plain"]["conditioning"].startswith("encoded")
    assert [c for c in policies["plain"]["loaded_components"] if c.startswith(TEXT)]
    assert policies["latents"]["optimizer_steps"] == policies["plain"]["optimizer_steps"] >= 1
    a = load_file(tmp_path / "latents-policy" / LORA_WEIGHTS)
    b = load_file(tmp_path / "plain-policy" / LORA_WEIGHTS)
    assert a.keys() == b.keys() and any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)
    assert all(torch.equal(a[k], b[k]) for k in a)
