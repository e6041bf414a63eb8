"""Diffusion model families behind one adapter protocol.

`FlowPolicy` (stages/models/diffusion.py) is family-agnostic: per-seed noise, the prompt cache,
LoRA and full-weight save/load, reference/old/EMA weight swaps. What differs between pipelines is a
`FamilyAdapter`: the σ schedule (dynamic shift), the stored latent shape, prompt encoding, the
guided velocity v(x, σ) (packing, position ids, timestep scale, CFG kind), decoding and VAE encoding,
and the reference trainers' LoRA targets. `samplers.step` stays the one sampler for every family.

A family is one module holding its adapter and its tiny builder. Adapters are looked up by the
pipeline's `model_index.json` `_class_name` (for a family whose released folder is no diffusers
pipeline, the class `folders.NATIVE_FOLDERS` names it by; its adapter overrides the loading hooks):
the built-ins below (imported only when used), or an installed package's entry point in group
``omnirl.families`` (``PipelineClass = "pkg.mod:Adapter"``).
This module is a leaf: it imports nothing from sample/ or update/.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from stages.errors import UserInputError

ENTRY_POINT_GROUP = "omnirl.families"
# Built-in adapters by pipeline class (diffusers' `_class_name`, or a family's own folder's name in
# `folders.NATIVE_FOLDERS`), as "module:attribute".
BUILTIN: dict[str, str] = {
    "Bagel": "stages.models.bagel:BagelAdapter",
    "Flux2KleinPipeline": "stages.models.flux2:Flux2KleinAdapter",
    "Flux2Pipeline": "stages.models.flux2:Flux2Adapter",
    "FluxKontextPipeline": "stages.models.flux_kontext:FluxKontextAdapter",
    "FluxPipeline": "stages.models.flux:FluxAdapter",
    "QwenImageEditPipeline": "stages.models.qwen_image_edit:QwenImageEditAdapter",
    "QwenImageEditPlusPipeline": "stages.models.qwen_image_edit:QwenImageEditPlusAdapter",
    "QwenImagePipeline": "stages.models.qwen_image:QwenImageAdapter",
    "StableDiffusion3Pipeline": "stages.models.sd3:SD3Adapter",
    "WanImageToVideoPipeline": "stages.models.wan_i2v:WanI2VAdapter",
    "WanPipeline": "stages.models.wan:WanAdapter",
    "ZImagePipeline": "stages.models.z_image:ZImageAdapter",
}

Tensors = dict[str, torch.Tensor]
# A sample's size in pixels: one side (square) or (height, width).
Resolution = int | tuple[int, int]
RESOLUTION_HELP = "a side (512) or HEIGHTxWIDTH (240x416)"


def parse_resolution(value: Any, option: str = "--resolution") -> tuple[int, int]:
    """(height, width) in pixels of a resolution as a user or a file gives it: a side N (square), the
    string "N" or "HxW", or a [height, width] pair (a config layer may wrap a scalar in a one-element
    list). Anything else, or a side below 1, is a one-line UserInputError naming `option`."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    try:
        if isinstance(value, str):
            parts = value.strip().lower().split("x")
            if len(parts) not in (1, 2):
                raise ValueError
            sides = tuple(int(p) for p in parts)
        elif isinstance(value, (list, tuple)) and len(value) == 2:
            sides = tuple(operator.index(v) for v in value)
        else:
            sides = (operator.index(value),)
    except (TypeError, ValueError):
        raise UserInputError(f"{option} {value!r}: give {RESOLUTION_HELP}") from None
    height, width = sides if len(sides) == 2 else sides * 2
    if height < 1 or width < 1:
        raise UserInputError(
            f"{option} {_spelled(height, width)}: each side must be a positive number of pixels"
        )
    return height, width


def _spelled(height: int, width: int) -> str:
    return str(height) if height == width else f"{height}x{width}"


def format_resolution(resolution: Resolution) -> str:
    """A resolution as the option spells it: "512" for a square, "HxW" otherwise."""
    return _spelled(*parse_resolution(resolution))


