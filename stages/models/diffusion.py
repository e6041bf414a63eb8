"""Flow-matching text-to-image pipelines seen as RL policies.

A `FlowPolicy` wraps a diffusers pipeline folder, or a family's own released folder (BAGEL's),
optionally with an omnirl adapter on top, and exposes what the stages need: prompt conditioning, the guided velocity v(x, σ), the pipeline's own
σ schedule, initial noise from per-sample seeds, and decoding. Sampling, replay and training all go
through `velocity`, so the three compute the same numbers. Everything that differs between pipeline
families is the family's adapter (`stages.models.families`); this class is the same for all. Its methods
over the trained weights (LoRA, the frozen reference, swapped-in weights) are trained_weights.py's.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from stages import knobs
from stages.dist import unwrap
from stages.errors import UserInputError
from stages.models.condition_images import decode_images, images_digest, stored_condition_images
from stages.models.conditioning import Entries, Key, encoder_identity, stored_conditioning
from stages.models.families import Condition, FamilyAdapter, Resolution, adapter_class
from stages.models.folders import (
    ADAPTER_CONFIG,
    LORA_WEIGHTS,
    PEFT_CONFIG,
    TEXT_PREFIXES,
    adapter_loading,
    check_adapter_layout,
    check_pipeline_folder,
    load_expert_loras,
    load_lora,
    lora_has_layers,
    pipeline_index,
    read_adapter_config,
    text_components,
    trained_folders,
)
from stages.models.hub import base_model_record
from stages.models.lora_weights import lora_config_dict
from stages.models.packing import PATCH
from stages.models.trained_weights import TrainedWeights
from stages.parallelism import check_sequence
from stages.safe_files import refuse_pickled_weights

DTYPES = dict(zip(knobs.DTYPES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def seed_generator(seed: int) -> torch.Generator:
    """A CPU generator for one sample: noise never depends on batch composition or device."""
    return torch.Generator("cpu").manual_seed(int(seed))


def vae_memory(vae: Any, family: str, *, tiling: bool = False, slicing: bool = False) -> None:
    """Decode with less memory (video): the VAE decodes in overlapping spatial tiles (`tiling`, its
    `enable_tiling()`; may change pixels at tile seams) and/or one sample at a time (`slicing`,
    `enable_slicing()`; each sample's pixels as decoded alone). A VAE without the method is a one-line error."""
    for option, wanted, method in (
        ("--vae-tiling", tiling, "enable_tiling"),
        ("--vae-slicing", slicing, "enable_slicing"),
    ):
        if not wanted:
            continue
        enable = getattr(vae, method, None)
        if not callable(enable):
            raise UserInputError(
                f"{option}: the {type(vae).__name__} VAE of {family} has no {method}(); drop {option}"
            )
        enable()


def _pipeline_to_load(model_path: str | Path, dtype: str) -> tuple[Path, dict[str, Any], type[FamilyAdapter]]:
    """What loading a pipeline folder starts with (for `FlowPolicy.load` and `load_decoder`): the checked
    folder, its model_index.json and its family's adapter class; a bad folder or `dtype` is one line.
    Silences diffusers' progress bars."""
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()
    model_path = check_pipeline_folder(model_path)
    refuse_pickled_weights(model_path, "--model")
    if dtype not in DTYPES:
        raise UserInputError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    index = pipeline_index(model_path)
    return model_path, index, adapter_class(index["_class_name"], str(model_path))


def load_decoder(
    model_path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: str = "fp32",
    tiling: bool = False,
    slicing: bool = False,
) -> FamilyAdapter:
    """The family adapter of a pipeline folder loaded with its VAE alone (every other component None:
    no transformer, text encoder or tokenizer is read), for `decode` of stored latents exactly as
    `FlowPolicy.decode` decodes them under the same `dtype` and device; `tiling`/`slicing` as
    `vae_memory`. An adapter never changes the VAE, so none is taken."""
    model_path, index, family_class = _pipeline_to_load(model_path, dtype)
    names = family_class.component_names(index)
    if "vae" not in names:
        raise UserInputError(
            f"--model {model_path}: its model_index.json lists no vae; pass the pipeline folder"
        )
    others = {name: None for name in names if name != "vae"}
    pipe = family_class.load_pipeline(model_path, index, others, DTYPES[dtype])
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.to(device).requires_grad_(False).eval()
    family = family_class(pipe)
    vae_memory(pipe.vae, family.name, tiling=tiling, slicing=slicing)
    return family


def _config_only(model_path: Path, index: dict[str, Any], name: str) -> torch.nn.Module:
    """Component `name` of a pipeline folder built from its config on the meta device (no weights read,
    no memory): the pipeline's constructor reads sizes from it (the VAE's scale factors)."""
    library, class_name = index[name]
    klass = getattr(importlib.import_module(library), class_name)
    with torch.device("meta"):
        return klass.from_config(klass.load_config(model_path / name))


class FlowPolicy(TrainedWeights):
    """A flow-matching pipeline of any supported family as a policy over denoising steps."""

    def __init__(
        self,
        pipe: Any,
        family: FamilyAdapter,
        *,
        model_path: str,
        adapter: str | None,
        device: torch.device,
        dtype: torch.dtype,
        conditioning: Entries | None = None,
    ):
        self.pipe = pipe
        self.family = family
        self.model_path = model_path
        self.adapter = adapter
        self.device = device
        self.dtype = dtype
        # the trained pipeline modules by attribute (one, or each expert), and the network they form
        self.parts: dict[str, torch.nn.Module] = {
            name: getattr(pipe, name) for name in family.trained_modules()
        }
        self.transformer = family.trained_network(self.parts)
        self.lora = any(getattr(part, "peft_config", None) for part in self.parts.values())
        self._prompt_cache: dict[Key, tuple[dict, dict]] = {}
        # a rollout's stored conditioning (CPU), moved into the cache as prompts are asked for; with it
        # the pipeline has no text encoder
        self._stored: Entries | None = conditioning
        # where `encode` takes prompts from, as `for_rollout` reports it
        self.conditioning_source = "stored" if conditioning is not None else "encoded"
        # a rollout's condition images by group id (`stages.models.condition_images`): what `images_of`
        # gives the stages that replay or train on its rows
        self.group_images: dict[str, list[bytes]] = {}
        self._reference: torch.nn.Module | None = None

    @property
    def module(self) -> torch.nn.Module:
        """The trained network (the family's trained module, e.g. the transformer)."""
        return unwrap(self.transformer)

    def untrained_loras(self) -> list[str]:
        """Pipeline components besides the trained module that carry LoRA layers (a diffusers LoRA file's
        text-encoder weights): applied when sampling, but never trained or saved."""
        return sorted(
            name
            for name, module in self.pipe.components.items()
            if name not in self.parts and getattr(module, "peft_config", None)
        )

    def gradient_checkpointing(self) -> None:
        """Recompute the trained module's activations in the backward instead of keeping them
        (diffusers' per-block checkpointing): less memory, one more forward per trained step."""
        for part in self.parts.values():
            if not getattr(part, "_supports_gradient_checkpointing", False):
                raise UserInputError(f"--gradient-checkpointing: {type(part).__name__} does not support it")
            part.enable_gradient_checkpointing()

    def vae_memory(self, *, tiling: bool = False, slicing: bool = False) -> None:
        """Decode with less memory (`vae_memory`, the module function)."""
        vae_memory(self.pipe.vae, self.family.name, tiling=tiling, slicing=slicing)

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        model_path: str | Path,
        *,
        adapter: str | Path | None = None,
        device: torch.device | str = "cpu",
        dtype: str = "fp32",
        conditioning: Entries | None = None,
        vae: bool = True,
    ) -> FlowPolicy:
        """Load a pipeline folder with `from_pretrained` and apply an adapter folder, if any: one `omnirl
        update` wrote, or a diffusers LoRA folder (`pytorch_lora_weights.safetensors`) from another tool.

        `conditioning`: a rollout's stored prompt conditioning (`stages.models.conditioning`); the text
        encoders and tokenizers are then not loaded, and `encode` takes every prompt from it. `vae`
        False: no VAE weights are read (for stages that neither decode nor encode images); its config
        alone stands in while the pipeline is built, so latent sizes stay the model's own.
        """
        model_path, index, family_class = _pipeline_to_load(model_path, dtype)
        torch_dtype = DTYPES[dtype]
        kwargs: dict[str, Any] = {}
        if conditioning is not None:
            kwargs.update({name: None for name in text_components(index)})
        if not vae:  # a family without a VAE component in its index (its own layout) reads none
            kwargs["vae"] = (
                _config_only(model_path, index, "vae") if isinstance(index.get("vae"), list) else None
            )
        config = read_adapter_config(adapter) if adapter else None
        if adapter:
            refuse_pickled_weights(adapter, "--adapter")
        if config:
            trained = family_class.trained_module
            check_adapter_layout(
                adapter, config, lora_files=(LORA_WEIGHTS, PEFT_CONFIG), full_file=f"{trained}/config.json"
            )
        kwargs.update(family_class.load_components(model_path, set(index) - set(kwargs)))
        full: dict[str, torch.nn.Module] = {}
        if config and config["kind"] == "full":  # each trained module it holds, of the index's class
            for name in trained_folders(Path(adapter), index):
                library, class_name = index[name]
                with adapter_loading(adapter, model_path):
                    full[name] = getattr(importlib.import_module(library), class_name).from_pretrained(
                        Path(adapter) / name, dtype=torch_dtype, use_safetensors=True
                    )
        pipe = family_class.load_pipeline(model_path, index, {**kwargs, **full}, torch_dtype)
        # diffusers loads an optional component (Wan's transformer, transformer_2) from the model folder
        # even when one is passed, so the adapter's modules are put in place afterwards as well
        pipe.register_modules(**full)
        if not vae:
            pipe.register_modules(vae=None)
        family = family_class(pipe)
        pipe.set_progress_bar_config(disable=True)
        pipe.to(device)
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False)
                module.eval()
        if config and config["kind"] == "lora":
            with adapter_loading(adapter, model_path):
                load_lora(pipe, family.trained_module, Path(adapter))
                load_expert_loras(pipe, family.trained_modules()[1:], Path(adapter))
            if not getattr(getattr(pipe, family.trained_module), "peft_config", None):
                raise UserInputError(
                    f"--adapter {adapter}: none of its LoRA weights fit the {family.trained_module} of --model "
                    f"{model_path}; pass a LoRA trained from this base model"
                )
        return cls(
            pipe,
            family,
            model_path=str(model_path),
            adapter=str(adapter) if adapter else None,
            device=torch.device(device),
            dtype=torch_dtype,
            conditioning=conditioning,
        )

    @classmethod
    def for_rollout(
        cls,
        model_path: str | Path,
        inputs: Any,
        max_sequence_length: int,
        *,
        adapter: str | Path | None = None,
        device: torch.device | str = "cpu",
        dtype: str = "fp32",
    ) -> FlowPolicy:
        """The policy of a stage that replays or trains on a rollout's latents (`logprob`, `update`): no
        VAE, and no text encoder or tokenizer when the rollout among the zipped `inputs` stores its prompt
        conditioning for this --model (`conditioning.stored_conditioning`; another encoder is refused);
        `conditioning_source` says which ("stored", or why it encodes)."""
        identity = encoder_identity(model_path, dtype, max_sequence_length)
        stored, source = stored_conditioning(inputs.paths, inputs.manifests, identity)
        if stored is not None and adapter and lora_has_layers(Path(adapter), TEXT_PREFIXES):
            # an adapter with text-encoder LoRA layers loads onto the text encoders: keep them
            stored, source = None, f"--adapter {adapter} has text-encoder LoRA weights"
        group_images = stored_condition_images(inputs.paths, inputs.manifests)
        # an editing model that encodes its prompts encodes their condition images with the VAE too
        policy = cls.load(
            model_path,
            adapter=adapter,
            device=device,
            dtype=dtype,
            conditioning=stored,
            vae=stored is None and bool(group_images),
        )
        policy.conditioning_source = source
        policy.group_images = group_images
        return policy

    def images_of(self, group_ids: list[str]) -> list[list[bytes]] | None:
        """The condition images of rows of these prompt groups (`group_images`); None for a rollout
        without any (a text-to-image rollout)."""
        if not self.group_images:
            return None
        return [self.group_images.get(g, []) for g in group_ids]

    def add_conditioning(self, entries: Entries) -> None:
        """Add prompt conditioning to what a policy loaded with `conditioning` takes prompts from (how
        `online`'s trainer receives it from its sampler, iteration by iteration)."""
        if self._stored is None:
            raise ValueError(
                "add_conditioning: this policy encodes its prompts (it was loaded with text encoders)"
            )
        self._stored.update(entries)

    @property
    def loaded_components(self) -> list[str]:
        """The pipeline components actually instantiated (not None), sorted: what this policy holds."""
        return sorted(name for name, part in self.pipe.components.items() if part is not None)

    def conditioning(self, keys: list[Key]) -> Entries:
        """The cached conditioning of `keys` (those encoded so far), on the CPU, for storing it."""
        found: Entries = {}
        for key in keys:
            if key in self._prompt_cache:
                pos, neg = self._prompt_cache[key]
                found[key] = ({n: t.cpu() for n, t in pos.items()}, {n: t.cpu() for n, t in neg.items()})
        return found

    # ---------------------------------------------------------------- saving
    def save_adapter(
        self,
        out: Path,
        *,
        kind: str,
        extra: dict[str, Any],
        state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write the trained weights so `pipe.load_lora_weights(out)` (LoRA) or `from_pretrained` (full) loads them.

        state: the trained module's full state dict when it is sharded (gathered by the caller);
        None reads the module's own. With several experts, the first one's LoRA is the folder's own
        file and each further expert's goes to `out/<expert>/` (`load_expert_loras`); full weights go to
        `out/<module>/` for every trained module.
        """
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        state = self.module.state_dict() if state is None else state
        first = self.family.trained_module
        for name, part in self.parts.items():
            own = (
                state
                if len(self.parts) == 1
                else {k.removeprefix(f"{name}."): v for k, v in state.items() if k.startswith(f"{name}.")}
            )
            if kind == "lora":
                from peft.utils import get_peft_model_state_dict

                if not getattr(part, "peft_config", None):
                    continue
                layers = get_peft_model_state_dict(part, state_dict=own, adapter_name="default")
                meta = lora_config_dict(part.peft_config["default"])
                self.family.save_lora(out if name == first else out / name, layers, meta)
            else:  # the files diffusers' save_pretrained writes: config.json and one safetensors file
                part.save_config(out / name)
                weights = {k: v.detach().contiguous() for k, v in own.items()}
                save_file(
                    weights, out / name / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"}
                )
        config = {"kind": kind, **base_model_record(self.model_path), **extra}
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))

    # ---------------------------------------------------------------- math
    def sigmas(self, num_steps: int, resolution: Resolution) -> torch.Tensor:
        """The family's own σ schedule [N+1] (ends in 0), float32, for samples of `resolution` (a side or
        (height, width))."""
        return self.family.sigmas(num_steps, resolution)

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        """The stored latent of one sample of `resolution` and `frames` frames (the family's layout); more
        than one frame from an image family is a one-line error naming --frames."""
        if frames != 1 and self.family.media != "video":
            raise UserInputError(
                f"--frames {frames}: --model {self.model_path} makes images ({self.family.name}); leave --frames at 1"
            )
        return self.family.latent_shape(resolution, frames)

    def needs_negative(self, guidance: float) -> bool:
        """Whether sampling with `guidance` runs an unconditional branch (the family's CFG kind)."""
        return self.family.needs_negative(guidance)

    def initial_noise(self, seeds: list[int], resolution: Resolution, frames: int = 1) -> torch.Tensor:
        """x_T [B, *latent_shape] drawn per sample from its own seed (batching never changes it)."""
        shape = self.latent_shape(resolution, frames)
        noise = [torch.randn(shape, generator=seed_generator(s), dtype=torch.float32) for s in seeds]
        return torch.stack(noise).to(self.device)

    @torch.no_grad()
    def encode(
        self,
        prompts: list[str],
        negative: list[str] | None,
        cfg: bool,
        max_sequence_length: int = 128,
        images: list[list[bytes]] | None = None,
    ) -> Condition:
        """Frozen conditioning, cached per unique (prompt, negative, text length, condition images): a
        server keeps its policy across requests that ask for other lengths; negatives when `cfg`.
        `images`: each prompt's condition images as encoded files (an editing model's source images,
        `stages.models.condition_images`; None: none), a count the family does not take a one-line error.
        A policy loaded with stored conditioning takes it from there, and a prompt it lacks is a one-line
        error."""
        negative = negative or [""] * len(prompts)
        images = images if images is not None else [[] for _ in prompts]
        for prompt, given in zip(prompts, images):
            self.family.check_condition_images(len(given), prompt, self.family.name)
        digests = [images_digest(given) for given in images]
        by_digest = dict(zip(digests, images))
        keys = [(p, n, max_sequence_length, d) for p, n, d in zip(prompts, negative, digests)]
        missing = [key for key in dict.fromkeys(keys) if key not in self._prompt_cache]
        if missing and self._stored is not None:
            absent = next((key for key in missing if key not in self._stored), None)
            if absent is not None:
                with_images = " and its condition images" if absent[3] else ""
                raise UserInputError(
                    f"prompt {absent[0]!r}{with_images} (negative {absent[1]!r}, max length {absent[2]}) is "
                    "not in the rollout's stored conditioning, and no text encoder was loaded; pass the --in "
                    "of the rollout these rows were sampled in"
                )
            for key in missing:
                pos, neg = self._stored[key]
                self._prompt_cache[key] = (
                    {n: t.to(self.device) for n, t in pos.items()},
                    {n: t.to(self.device) for n, t in neg.items()},
                )
            missing = []
        if missing:
            extra = {}
            if self.family.condition_images[1]:  # an editing family: each prompt's images, decoded
                extra["images"] = [decode_images(by_digest[d], f"prompt {p!r}") for p, _, _, d in missing]
            encoded = self.family.encode_prompts(
                [p for p, *_ in missing],
                [n for _, n, *_ in missing],
                self.device,
                max_sequence_length,
                **extra,
            )
            self._prompt_cache.update(zip(missing, encoded))
        parts = [self._prompt_cache[key] for key in keys]
        pos = self.family.collate([part[0] for part in parts])
        return Condition(pos, self.family.collate([part[1] for part in parts]) if cfg else None)

    def forget_prompts(self) -> None:
        """Empty `encode`'s cache. A text encoder's output for a prompt depends on the batch it is
        encoded in (rounding: SD3's pooled embeddings by up to 4e-7), so the cache makes it depend on the
        history of the process; a run that must equal another from some point on (`omnirl online`
        resumed after a kill, or as the staged commands) starts each iteration without it."""
        self._prompt_cache.clear()

    def velocity(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Condition,
        guidance: float,
        guidance_2: float | None = None,
    ) -> torch.Tensor:
        """Guided velocity v(x, σ) [B, *latent_shape] in fp32 (σ a scalar or [B]), by the family.
        `guidance_2`: the low-noise expert's guidance of a two-expert model (None: `guidance`); any other
        model refuses it in one line."""
        sigma = sigma.to(self.device, torch.float32).expand(x.shape[0])
        extra = {}
        if guidance_2 is not None:
            if len(self.parts) < 2:
                raise UserInputError(
                    f"--guidance-2 {guidance_2:g}: --model {self.model_path} ({self.family.name}) has one "
                    "transformer; it guides the low-noise expert of a two-expert model (Wan 2.2 A14B)"
                )
            extra["guidance_2"] = guidance_2
        cond = cond.to(self.transformer.dtype)
        patches = [*x.shape[2:-2], x.shape[-2] // PATCH, x.shape[-1] // PATCH]  # every family patches 2×2
        check_sequence(
            unwrap(self.transformer), math.prod(patches), " × ".join(map(str, patches)) + " patches"
        )
        return self.family.velocity(self.transformer, x, sigma, cond, guidance, **extra)

    def finish(self, x0: torch.Tensor, cond: Condition) -> torch.Tensor:
        """The sample the pipeline returns for the sampler's last latents x0 (`FamilyAdapter.finish`)."""
        return self.family.finish(x0, cond)

    @torch.no_grad()
    def encode_images(self, images: list[Any], resolution: Resolution) -> torch.Tensor:
        """PIL images → latents [B, *latent_shape] (resized and centre-cropped), the inverse of `decode`."""
        return self.family.encode_images(images, resolution, self.device)

    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> list[Any]:
        """Latents [B, *latent_shape] → per sample a PIL image, or a list of PIL frames for a video
        family (`FamilyAdapter.media`)."""
        return self.family.decode(x0)
