"""Flow-matching text-to-image pipelines seen as RL policies.

A `FlowPolicy` wraps a diffusers pipeline folder (optionally with an omnirl adapter on top) and
exposes what the stages need: prompt conditioning, the guided velocity v(x, σ), the pipeline's own
σ schedule, initial noise from per-sample seeds, and decoding. Sampling, replay and training all go
through `velocity`, so the three compute the same numbers. Everything that differs between pipeline
families is the family's adapter (`stages.models.families`); this class is the same for all.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from stages.dist import unwrap
from stages.errors import UserInputError
from stages.models.conditioning import (
    TEXT_PREFIXES,
    Entries,
    Key,
    encoder_identity,
    stored_conditioning,
    text_components,
)
from stages.models.families import Condition, FamilyAdapter, Resolution, adapter_class
from stages.models.hub import base_model_record
from stages.models.lora_weights import lora_config_dict, lora_file, swap_lora
from stages.safe_files import refuse_pickled_weights

ADAPTER_CONFIG = "omnirl_adapter.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
# Where `PeftModel.save_pretrained` puts the wrapped module's own parameter names.
PEFT_PREFIX = "base_model.model."
ADAPTER_KINDS = ("lora", "full")
# The file that marks each LoRA layout omnirl loads: its family and what writes it.
LORA_LAYOUTS = {
    LORA_WEIGHTS: ("diffusers", "`pipe.save_lora_weights`"),
    PEFT_CONFIG: ("PEFT", "`PeftModel.save_pretrained`"),
}
ADAPTER_FORMS = (
    f"pass a folder written by `omnirl update`, a diffusers LoRA folder ({LORA_WEIGHTS}, as "
    f"`save_lora_weights` writes) or a PEFT LoRA folder ({PEFT_CONFIG}, as `save_pretrained` writes)"
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_pipeline_folder(model: str | Path, option: str = "--model") -> Path:
    """`model` as a Path when it is a diffusers pipeline folder (has model_index.json): checked before
    anything hashes or loads it, since any folder (even /tmp) could be walked otherwise."""
    path = Path(model)
    if not (path / "model_index.json").is_file():
        raise UserInputError(f"{option} {model}: not a diffusers pipeline folder (no model_index.json)")
    return path


def pipeline_index(model: str | Path, option: str = "--model") -> dict[str, Any]:
    """The model_index.json of pipeline folder `model` (its `_class_name` names the pipeline, each
    component entry its library and class); not a pipeline folder, or an unreadable index, is one line."""
    path = check_pipeline_folder(model, option)
    try:
        index = json.loads((path / "model_index.json").read_bytes())
        if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
            raise ValueError
    except (OSError, ValueError):
        raise UserInputError(
            f"{option} {model}: model_index.json is not a diffusers pipeline index"
        ) from None
    return index


def seed_generator(seed: int) -> torch.Generator:
    """A CPU generator for one sample: noise never depends on batch composition or device."""
    return torch.Generator("cpu").manual_seed(int(seed))


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
    unused = sorted(set(state) - set(get_peft_model_state_dict(module, adapter_name="default")))
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


def _lora_changes_text_encoders(adapter: Path) -> bool:
    """Whether a diffusers LoRA folder's weights (`LORA_WEIGHTS`) hold text-encoder layers (read from
    the safetensors header alone). A damaged file says no: loading it is then refused in one line."""
    from safetensors import safe_open

    path = adapter / LORA_WEIGHTS
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return any(key.startswith(TEXT_PREFIXES) for key in f.keys())  # noqa: SIM118 (no mapping)
    except (SafetensorError, OSError):
        return False


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
    from diffusers import DiffusionPipeline

    model_path, index, family_class = _pipeline_to_load(model_path, dtype)
    if not isinstance(index.get("vae"), list):
        raise UserInputError(
            f"--model {model_path}: its model_index.json lists no vae; pass the pipeline folder"
        )
    others = {name: None for name, entry in index.items() if isinstance(entry, list) and name != "vae"}
    pipe = DiffusionPipeline.from_pretrained(model_path, dtype=DTYPES[dtype], use_safetensors=True, **others)
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


class FlowPolicy:
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
        from diffusers import DiffusionPipeline

        model_path, index, family_class = _pipeline_to_load(model_path, dtype)
        torch_dtype = DTYPES[dtype]
        kwargs: dict[str, Any] = {"dtype": torch_dtype, "use_safetensors": True}
        if conditioning is not None:
            kwargs.update({name: None for name in text_components(index)})
        if not vae and isinstance(index.get("vae"), list):
            kwargs["vae"] = _config_only(model_path, index, "vae")
        config = read_adapter_config(adapter) if adapter else None
        if adapter:
            refuse_pickled_weights(adapter, "--adapter")
        if config:
            trained = family_class.trained_module
            check_adapter_layout(
                adapter, config, lora_files=(LORA_WEIGHTS, PEFT_CONFIG), full_file=f"{trained}/config.json"
            )
        full: dict[str, torch.nn.Module] = {}
        if config and config["kind"] == "full":  # each trained module it holds, of the index's class
            for name in trained_folders(Path(adapter), index):
                library, class_name = index[name]
                with adapter_loading(adapter, model_path):
                    full[name] = getattr(importlib.import_module(library), class_name).from_pretrained(
                        Path(adapter) / name, dtype=torch_dtype, use_safetensors=True
                    )
        pipe = DiffusionPipeline.from_pretrained(model_path, **kwargs, **full)
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
        if stored is not None and adapter and _lora_changes_text_encoders(Path(adapter)):
            # an adapter with text-encoder LoRA layers loads onto the text encoders: keep them
            stored, source = None, f"--adapter {adapter} has text-encoder LoRA weights"
        policy = cls.load(
            model_path, adapter=adapter, device=device, dtype=dtype, conditioning=stored, vae=False
        )
        policy.conditioning_source = source
        return policy

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

    def add_lora(
        self, *, rank: int = 32, alpha: int = 64, targets: tuple[str, ...] | None = None, seed: int = 0
    ) -> None:
        """Attach a fresh LoRA adapter (gaussian A, zero B: the policy starts equal to the base model) on
        `targets`, by default the family's (the reference trainers' list), to every trained module (each
        expert gets its own)."""
        from peft import LoraConfig

        targets = self.family.lora_targets if targets is None else targets
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for part in self.parts.values():
                part.add_adapter(
                    LoraConfig(
                        r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets)
                    )
                )
        self.lora = True

    def trainable_parameters(self, full: bool = False) -> list[torch.nn.Parameter]:
        """Mark and return the trained parameters: LoRA weights, or every weight of the trained module
        with `full`. They are cast to fp32 whatever --dtype (diffusers' `cast_training_params`), so the
        optimizer steps in fp32; --dtype stays the storage dtype of the frozen weights."""
        params = []
        for name, p in self.transformer.named_parameters():
            train = full or "lora_" in name
            p.requires_grad_(train)
            if train:
                p.data = p.data.float()
                params.append(p)
        if not params:
            raise UserInputError(
                "nothing to train: the policy has no LoRA adapter; pass --lora-rank > 0 or --full"
            )
        return params

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Run the frozen base model inside the block, for KL references.

        With LoRA the adapter is switched off; with full fine-tuning a frozen copy of the base
        transformer (loaded once from the model folder) stands in for the trained one.
        """
        if self.lora:
            adapted = [part for part in self.parts.values() if getattr(part, "peft_config", None)]
            for part in adapted:
                part.disable_adapters()
            try:
                yield
            finally:
                for part in adapted:
                    part.enable_adapters()
            return
        if self._reference is None:
            self._reference = self.family.trained_network(
                {
                    name: type(part)
                    .from_pretrained(Path(self.model_path) / name, dtype=self.dtype)
                    .to(self.device)
                    .requires_grad_(False)
                    .eval()
                    for name, part in self.parts.items()
                }
            )
        trained, self.transformer = self.transformer, self._reference
        try:
            yield
        finally:
            self.transformer = trained

    @contextmanager
    def weights(self, state: dict[str, torch.Tensor] | None) -> Iterator[None]:
        """Run the transformer with `state` (name → tensor) in place of those weights inside the block.

        Used for DiffusionNFT's old policy and AWM's old/EMA weights. Plain parameters get the tensors
        swapped in (no copies, and the autograd graph of an earlier forward keeps its own). A sharded
        module (FSDP2, resharded after each forward) gathers its weights from the shards' own storage
        at every forward, so there the values are copied into the shards and back.
        """
        from torch.distributed.tensor import DTensor

        params = dict(self.module.named_parameters())
        state = state or {}
        if any(isinstance(params[name], DTensor) for name in state):
            saved = {name: params[name].detach().clone() for name in state}
            with torch.no_grad():
                for name, value in state.items():
                    params[name].copy_(value)
            try:
                yield
            finally:
                with torch.no_grad():
                    for name, value in saved.items():
                        params[name].copy_(value)
            return
        swapped = {}
        try:
            for name, value in state.items():
                swapped[name] = params[name].data
                params[name].data = value.to(params[name].device, params[name].dtype)
            yield
        finally:
            for name, value in swapped.items():
                params[name].data = value

    # ---------------------------------------------------------------- LoRA in memory
    def _one_trained_module(self, what: str) -> None:
        if len(self.parts) > 1:
            raise UserInputError(
                f"{what} takes a family with one trained module; this one trains {', '.join(self.parts)}: "
                "load the adapter folder instead (`omnirl serve --adapter`, or POST its path)"
            )

    def lora_file(self) -> bytes:
        """The trained module's LoRA as the bytes of a diffusers LoRA file (`lora_weights.lora_file`)."""
        self._one_trained_module("sending LoRA weights as one file")
        return lora_file(self.module, self.family.trained_module)

    def set_lora(self, layers: dict[str, torch.Tensor] | None, config: dict[str, Any] | None) -> str:
        """Swap LoRA `layers` of `config` onto the trained module in place of its adapter (None: the base
        model), without reloading anything (`lora_weights.swap_lora`); returns how it was done."""
        self._one_trained_module("swapping LoRA weights in place")
        how = swap_lora(self.module, layers, config)
        self.lora = bool(getattr(self.module, "peft_config", None))
        return how

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
                type(self.pipe).save_lora_weights(
                    out if name == first else out / name,
                    **{f"{first}_lora_layers": layers, f"{first}_lora_adapter_metadata": meta},
                )
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
        self, prompts: list[str], negative: list[str] | None, cfg: bool, max_sequence_length: int = 128
    ) -> Condition:
        """Frozen text conditioning, cached per unique (prompt, negative, text length): a server keeps
        its policy across requests that ask for other lengths; negatives when `cfg`. A policy loaded with
        stored conditioning takes it from there, and a prompt it lacks is a one-line error."""
        negative = negative or [""] * len(prompts)
        keys = [(p, n, max_sequence_length) for p, n in zip(prompts, negative)]
        missing = [key for key in dict.fromkeys(keys) if key not in self._prompt_cache]
        if missing and self._stored is not None:
            absent = next((key for key in missing if key not in self._stored), None)
            if absent is not None:
                raise UserInputError(
                    f"prompt {absent[0]!r} (negative {absent[1]!r}, max length {absent[2]}) is not in the "
                    "rollout's stored conditioning, and no text encoder was loaded; pass the --in of the "
                    "rollout these rows were sampled in"
                )
            for key in missing:
                pos, neg = self._stored[key]
                self._prompt_cache[key] = (
                    {n: t.to(self.device) for n, t in pos.items()},
                    {n: t.to(self.device) for n, t in neg.items()},
                )
            missing = []
        if missing:
            encoded = self.family.encode_prompts(
                [p for p, _, _ in missing], [n for _, n, _ in missing], self.device, max_sequence_length
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
        return self.family.velocity(self.transformer, x, sigma, cond, guidance, **extra)

    @torch.no_grad()
    def encode_images(self, images: list[Any], resolution: Resolution) -> torch.Tensor:
        """PIL images → latents [B, *latent_shape] (resized and centre-cropped), the inverse of `decode`."""
        return self.family.encode_images(images, resolution, self.device)

    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> list[Any]:
        """Latents [B, *latent_shape] → per sample a PIL image, or a list of PIL frames for a video
        family (`FamilyAdapter.media`)."""
        return self.family.decode(x0)