def resolution_identity(resolution: Resolution) -> int | str:
    """A resolution as run identities record it: one int for a square (as every run recorded it before
    non-square sizes), "HxW" otherwise, so `512`, "512", "512x512" and [512, 512] are one run."""
    height, width = parse_resolution(resolution)
    return height if height == width else f"{height}x{width}"


def latent_grid(resolution: Resolution, factor: int, multiple: int, why: str = "") -> tuple[int, int]:
    """The latent (h, w) of a `resolution` for a VAE of spatial `factor`: each pixel side must be a
    positive multiple of `multiple` (the VAE factor × the transformer's patch), else a one-line
    UserInputError naming --resolution (`why` says where the multiple comes from)."""
    height, width = parse_resolution(resolution)
    if height % multiple or width % multiple:
        raise UserInputError(
            f"--resolution {_spelled(height, width)}: height and width must each be a positive multiple "
            f"of {multiple} for this model{f' ({why})' if why else ''}"
        )
    return height // factor, width // factor


@dataclass
class Condition:
    """Text conditioning of a batch, as the family's adapter packs it.

    pos / neg: name → tensor with a leading batch dim B (neg only when the guidance needs a
    negative branch). What the names are is the adapter's business (SD3: embeds [B, L, D], pooled
    [B, P]); the rest of omnirl only selects rows.
    """

    pos: Tensors
    neg: Tensors | None = None

    def to(self, dtype: torch.dtype) -> Condition:
        """Floating tensors cast to `dtype` (the trained module's: fp32 under --full with a bf16
        --dtype); masks and lengths stay as they are. No copy when the dtype already matches."""

        def cast(d: Tensors | None) -> Tensors | None:
            if d is None:
                return None
            return {k: v.to(dtype) if v.is_floating_point() else v for k, v in d.items()}

        return Condition(cast(self.pos), cast(self.neg))

    def select(self, index: torch.Tensor | list[int]) -> Condition:
        """The rows `index` of every tensor."""

        def pick(d: Tensors | None) -> Tensors | None:
            return None if d is None else {k: v[index] for k, v in d.items()}

        return Condition(pick(self.pos), pick(self.neg))


class Experts(torch.nn.ModuleDict):
    """Several trained networks of one pipeline as one module (Wan 2.2 A14B's high- and low-noise
    experts): parameters are named "<pipeline attribute>.<name>", so the trainer, the optimizer, EMA
    and weight swaps see one module, and `experts(name, **inputs)` runs one expert through this
    module's own forward (a data-parallel wrapper's forward reaches it)."""

    def forward(self, name: str, **inputs: Any) -> Any:
        return self[name](**inputs)

    @property
    def dtype(self) -> torch.dtype:
        """The experts' dtype (they share one)."""
        return next(iter(self.values())).dtype

    @property
    def _no_split_modules(self) -> list[str]:
        """The experts' block classes, so FSDP2 shards every block of each expert (`update.parallel`)."""
        return sorted({name for expert in self.values() for name in expert._no_split_modules or ()})


