"""A LoRA adapter as one safetensors file in memory, and swapping it onto a loaded module.

The file is the one diffusers' `save_lora_weights` writes (`pytorch_lora_weights.safetensors`): the
trained module's LoRA tensors named ``<module>.<layer>.lora_A.weight`` and, in the header's
``__metadata__``, its PEFT `LoraConfig` as JSON under ``lora_adapter_metadata`` (keys ``<module>.r``,
``<module>.lora_alpha``, ...). A trainer sends these bytes to `omnirl serve`, which swaps them onto the
pipeline it already holds (`swap_lora`) instead of loading a second pipeline beside it.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from stages.errors import UserInputError

METADATA_KEY = "lora_adapter_metadata"  # diffusers' key of the LoRA config in the file's metadata
ADAPTER = "default"


def lora_config_dict(config: Any) -> dict[str, Any]:
    """A PEFT `LoraConfig` as the JSON-able dict diffusers stores beside LoRA weights and rebuilds the
    config from (`LoraConfig(**metadata)`): sets become sorted lists."""
    meta = config.to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in meta.items()}


def lora_file(module: torch.nn.Module, prefix: str) -> bytes:
    """The safetensors bytes of `module`'s LoRA adapter (module docstring), tensors under `prefix`."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save

    layers = get_peft_model_state_dict(module, adapter_name=ADAPTER)
    config = lora_config_dict(module.peft_config[ADAPTER])
    tensors = {f"{prefix}.{k}": v.detach().contiguous() for k, v in layers.items()}
    meta = json.dumps({f"{prefix}.{k}": v for k, v in config.items()}, indent=2, sort_keys=True)
    return save(tensors, metadata={"format": "pt", METADATA_KEY: meta})


def read_lora_file(raw: bytes, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(LoRA tensors named as `peft`'s state dict of the module, LoRA config dict) of a LoRA file's bytes
    whose tensors are under `prefix`. `ValueError` (one line) when it is not such a file."""
    from safetensors.torch import load

    if len(raw) < 8:
        raise ValueError("not a safetensors file (shorter than its 8-byte header length)")
    size = int.from_bytes(raw[:8], "little")
    if size > len(raw) - 8:
        raise ValueError("not a safetensors file (its header is longer than the body)")
    try:
        header = json.loads(raw[8 : 8 + size])
        tensors = load(raw)
    except Exception as exc:  # safetensors raises its own error type for a damaged file
        raise ValueError(f"not a readable safetensors file ({type(exc).__name__})") from None
    meta = (header.get("__metadata__") or {}).get(METADATA_KEY) if isinstance(header, dict) else None
    if not meta:
        raise ValueError(
            f"no {METADATA_KEY} in the file's metadata: send the {prefix}'s LoRA as diffusers' "
            "`save_lora_weights` writes it (with its LoRA config)"
        )
    config = {
        k.removeprefix(f"{prefix}."): v for k, v in json.loads(meta).items() if k.startswith(f"{prefix}.")
    }
    other = sorted(k for k in tensors if not k.startswith(f"{prefix}."))
    if other or not tensors or not config:
        first = other[0] if other else "(none)"
        raise ValueError(
            f"only the {prefix}'s LoRA can be loaded: tensors must be under '{prefix}.' ({first})"
        )
    return {k.removeprefix(f"{prefix}."): v for k, v in tensors.items()}, config


def _check_fits(module: torch.nn.Module, layers: dict[str, torch.Tensor]) -> None:
    from peft.utils import get_peft_model_state_dict

    held = get_peft_model_state_dict(module, adapter_name=ADAPTER)
    missing, extra = sorted(set(held) - set(layers)), sorted(set(layers) - set(held))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which fits no layer"
        raise UserInputError(f"the LoRA {what} ({len(missing)} missing, {len(extra)} unknown weights)")
    for key, value in layers.items():
        if value.shape != held[key].shape:
            raise UserInputError(
                f"the LoRA's {key} has shape {list(value.shape)}, the layer {list(held[key].shape)}"
            )


def swap_lora(
    module: torch.nn.Module, layers: dict[str, torch.Tensor] | None, config: dict[str, Any] | None
) -> str:
    """Put LoRA `layers` with LoRA `config` (`read_lora_file`) on `module` in place of its adapter, or
    remove its adapter (`layers` None: the base model). Returns what was done:

    - ``copied``: the module holds a LoRA of the same config: the values are copied into its LoRA
      parameters (PEFT's `set_peft_model_state_dict`), nothing is allocated;
    - ``replaced``: the old adapter (if any) is unloaded and one of `config` added, then copied into;
    - ``unloaded``: the LoRA layers are removed (the base model's layers again).

    A LoRA that does not fit (`UserInputError`) leaves the module as it was.
    """
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    held = (getattr(module, "peft_config", None) or {}).get(ADAPTER)
    if layers is None:
        if held is not None:
            module.unload_lora()
        return "unloaded"
    try:
        new = LoraConfig(**(config or {}))
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"the LoRA config does not build a LoraConfig ({exc})") from None
    how = "copied"
    if held is None or lora_config_dict(held) != lora_config_dict(new):
        previous = None
        if held is not None:
            state = get_peft_model_state_dict(module, adapter_name=ADAPTER)
            previous = ({k: v.detach().clone() for k, v in state.items()}, lora_config_dict(held))
            module.unload_lora()
        try:
            module.add_adapter(new, adapter_name=ADAPTER)
            _check_fits(module, layers)
        except Exception:
            module.unload_lora()
            if previous is not None:
                swap_lora(module, *previous)
            raise
        how = "replaced"
    else:
        _check_fits(module, layers)
    with torch.no_grad():
        set_peft_model_state_dict(module, layers, adapter_name=ADAPTER)
    return how


def merge_lora(module: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """Fold every LoRA layer of `module` into its base layer's weight (peft's merge, W + scale·B·A, in
    the weights' dtype; a non-finite sum is refused) and remove the LoRA layers: (the plain module, a
    `PeftModel`'s base model, and the number of LoRA layers merged)."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    if isinstance(module, PeftModel):
        return module.merge_and_unload(safe_merge=True), len(layers)
    if layers:
        from diffusers.utils import recurse_remove_peft_layers

        for layer in layers:
            layer.merge(safe_merge=True)
        recurse_remove_peft_layers(module)
    if hasattr(module, "peft_config"):
        del module.peft_config
    if getattr(module, "_hf_peft_config_loaded", False):
        module._hf_peft_config_loaded = False
    return module, len(layers)
