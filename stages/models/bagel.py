"""BAGEL's text-to-image generation as a diffusion family (`BagelAdapter`, registered in
`families.BUILTIN` under the pipeline class `Bagel`; the model: `stages.models.bagel_model`, its released
folder: `stages.models.bagel_folder`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stages.errors import UserInputError
from stages.models.bagel_folder import (
    AUTOENCODER,
    FAMILY,
    LLM_CONFIG,
    SIZES,
    TOKENIZER_FILES,
    WEIGHTS,
    autoencoder_config,
    autoencoder_scale,
    load_autoencoder,
    load_bagel,
    make_autoencoder,
    make_bagel,
    prompt_ids,
    read_config,
    save_folder,
    weight_shapes,
)
from stages.models.bagel_layers import LATENT_PATCH, Context, pack_latents, unpack_latents
from stages.models.bagel_model import Bagel, sigmas
from stages.models.families import (
    Condition,
    FamilyAdapter,
    Resolution,
    Tensors,
    format_resolution,
    latent_grid,
)


class BagelPipeline:
    """A BAGEL folder loaded for generation, with the part of a diffusers pipeline's interface the policy
    uses: `transformer` (the `Bagel` model: the trained module), `vae` (the FLUX.1 autoencoder, or None
    when not loaded), `tokenizer`, `image_processor` and `vae_scale_factor`."""

    def __init__(self, transformer: Bagel, vae: Any, tokenizer: Any, vae_scale_factor: int) -> None:
        from diffusers.image_processor import VaeImageProcessor

        self.transformer, self.vae, self.tokenizer = transformer, vae, tokenizer
        self.vae_scale_factor = vae_scale_factor
        self.image_processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor)

    @property
    def components(self) -> dict[str, Any]:
        return {"transformer": self.transformer, "vae": self.vae, "tokenizer": self.tokenizer}

    def register_modules(self, **modules: Any) -> None:
        for name, module in modules.items():
            setattr(self, name, module)

    def to(self, device: torch.device | str) -> BagelPipeline:
        for module in (self.transformer, self.vae):
            if module is not None:
                module.to(device)
        return self

    @property
    def largest_side(self) -> int:
        """The largest image side it generates, in pixels: its latent position table's side."""
        return self.transformer.config.max_latent_size * LATENT_PATCH * self.vae_scale_factor

    def set_progress_bar_config(self, **_: Any) -> None:
        """Nothing to set: loading and sampling a BAGEL folder show no progress bars."""

    def save_pretrained(self, out: str | Path, **_: Any) -> None:
        """Write the pipeline as a released BAGEL folder (`save_folder`; `export` of a merged LoRA)."""
        Path(out).mkdir(parents=True, exist_ok=True)
        save_folder(Path(out), self.transformer, self.vae, self.tokenizer)


def meta_pipeline(folder: Path) -> BagelPipeline:
    """The pipeline of a BAGEL folder built from its configs, its tokenizer and its two weight files'
    headers (the tables' sizes, the autoencoder's widths) without reading a weight: under
    `torch.device("meta")`, the architecture `omnirl plan` counts."""
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = Bagel(read_config(folder, weight_shapes(folder / WEIGHTS), tokenizer))
    vae = AutoencoderKL(**autoencoder_config(weight_shapes(folder / AUTOENCODER)))
    return BagelPipeline(model, vae, tokenizer, autoencoder_scale(folder))


def make_pipeline(size: str, seed: int = 0) -> BagelPipeline:
    """The pipeline of a BAGEL size (`make_bagel` and its autoencoder) with seeded random weights,
    unsaved: under `torch.device("meta")`, a size's architecture for `omnirl plan`."""
    from stages.models.factory import choose_size

    spec = choose_size(FAMILY, size, SIZES)
    vae = make_autoencoder(spec, seed)
    return BagelPipeline(make_bagel(size, seed), vae, None, 2 ** (len(spec.vae_channels) - 1))


def _context(branch: Tensors) -> Context:
    """`Context` of a collated branch ("keys"/"values" [B, layers, kv_heads, L, head_dim], "valid" [B, L])."""
    valid = branch["valid"]
    return Context(list(branch["keys"].unbind(1)), list(branch["values"].unbind(1)), valid, valid.sum(1))


