"""User mistakes end in one line naming the option or file and what to do, exit 2 (issue 10, item 21):
prompt files in another encoding, a --resolution the model cannot take, a group size that cannot fit
in memory, an --adapter that is missing, damaged, of another model family or of another base model.
LoRA folders other tools wrote (diffusers, PEFT) load as they are."""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import PROMPTS, fails, ins, run
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers.utils import logging as transformers_logging

from stages.errors import UserInputError
from stages.models.folders import ADAPTER_CONFIG, LORA_WEIGHTS, PEFT_CONFIG, PEFT_WEIGHTS
from stages.shards.manifest import MANIFEST_NAME
from stages.shards.reader import ShardSet

# In this process transformers was imported before the CLI could silence its loading bars (a real
# `omnirl` process sets the variables first); turn them off so stderr holds only omnirl's own lines.
transformers_logging.disable_progress_bar()


def finished(out: Path) -> bool:
    """True when `out` looks like a finished output: a shard-set manifest or an adapter config."""
    return (out / MANIFEST_NAME).exists() or (out / ADAPTER_CONFIG).exists()


def sample_cmd(
    model: Path, prompts: Path, out: Path, *extra: str, resolution: str | None = "32"
) -> list[str]:
    """A small diffusion `sample`: 1 sample per prompt, 2 SDE steps at `resolution` px, no CFG."""
    return [
        "sample",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "-n",
        "1",
        "--steps",
        "2",
        *(["--resolution", resolution] if resolution else []),
        "--guidance",
        "1",
        "--out",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


# ------------------------------------------------------------------------------ prompt files


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("p.txt", "a cat\ncafé\n"),
        ("p.jsonl", '{"prompt": "a cat"}\n{"prompt": "café"}\n'),
        ("p.csv", "prompt\ncafé\n"),
    ],
)
def test_a_prompt_file_in_another_encoding(tiny_sd3: Path, tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_bytes(text.encode("latin-1"))
    out = tmp_path / "samples"
    line = fails(sample_cmd(tiny_sd3, path, out), str(path), "line 2", "save the file as UTF-8")
    assert "internal error" not in line and not out.exists()


def test_a_pairs_table_in_another_encoding(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_bytes('{"prompt": "café", "chosen": "a.png", "rejected": "b.png"}\n'.encode("latin-1"))
    out = tmp_path / "pairs"
    fails(
        ["pairs", "--pairs", str(path), "--out", str(out)],
        f"--pairs {path}: line 1",
        "save the file as UTF-8",
    )
    assert not out.exists()


# ------------------------------------------------------------------------------ --model


def test_a_model_folder_that_is_not_a_pipeline_is_refused_before_it_is_read(
    prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sample --model /tmp` would hash all of /tmp: the folder is checked first, in one line."""
    import stages.shards.digest

    folder = tmp_path / "not-a-model"
    (folder / "big").mkdir(parents=True)
    (folder / "big" / "file.bin").write_bytes(b"x" * 1024)

    def walked(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"content_digest{args} ran before the --model check")

    monkeypatch.setattr(stages.shards.digest, "content_digest", walked)
    out = tmp_path / "samples"
    fails(sample_cmd(folder, prompts, out), f"--model {folder}", "model_index.json")
    assert not out.exists()


# ------------------------------------------------------------------------------ --resolution


@pytest.mark.parametrize("flags", [["--resolution", "0"], ["--resolution", "-16"], ["--set", "resolution=0"]])
def test_sample_resolution_that_is_not_positive(
    tiny_sd3: Path, prompts: Path, tmp_path: Path, flags: list[str]
) -> None:
    out = tmp_path / "samples"
    fails(sample_cmd(tiny_sd3, prompts, out, *flags, resolution=None), "--resolution")
    assert not out.exists()


def test_sample_resolution_that_the_vae_and_patching_cannot_take(
    tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "samples"
    # the tiny VAE halves the side twice (factor 4) and the transformer patches 2×2: multiples of 8
    line = fails(sample_cmd(tiny_sd3, prompts, out, resolution="36"), "--resolution 36", "multiple of 8")
    assert "positive" in line and not finished(out)


@pytest.mark.parametrize("flags", [["--frames", "100001"], ["--set", "frames=4097"]])
def test_sample_frames_past_the_servers_bound(
    tiny_sd3: Path, prompts: Path, tmp_path: Path, flags: list[str]
) -> None:
    from stages.sample.rollout import SampleConfig
    from stages.sample.rollout_server import MAX_FRAMES

    out = tmp_path / "samples"
    fails(sample_cmd(tiny_sd3, prompts, out, *flags), "--frames", f"{MAX_FRAMES}")
    assert not out.exists()
    SampleConfig(frames=MAX_FRAMES).validate()  # the bound itself is allowed, in the library as in the CLI
    with pytest.raises(UserInputError, match=rf"--frames {MAX_FRAMES + 1}: must lie in \[1, {MAX_FRAMES}\]"):
        SampleConfig(frames=MAX_FRAMES + 1).validate()


@pytest.mark.parametrize("flags", [["--resolution", "0"], ["--set", "resolution=0"]])
def test_encode_resolution_zero(staged: dict[str, Path], tmp_path: Path, flags: list[str]) -> None:
    out = tmp_path / "latents"
    fails(
        [
            "encode",
            "--model",
            str(staged["model"]),
            "--in",
            str(staged["samples"]),
            *flags,
            "--out",
            str(out),
        ],
        "--resolution",
    )
    assert not out.exists()


# ------------------------------------------------------------------------------ a huge -n


def _limit_memory() -> None:
    """8 GiB of address space: the same verdict on any machine, and no machine filled if a check fails."""
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def _omnirl_limited(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "omnirl_cli", *args],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=_limit_memory,
        timeout=300,
    )


def _vlm_prompts(folder: Path) -> Path:
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), "red").save(buf, format="PNG")
    row = {
        "prompt": [{"role": "user", "content": "<image>What colour?"}],
        "images": [{"bytes": buf.getvalue()}],
    }
    path = folder / "colours.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    return path


@pytest.mark.parametrize("family", ["sd3", "vlm"])
def test_a_group_size_that_cannot_fit_in_memory(
    family: str, tiny_sd3: Path, tiny_vlm: Path, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "samples"
    if family == "sd3":
        args = sample_cmd(tiny_sd3, prompts, out)
    else:
        args = [
            "sample",
            "--model",
            str(tiny_vlm),
            "--prompts",
            str(_vlm_prompts(tmp_path)),
            "-n",
            "1",
            "--out",
            str(out),
        ]
    args[args.index("-n") + 1] = "100000000"
    result = _omnirl_limited(args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and "-n/--group-size 100000000" in lines[0] and "GiB" in lines[0], lines
    assert not out.exists()


# ------------------------------------------------------------------------------ --adapter


@pytest.fixture(scope="module")
def bad_adapters(staged: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters a user may pass by mistake, built from the staged run's LoRA (`policy1`)."""
    root = tmp_path_factory.mktemp("adapters")
    good = staged["policy1"]

    def copy(name: str) -> Path:
        shutil.copytree(good, root / name)
        return root / name

    a = {"missing": root / "nope", "a file": staged["prompts"], "weights file": good / LORA_WEIGHTS}
    a["no adapter"] = root / "notes"
    a["no adapter"].mkdir()
    (a["no adapter"] / "notes.txt").write_text("not an adapter")
    a["corrupt json"] = copy("corrupt")
    (a["corrupt json"] / ADAPTER_CONFIG).write_text('{"kind": ')
    a["no kind"] = copy("nokind")
    (a["no kind"] / ADAPTER_CONFIG).write_text(json.dumps({"step": 3}))
    a["peft without weights"] = root / "peft"
    a["peft without weights"].mkdir()
    (a["peft without weights"] / PEFT_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    a["damaged weights"] = copy("damaged")
    weights = a["damaged weights"] / LORA_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    a["other base model"] = copy("other")
    state = load_file(good / LORA_WEIGHTS)
    other = {k: torch.zeros(v.shape[0], v.shape[1] + 3) if "lora_A" in k else v for k, v in state.items()}
    save_file(other, a["other base model"] / LORA_WEIGHTS)
    return a


# What each mistake's line says besides the path.
SAYS = {
    "missing": "no such folder/file",
    "a file": "not an adapter folder",
    "weights file": f"put it in a folder as {LORA_WEIGHTS}",
    "no adapter": f"no {ADAPTER_CONFIG}, {LORA_WEIGHTS} or {PEFT_CONFIG}",
    "corrupt json": "is not valid JSON",
    "no kind": 'no "kind" of lora or full',
    "peft without weights": f"a PEFT LoRA folder without {PEFT_WEIGHTS}",
    "damaged weights": "its weights do not load onto --model",
    "other base model": "size mismatch",
}


@pytest.mark.parametrize("command", ["sample", "logprob", "update"])
@pytest.mark.parametrize("mistake", list(SAYS))
def test_an_adapter_that_is_not_one(
    command: str, mistake: str, bad_adapters: dict[str, Path], staged: dict[str, Path], tmp_path: Path
) -> None:
    adapter, out, model = bad_adapters[mistake], tmp_path / "out", staged["model"]
    if command == "sample":
        args = sample_cmd(model, staged["prompts"], out)
    elif command == "logprob":
        args = ["logprob", "--model", str(model), "--in", str(staged["samples"]), "--out", str(out)]
    else:
        inputs = ins(staged["samples"], staged["logprobs"], staged["advantages"])
        args = ["update", "--model", str(model), *inputs, "--out", str(out)]
    fails([*args, "--adapter", str(adapter)], f"--adapter {adapter}", SAYS[mistake])
    assert not finished(out)


def test_a_diffusers_lora_folder_samples_like_the_omnirl_adapter_it_came_from(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    third_party = tmp_path / "lora"
    third_party.mkdir()
    shutil.copy(staged["policy1"] / LORA_WEIGHTS, third_party / LORA_WEIGHTS)  # no omnirl_adapter.json
    latents = {}
    for name, adapter in (
        ("omnirl", [str(staged["policy1"])]),
        ("diffusers", [str(third_party)]),
        ("base", []),
    ):
        out = tmp_path / name
        run(
            *sample_cmd(
                staged["model"], staged["prompts"], out, *(["--adapter", *adapter] if adapter else [])
            )
        )
        latents[name] = ShardSet(out).read_all()["final_latent"]
    assert ShardSet(tmp_path / "diffusers").manifest.policy["version"] == 0  # no step recorded: step 0
    assert torch.equal(latents["omnirl"], latents["diffusers"])
    assert not torch.equal(latents["diffusers"], latents["base"])  # the LoRA was applied


# ------------------------------------------------------------------------------ --adapter, VLM


@pytest.fixture(scope="module")
def vlm_lora(tiny_vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An omnirl LoRA of the tiny VLM (PEFT folder + omnirl_adapter.json)."""
    from stages.models.vlm import VLMPolicy

    out = tmp_path_factory.mktemp("vlm-lora") / "policy"
    policy = VLMPolicy.load(tiny_vlm)
    policy.add_lora(rank=2, alpha=4, seed=1)
    policy.save_adapter(out, kind="lora", extra={"step": 1})
    return out


def test_vlm_refuses_a_diffusers_lora_and_damaged_peft_weights(
    tiny_vlm: Path, vlm_lora: Path, bad_adapters: dict[str, Path], staged: dict[str, Path], tmp_path: Path
) -> None:
    prompts, out = _vlm_prompts(tmp_path), tmp_path / "out"
    args = ["sample", "--model", str(tiny_vlm), "--prompts", str(prompts), "-n", "2", "--max-new-tokens", "2"]
    diffusers_lora = staged["policy1"]
    fails(
        [*args, "--adapter", str(diffusers_lora), "--out", str(out)],
        f"--adapter {diffusers_lora}",
        f"a diffusers LoRA folder ({LORA_WEIGHTS}), which this --model does not load",
        PEFT_CONFIG,
    )
    damaged = tmp_path / "damaged"
    shutil.copytree(vlm_lora, damaged)
    weights = next(damaged.glob("adapter_model.*"))
    weights.write_bytes(weights.read_bytes()[:50])
    fails(
        [*args, "--adapter", str(damaged), "--out", str(out)],
        f"--adapter {damaged}",
        "do not load onto --model",
    )
    assert not finished(out)


def test_a_peft_folder_loads_the_same_weights_as_the_omnirl_adapter(
    tiny_vlm: Path, vlm_lora: Path, tmp_path: Path
) -> None:
    from stages.models.vlm import VLMPolicy

    peft = tmp_path / "peft"
    shutil.copytree(vlm_lora, peft)
    (peft / ADAPTER_CONFIG).unlink()
    ours = dict(VLMPolicy.load(tiny_vlm, adapter=vlm_lora).model.named_parameters())
    theirs = dict(VLMPolicy.load(tiny_vlm, adapter=peft).model.named_parameters())
    lora = [k for k in ours if "lora_A" in k]
    assert lora and sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(ours[k].abs().sum() > 0 for k in lora)  # the LoRA weights themselves were loaded


def test_a_resolution_past_the_positional_table_is_one_line(tmp_path: Path) -> None:
    model = tmp_path / "demo"
    run("init-model", "--family", "sd3", "--size", "demo", "--seed", "0", str(model))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    args = [
        "sample",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--resolution",
        "128",
        "--out",
        str(tmp_path / "s"),
    ]
    fails(args, "--resolution 128", "at most 64 px")