class FamilyAdapter:
    """What one pipeline family needs beyond the generic policy. Subclass it, set the class
    attributes and implement the methods; `pipe` is the loaded diffusers pipeline.

    Media. An image family (`media` "image") decodes a batch to one PIL image per sample. A video
    family (`media` "video") has latents [C, F, h, w] and decodes a batch to one list of PIL frames
    per sample (all of `frames` frames, in order); `latent_shape` takes the frame count.
    """

    name: ClassVar[str]
    # The reference trainers' default LoRA target modules (docs/families.md's table says whose).
    lora_targets: ClassVar[tuple[str, ...]]
    # The pipeline attribute that is trained and saved (its class reloads full weights).
    trained_module: ClassVar[str] = "transformer"
    # "image": decode gives a PIL image per sample; "video": a list of PIL frames per sample.
    media: ClassVar[str] = "image"
    # The text length the family's pipeline encodes with, used when a model card names none (None:
    # omnirl's default, `stages.models.factory.DEFAULT_TEXT_LENGTH`).
    text_length: ClassVar[int | None] = None
    # "true": guidance > 1 runs an unconditional branch; "distilled": guidance is a model input.
    cfg_kind: ClassVar[str] = "true"
    # The guidance a policy is trained at when no rollout records one (offline pairs / latents):
    # CFG off for true-CFG families, the pipeline's default for distilled guidance.
    default_guidance: ClassVar[float] = 1.0
    # How many condition images (a prompt row's `image` / `images`) a prompt takes: (fewest, most).
    # (0, 0): text-only; an editing family takes some, and `encode_prompts` then receives them.
    condition_images: ClassVar[tuple[int, int]] = (0, 0)
    # Whether each condition image's latent tokens join the transformer's sequence (Kontext, Qwen-Image-Edit,
    # FLUX.2: appended after the latent tokens; `omnirl plan` counts them); False: it enters otherwise.
    condition_tokens: ClassVar[bool] = True
    # Whether --full trains (and saves) every weight of the trained module; False: LoRA only.
    full_weights: ClassVar[bool] = True

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        # Training through CFG: stop the gradient at the unconditional branch (flow_grpo since July
        # 2025). The forward values are the same either way, so sampling and replay are unaffected.
        self.detach_uncond = False

    @classmethod
    def load_components(cls, model_path: Path, wanted: set[str]) -> dict[str, Any]:
        """The components among `wanted` (model_index.json names still to load) that the family loads
        itself rather than `from_pretrained` by their listed class (a processor transformers cannot load
        without torchvision), by name."""
        return {}

    # Loading and saving a model folder. The defaults read and write diffusers' layout (a pipeline folder,
    # LoRA files as `save_lora_weights` writes them); a family whose released folder is not a diffusers
    # pipeline (`folders.NATIVE_FOLDERS`) overrides them, and the policy, the stages and the stored
    # conditioning work through these alone.

    @classmethod
    def load_pipeline(
        cls, folder: Path, index: dict[str, Any], components: dict[str, Any], dtype: torch.dtype
    ) -> Any:
        """The pipeline of model `folder` (its `index`, `folders.pipeline_index`) in `dtype`: an object with
        the components as attributes, `components`, `register_modules`, `to` and
        `set_progress_bar_config`, as diffusers' pipelines have. `components` override the folder's own
        (a module, or None: not loaded)."""
        from diffusers import DiffusionPipeline

        return DiffusionPipeline.from_pretrained(folder, dtype=dtype, use_safetensors=True, **components)

    @classmethod
    def component_names(cls, index: dict[str, Any]) -> list[str]:
        """The components `load_pipeline` loads from a folder of this `index` (those `components` may
        override): by default every entry of the index with a library and class."""
        return [name for name, entry in index.items() if isinstance(entry, list)]

    @classmethod
    def encoder_files(cls, folder: Path, index: dict[str, Any]) -> list[str]:
        """The files or subfolders of model `folder` whose contents make a prompt's conditioning (what the
        stored conditioning's identity digests): by default the text encoders and tokenizers its index lists."""
        from stages.models.folders import text_components

        return text_components(index)

    def load_trained(self, folder: Path, name: str, dtype: torch.dtype) -> torch.nn.Module:
        """Trained module `name` as model `folder` holds it, in `dtype` (the frozen reference of a
        full-weight run): by default the class of the loaded one, `from_pretrained(folder / name)`."""
        return type(getattr(self.pipe, name)).from_pretrained(folder / name, dtype=dtype)

    def save_lora(self, out: Path, layers: Tensors, metadata: dict[str, Any]) -> None:
        """Write the LoRA `layers` of the trained module (PEFT names without the adapter, `metadata` its
        `LoraConfig` as a dict) into folder `out` so this family's loading reads them back
        (`folders.load_lora`): by default diffusers' `save_lora_weights` file."""
        first = self.trained_module
        type(self.pipe).save_lora_weights(
            out, **{f"{first}_lora_layers": layers, f"{first}_lora_adapter_metadata": metadata}
        )

    def unconditional(self, uncond: torch.Tensor) -> torch.Tensor:
        """The unconditional prediction as guidance should combine it: detached when `detach_uncond`."""
        return uncond.detach() if self.detach_uncond else uncond

    def trained_modules(self) -> tuple[str, ...]:
        """The pipeline attributes that are trained and saved: `trained_module` alone, or every expert
        of a pipeline that switches between several (each carries its own LoRA)."""
        return (self.trained_module,)

    def trained_network(self, modules: dict[str, torch.nn.Module]) -> torch.nn.Module:
        """The one module `velocity` is given, built from the trained `modules` (attribute → module):
        the module itself when there is one, else the `Experts` of all of them."""
        if len(modules) == 1:
            return next(iter(modules.values()))
        return Experts(modules)

    def sigmas(self, num_steps: int, resolution: Resolution) -> torch.Tensor:
        """The σ schedule [N+1] (ends in 0), float32, as the family's own pipeline computes it for
        samples of `resolution` (a side or (height, width))."""
        raise NotImplementedError

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        """The stored (unpacked) latent of one sample of `resolution` (a side or (height, width)) and
        `frames` frames, any rank (an image family is only asked for 1 frame); a size or frame count the
        family cannot take is a one-line UserInputError naming --resolution or --frames
        (`latent_grid` checks the sides)."""
        raise NotImplementedError

    @classmethod
    def variant_name(cls, config: Mapping[str, Any]) -> str:
        """The name of the family a pipeline of this class is, from its `config` (a folder's model_index.json
        or a loaded pipeline's `config`): `name`, unless the class serves several (Wan's variants)."""
        return cls.name

    @classmethod
    def images_instead(cls, name: str) -> str:
        """What to do when prompt rows carry images that text-only family `name` cannot take."""
        return "drop the 'image'/'images' column, or pass an editing model (qwen_image_edit, flux_kontext)"

    @classmethod
    def check_condition_images(cls, count: int, prompt: str, name: str) -> None:
        """Refuse, in one line naming the prompt and family `name` (`variant_name`), a number of condition
        images the family does not take."""
        fewest, most = cls.condition_images
        if fewest <= count <= most:
            return
        where = f"the row of prompt {prompt[:60]!r}"  # a --prompts, --data or rollout row
        if most == 0:
            raise UserInputError(
                f"{where}: has {count} condition image(s), but {name} generates from text alone; "
                f"{cls.images_instead(name)}"
            )
        if count == 0:
            raise UserInputError(
                f"{where}: {name} edits a source image and the row has none; give it one in column "
                "'image' (a path relative to the table, the file's bytes or a datasets Image)"
            )
        takes = str(most) if fewest == most else f"{fewest} to {most}"
        raise UserInputError(
            f"{where}: has {count} condition images, but {name} takes {takes} per prompt; "
            f"give {takes} in column '{'image' if most == 1 else 'images'}'"
        )

    def needs_negative(self, guidance: float) -> bool:
        """Whether `guidance` runs an unconditional (negative-prompt) branch."""
        return self.cfg_kind == "true" and guidance > 1.0

    def encode_prompts(
        self, prompts: list[str], negatives: list[str], device: torch.device, max_sequence_length: int
    ) -> list[tuple[Tensors, Tensors]]:
        """(positive, negative) conditioning of each prompt, tensors without a batch dim, cached per
        (prompt, negative) by the policy; one batched call, as the family's pipeline makes it. An editing
        family (`condition_images`) also takes `images`: each prompt's condition images, a list of RGB
        PIL images per prompt, and conditions on them (its tensors hold e.g. their VAE latents)."""
        raise NotImplementedError

    def collate(self, items: Sequence[Tensors]) -> Tensors:
        """Per-prompt tensors → a batch (stacked; families with variable lengths pad and mask)."""
        return {k: torch.stack([item[k] for item in items]) for k in items[0]}

    def velocity(
        self,
        transformer: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Condition,
        guidance: float,
    ) -> torch.Tensor:
        """Guided velocity v(x, σ) in fp32 and x's layout ([B, *latent_shape]); σ is [B]. The
        transformer is passed in because the policy swaps it (reference model). A family with several
        experts (`trained_modules`) also takes `guidance_2`, its low-noise expert's guidance."""
        raise NotImplementedError

    def finish(self, x0: torch.Tensor, cond: Condition) -> torch.Tensor:
        """The sample [B, *latent_shape] the family's pipeline returns for the sampler's last latents x0
        under `cond`: x0 itself, unless part of it is given rather than generated (an image-to-video
        model's first frame), which the pipeline puts back."""
        return x0

    def decode(self, x0: torch.Tensor) -> list[Any]:
        """Latents [B, *latent_shape] → per sample a PIL image, or for a video family a list of PIL
        frames. The default is the AutoencoderKL form z/scale + shift
        that SD3, FLUX.1 and Z-Image share; other VAEs override it."""
        vae = self.pipe.vae
        z = x0.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")

    def encode_images(self, images: list[Any], resolution: Resolution, device: torch.device) -> torch.Tensor:
        """PIL images → latents [B, *latent_shape] (resize + centre-crop to `resolution`), the inverse of
        `decode`: by default the VAE posterior mode, then (z − shift)·scale."""
        self.latent_shape(resolution)
        height, width = parse_resolution(resolution)
        vae = self.pipe.vae
        pixels = self.pipe.image_processor.preprocess(images, height=height, width=width, resize_mode="crop")
        z = vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode()
        return ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()