class BagelAdapter(FamilyAdapter):
    """BAGEL's text-to-image generation as a diffusion family. Conditioning is the understanding expert's
    keys/values of the prompt (`Bagel.encode_context`; the negative branch: the negative prompt's, the
    empty context for ""), the velocity `Bagel.guided_velocity` with --guidance as the text CFG scale and
    BAGEL's image CFG 1.5 and interval, σ `sigmas` (shift 3). LoRA goes on the generation expert alone,
    so the stored conditioning stays valid for every adapter; it is saved as a PEFT folder. (A UniGRPO
    folder, written by an understanding update, also holds the understanding expert's layers: the
    context is then the sampling adapter's, docs/families.md.)"""

    name = FAMILY
    # the generation expert: its attention projections and MLP in every layer
    lora_targets = (
        *(f"{p}_moe_gen" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        *(f"mlp_moe_gen.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
    )
    full_weights = False

    @classmethod
    def load_pipeline(
        cls, folder: Path, index: dict[str, Any], components: dict[str, Any], dtype: torch.dtype
    ) -> BagelPipeline:
        """The model with its tokenizer (`load_bagel`) and the autoencoder (`load_autoencoder`) of a BAGEL
        folder; `components` "transformer" or "vae" None: that one not read (the tokenizer goes with the
        model)."""
        model, tokenizer = (
            load_bagel(folder, dtype) if components.get("transformer", True) is not None else (None, None)
        )
        vae = components["vae"] if "vae" in components else load_autoencoder(folder)
        if vae is not None and dtype != torch.float32:
            vae.to(dtype)
        return BagelPipeline(model, vae, tokenizer, autoencoder_scale(folder))

    @classmethod
    def component_names(cls, index: dict[str, Any]) -> list[str]:
        return ["transformer", "vae", "tokenizer"]

    @classmethod
    def encoder_files(cls, folder: Path, index: dict[str, Any]) -> list[str]:
        """The context comes from the understanding expert's weights and the tokenizer's files."""
        tokenizer = sorted(
            p.name for p in folder.iterdir() if p.is_file() and p.name.startswith(TOKENIZER_FILES)
        )
        return [WEIGHTS, LLM_CONFIG, *tokenizer]

    def load_trained(self, folder: Path, name: str, dtype: torch.dtype) -> torch.nn.Module:
        return load_bagel(folder, dtype)[0]

    def save_lora(self, out: Path, layers: Tensors, metadata: dict[str, Any]) -> None:
        """A PEFT folder (adapter_config.json, adapter_model.safetensors under "base_model.model."), as
        `PeftModel.save_pretrained` writes one for the `Bagel` module; `folders.load_lora` reads it."""
        from peft import LoraConfig
        from safetensors.torch import save_file

        from stages.models.folders import PEFT_PREFIX, PEFT_WEIGHTS

        LoraConfig(**metadata).save_pretrained(str(out))
        tensors = {PEFT_PREFIX + k: v.detach().contiguous() for k, v in layers.items()}
        save_file(tensors, out / PEFT_WEIGHTS, metadata={"format": "pt"})

    def sigmas(self, num_steps: int, resolution: Resolution) -> torch.Tensor:
        return sigmas(num_steps)

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        """[C, H/f, W/f] for the autoencoder's factor f; each side a multiple of 2f (2×2 latent patches)
        and at most the position table's side."""
        model, factor = self.pipe.transformer, self.pipe.vae_scale_factor
        h, w = latent_grid(
            resolution, factor, LATENT_PATCH * factor, "the autoencoder's factor × 2×2 patches"
        )
        if max(h, w) > model.config.max_latent_size * LATENT_PATCH:
            raise UserInputError(
                f"--resolution {format_resolution(resolution)}: this BAGEL generates at most "
                f"{self.pipe.largest_side} pixels a side "
                "(its latent position table); pass a smaller one"
            )
        return (model.config.latent_channels, h, w)

    def encode_prompts(
        self, prompts: list[str], negatives: list[str], device: torch.device, max_sequence_length: int
    ) -> list[tuple[Tensors, Tensors]]:
        """Each prompt's and negative's context as "keys"/"values" [layers, kv_heads, L, head_dim]."""
        model, tokenizer = self.pipe.transformer, self.pipe.tokenizer
        texts = list(dict.fromkeys([*prompts, *negatives]))
        ids = [prompt_ids(tokenizer, model.config, t) if t else [] for t in texts]
        context = model.encode_context(ids)
        encoded = {
            text: {
                "keys": torch.stack([k[row, :, : len(i)] for k in context.keys]),
                "values": torch.stack([v[row, :, : len(i)] for v in context.values]),
            }
            for row, (text, i) in enumerate(zip(texts, ids, strict=True))
        }
        return [(encoded[p], encoded[n]) for p, n in zip(prompts, negatives, strict=True)]

    def collate(self, items: Sequence[Tensors]) -> Tensors:
        """Contexts padded to the longest: "keys"/"values" [B, layers, kv_heads, L, head_dim], "valid" [B, L]."""
        longest = max(item["keys"].shape[2] for item in items)
        batch = {
            name: torch.stack([F.pad(item[name], (0, 0, 0, longest - item[name].shape[2])) for item in items])
            for name in ("keys", "values")
        }
        lengths = torch.tensor([item["keys"].shape[2] for item in items], device=batch["keys"].device)
        batch["valid"] = torch.arange(longest, device=lengths.device) < lengths[:, None]
        return batch

    def velocity(
        self,
        transformer: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Condition,
        guidance: float,
    ) -> torch.Tensor:
        """`Bagel.guided_velocity` of latents x [B, C, 2h, 2w], as [B, C, 2h, 2w] in fp32."""
        grid = (x.shape[2] // LATENT_PATCH, x.shape[3] // LATENT_PATCH)
        context = _context(cond.pos)
        empty = _context(cond.neg) if cond.neg is not None else context
        v = transformer(
            pack_latents(x),
            sigma,
            context,
            empty,
            grid,
            text_scale=guidance,
            detach_uncond=self.detach_uncond,
        )
        return unpack_latents(v, *grid).float()
