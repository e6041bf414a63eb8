"""Which model folders are VLM policies (`stages.models.vlm.VLMPolicy`) and how each family's module
loads its model and processor."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from stages.errors import UserInputError
from stages.models.folders import native_class

# `config.json` model types this module loads as policies, and the module of each family (its
# `load_model` and `load_processor` read the folder's model and processor; importing it registers
# omnirl's processor classes; its optional `LORA_TARGETS` replaces `TEXT_LORA_TARGETS`, `TRAINS_FULL =
# False` refuses --full). A whole Qwen3-Omni folder (qwen3_omni_moe) loads as its thinker.
VLM_FAMILIES = {
    "bagel": "stages.models.bagel_vlm",
    "qwen2_5_vl": "stages.models.qwen2_5_vl",
    "qwen3_vl": "stages.models.qwen3_vl",
    "qwen3_vl_moe": "stages.models.qwen3_vl",
    "qwen3_omni_moe_thinker": "stages.models.qwen3_omni",
    "qwen3_omni_moe": "stages.models.qwen3_omni",
}
VLM_MODEL_TYPES = tuple(VLM_FAMILIES)
# Released folders of another layout (`folders.NATIVE_FOLDERS`) that also load as VLM policies, by their
# pipeline class: BAGEL is a diffusion family that understands too (`understands`).
NATIVE_VLMS = {"Bagel": "bagel"}


def model_type(model_dir: str | Path) -> str:
    """The family of a checkpoint folder: its transformers `model_type` (e.g. qwen2_5_vl), or that of a
    native folder that understands (`NATIVE_VLMS`)."""
    native = NATIVE_VLMS.get(native_class(Path(model_dir)) or "")
    if native and not (Path(model_dir) / "config.json").is_file():
        return native
    return str(json.loads((Path(model_dir) / "config.json").read_text()).get("model_type"))


def is_vlm_model(model_dir: str | Path) -> bool:
    """True when `model_dir` is a transformers vision-language checkpoint this module loads.

    A diffusers pipeline folder has `model_index.json`; a VLM has `config.json` with its model type.
    """
    config = Path(model_dir) / "config.json"
    if (Path(model_dir) / "model_index.json").is_file() or not config.is_file():
        return False
    try:
        return model_type(model_dir) in VLM_MODEL_TYPES
    except (json.JSONDecodeError, AttributeError):
        raise UserInputError(f"--model {model_dir}: config.json is not a JSON object") from None


def understands(model_dir: str | Path) -> bool:
    """True when `model_dir` loads as a VLM policy: a VLM (`is_vlm_model`) or a native folder that is also
    a diffusion family (`NATIVE_VLMS`: BAGEL), whose kind the data or `sample --understand` decides."""
    return is_vlm_model(model_dir) or native_class(Path(model_dir)) in NATIVE_VLMS


def family_module(model_dir: str | Path) -> Any:
    """The module of a VLM folder's family (`VLM_FAMILIES`)."""
    return importlib.import_module(VLM_FAMILIES[model_type(model_dir)])


def load_processor(model_dir: str | Path) -> Any:
    """The processor of a VLM folder, read by its family's module (local files only)."""
    return family_module(model_dir).load_processor(model_dir)


def load_model(model_dir: str | Path, dtype: torch.dtype) -> Any:
    """The policy network of a VLM folder, read by its family's module (local files only)."""
    return family_module(model_dir).load_model(model_dir, dtype)
