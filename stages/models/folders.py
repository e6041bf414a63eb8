"""The folders a model is loaded from: a diffusers pipeline folder (model_index.json) and the adapter
folders on top of it, omnirl's own (`omnirl_adapter.json`, written by `FlowPolicy.save_adapter`),
diffusers' LoRA files and PEFT's. Reading and checking them, and putting a LoRA folder's weights
onto a loaded pipeline (`load_lora`), with one-line errors that say which folder and what to pass.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from stages.errors import UserInputError
from stages.models.lora_weights import lora_config_dict

ADAPTER_CONFIG = "omnirl_adapter.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
# Where `PeftModel.save_pretrained` puts the wrapped module's own parameter names.
PEFT_PREFIX = "base_model.model."
ADAPTER_KINDS = ("lora", "full")
# Released checkpoint folders that are not diffusers pipelines, as the pipeline class their family
# adapter is registered under (`families.BUILTIN`), by the files that mark one (all of them present).
NATIVE_FOLDERS: dict[str, tuple[str, ...]] = {
    "Bagel": ("llm_config.json", "vit_config.json"),
}
# The file that marks each LoRA layout omnirl loads: its family and what writes it.
LORA_LAYOUTS = {
    LORA_WEIGHTS: ("diffusers", "`pipe.save_lora_weights`"),
    PEFT_CONFIG: ("PEFT", "`PeftModel.save_pretrained`"),
}
ADAPTER_FORMS = (
    f"pass a folder written by `omnirl update`, a diffusers LoRA folder ({LORA_WEIGHTS}, as "
    f"`save_lora_weights` writes) or a PEFT LoRA folder ({PEFT_CONFIG}, as `save_pretrained` writes)"
)


def native_class(path: Path) -> str | None:
    """The pipeline class of a released non-diffusers folder (`NATIVE_FOLDERS`), None for any other."""
    return next(
        (name for name, marks in NATIVE_FOLDERS.items() if all((path / mark).is_file() for mark in marks)),
        None,
    )


def check_pipeline_folder(model: str | Path, option: str = "--model") -> Path:
    """`model` as a Path when it is a diffusers pipeline folder (has model_index.json) or a released folder
    of a family that has its own layout (`NATIVE_FOLDERS`): checked before anything hashes or loads it,
    since any folder (even /tmp) could be walked otherwise."""
    path = Path(model)
    if not (path / "model_index.json").is_file() and native_class(path) is None:
        raise UserInputError(f"{option} {model}: not a diffusers pipeline folder (no model_index.json)")
    return path


def pipeline_index(model: str | Path, option: str = "--model") -> dict[str, Any]:
    """The model_index.json of pipeline folder `model` (its `_class_name` names the pipeline, each
    component entry its library and class); not a pipeline folder, or an unreadable index, is one line.
    A family's own folder (`NATIVE_FOLDERS`) reads as an index of its class alone, no components."""
    path = check_pipeline_folder(model, option)
    native = None if (path / "model_index.json").is_file() else native_class(path)
    if native is not None:
        return {"_class_name": native}
    try:
        index = json.loads((path / "model_index.json").read_bytes())
        if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
            raise ValueError
    except (OSError, ValueError):
        raise UserInputError(
            f"{option} {model}: model_index.json is not a diffusers pipeline index"
        ) from None
    return index


def read_adapter_config(adapter: str | Path, option: str = "--adapter") -> dict[str, Any]:
    """An adapter folder's `omnirl_adapter.json`: kind (lora or full), base model, step, lineage.

    A LoRA folder another tool wrote (diffusers' `pytorch_lora_weights.safetensors`, or PEFT's
    `adapter_config.json` + weights) has none and reads as {"kind": "lora"} at step 0, so it samples,
    replays and trains like omnirl's own; the model's `load` checks that its family takes that layout.
    `option` names the folder in errors.
    """
    folder = Path(adapter)
    if folder.is_file() and folder.suffix == ".safetensors":
        raise UserInputError(
            f"{option} {adapter} is a weights file; put it in a folder as {LORA_WEIGHTS} (diffusers' "
            "LoRA layout) and pass the folder"
        )
    if not folder.is_dir():
        what = "is a file, not an adapter folder" if folder.exists() else "does not exist"
        raise UserInputError(f"{option} {adapter} {what}; {ADAPTER_FORMS}")
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        if (folder / LORA_WEIGHTS).is_file() or (folder / PEFT_CONFIG).is_file():
            return {"kind": "lora"}
        raise UserInputError(
            f"{option} {adapter}: no {ADAPTER_CONFIG}, {LORA_WEIGHTS} or {PEFT_CONFIG}; {ADAPTER_FORMS}"
        )
    try:
        config = json.loads(path.read_bytes())
    except ValueError as exc:  # invalid JSON or not UTF-8
        raise UserInputError(
            f"{option} {adapter}: {ADAPTER_CONFIG} is not valid JSON ({exc}); re-run the `omnirl update` "
            "that wrote it"
        ) from None
    if not isinstance(config, dict) or config.get("kind") not in ADAPTER_KINDS:
        raise UserInputError(
            f'{option} {adapter}: {ADAPTER_CONFIG} has no "kind" of lora or full; re-run the '
            "`omnirl update` that wrote it"
        )
    return config


def trained_folders(adapter: Path, index: dict[str, Any]) -> list[str]:
    """The pipeline modules a full adapter folder holds: the components of the pipeline index (a
    `[library, class]` entry) with a `<name>/config.json` in the folder."""
    return [
        name
        for name, entry in index.items()
        if isinstance(entry, list) and len(entry) == 2 and (adapter / name / "config.json").is_file()
    ]


