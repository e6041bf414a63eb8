"""Weights from wherever users keep them: Hub ids in the local Hugging Face cache, LoRAs that other tools
saved (diffusers' `save_lora_weights` / `save_lora_adapter`, PEFT's `save_pretrained` as flow_grpo
does), and adapters that name their base model by absolute path (and Hub id)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import fails, ins, run, sample_args

from stages.errors import UserInputError
from stages.models.diffusion import FlowPolicy
from stages.models.folders import ADAPTER_CONFIG, LORA_WEIGHTS, PEFT_CONFIG
from stages.models.hub import hub_origin, locate, split_hub_id
from stages.shards.digest import content_digest
from stages.shards.reader import ShardSet

REPO = "omnirl-test/sd3-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def cache_repo(hub: Path, repo: str, folder: Path, commit: str) -> Path:
    """Put `folder` into the hub cache `hub` as huggingface_hub lays a download out: content-addressed
    blobs, `snapshots/<commit>/` of relative symlinks to them, and `refs/main` naming the commit."""
    root = hub / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / src.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None) -> Path:
    """An empty hub cache under a temporary HF_HOME, used by this process's huggingface_hub."""
    import huggingface_hub.constants

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    return home / "hub"


def test_hub_ids_are_spelled_org_name_with_an_optional_revision() -> None:
    assert split_hub_id("org/name") == ("org/name", None)
    assert split_hub_id("org/na.me-2@v1.0") == ("org/na.me-2", "v1.0")
    for not_an_id in ("models", "runs/it0/policy/x", "./org/name", "~/org", "org/name@", "org/na--me"):
        assert split_hub_id(not_an_id) is None, not_an_id


def test_a_hub_id_resolves_through_the_offline_cache(
    hub: Path, tiny_sd3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = cache_repo(hub, REPO, tiny_sd3, COMMIT)
    for spelling in (REPO, f"{REPO}@main", f"{REPO}@{COMMIT}"):
        assert locate(spelling, "--model") == snapshot
    assert hub_origin(snapshot) == {"id": REPO, "revision": COMMIT}
    assert hub_origin(tiny_sd3) is None
    # the run identity hashes the snapshot's bytes (through the blob symlinks), equal to the folder's
    assert content_digest(snapshot, "--model") == content_digest(tiny_sd3, "--model")
    with pytest.raises(UserInputError, match=f"`hf download {REPO} --revision v2`"):
        locate(f"{REPO}@v2", "--model")
    # a path that exists wins over the id it spells
    monkeypatch.chdir(tmp_path)
    (tmp_path / REPO).mkdir(parents=True)
    assert locate(REPO, "--model") == Path(REPO)


def test_sample_logprob_and_update_take_hub_ids(hub: Path, staged: dict[str, Path], tmp_path: Path) -> None:
    snapshot = cache_repo(hub, REPO, staged["model"], COMMIT)
    cache_repo(hub, "omnirl-test/lora", staged["policy1"], COMMIT)
    out = tmp_path / "samples"
    run(*sample_args(REPO, staged["prompts"], out, "--num-shards", "2"))  # the staged rollout's options
    ours, local = ShardSet(out), ShardSet(staged["samples"])
    assert torch.equal(ours.read_all()["final_latent"], local.read_all()["final_latent"])
    assert ours.manifest.config["model_sha256"] == local.manifest.config["model_sha256"]
    assert ours.manifest.policy["model"] == str(snapshot)

    logprobs = tmp_path / "logprobs"
    run(
        "logprob",
        "--model",
        REPO,
        "--adapter",
        "omnirl-test/lora",
        "--in",
        str(staged["samples"]),
        "--out",
        str(logprobs),
    )
    assert ShardSet(logprobs).manifest.config["adapter_sha256"] == content_digest(
        staged["policy1"], "--adapter"
    )

    policy = tmp_path / "policy"
    inputs = ins(staged["samples"], staged["logprobs"], staged["advantages"])
    run("update", "--model", f"{REPO}@main", *inputs, "--lora-rank", "2", "--out", str(policy))
    record = json.loads((policy / ADAPTER_CONFIG).read_text())
    assert record["base_model"] == str(snapshot) and Path(record["base_model"]).is_absolute()
    assert (record["base_model_id"], record["base_model_revision"]) == (REPO, COMMIT)


@pytest.mark.parametrize("option", ["--model", "--adapter"])
def test_a_hub_id_not_in_the_cache_is_one_line(
    option: str, hub: Path, staged: dict[str, Path], tmp_path: Path
) -> None:
    missing = "omnirl-test/not-cached"
    model = missing if option == "--model" else str(staged["model"])
    args = ["logprob", "--model", model, "--in", str(staged["samples"]), "--out", str(tmp_path / "out")]
    if option == "--adapter":
        args += ["--adapter", missing]
    fails(args, f"{option} {missing}", "not in the local Hugging Face cache", f"`hf download {missing}`")
    assert not (tmp_path / "out").exists()


def test_online_takes_the_same_hub_ids(hub: Path, staged: dict[str, Path], tmp_path: Path) -> None:
    missing, preset = "omnirl-test/not-cached@v1", tmp_path / "preset.yaml"
    preset.write_text("{}\n")
    args = ["online", "--config", str(preset), "--model", missing, "--prompts", str(staged["prompts"])]
    fails(
        [*args, "--out", str(tmp_path / "run")],
        f"--model {missing}",
        "`hf download omnirl-test/not-cached --revision v1`",
    )
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ LoRAs of other tools


def _lora_pipe(model: Path, seed: int):
    """The tiny pipeline with a random (not identity) LoRA of rank 4, alpha 8 on its transformer."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig

    pipe = DiffusionPipeline.from_pretrained(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=LORA_TARGETS)
        pipe.transformer.add_adapter(config)
    return pipe


@pytest.fixture(scope="module")
def third_party(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """LoRA folders as other tools save them (none has omnirl_adapter.json)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    root = tmp_path_factory.mktemp("third-party")
    folders = {name: root / name for name in ("diffusers", "diffusers-module", "peft")}
    pipe = _lora_pipe(tiny_sd3, 1)  # a diffusers training script's save, without alpha metadata
    type(pipe).save_lora_weights(
        folders["diffusers"], transformer_lora_layers=get_peft_model_state_dict(pipe.transformer)
    )
    _lora_pipe(tiny_sd3, 2).transformer.save_lora_adapter(folders["diffusers-module"])
    from diffusers import DiffusionPipeline

    transformer = DiffusionPipeline.from_pretrained(tiny_sd3).transformer
    with torch.random.fork_rng(devices=[]):  # flow_grpo: get_peft_model on the transformer, save_pretrained
        torch.manual_seed(3)
        config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=LORA_TARGETS)
        get_peft_model(transformer, config).save_pretrained(folders["peft"])
    assert not any((f / ADAPTER_CONFIG).exists() for f in folders.values())
    assert (folders["peft"] / PEFT_CONFIG).is_file() and (folders["diffusers"] / LORA_WEIGHTS).is_file()
    return folders


