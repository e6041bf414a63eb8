"""The architecture `omnirl plan` counts (`stages.models.plan`): a model's modules built on the meta device
(shapes, no memory, no weights read) from a model folder's configs (`model_index.json` and each
component's config, a VLM's `config.json`, or a family's own released layout) or from a family's
published size (`stages.models.factory.make_model`), with what the plan needs to know about them.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from stages.errors import UserInputError
from stages.models.config import FAMILIES
from stages.models.factory import parameter_count
from stages.models.families import Resolution, adapter_class

VLM_TEXT_TOKENS = 1024
# The module of each family that is not a diffusers pipeline (`folders.NATIVE_FOLDERS`), by its pipeline
# class and its model's class: `meta_pipeline(folder)` builds a released folder's pipeline from its configs,
# `make_pipeline(size)` a size's.
NATIVE_PIPELINES = {"Bagel": "stages.models.bagel"}
# The transformers class of each VLM `model_type` omnirl trains (stages.models.vlm_families.VLM_FAMILIES); a whole
# Qwen3-Omni folder trains its thinker.
VLM_CLASSES = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", None),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", None),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", None),
    "qwen3_omni_moe_thinker": ("Qwen3OmniMoeThinkerForConditionalGeneration", None),
    "qwen3_omni_moe": ("Qwen3OmniMoeThinkerForConditionalGeneration", "thinker_config"),
}


@dataclass
class Architecture:
    """A model's modules on the meta device and what the plan needs to know about them."""

    name: str
    kind: str  # "diffusion" or "vlm"
    modules: dict[str, torch.nn.Module]
    trained: tuple[str, ...]
    lora_targets: tuple[str, ...] | str  # a family's suffixes, or a VLM's regex over full names
    adapter: Any = None  # the family adapter of the meta pipeline: latent shape, CFG branches
    resolution: Resolution = 512
    text_tokens: int = 128
    trains_full: bool = True  # whether update offers --full (the family adapter's or VLM family's word)

    def parameters(self) -> dict[str, int]:
        """Parameter count per component (a VLM's towers and language model apart)."""
        if self.kind == "vlm":
            model = self.modules["model"]
            inner = getattr(model, "model", model)  # a transformers VLM's towers and language model
            parts = {
                name: parameter_count(child)
                for name, child in inner.named_children()
                if parameter_count(child)
            }
            parts["lm_head"] = parameter_count(model) - sum(parts.values())
            return {k: v for k, v in parts.items() if v}
        return {name: parameter_count(module) for name, module in self.modules.items()}


def _meta_pipeline(folder: Path) -> Any:
    """The folder's diffusers pipeline with every model component built on the meta device from its
    config and each scheduler from its config; tokenizers and processors are left out (None)."""
    import diffusers
    from diffusers import ModelMixin, SchedulerMixin
    from transformers import AutoConfig, PreTrainedModel

    from stages.models.folders import pipeline_index

    index = pipeline_index(folder)
    components: dict[str, Any] = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list):
            continue
        library, class_name = entry
        cls = getattr(importlib.import_module(library), class_name, None) if library else None
        where = folder / name
        if cls is None:
            components[name] = None
        elif issubclass(cls, (ModelMixin, SchedulerMixin)):
            components[name] = cls.from_config(cls.load_config(where))
        elif issubclass(cls, PreTrainedModel):
            components[name] = cls(AutoConfig.from_pretrained(where))
        else:
            components[name] = None
    pipeline_class = getattr(diffusers, index["_class_name"], None)
    if pipeline_class is None:
        raise UserInputError(f"--model {folder}: diffusers has no pipeline {index['_class_name']}")
    return pipeline_class(**components)


def _diffusion(name: str, pipe: Any, card: dict[str, Any], pipeline_class: str | None = None) -> Architecture:
    from stages.models.factory import DEFAULT_TEXT_LENGTH

    family = adapter_class(pipeline_class or type(pipe).__name__, name)
    adapter = family(pipe)
    details = card.get("details", {})
    architecture = details.get("architecture", {})
    text = details.get("text_length") or architecture.get("text_length") or family.text_length
    return Architecture(
        name=name,
        kind="diffusion",
        modules={n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)},
        trained=adapter.trained_modules(),
        lora_targets=family.lora_targets,
        adapter=adapter,
        resolution=details.get("image_size", 512),
        text_tokens=int(text or DEFAULT_TEXT_LENGTH),
        trains_full=family.full_weights,
    )


def _vlm(name: str, model: torch.nn.Module, model_type: str) -> Architecture:
    """A VLM policy's network; its family module (`vlm_families.VLM_FAMILIES`) may replace the LoRA
    targets (`LORA_TARGETS`) and refuse --full (`TRAINS_FULL`), as `VLMPolicy` reads them."""
    from stages.models.vlm import TEXT_LORA_TARGETS
    from stages.models.vlm_families import VLM_FAMILIES

    family = importlib.import_module(VLM_FAMILIES[model_type])
    return Architecture(
        name=name,
        kind="vlm",
        modules={"model": model},
        trained=("model",),
        lora_targets=getattr(family, "LORA_TARGETS", TEXT_LORA_TARGETS),
        text_tokens=VLM_TEXT_TOKENS,
        trains_full=getattr(family, "TRAINS_FULL", True),
    )