def check_adapter_layout(
    adapter: str | Path, config: dict[str, Any], *, lora_files: tuple[str, ...], full_file: str
) -> None:
    """Refuse an adapter folder whose files are not a layout the loading model family reads: a LoRA
    needs one of `lora_files` (diffusion: diffusers' weights or PEFT's config, VLM: PEFT's config), a
    full adapter `full_file`."""
    folder = Path(adapter)
    needs = lora_files if config["kind"] == "lora" else (full_file,)
    if any((folder / need).is_file() for need in needs):
        return
    other = next((f for f in LORA_LAYOUTS if f not in lora_files and (folder / f).is_file()), None)
    if config["kind"] == "lora" and other:
        takes = " or ".join(f"{f}, as {LORA_LAYOUTS[f][1]} writes" for f in lora_files)
        raise UserInputError(
            f"--adapter {adapter}: a {LORA_LAYOUTS[other][0]} LoRA folder ({other}), which this --model "
            f"does not load; it takes a LoRA folder with {takes}"
        )
    raise UserInputError(
        f"--adapter {adapter}: a {config['kind']} adapter without {' or '.join(needs)}; pass one that "
        "`omnirl update` wrote for this --model"
    )


def load_expert_loras(pipe: Any, experts: tuple[str, ...], folder: Path) -> None:
    """Apply the LoRA of each further expert (Wan 2.2 A14B's `transformer_2`) from its subfolder
    `<folder>/<expert>/pytorch_lora_weights.safetensors` (keys under "transformer.", as diffusers saves
    each expert's LoRA) through the pipeline's `load_lora_weights(..., load_into_<expert>=True)`, as
    diffusers loads one LoRA per expert. An expert without a subfolder stays bare."""
    for expert in experts:
        if (folder / expert / LORA_WEIGHTS).is_file():
            pipe.load_lora_weights(
                str(folder / expert), adapter_name="default", **{f"load_into_{expert}": True}
            )


def load_lora(pipe: Any, trained: str, folder: Path) -> None:
    """Apply a LoRA folder to the pipeline's trained module as adapter "default".

    Three layouts: diffusers' pipeline-level file (`save_lora_weights`, keys under "transformer.")
    through the pipeline's `load_lora_weights`, which also converts other trainers' key names; the
    module-level file (`save_lora_adapter`, keys without the prefix); and a PEFT folder
    (`PeftModel.save_pretrained` on the module, flow_grpo's checkpoints: keys under
    "base_model.model.", rank and alpha in adapter_config.json) through the module's
    `load_lora_adapter` with that config. A LoRA that fits none of the module's layers leaves it bare
    (the caller refuses it).
    """
    module = getattr(pipe, trained)
    if (folder / LORA_WEIGHTS).is_file():
        pipe.load_lora_weights(str(folder), adapter_name="default")
        if not getattr(module, "peft_config", None):
            module.load_lora_adapter(
                str(folder), weight_name=LORA_WEIGHTS, prefix=None, adapter_name="default"
            )
        return
    from peft import LoraConfig
    from safetensors.torch import load_file

    if not (folder / PEFT_WEIGHTS).is_file():
        raise UserInputError(
            f"--adapter {folder}: a PEFT LoRA folder without {PEFT_WEIGHTS} (omnirl reads safetensors "
            "weights only); save it with `save_pretrained(..., safe_serialization=True)`"
        )
    from peft.utils import get_peft_model_state_dict

    state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(folder / PEFT_WEIGHTS).items()}
    config = lora_config_dict(LoraConfig.from_pretrained(str(folder)))
    module.load_lora_adapter(state, prefix=None, adapter_name="default", metadata=config)
    # diffusers only warns about weights that fit no layer; those layers would keep their init
    own = get_peft_model_state_dict(module, adapter_name="default", save_embedding_layers=False)
    unused = sorted(set(state) - set(own))
    if unused:
        raise UserInputError(
            f"--adapter {folder}: {len(unused)} of its LoRA weights fit no layer of the {trained} (first: "
            f"{unused[0]}); pass a LoRA trained from this base model"
        )


@contextmanager
def adapter_loading(adapter: str | Path, model: str | Path) -> Iterator[None]:
    """Report adapter weights that do not load onto the base model (a damaged file, a LoRA of another
    base model) as one line naming both, instead of the loader's traceback and the error it logs
    before raising (the loaders' own logs are muted inside the block). Out-of-memory passes."""
    loggers = [logging.getLogger(name) for name in ("diffusers", "transformers", "peft")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
        if "OutOfMemory" in type(exc).__name__:
            raise
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        what = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # "Error(s) in ...:" + the first
        raise UserInputError(
            f"--adapter {adapter}: its weights do not load onto --model {model} ({type(exc).__name__}: "
            f"{what}); the file is damaged or the adapter was trained from another base model"
        ) from None
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def lora_has_layers(adapter: Path, prefixes: tuple[str, ...]) -> bool:
    """Whether a diffusers LoRA folder's weights (`LORA_WEIGHTS`) hold layers whose keys start with one of
    `prefixes` (read from the safetensors header alone). A damaged file says no: loading it is then
    refused in one line."""
    from safetensors import safe_open

    path = adapter / LORA_WEIGHTS
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return any(key.startswith(prefixes) for key in f.keys())  # noqa: SIM118 (no mapping)
    except (SafetensorError, OSError):
        return False


# The components of a pipeline that make a prompt's conditioning (`stages.models.conditioning`).
TEXT_PREFIXES = ("text_encoder", "tokenizer", "processor")


def text_components(index: dict[str, Any]) -> list[str]:
    """The text encoders, tokenizers and processors a pipeline's model_index.json lists (entries with a library)."""
    return [
        name
        for name, entry in index.items()
        if name.startswith(TEXT_PREFIXES) and isinstance(entry, list) and entry and entry[0] is not None
    ]
