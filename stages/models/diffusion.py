"""Flow-matching text-to-image pipelines seen as RL policies.

A `FlowPolicy` wraps a diffusers pipeline folder (optionally with an omnirl adapter on top) and
exposes what the stages need: prompt conditioning, the guided velocity v(x, σ), the pipeline's own
σ schedule, initial noise from per-sample seeds, and decoding. Sampling, replay and training all go
through `velocity`, so the three compute the same numbers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from stages.errors import UserInputError

ADAPTER_CONFIG = "omnirl_adapter.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
PEFT_CONFIG = "adapter_config.json"
ADAPTER_KINDS = ("lora", "full")
# The file that marks each LoRA layout omnirl loads: its family and what writes it.
LORA_LAYOUTS = {
    LORA_WEIGHTS: ("diffusers", "`pipe.save_lora_weights`"),
    PEFT_CONFIG: ("PEFT", "`PeftModel.save_pretrained`"),
}
ADAPTER_FORMS = (
    f"pass a folder written by `omnirl update`, a diffusers LoRA folder ({LORA_WEIGHTS}) or, for a VLM, "
    f"a PEFT LoRA folder ({PEFT_CONFIG})"
)
# flow_grpo's LoRA targets for SD3 (diffusion-rl.md §1.5).
SD3_LORA_TARGETS = (
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Condition:
    """Text conditioning of a batch: embeddings [B, L, D] and pooled [B, P]; negatives when CFG is on."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    neg_embeds: torch.Tensor | None = None
    neg_pooled: torch.Tensor | None = None

    def select(self, index: torch.Tensor | list[int]) -> Condition:
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Condition(pick(self.embeds), pick(self.pooled), pick(self.neg_embeds), pick(self.neg_pooled))


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