def _by_hand(model: Path, layout: str, folder: Path) -> FlowPolicy:
    """The pipeline with the LoRA applied as its own library documents, wrapped as a policy."""
    from diffusers import DiffusionPipeline
    from peft import PeftModel

    from stages.models.sd3 import SD3Adapter

    pipe = DiffusionPipeline.from_pretrained(model)
    if layout == "diffusers":
        pipe.load_lora_weights(folder)
    elif layout == "diffusers-module":
        pipe.transformer.load_lora_adapter(folder, prefix=None, weight_name=LORA_WEIGHTS)
    else:
        pipe.transformer = PeftModel.from_pretrained(pipe.transformer, folder)
    return FlowPolicy(
        pipe,
        SD3Adapter(pipe),
        model_path=str(model),
        adapter=None,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


@pytest.mark.parametrize("layout", ["diffusers", "diffusers-module", "peft"])
def test_a_lora_of_another_tool_loads_as_applied_by_hand(
    layout: str, third_party: dict[str, Path], tiny_sd3: Path
) -> None:
    ours = FlowPolicy.load(tiny_sd3, adapter=third_party[layout])
    hand = _by_hand(tiny_sd3, layout, third_party[layout])
    base = FlowPolicy.load(tiny_sd3)
    x = torch.randn(2, *ours.latent_shape(32), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.3])

    def v(policy: FlowPolicy) -> torch.Tensor:
        with torch.no_grad():
            return policy.velocity(x, sigma, policy.encode(["a red apple", "a blue sky"], None, False), 1.0)

    assert ours.lora and torch.equal(v(ours), v(hand))
    assert (v(ours) - v(base)).abs().max() > 1e-3  # the LoRA changes the model


