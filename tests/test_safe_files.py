"""Nothing a user passes is unpickled: pickle-format weights are refused before a loader opens them, a
torch checkpoint is read as tensors only, and each refusal is one line naming the file (exit 2)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import fails

from stages.errors import UserInputError
from stages.safe_files import load_tensors, refuse_pickled_weights


class _Payload:
    """What a crafted pickle runs when unpickled: it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def test_a_pipeline_with_pickled_weights_is_refused_before_loading(tiny_sd3: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_sd3, model)
    marker = tmp_path / "ran"
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.unlink()
    (model / "transformer" / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    (tmp_path / "p.txt").write_text("a red apple\n")
    args = [
        "sample",
        "--model",
        str(model),
        "--prompts",
        str(tmp_path / "p.txt"),
        "--out",
        str(tmp_path / "s"),
    ]
    line = fails(args, "--model", "diffusion_pytorch_model.bin is a pickle", "safetensors")
    assert "weights_only=False" not in line and not marker.exists()
    assert not (tmp_path / "s").exists()

    # an adapter folder is held to the same rule (a PEFT/diffusers LoRA saved as .bin)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "pytorch_lora_weights.bin").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UserInputError, match=r"--adapter .*pytorch_lora_weights\.bin is a pickle"):
        refuse_pickled_weights(adapter, "--adapter")
    # safetensors beside a pickle: the loaders take the safetensors, so the folder is fine
    (adapter / "pytorch_lora_weights.safetensors").write_bytes(b"")
    refuse_pickled_weights(adapter, "--adapter")
    assert not marker.exists()


def test_torch_checkpoints_load_as_tensors_only(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    crafted = tmp_path / "optimizer.pt"
    torch.save({"state": {0: {"exp_avg": _Payload(marker)}}}, crafted)
    with pytest.raises(
        UserInputError, match=r"optimizer\.pt is a pickle that holds more than tensors"
    ) as info:
        load_tensors(crafted, "--adapter a")
    assert "\n" not in str(info.value) and "weights_only=False" not in str(info.value)
    assert not marker.exists()

    whole = tmp_path / "whole.pt"
    torch.save({"w": torch.arange(6.0)}, whole)
    assert torch.equal(load_tensors(whole, "x")["w"], torch.arange(6.0))
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[:100])
    with pytest.raises(UserInputError, match=r"cut\.pt is not a whole torch tensor file .* truncated"):
        load_tensors(cut, "x")


def test_a_crafted_optimizer_state_is_refused_in_one_line(tmp_path: Path) -> None:
    from stages.update.trainer import load_state

    adapter = tmp_path / "adapter"
    state = adapter / "trainer_state"
    state.mkdir(parents=True)
    marker = tmp_path / "ran"
    (state / "state.json").write_text(json.dumps({"step": 1}))
    torch.save({"state": _Payload(marker)}, state / "optimizer.pt")
    with pytest.raises(UserInputError, match=r"--adapter .*optimizer\.pt is a pickle that holds more"):
        load_state(adapter)
    assert not marker.exists()
