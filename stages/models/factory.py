"""Tiny-model factory: builds random-weight pipeline folders offline, one builder per model family.

Tests and benchmarks need real diffusers/transformers checkpoints without the network, so each
family builds its components from configs with seeded random weights and `save_pretrained`s a
complete folder that `from_pretrained` loads like a published checkpoint. The folder also gets
`omnirl_model.json` (family, size, seed, parameter counts), written last so that a folder without
it is an unfinished build.

A family is registered as `"module:builder"` in `stages.models.config.FAMILIES` (torch-free, so the
CLI lists the names without importing the factory), imported only when built. A builder is `builder(out_dir, *, size, seed) -> dict`, raises `UserInputError` for
a size it does not know, and ends with `finish_model_dir`. Beside each `build_X` its module has
`make_X(size, seed)`, the construction without saving (the diffusers pipeline, or the transformers
model): under `torch.device("meta")` it gives the architecture of any size, even a published one too
large for this machine, without memory (`make_model`, which `omnirl plan` reads); `make_model_on` constructs
it directly on an accelerator instead, for benchmarks that never write its weights.

Sizes: "tiny" (tests), "small" (benchmarks), and each family's published sizes with the real widths,
depths and vocabularies, "full" naming its flagship (Qwen-Image 20B, FLUX.1-dev, Wan 2.1 T2V 14B, SD3.5
Large, ...), for GPU benchmarks; the others by their published names ("medium", "1.3b", "3b", "7b", "8b").
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from stages.errors import UserInputError
from stages.models.config import FAMILIES

MODEL_CARD_NAME = "omnirl_model.json"
MODEL_CARD_FORMAT = "omnirl-model"
MODEL_CARD_VERSION = 1

Builder = Callable[..., dict[str, Any]]


def available_families() -> list[str]:
    """Names accepted by `init_model`, sorted."""
    return sorted(FAMILIES)


def get_builder(family: str) -> Builder:
    """The builder registered for `family`; `UserInputError` naming the valid families otherwise."""
    target = FAMILIES.get(family)
    if target is None:
        raise UserInputError(
            f"unknown model family {family!r}; choose one of: {', '.join(available_families())}"
        )
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def init_model(family: str, out_dir: str | Path, *, size: str = "tiny", seed: int = 0) -> dict[str, Any]:
    """Build a random-weight `family` pipeline of `size` into the empty or new folder `out_dir`.

    Returns the summary: family, size, seed, out_dir, pipeline_class, parameters (per component),
    bytes (whole folder). The same (family, size, seed) writes bit-identical weight files.
    """
    builder = get_builder(family)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise UserInputError(f"--seed must be an integer in [0, 2**63), got {seed!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"{out} already exists and is not an empty directory; choose a new --out")
    return builder(out, size=size, seed=seed)


def make_model(family: str, size: str, seed: int = 0) -> Any:
    """The `family`'s model of `size` as its builder constructs it, unsaved (its module's `make_X` beside
    `build_X`): a diffusers pipeline or a transformers model, on the current default device."""
    get_builder(family)  # an unknown family is one line
    module_name, attribute = FAMILIES[family].split(":")
    make = getattr(importlib.import_module(module_name), "make_" + attribute.removeprefix("build_"))
    return make(size=size, seed=seed)


def make_model_on(family: str, size: str, seed: int, device: torch.device | str, dtype: torch.dtype) -> Any:
    """`make_model` constructed directly on `device` (no host copy, no disk), each module component then
    cast to `dtype`, frozen and in eval mode, as `FlowPolicy.load` leaves a loaded pipeline.

    Constructed, not built on the meta device and materialised with `to_empty`: the constructors compute
    tables that are no weights (RoPE frequencies as buffers or plain tensor attributes) and would be left
    empty. The initialisers run on `device` under the factory's per-component seeds, so the same
    (family, size, seed, device) gives the same weights. Peak memory: the components in fp32 until cast
    (Qwen-Image full: 115 GB, then 57 GB in bf16)."""
    with torch.device(device):
        model = make_model(family, size, seed)
    modules = model.components.values() if hasattr(model, "components") else [model]
    for module in modules:
        if isinstance(module, torch.nn.Module):
            module.to(dtype=dtype).requires_grad_(False).eval()
    return model


def choose_size(family: str, size: str, sizes: Mapping[str, Any]) -> Any:
    """`sizes[size]`, or `UserInputError` listing the sizes `family` offers."""
    if size not in sizes:
        raise UserInputError(
            f"unknown size {size!r} for model family {family!r}; choose one of: {', '.join(sizes)}"
        )
    return sizes[size]


def component_seed(seed: int, component: str) -> int:
    """A seed for one component derived from the build seed, so components draw independent weights
    and adding a component to a family never changes the weights of the others."""
    digest = hashlib.sha256(f"{seed}:{component}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextlib.contextmanager
def seeded(seed: int, component: str) -> Iterator[None]:
    """Run the block (a model constructor) under `component_seed(seed, component)`; the global CPU RNG
    is restored afterwards, so building a model does not disturb the caller's random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(component_seed(seed, component))
        yield


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Silence transformers' per-shard progress bars while a builder saves, then restore the setting."""
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


def parameter_count(module: torch.nn.Module) -> int:
    """Number of trainable-shaped weights (buffers such as fixed position tables excluded)."""
    return sum(parameter.numel() for parameter in module.parameters())


def folder_bytes(path: Path) -> int:
    """Total size of the regular files under `path`."""
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def zero_residual_branches(decoder: torch.nn.Module) -> None:
    """Zero-initialise the last layer of every residual branch of an untrained VAE decoder.

    Each resnet then starts as the identity, so the decoded image follows the latent's structure
    instead of the texture of random convolutions: an image reward (e.g. JPEG compressibility)
    responds to what the policy generates, which lets the demo and end-to-end tests learn.
    """
    with torch.no_grad():
        for name, module in decoder.named_modules():
            if name.endswith(("conv2", "to_out.0")):
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()