def _load(spec: str, what: str) -> type[FamilyAdapter]:
    module_name, _, attribute = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise UserInputError(f"{what}: the family adapter {spec!r} cannot be loaded ({exc})") from None


def family_text_length(pipeline_class: str) -> int | None:
    """The `text_length` of a pipeline class's adapter (None without one: loading the model says so)."""
    try:
        return adapter_class(pipeline_class, pipeline_class).text_length
    except UserInputError:
        return None


def supported_pipelines() -> list[str]:
    """Pipeline classes with an adapter: built-in and installed through entry points."""
    plugins = [ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    return sorted({*BUILTIN, *plugins})


def adapter_class(pipeline_class: str, model: str) -> type[FamilyAdapter]:
    """The family adapter of a pipeline class (`model_index.json` `_class_name`); an unsupported class
    is a one-line error naming the supported ones."""
    what = f"--model {model}"
    if pipeline_class in BUILTIN:
        return _load(BUILTIN[pipeline_class], what)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == pipeline_class:
            return _load(ep.value, what)
    raise UserInputError(
        f"{what}: pipeline {pipeline_class} has no family adapter (supported: "
        f"{', '.join(supported_pipelines())}); a package can add one through the {ENTRY_POINT_GROUP!r} "
        "entry point"
    )


def latent_normalisation(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3-D VAE's per-channel `latents_mean` and 1/`latents_std` (Wan's and Qwen-Image's VAEs), shaped
    [1, C, 1, 1, 1] on the device and dtype of `like`: latents are (z − mean) · std⁻¹."""
    config = vae.config
    shape = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean).view(shape).to(like.device, like.dtype)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, inv_std


def encode_3d(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels [B, 3, F, H, W] in [−1, 1] → latents [B, C, F', h, w] of a 3-D VAE, float32: its posterior
    mode, then (z − mean)·std⁻¹ (`latent_normalisation`), as Wan's and Qwen-Image's pipelines scale them."""
    z = vae.encode(pixels.to(dtype=vae.dtype)).latent_dist.mode()
    mean, inv_std = latent_normalisation(vae, z)
    return ((z - mean) * inv_std).float()


def decode_3d(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, F', h, w] → a 3-D VAE's pixels [B, 3, F, H, W]: z = x/std⁻¹ + mean, then decoded, as the
    pipelines do before postprocessing."""
    z = latents.to(vae.dtype)
    mean, inv_std = latent_normalisation(vae, z)
    return vae.decode(z / inv_std + mean, return_dict=False)[0]