def test_a_peft_lora_with_weights_that_fit_no_layer_is_refused(
    third_party: dict[str, Path], tiny_sd3: Path, tmp_path: Path
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "renamed"
    shutil.copytree(third_party["peft"], folder)
    state = load_file(folder / "adapter_model.safetensors")
    key = sorted(state)[0]
    state[key.replace("transformer_blocks.0.", "transformer_blocks.9.")] = state.pop(key)
    save_file(state, folder / "adapter_model.safetensors")
    with pytest.raises(UserInputError, match="1 of its LoRA weights fit no layer of the transformer"):
        FlowPolicy.load(tiny_sd3, adapter=folder)


def test_a_peft_lora_samples_replays_and_trains(
    third_party: dict[str, Path], staged: dict[str, Path], tmp_path: Path
) -> None:
    adapter = third_party["peft"]
    samples = tmp_path / "samples"
    run(
        *sample_args(
            staged["model"], staged["prompts"], samples, "--num-shards", "2", "--adapter", str(adapter)
        )
    )
    latents = ShardSet(samples).read_all()["final_latent"]
    assert not torch.equal(latents, ShardSet(staged["samples"]).read_all()["final_latent"])
    logprobs = tmp_path / "logprobs"
    replay = run(
        "logprob",
        "--model",
        str(staged["model"]),
        "--adapter",
        str(adapter),
        "--in",
        str(samples),
        "--out",
        str(logprobs),
    )
    assert replay["abs_delta_max"] < 1e-5  # on-policy: the replay under the same LoRA gives the rollout's
    # update continues from the LoRA's own weights (rank 4, alpha 8) with a fresh optimizer at step 0:
    # at --lr 0 the saved adapter is the LoRA itself, now in diffusers' layout with omnirl's record
    policy = tmp_path / "policy"
    inputs = ins(staged["samples"], staged["logprobs"], staged["advantages"])
    result = run(
        "update",
        "--model",
        str(staged["model"]),
        "--adapter",
        str(adapter),
        *inputs,
        "--lr",
        "0",
        "--out",
        str(policy),
    )
    record = json.loads((policy / ADAPTER_CONFIG).read_text())
    assert result["step"] == result["optimizer_steps"] == record["step"] > 0
    assert record["parent_adapter"] == str(adapter)
    continued, loaded = (
        FlowPolicy.load(staged["model"], adapter=policy),
        FlowPolicy.load(staged["model"], adapter=adapter),
    )
    lora = {k: p for k, p in continued.transformer.named_parameters() if "lora_" in k}
    theirs = dict(loaded.transformer.named_parameters())
    assert lora and sorted(lora) == sorted(k for k in theirs if "lora_" in k)
    assert all(torch.equal(p, theirs[k]) for k, p in lora.items())
    assert continued.transformer.peft_config["default"].lora_alpha == 8


def test_update_refuses_a_lora_that_also_changes_a_text_encoder(
    tiny_sd3: Path, staged: dict[str, Path], tmp_path: Path
) -> None:
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    pipe = _lora_pipe(tiny_sd3, 4)
    config = LoraConfig(r=2, init_lora_weights=False, target_modules=["q_proj"])
    inject_adapter_in_model(config, pipe.text_encoder)
    folder = tmp_path / "with-text-encoder"
    type(pipe).save_lora_weights(
        folder,
        transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
        text_encoder_lora_layers=get_peft_model_state_dict(pipe.text_encoder),
    )
    assert FlowPolicy.load(tiny_sd3, adapter=folder).untrained_loras() == ["text_encoder"]
    out = tmp_path / "policy"
    args = ["update", "--model", str(staged["model"]), "--adapter", str(folder), "--out", str(out)]
    fails(
        [*args, *ins(staged["samples"], staged["logprobs"], staged["advantages"])],
        f"--adapter {folder}",
        "text_encoder",
    )
    assert not out.exists()


def test_an_unrecognised_folder_names_the_layouts_it_takes(staged: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "lora.safetensors").write_bytes(b"")
    args = sample_args(staged["model"], staged["prompts"], tmp_path / "out", "--adapter", str(folder))
    fails(args, f"--adapter {folder}", LORA_WEIGHTS, PEFT_CONFIG, "save_lora_weights", "save_pretrained")


# ------------------------------------------------------------------------------ VLM adapters


def test_a_vlm_adapter_loads_with_autopeft_from_another_directory(
    tiny_vlm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    from peft import AutoPeftModelForCausalLM

    from stages.models.vlm import VLMPolicy

    monkeypatch.chdir(tiny_vlm.parent)
    policy = VLMPolicy.load(Path(tiny_vlm.name))  # the base named relative to the working directory
    policy.add_lora(rank=2, alpha=4, seed=1)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    adapter = tmp_path / "adapter"
    policy.save_adapter(adapter, kind="lora", extra={"step": 1})
    assert json.loads((adapter / PEFT_CONFIG).read_text())["base_model_name_or_path"] == str(tiny_vlm)
    assert json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model"] == str(tiny_vlm)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter))
    theirs = {k.replace(".default", ""): p for k, p in model.named_parameters() if "lora_" in k}
    ours = {k.replace(".default", ""): p for k, p in policy.model.named_parameters() if "lora_" in k}
    assert ours and sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
