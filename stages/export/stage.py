"""A trained adapter as a plain model folder for deployment: the LoRA merged into the base weights.

`export_adapter` loads the base model with the adapter exactly as sampling does (`FlowPolicy.load`,
`VLMPolicy.load`), folds every LoRA layer into its base weight in fp32 (W + scale·B·A: peft's own
merge, `lora_weights.merge_lora`), casts to the asked dtype once and saves with the libraries' own
`save_pretrained`: a diffusers pipeline folder (every component, the trained one merged) or a
transformers model folder with its processor. Either loads with `from_pretrained` and no peft, and
computes what the base with the adapter computes (to rounding in fp32). A full adapter is saved the
same way, without a merge.

The base is the one the adapter records (`omnirl_adapter.json`: `base_model`, or its Hub id); a
different --model is refused while the recorded one exists, so an adapter is never merged into a base
it was not trained from. The folder is written as a hidden sibling and renamed into place once
complete, and an existing folder is never replaced.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from stages.errors import UserInputError
from stages.models.diffusion import DTYPES, FlowPolicy
from stages.models.factory import MODEL_CARD_NAME, folder_bytes, no_progress_bars
from stages.models.folders import ADAPTER_CONFIG, read_adapter_config
from stages.models.hub import cached_snapshot, download_hint, hub_origin
from stages.models.lora_weights import merge_lora
from stages.models.vlm import VLMPolicy
from stages.models.vlm_families import is_vlm_model
from stages.shards.atomic import fsync_dir


def recorded_base(adapter: Path, config: dict[str, Any], model: Path | None) -> Path:
    """The base model to merge `adapter` into: the folder its `omnirl_adapter.json` records (its
    `base_model`, else the cached snapshot of its `base_model_id`), or `model` where the adapter records
    none or its recorded folder is gone. A `model` other than an existing recorded base, or a Hub
    snapshot of another repository, is a `UserInputError`."""
    recorded = config.get("base_model")
    hub_id, revision = config.get("base_model_id"), config.get("base_model_revision")
    found = Path(recorded) if recorded and Path(recorded).exists() else None
    if found is None and hub_id:
        found = cached_snapshot(hub_id, revision)
    if model is None:
        if found is not None:
            return found
        if not recorded:
            raise UserInputError(
                f"ADAPTER {adapter}: records no base model (no {ADAPTER_CONFIG}: a LoRA folder another tool "
                "wrote); pass the model it was trained from as --model"
            )
        fetch = f", or fetch it with {download_hint(hub_id, revision)}" if hub_id else ""
        raise UserInputError(
            f"ADAPTER {adapter}: its base model {recorded} (in its {ADAPTER_CONFIG}) does not exist here; pass "
            f"that model as --model{fetch}"
        )
    origin = hub_origin(model)
    other_repo = hub_id and origin and origin["id"] != hub_id
    if other_repo or (found is not None and not os.path.samefile(found, model)):
        raise UserInputError(
            f"ADAPTER {adapter} was trained from {hub_id if other_repo else found} (its {ADAPTER_CONFIG}), not "
            f"--model {model}; drop --model to export onto its own base"
        )
    return model


def _save_pipeline(base: Path, adapter: Path, tmp: Path, dtype: torch.dtype, device: Any) -> int:
    """The diffusers pipeline of `base` with `adapter` applied, merged and saved into `tmp`; returns the
    number of LoRA layers merged (text-encoder LoRA layers of a diffusers LoRA file included)."""
    policy = FlowPolicy.load(base, adapter=adapter, device=device, dtype="fp32")
    merged = 0
    for module in policy.pipe.components.values():
        if isinstance(module, torch.nn.Module):
            merged += merge_lora(module)[1]
            module.to(dtype)
    policy.pipe.save_pretrained(tmp, safe_serialization=True)
    if (base / MODEL_CARD_NAME).is_file():  # the native resolution and text length `sample` defaults to
        shutil.copy2(base / MODEL_CARD_NAME, tmp / MODEL_CARD_NAME)
    return merged


def _save_vlm(base: Path, adapter: Path, tmp: Path, dtype: torch.dtype, device: Any) -> int:
    """The transformers VLM of `base` with `adapter` applied, merged and saved into `tmp` with its
    processor; returns the number of LoRA layers merged."""
    policy = VLMPolicy.load(base, adapter=adapter, device=device, dtype="fp32")
    model, merged = merge_lora(policy.module)
    model.to(dtype)
    model.save_pretrained(tmp)
    policy.processor.save_pretrained(tmp)
    return merged


def export_adapter(
    adapter: Path, out: Path, *, model: Path | None = None, dtype: str = "fp32", device: Any = "cpu"
) -> dict[str, Any]:
    """Write `adapter` applied to its base model as a plain model folder at `out` (module docstring).

    Returns the summary: out, base_model, kind (lora or full), dtype, merged_layers, bytes.
    """
    if out.exists() or out.is_symlink():
        raise UserInputError(f"--out {out} exists; an export never replaces a folder: pass a new --out")
    config = read_adapter_config(adapter, "ADAPTER")
    base = recorded_base(adapter, config, model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        save = _save_vlm if is_vlm_model(base) else _save_pipeline
        with no_progress_bars():  # the command draws its own
            merged = save(base, adapter, tmp, DTYPES[dtype], device)
        if out.exists():
            raise UserInputError(f"--out {out} appeared while exporting; the export is left unwritten")
        os.rename(tmp, out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "out": str(out),
        "base_model": str(base),
        "kind": config["kind"],
        "dtype": dtype,
        "merged_layers": merged,
        "bytes": folder_bytes(out),
    }
