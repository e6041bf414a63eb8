"""What omnirl reads from a folder a user passes: safetensors and plain tensors, never a pickle's code.

Models, adapters, trainer states and reward checkpoints come from the Hub, colleagues and shared scratch
directories, so every file in them is untrusted input. Weights load from safetensors (JSON header + raw
bytes); a torch checkpoint (`optimizer.pt`, a reward's `.pt`) is read with `torch.load(weights_only=True)`,
whose unpickler builds tensors and plain containers only and refuses anything else. A weights folder that
holds only pickle-format weights (`.bin`, `.pt`, ...) is refused before any loader could open it, and each
refusal is one line naming the file.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from stages.errors import UserInputError

# suffixes of the pickle-based weight formats diffusers, transformers and PEFT fall back to
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SAFE = "omnirl loads safetensors (and weights_only tensors) only"


def refuse_pickled_weights(folder: str | Path, option: str) -> None:
    """Refuse a model or adapter folder (`option` names it) whose weights, in the folder itself or in one
    of its component subfolders (those with a config.json: what diffusers and transformers load), are
    pickle files with no safetensors beside them: a loader would fall back to them. Folders holding
    safetensors are left to the loaders, which prefer them; a trainer state's `optimizer.pt` is no
    component and is read by `load_tensors`."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    components = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "config.json").is_file())
    for where in (folder, *components):
        pickled = sorted(p for p in where.iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES)
        if pickled and not any(where.glob("*.safetensors")):
            raise UserInputError(
                f"{option} {folder}: {pickled[0]} is a pickle; {SAFE}: save its weights with "
                "safetensors (save_pretrained(..., safe_serialization=True)) and pass that folder"
            )


def load_tensors(path: str | Path, option: str) -> Any:
    """`torch.load(path, weights_only=True)` on the CPU: tensors and plain containers only. A pickle that
    holds anything else (code to run), or a truncated or foreign file, is one line naming `option` and
    the file."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserInputError(
            f"{option}: {path} is a pickle that holds more than tensors; {SAFE}, and never unpickles code"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:  # a cut zip, a foreign file
        raise UserInputError(
            f"{option}: {path} is not a whole torch tensor file ({str(exc).strip().splitlines()[0][:200]}); "
            "it is truncated or corrupt"
        ) from None