def _native(name: str, pipe: Any, card: dict[str, Any], native: str, understand: bool) -> Architecture:
    """A family's own pipeline (`NATIVE_PIPELINES`): its generation, or with `understand` its network as
    the VLM policy that answers questions (`vlm_families.NATIVE_VLMS`: BAGEL's understanding expert)."""
    from stages.models.vlm_families import NATIVE_VLMS

    if understand and native in NATIVE_VLMS:
        return _vlm(name, pipe.transformer, NATIVE_VLMS[native])
    _generates_only(name, understand)
    return _diffusion(name, pipe, card, native)


def _generates_only(name: str, understand: bool) -> None:
    if understand:
        raise UserInputError(
            f"--understand: {name} generates images and answers no questions; drop --understand"
        )


def from_folder(folder: str | Path, understand: bool = False) -> Architecture:
    """The architecture of a diffusers pipeline folder (model_index.json), a transformers VLM folder
    (config.json) or a family's own released folder (BAGEL's), built on the meta device from its configs
    alone (no weights are read); `understand`: a folder that also answers questions, as a VLM."""
    from stages.models.factory import read_model_card
    from stages.models.folders import native_class

    path = Path(folder)
    native = None if (path / "model_index.json").is_file() else native_class(path)
    if native is not None:
        module = importlib.import_module(NATIVE_PIPELINES[native])
        with torch.device("meta"):
            pipe = module.meta_pipeline(path)
        return _native(str(folder), pipe, read_model_card(path) or {}, native, understand)
    if (path / "model_index.json").is_file():
        _generates_only(str(folder), understand)
        with torch.device("meta"):
            pipe = _meta_pipeline(path)
        return _diffusion(str(folder), pipe, read_model_card(path) or {})
    if (path / "config.json").is_file():
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        if config.model_type not in VLM_CLASSES:
            raise UserInputError(
                f"--model {folder}: model_type {config.model_type!r} is not a model omnirl trains "
                f"({', '.join(VLM_CLASSES)})"
            )
        class_name, sub = VLM_CLASSES[config.model_type]
        cls = getattr(importlib.import_module("transformers"), class_name)
        with torch.device("meta"):
            model = cls(getattr(config, sub) if sub else config)
        return _vlm(str(folder), model, config.model_type)
    raise UserInputError(
        f"--model {folder}: no model_index.json (diffusers pipeline) or config.json (transformers model); "
        "pass a model folder, or --family F --size S for a built-in architecture"
    )


def from_family(family: str, size: str, understand: bool = False) -> Architecture:
    """The architecture of a family's size (`stages.models.factory`), on the meta device; `understand`
    as `from_folder`."""
    from stages.models.factory import make_model

    with torch.device("meta"):
        model = make_model(family, size)
    name = f"{family}/{size}"
    if isinstance(model, torch.nn.Module):
        from transformers import PreTrainedModel

        if isinstance(model, PreTrainedModel):
            return _vlm(name, model, model.config.model_type)
        native = type(model).__name__  # a family's own model, named as its pipeline class
        if native not in NATIVE_PIPELINES:
            raise UserInputError(f"--family {family}: plan does not count this architecture's memory yet")
        with torch.device("meta"):
            pipe = importlib.import_module(NATIVE_PIPELINES[native]).make_pipeline(size)
        # the side `sample` defaults to (the model card `init-model` writes)
        return _native(name, pipe, {"details": {"image_size": pipe.largest_side}}, native, understand)
    _generates_only(name, understand)
    spec = _size_spec(family, size)
    card: dict[str, Any] = {"details": {"architecture": spec}}
    image_size = spec.get("image_size") or _default_side(spec, model)
    if image_size:
        card["details"]["image_size"] = image_size
    return _diffusion(name, model, card)


def _default_side(spec: dict[str, Any], pipe: Any) -> int | None:
    """The square side a size samples at by default: its latent side × the VAE's spatial factor (a video
    pipeline's `vae_scale_factor_spatial`, an image pipeline's `vae_scale_factor`); None without either."""
    side = spec.get("sample_size") or spec.get("latent_size") or spec.get("latent_side")
    factor = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None)
    return side * int(factor) if side and factor else None


def _size_spec(family: str, size: str) -> dict[str, Any]:
    """The size's dataclass as a dict (the family module's `SIZES`, or Wan's `PUBLISHED` per variant)."""
    module = importlib.import_module(FAMILIES[family].split(":")[0])
    sizes = {**module.SIZES, **getattr(module, "PUBLISHED", {}).get(family, {})}
    return asdict(sizes[size])