def check_adapter_layout(
    adapter: str | Path, config: dict[str, Any], *, lora_file: str, full_file: str
) -> None:
    """Refuse an adapter folder whose files are not the layout the loading model family reads: a LoRA
    needs `lora_file` (diffusers: the weights, VLM: PEFT's config), a full adapter `full_file`."""
    folder = Path(adapter)
    need = lora_file if config["kind"] == "lora" else full_file
    if (folder / need).is_file():
        return
    other = next((f for f in LORA_LAYOUTS if f != lora_file and (folder / f).is_file()), None)
    if config["kind"] == "lora" and other:
        raise UserInputError(
            f"--adapter {adapter}: a {LORA_LAYOUTS[other][0]} LoRA folder ({other}), which this --model "
            f"does not load; it takes a LoRA folder with {lora_file}, as {LORA_LAYOUTS[lora_file][1]} writes"
        )
    raise UserInputError(
        f"--adapter {adapter}: a {config['kind']} adapter without {need}; pass one that `omnirl update` "
        "wrote for this --model"
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


class FlowPolicy:
    """A flow-matching pipeline (SD3 family) as a policy over denoising steps."""

    def __init__(
        self, pipe: Any, *, model_path: str, adapter: str | None, device: torch.device, dtype: torch.dtype
    ):
        self.pipe = pipe
        self.model_path = model_path
        self.adapter = adapter
        self.device = device
        self.dtype = dtype
        self.transformer = pipe.transformer
        self.lora = bool(getattr(self.transformer, "peft_config", None))
        self._prompt_cache: dict[tuple[str, str], tuple[torch.Tensor, ...]] = {}
        self._reference: torch.nn.Module | None = None

    @property
    def module(self) -> torch.nn.Module:
        """The trained network (the transformer)."""
        return self.transformer

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        model_path: str | Path,
        *,
        adapter: str | Path | None = None,
        device: torch.device | str = "cpu",
        dtype: str = "fp32",
    ) -> FlowPolicy:
        """Load a pipeline folder with `from_pretrained` and apply an adapter folder, if any: one `omnirl
        update` wrote, or a diffusers LoRA folder (`pytorch_lora_weights.safetensors`) from another tool."""
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()

        model_path = Path(model_path)
        if not (model_path / "model_index.json").is_file():
            raise UserInputError(
                f"--model {model_path}: not a diffusers pipeline folder (no model_index.json)"
            )
        if dtype not in DTYPES:
            raise UserInputError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
        torch_dtype = DTYPES[dtype]
        kwargs: dict[str, Any] = {"dtype": torch_dtype}
        config = read_adapter_config(adapter) if adapter else None
        if config:
            check_adapter_layout(adapter, config, lora_file=LORA_WEIGHTS, full_file="transformer/config.json")
        if config and config["kind"] == "full":
            from diffusers import SD3Transformer2DModel

            with adapter_loading(adapter, model_path):
                kwargs["transformer"] = SD3Transformer2DModel.from_pretrained(
                    Path(adapter) / "transformer", dtype=torch_dtype
                )
        pipe = DiffusionPipeline.from_pretrained(model_path, **kwargs)
        if type(pipe).__name__ not in ("StableDiffusion3Pipeline",):
            raise UserInputError(
                f"--model {model_path}: pipeline {type(pipe).__name__} is not supported yet (supported: SD3 family)"
            )
        pipe.set_progress_bar_config(disable=True)
        pipe.to(device)
        for part in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "transformer"):
            module = getattr(pipe, part, None)
            if module is not None:
                module.requires_grad_(False)
                module.eval()
        if config and config["kind"] == "lora":
            with adapter_loading(adapter, model_path):
                pipe.load_lora_weights(str(adapter), adapter_name="default")
            if not getattr(pipe.transformer, "peft_config", None):
                raise UserInputError(
                    f"--adapter {adapter}: none of its LoRA weights fit the transformer of --model "
                    f"{model_path}; pass a LoRA trained from this base model"
                )
        return cls(
            pipe,
            model_path=str(model_path),
            adapter=str(adapter) if adapter else None,
            device=torch.device(device),
            dtype=torch_dtype,
        )

    def add_lora(
        self, *, rank: int = 32, alpha: int = 64, targets: tuple[str, ...] = SD3_LORA_TARGETS, seed: int = 0
    ) -> None:
        """Attach a fresh LoRA adapter (gaussian A, zero B: the policy starts equal to the base model)."""
        from peft import LoraConfig

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.transformer.add_adapter(
                LoraConfig(
                    r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets)
                )
            )
        self.lora = True

    def trainable_parameters(self, full: bool = False) -> list[torch.nn.Parameter]:
        """Mark and return the trained parameters: LoRA weights, or every transformer weight with `full`."""
        params = []
        for name, p in self.transformer.named_parameters():
            train = full or "lora_" in name
            p.requires_grad_(train)
            if train:
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
            self.transformer.disable_adapters()
            try:
                yield
            finally:
                self.transformer.enable_adapters()
            return
        if self._reference is None:
            self._reference = (
                type(self.transformer)
                .from_pretrained(Path(self.model_path) / "transformer", dtype=self.dtype)
                .to(self.device)
                .requires_grad_(False)
                .eval()
            )
        trained, self.transformer = self.transformer, self._reference
        try:
            yield
        finally:
            self.transformer = trained

    @contextmanager
    def weights(self, state: dict[str, torch.Tensor] | None) -> Iterator[None]:
        """Run the transformer with `state` (name → tensor) in place of those weights inside the block.

        Swaps tensor storage, no copies: used for DiffusionNFT's old policy and AWM's old/EMA weights.
        """
        params = dict(self.transformer.named_parameters())
        saved = {}
        try:
            for name, value in (state or {}).items():
                saved[name] = params[name].data
                params[name].data = value.to(params[name].device, params[name].dtype)
            yield
        finally:
            for name, value in saved.items():
                params[name].data = value

    # ---------------------------------------------------------------- saving
    def save_adapter(self, out: Path, *, kind: str, extra: dict[str, Any]) -> None:
        """Write the trained weights so `pipe.load_lora_weights(out)` (LoRA) or `from_pretrained` (full) loads them."""
        out.mkdir(parents=True, exist_ok=True)
        if kind == "lora":
            from peft.utils import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.transformer, adapter_name="default")
            meta = self.transformer.peft_config["default"].to_dict()
            meta = {k: (sorted(v) if isinstance(v, set) else v) for k, v in meta.items()}
            type(self.pipe).save_lora_weights(
                out, transformer_lora_layers=state, transformer_lora_adapter_metadata=meta
            )
        else:
            self.transformer.save_pretrained(out / "transformer")
        config = {"kind": kind, "base_model": self.model_path, **extra}
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))

    # ---------------------------------------------------------------- math
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline scheduler's own σ schedule [N+1] (ends in 0), float32."""
        from stages.sample.samplers import flow_match_sigmas

        return flow_match_sigmas(self.pipe.scheduler, num_steps)

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        """(C, h, w) of a `resolution`² image; the side must be a positive multiple of the VAE factor ×
        the transformer's patch size, as the diffusers SD3 pipeline requires."""
        factor = self.pipe.vae_scale_factor
        multiple = factor * self.transformer.config.patch_size
        if resolution < 1 or resolution % multiple:
            raise UserInputError(
                f"--resolution {resolution}: must be a positive multiple of {multiple} for this model"
            )
        return (self.transformer.config.in_channels, resolution // factor, resolution // factor)

    def initial_noise(self, seeds: list[int], resolution: int) -> torch.Tensor:
        """x_T [B, C, h, w] drawn per sample from its own seed (batching never changes it)."""
        shape = self.latent_shape(resolution)
        noise = [torch.randn(shape, generator=seed_generator(s), dtype=torch.float32) for s in seeds]
        return torch.stack(noise).to(self.device)

    @torch.no_grad()
    def encode(
        self, prompts: list[str], negative: list[str] | None, cfg: bool, max_sequence_length: int = 128
    ) -> Condition:
        """Frozen text conditioning, cached per unique (prompt, negative) pair."""
        negative = negative or [""] * len(prompts)
        missing = [
            (p, n) for p, n in dict.fromkeys(zip(prompts, negative)) if (p, n) not in self._prompt_cache
        ]
        if missing:
            ps = [p for p, _ in missing]
            ns = [n for _, n in missing]
            emb, neg_emb, pooled, neg_pooled = self.pipe.encode_prompt(
                prompt=ps,
                prompt_2=ps,
                prompt_3=ps,
                negative_prompt=ns,
                negative_prompt_2=ns,
                negative_prompt_3=ns,
                do_classifier_free_guidance=True,
                device=self.device,
                max_sequence_length=max_sequence_length,
            )
            for i, key in enumerate(missing):
                self._prompt_cache[key] = (emb[i], pooled[i], neg_emb[i], neg_pooled[i])
        parts = [self._prompt_cache[(p, n)] for p, n in zip(prompts, negative)]
        stack = [torch.stack([part[k] for part in parts]) for k in range(4)]
        if not cfg:
            return Condition(stack[0], stack[1])
        return Condition(*stack)

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: Condition, guidance: float
    ) -> torch.Tensor:
        """Guided velocity v(x, σ) [B, C, h, w] in fp32; the model sees timestep σ·1000 as SD3 does.

        With guidance > 1 the unconditional and conditional branches run in one batch of 2B, as the
        diffusers pipeline does, so the numbers match its own call.
        """
        sigma = sigma.to(self.device, torch.float32).expand(x.shape[0])
        timestep = sigma * 1000
        model_in = x.to(self.dtype)
        if guidance > 1.0:
            out = self.transformer(
                hidden_states=torch.cat([model_in, model_in]),
                timestep=torch.cat([timestep, timestep]),
                encoder_hidden_states=torch.cat([cond.neg_embeds, cond.embeds]),
                pooled_projections=torch.cat([cond.neg_pooled, cond.pooled]),
                return_dict=False,
            )[0]
            uncond, text = out.float().chunk(2)
            return uncond + guidance * (text - uncond)
        out = self.transformer(
            hidden_states=model_in,
            timestep=timestep,
            encoder_hidden_states=cond.embeds,
            pooled_projections=cond.pooled,
            return_dict=False,
        )[0]
        return out.float()

    @torch.no_grad()
    def encode_images(self, images: list[Any], resolution: int) -> torch.Tensor:
        """PIL images → latents [B, C, h, w]: resized and centre-cropped to `resolution`, VAE posterior
        mode, then SD3's (z − shift)·scale, the inverse of `decode`."""
        self.latent_shape(resolution)
        vae = self.pipe.vae
        pixels = self.pipe.image_processor.preprocess(
            images, height=resolution, width=resolution, resize_mode="crop"
        )
        z = vae.encode(pixels.to(self.device, vae.dtype)).latent_dist.mode()
        return ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()

    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> list[Any]:
        """Latents [B, C, h, w] → PIL images."""
        vae = self.pipe.vae
        z = x0.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")