def autoencoder_kl(
    seed: int,
    *,
    channels: tuple[int, ...],
    groups: int,
    layers_per_block: int,
    latent_channels: int,
    scaling_factor: float,
    shift_factor: float,
    sample_size: int | None = None,
) -> Any:
    """A seeded `AutoencoderKL` of the SD3 / FLUX.1 / Z-Image form ((z − shift)·scale latents, no quant
    convs) with the decoder's residual branches zeroed (`zero_residual_branches`)."""
    from diffusers import AutoencoderKL

    size = {} if sample_size is None else {"sample_size": sample_size}
    with seeded(seed, "vae"):
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * len(channels),
            up_block_types=("UpDecoderBlock2D",) * len(channels),
            block_out_channels=channels,
            layers_per_block=layers_per_block,
            latent_channels=latent_channels,
            norm_num_groups=groups,
            **size,
            scaling_factor=scaling_factor,
            shift_factor=shift_factor,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        zero_residual_branches(vae.decoder)
    return vae


def t5_encoder(
    seed: int,
    component: str,
    tokenizer: Any,
    *,
    width: int,
    heads: int,
    ff: int,
    layers: int,
    vocab: int | None = None,
) -> Any:
    """A seeded gated-GELU `T5EncoderModel` for `tokenizer` (SD3's and FLUX.1's third/second text encoder);
    `vocab` rows (a published size's, e.g. T5-XXL's 32128), else one per token of `tokenizer`."""
    from transformers import T5Config, T5EncoderModel

    with seeded(seed, component):
        return T5EncoderModel(
            T5Config(
                vocab_size=vocab or len(tokenizer),
                d_model=width,
                d_kv=width // heads,
                d_ff=ff,
                num_layers=layers,
                num_heads=heads,
                feed_forward_proj="gated-gelu",
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=tokenizer.pad_token_id,
            )
        )


def save_pipeline(
    pipeline: Any, out_dir: Path, *, family: str, size: str, seed: int, details: Mapping[str, Any]
) -> dict[str, Any]:
    """Save a built diffusers pipeline with `save_pretrained` (safetensors) and finish the folder with
    its model card; the card counts the parameters of every module component."""
    with no_progress_bars():
        pipeline.save_pretrained(out_dir, safe_serialization=True)
    parameters = {
        name: parameter_count(module)
        for name, module in pipeline.components.items()
        if isinstance(module, torch.nn.Module)
    }
    return finish_model_dir(
        out_dir,
        family=family,
        size=size,
        seed=seed,
        pipeline_class=type(pipeline).__name__,
        parameters=parameters,
        details=details,
    )


def finish_model_dir(
    out_dir: Path,
    *,
    family: str,
    size: str,
    seed: int,
    pipeline_class: str,
    parameters: Mapping[str, int],
    details: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write `omnirl_model.json` into a saved pipeline folder and return the build summary
    (the card as read back from JSON, plus `out_dir` and `bytes`).

    `details` holds family-specific facts a tool may show (default resolution, architecture notes).
    """
    card = {
        "format": MODEL_CARD_FORMAT,
        "version": MODEL_CARD_VERSION,
        "family": family,
        "size": size,
        "seed": seed,
        "pipeline_class": pipeline_class,
        "parameters": dict(parameters),
        "details": dict(details or {}),
    }
    text = json.dumps(card, indent=2, sort_keys=True) + "\n"
    (out_dir / MODEL_CARD_NAME).write_text(text)
    return {**json.loads(text), "out_dir": str(out_dir), "bytes": folder_bytes(out_dir)}


DEFAULT_TEXT_LENGTH = 128  # the T5 length the samplers encode with when a model card names none
# The side `sample` draws at for a folder whose card records no native resolution (a real checkpoint):
# flow_grpo's 512 px.
DEFAULT_RESOLUTION = 512


def read_model_card(model_dir: str | Path) -> dict[str, Any] | None:
    """The `omnirl_model.json` of a folder built by this factory, or None for any other checkpoint."""
    path = Path(model_dir) / MODEL_CARD_NAME
    if not path.is_file():
        return None
    try:
        card = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserInputError(f"{path} is not readable JSON ({error}); rebuild the model folder") from error
    if not isinstance(card, dict) or card.get("format") != MODEL_CARD_FORMAT:
        raise UserInputError(f"{path} is not an omnirl model card (format != {MODEL_CARD_FORMAT!r})")
    return card


def model_details(model: str | Path) -> dict[str, Any]:
    """The `details` of a model folder's `omnirl_model.json` ({} for a folder without one)."""
    return dict((read_model_card(model) or {}).get("details", {}))


def native_resolution(model: str | Path) -> int | None:
    """The image side a model folder records as its own: its card's `details.image_size`, the native
    resolution `init-model` built it for (or `pretrain` trained it at); None for a folder without one
    (a real checkpoint). `sample` and `pretrain` use it when --resolution is not given."""
    side = model_details(model).get("image_size")
    return int(side) if side else None


def default_text_length(model: str | Path) -> int:
    """The text length a model folder asks for: its card's `details.text_length`, else its pipeline
    family's own (`FamilyAdapter.text_length`, e.g. Wan's 512), else 128."""
    details = model_details(model)
    if "text_length" in details:
        return int(details["text_length"])
    index = Path(model) / "model_index.json"
    try:
        pipeline_class = json.loads(index.read_bytes())["_class_name"]
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_TEXT_LENGTH
    from stages.models.families import family_text_length

    return family_text_length(str(pipeline_class)) or DEFAULT_TEXT_LENGTH
