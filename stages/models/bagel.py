"""BAGEL (ByteDance-Seed's unified understanding and generation model), written from its published
architecture and loading the released checkpoint folder as it is.

The model is a Qwen2.5 language model made a Mixture-of-Transformers: every layer holds two experts,
the understanding one under the Qwen2 names (`q_proj`, `mlp`, `input_layernorm`, ...) and the
generation one under the same names with `_moe_gen` appended. Text and ViT tokens go through the
understanding expert, VAE-latent tokens through the generation expert, and all of them meet in one
self-attention (each expert projects its own tokens' q/k/v). Around it:

- generation: FLUX-VAE latents [16, H/8, W/8] cut into 2×2 patches (64 values a token), `vae2llm`
  plus a sinusoidal timestep embedding (`time_embedder`, σ ∈ [0, 1] as given) plus a fixed 2-D
  sin-cos position table (`latent_pos_embed`); `llm2vae` reads the velocity v = ε − x0 off the
  generation expert's last hidden states. The image chunk is `<|vision_start|>`, the latent tokens,
  `<|vision_end|>`, all at one RoPE position and attending to each other and to the whole context.
- understanding: a SigLIP2 ViT over 14-px patches with a learned position table (`vit_model`, all its
  layers but the last, then its final LayerNorm), through the `connector` MLP plus a sin-cos table
  (`vit_pos_embed`).

The released folder (BAGEL-7B-MoT): `llm_config.json` (Qwen2), `vit_config.json` (SigLIP),
`ema.safetensors` (the model above under these names), `ae.safetensors` (the FLUX.1 autoencoder in
Black Forest Labs' layout) and the Qwen2.5 tokenizer. What the reference code sets beside those
files is fixed here as it does: q/k RMS norms, untied embeddings, the ViT's last layer dropped, the
ViT patch embedding stored as a linear layer, a GELU-tanh connector; the two position tables' sizes
are read off the weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.loaders.peft import PeftAdapterMixin
from torch import nn

from stages.errors import UserInputError
from stages.models.factory import (
    autoencoder_kl,
    choose_size,
    finish_model_dir,
    parameter_count,
    seeded,
)
from stages.models.families import (
    Condition,
    FamilyAdapter,
    Resolution,
    Tensors,
    format_resolution,
    latent_grid,
)

FAMILY = "bagel"
PIPELINE_CLASS = "Bagel"
LLM_CONFIG = "llm_config.json"
VIT_CONFIG = "vit_config.json"
WEIGHTS = "ema.safetensors"
AUTOENCODER = "ae.safetensors"
# The FLUX.1 autoencoder's latent normalisation, as BAGEL's reference encodes and decodes with it.
AE_SCALE, AE_SHIFT = 0.3611, 0.1159
LATENT_PATCH = 2
# What a Qwen2.5 tokenizer folder's files start with (the released folder has the slow and fast forms).
TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens")
# The special tokens BAGEL frames a prompt (ChatML's turn markers) and an image chunk with.
BOS, EOS, IMAGE_START, IMAGE_END = "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"
# BAGEL's text-to-image sampling defaults (its demo): 50 σ points shifted by 3, text CFG 4 and image
# CFG 1.5 while σ ∈ (0.4, 1], the guided velocity rescaled to the conditional one's global norm.
TIMESTEP_SHIFT = 3.0
CFG_TEXT, CFG_IMAGE, CFG_INTERVAL = 4.0, 1.5, (0.4, 1.0)


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class BagelSize:
    """The widths of one build: the language model, the ViT, the VAE and the two position tables."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vit_hidden: int
    vit_intermediate: int
    vit_layers: int  # as vit_config.json counts them: the model uses one fewer
    vit_heads: int
    vit_image_size: int
    vit_patch: int
    max_latent_size: int  # latent patches per side the position table covers
    vae_channels: tuple[int, ...]
    vae_layers_per_block: int
    vae_groups: int
    latent_channels: int = 16
    rope_theta: float = 1_000_000.0
    vocab: int | None = None  # None: one row per token of the tokenizer


SIZES: dict[str, BagelSize] = {
    "tiny": BagelSize(
        hidden=64,
        intermediate=128,
        layers=2,
        heads=4,
        kv_heads=2,
        vit_hidden=32,
        vit_intermediate=64,
        vit_layers=3,
        vit_heads=2,
        vit_image_size=56,
        vit_patch=14,
        max_latent_size=8,
        vae_channels=(16, 16),
        vae_layers_per_block=1,
        vae_groups=16,
    ),
    # BAGEL-7B-MoT as released (Qwen2.5-7B twice, SigLIP2-so400m/14 at 980 px, the FLUX.1 VAE)
    "full": BagelSize(
        hidden=3584,
        intermediate=18944,
        layers=28,
        heads=28,
        kv_heads=4,
        vit_hidden=1152,
        vit_intermediate=4304,
        vit_layers=27,
        vit_heads=16,
        vit_image_size=980,
        vit_patch=14,
        max_latent_size=64,
        vae_channels=(128, 256, 512, 512),
        vae_layers_per_block=2,
        vae_groups=32,
        vocab=152064,
    ),
}


@dataclass(frozen=True)
class BagelConfig:
    """What the modules are built from: the two released config files, as dicts, the position tables'
    sides, the VAE's latent channels and the ids of the prompt's and the image chunk's marker tokens."""

    llm: dict[str, Any]
    vit: dict[str, Any]
    max_latent_size: int
    vit_max_patches_per_side: int
    latent_channels: int
    prompt_ends: tuple[int, int]  # <|im_start|>, <|im_end|>
    image_markers: tuple[int, int]  # <|vision_start|>, <|vision_end|>

    @property
    def head_dim(self) -> int:
        return self.llm["hidden_size"] // self.llm["num_attention_heads"]

    @property
    def patch_dim(self) -> int:
        """Values of one latent token: 2×2 patches of the VAE's channels."""
        return LATENT_PATCH * LATENT_PATCH * self.latent_channels


# ----------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Qwen2's RMS norm: normalised in fp32, scaled by the weight in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedMLP(nn.Module):
    """Qwen2's SwiGLU feed-forward."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _route(x: torch.Tensor, gen: torch.Tensor, und_fn: Any, gen_fn: Any) -> torch.Tensor:
    """`und_fn` on the rows of x [T, *] where `gen` [T] is False, `gen_fn` where it is True."""
    if not bool(gen.any()):
        return und_fn(x)
    if bool(gen.all()):
        return gen_fn(x)
    und_out, gen_out = und_fn(x[~gen]), gen_fn(x[gen])
    out = und_out.new_empty((x.shape[0], *und_out.shape[1:]))
    out[~gen] = und_out
    out[gen] = gen_out
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Rotary(nn.Module):
    """Qwen2's 1-D rotary embedding: cos/sin [B, N, head_dim] of integer positions [B, N]."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


@dataclass
class Context:
    """The keys and values every layer holds for a batch of contexts (prompts), left-aligned and padded:
    keys/values one [B, kv_heads, L, head_dim] per layer, `valid` [B, L], `lengths` [B] (the RoPE
    position the next chunk takes)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    lengths: torch.Tensor


class MoTAttention(nn.Module):
    """Self-attention shared by both experts; each expert projects (and q/k-normalises) its own tokens."""

    def __init__(self, config: BagelConfig) -> None:
        super().__init__()
        llm = config.llm
        hidden, self.heads, self.kv_heads = (
            llm["hidden_size"],
            llm["num_attention_heads"],
            llm["num_key_value_heads"],
        )
        self.head_dim = config.head_dim
        eps = llm["rms_norm_eps"]
        for suffix in ("", "_moe_gen"):
            setattr(self, "q_proj" + suffix, nn.Linear(hidden, self.heads * self.head_dim, bias=True))
            setattr(self, "k_proj" + suffix, nn.Linear(hidden, self.kv_heads * self.head_dim, bias=True))
            setattr(self, "v_proj" + suffix, nn.Linear(hidden, self.kv_heads * self.head_dim, bias=True))
            setattr(self, "o_proj" + suffix, nn.Linear(self.heads * self.head_dim, hidden, bias=False))
            setattr(self, "q_norm" + suffix, RMSNorm(self.head_dim, eps))
            setattr(self, "k_norm" + suffix, RMSNorm(self.head_dim, eps))

    def _qkv(self, x: torch.Tensor, suffix: str) -> torch.Tensor:
        q = getattr(self, "q_proj" + suffix)(x).unflatten(-1, (self.heads, self.head_dim))
        k = getattr(self, "k_proj" + suffix)(x).unflatten(-1, (self.kv_heads, self.head_dim))
        v = getattr(self, "v_proj" + suffix)(x).unflatten(-1, (self.kv_heads, self.head_dim))
        q, k = getattr(self, "q_norm" + suffix)(q), getattr(self, "k_norm" + suffix)(k)
        return torch.cat([q, k, v], dim=1)  # [T, heads + 2·kv_heads, head_dim]

    def forward(
        self,
        x: torch.Tensor,
        gen: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, N, hidden], gen [B, N], rope cos/sin [B, N, head_dim], mask [B, 1, N, L+N] (True: attend),
        past keys/values [B, kv_heads, L, head_dim] or None. Returns the output and this chunk's k/v."""
        batch, length = x.shape[:2]
        qkv = _route(
            x.flatten(0, 1), gen.flatten(), lambda t: self._qkv(t, ""), lambda t: self._qkv(t, "_moe_gen")
        )
        qkv = qkv.unflatten(0, (batch, length)).transpose(1, 2)  # [B, H', N, head_dim]
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        cos, sin = (r.unsqueeze(1).to(q.dtype) for r in rope)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).flatten(0, 1).flatten(-2)
        out = _route(out, gen.flatten(), self.o_proj, self.o_proj_moe_gen)
        return out.unflatten(0, (batch, length)), (k, v)


class MoTLayer(nn.Module):
    """One decoder layer: per-expert norms and MLPs around the shared attention."""

    def __init__(self, config: BagelConfig) -> None:
        super().__init__()
        llm = config.llm
        hidden, eps = llm["hidden_size"], llm["rms_norm_eps"]
        self.self_attn = MoTAttention(config)
        self.mlp = GatedMLP(hidden, llm["intermediate_size"])
        self.mlp_moe_gen = GatedMLP(hidden, llm["intermediate_size"])
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(self, name, RMSNorm(hidden, eps))
            setattr(self, name + "_moe_gen", RMSNorm(hidden, eps))

    def forward(
        self,
        x: torch.Tensor,
        gen: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """As `MoTAttention.forward`, through the norms and MLPs of each token's expert."""
        flat_gen = gen.flatten()

        def routed(h: torch.Tensor, und: nn.Module, gen_: nn.Module) -> torch.Tensor:
            return _route(h.flatten(0, 1), flat_gen, und, gen_).unflatten(0, h.shape[:2])

        h = routed(x, self.input_layernorm, self.input_layernorm_moe_gen)
        attn, kv = self.self_attn(h, gen, rope, mask, past)
        x = x + attn
        return x + routed(x, self._und_mlp, self._gen_mlp), kv

    def _und_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(x))

    def _gen_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(x))


class MoTModel(nn.Module):
    """`language_model.model`: embeddings, the MoT layers and one final norm per expert."""

    def __init__(self, config: BagelConfig) -> None:
        super().__init__()
        llm = config.llm
        self.embed_tokens = nn.Embedding(llm["vocab_size"], llm["hidden_size"])
        self.layers = nn.ModuleList(MoTLayer(config) for _ in range(llm["num_hidden_layers"]))
        self.norm = RMSNorm(llm["hidden_size"], llm["rms_norm_eps"])
        self.norm_moe_gen = RMSNorm(llm["hidden_size"], llm["rms_norm_eps"])
        self.rotary = Rotary(config.head_dim, llm.get("rope_theta", 10000.0))


class LanguageModel(nn.Module):
    """`language_model`: the MoT model and the (untied) LM head."""

    def __init__(self, config: BagelConfig) -> None:
        super().__init__()
        self.model = MoTModel(config)
        self.lm_head = nn.Linear(config.llm["hidden_size"], config.llm["vocab_size"], bias=False)

    def forward(
        self,
        x: torch.Tensor,
        gen: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        context: Context | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Hidden states [B, N, hidden] after the final norms, and each layer's k/v of this chunk.
        gen [B, N] marks generation-expert tokens, positions [B, N] their RoPE positions, mask
        [B, 1, N, L+N] what each attends to over the `context` (L keys) and the chunk."""
        rope = self.model.rotary(positions)
        kvs = []
        for index, layer in enumerate(self.model.layers):
            past = None if context is None else (context.keys[index], context.values[index])
            x, kv = layer(x, gen, rope, mask, past)
            kvs.append(kv)
        flat = _route(x.flatten(0, 1), gen.flatten(), self.model.norm, self.model.norm_moe_gen)
        return flat.unflatten(0, x.shape[:2]), kvs


class SiglipLayer(nn.Module):
    """A SigLIP encoder layer (pre-norm, GELU-tanh MLP, full attention within one image)."""

    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            self.self_attn.add_module(name, nn.Linear(hidden, hidden))
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = nn.Module()
        self.mlp.add_module("fc1", nn.Linear(hidden, intermediate))
        self.mlp.add_module("fc2", nn.Linear(intermediate, hidden))
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, hidden] (one image a row)."""
        attn = self.self_attn
        h = self.layer_norm1(x)
        q, k, v = (
            getattr(attn, p)(h).unflatten(-1, (self.heads, -1)).transpose(1, 2)
            for p in ("q_proj", "k_proj", "v_proj")
        )
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)
        x = x + attn.out_proj(h)
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.layer_norm2(x)), approximate="tanh"))


class SiglipViT(nn.Module):
    """`vit_model`: the SigLIP2 vision tower over flattened 14-px patches, named as released."""

    def __init__(self, config: BagelConfig) -> None:
        super().__init__()
        vit = config.vit
        hidden, patch, eps = vit["hidden_size"], vit["patch_size"], vit.get("layer_norm_eps", 1e-6)
        self.vision_model = nn.Module()
        embeddings = nn.Module()
        embeddings.add_module(
            "patch_embedding", nn.Linear(vit.get("num_channels", 3) * patch * patch, hidden)
        )
        embeddings.add_module("position_embedding", nn.Embedding((vit["image_size"] // patch) ** 2, hidden))
        self.vision_model.add_module("embeddings", embeddings)
        encoder = nn.Module()
        layers = vit["num_hidden_layers"] - 1  # the reference drops the last layer
        encoder.add_module(
            "layers",
            nn.ModuleList(
                SiglipLayer(hidden, vit["intermediate_size"], vit["num_attention_heads"], eps)
                for _ in range(layers)
            ),
        )
        self.vision_model.add_module("encoder", encoder)
        self.vision_model.add_module("post_layernorm", nn.LayerNorm(hidden, eps=eps))

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """patches [B, N, 3·p·p] (row-major, channels last), positions [B, N] → [B, N, vit_hidden]."""
        model = self.vision_model
        x = model.embeddings.patch_embedding(patches) + model.embeddings.position_embedding(positions)
        for layer in model.encoder.layers:
            x = layer(x)
        return model.post_layernorm(x)


class MLPConnector(nn.Module):
    """`connector`: ViT features → language-model width (GELU-tanh MLP)."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, outputs)
        self.fc2 = nn.Linear(outputs, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def sincos_table(dim: int, side: int) -> torch.Tensor:
    """The fixed 2-D sin-cos table [side², dim] (row = r·side + c): the first half of the channels
    encodes the column, the second the row (MAE's table, as BAGEL has it), each as [sin, cos] of
    position·10000^(−4i/dim)."""

    def one_axis(positions: torch.Tensor) -> torch.Tensor:
        omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
        angles = positions.reshape(-1, 1).double() * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return torch.cat([one_axis(cols), one_axis(rows)], dim=1).float()


class PositionTable(nn.Module):
    """A frozen sin-cos table indexed by flattened patch positions (`latent_pos_embed`, `vit_pos_embed`)."""

    def __init__(self, side: int, dim: int) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(sincos_table(dim, side), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[positions]


class TimestepEmbedder(nn.Module):
    """`time_embedder`: [cos, sin] of σ·10000^(−i/128) for 256 frequencies, then a SiLU MLP."""

    def __init__(self, hidden: int, frequencies: int = 256) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, sigma: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(
            -math.log(10000) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half
        )
        args = sigma.float()[:, None] * freqs
        return self.mlp(torch.cat([args.cos(), args.sin()], dim=-1).to(self.mlp[0].weight.dtype))


def flattened_positions(
    height: int, width: int, per_side: int, device: torch.device | None = None
) -> torch.Tensor:
    """Row-major patch positions of an height×width grid in a table of `per_side` columns [h·w]."""
    rows = torch.arange(height, device=device)[:, None] * per_side
    return (rows + torch.arange(width, device=device)).flatten()


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """VAE latents [B, C, 2h, 2w] → tokens [B, h·w, 2·2·C] (row-major, each patch (p, q, c))."""
    b, c, hh, ww = latents.shape
    x = latents.reshape(b, c, hh // LATENT_PATCH, LATENT_PATCH, ww // LATENT_PATCH, LATENT_PATCH)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, (hh // LATENT_PATCH) * (ww // LATENT_PATCH), -1)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Tokens [B, h·w, 2·2·C] of an h×w patch grid → VAE latents [B, C, 2h, 2w] (`pack_latents`' inverse)."""
    b = tokens.shape[0]
    x = tokens.reshape(b, height, width, LATENT_PATCH, LATENT_PATCH, -1)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(b, -1, height * LATENT_PATCH, width * LATENT_PATCH)


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """An image [3, H, W] → its patches [H/p · W/p, p·p·3], row-major, each patch (p, q, c)."""
    c, h, w = pixels.shape
    x = pixels.reshape(c, h // patch, patch, w // patch, patch)
    return x.permute(1, 3, 2, 4, 0).reshape(-1, patch * patch * c)


# ----------------------------------------------------------------------------- the model


class Bagel(nn.Module, PeftAdapterMixin):
    """BAGEL under the released state-dict names: `language_model`, the generation path
    (`time_embedder`, `vae2llm`, `llm2vae`, `latent_pos_embed`) and the understanding path
    (`vit_model`, `connector`, `vit_pos_embed`). LoRA adapters attach as on a diffusers model
    (`add_adapter`, `load_lora_adapter`, `disable_adapters`); its forward is `guided_velocity`."""

    def __init__(self, config: BagelConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.llm["hidden_size"]
        self.language_model = LanguageModel(config)
        self.time_embedder = TimestepEmbedder(hidden)
        self.vae2llm = nn.Linear(config.patch_dim, hidden)
        self.llm2vae = nn.Linear(hidden, config.patch_dim)
        self.latent_pos_embed = PositionTable(config.max_latent_size, hidden)
        self.vit_model = SiglipViT(config)
        self.connector = MLPConnector(config.vit["hidden_size"], hidden)
        self.vit_pos_embed = PositionTable(config.vit_max_patches_per_side, hidden)

    @property
    def dtype(self) -> torch.dtype:
        return self.vae2llm.weight.dtype

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(ids)

    def encode_context(self, prompts: Sequence[Sequence[int]]) -> Context:
        """The understanding expert's keys and values of each prompt's token ids (causal, RoPE
        positions from 0), padded to the longest; a prompt may be empty (the text-CFG branch)."""
        device = self.vae2llm.weight.device
        batch, longest = len(prompts), max((len(p) for p in prompts), default=0)
        ids = torch.zeros(batch, longest, dtype=torch.long, device=device)
        valid = torch.zeros(batch, longest, dtype=torch.bool, device=device)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
            valid[row, : len(prompt)] = True
        lengths = valid.sum(1)
        layers = self.config.llm["num_hidden_layers"]
        if longest == 0:
            kv = self.config.llm["num_key_value_heads"], 0, self.config.head_dim
            empty = [torch.zeros(batch, *kv, device=device, dtype=self.dtype) for _ in range(layers)]
            return Context(empty, [e.clone() for e in empty], valid, lengths)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
        # a padded row attends to itself only (its output is never read), so no row is all -inf
        mask = (causal & valid[:, None, :]) | torch.eye(longest, dtype=torch.bool, device=device)
        positions = torch.arange(longest, device=device).expand(batch, -1)
        gen = torch.zeros_like(valid)
        _, kvs = self.language_model(self._embed(ids), gen, positions, mask[:, None])
        return Context([k for k, _ in kvs], [v for _, v in kvs], valid, lengths)

    def velocity(
        self, tokens: torch.Tensor, sigma: torch.Tensor, context: Context, grid: tuple[int, int]
    ) -> torch.Tensor:
        """The velocity v = ε − x0 [B, h·w, 2·2·C] of noisy latent tokens [B, h·w, 2·2·C] (`pack_latents`)
        at σ [B], for an h×w patch grid: one image chunk `<|vision_start|>` tokens `<|vision_end|>` after
        each context, attending to its valid keys and to the whole chunk, all at RoPE position = the
        context's length."""
        batch, count = tokens.shape[:2]
        device = tokens.device
        markers = torch.tensor(self.config.image_markers, device=device).expand(batch, -1)
        ends = self._embed(markers)
        positions_2d = flattened_positions(*grid, self.config.max_latent_size, device)
        latent = (
            self.vae2llm(tokens.to(self.dtype))
            + self.time_embedder(sigma)[:, None]
            + self.latent_pos_embed(positions_2d)
        )
        x = torch.cat([ends[:, :1], latent, ends[:, 1:]], dim=1)
        length = count + 2
        gen = torch.zeros(batch, length, dtype=torch.bool, device=device)
        gen[:, 1:-1] = True
        mask = torch.cat([context.valid, torch.ones(batch, length, dtype=torch.bool, device=device)], dim=1)
        mask = mask[:, None, None, :].expand(batch, 1, length, -1)
        positions = context.lengths[:, None].expand(batch, length)
        hidden, _ = self.language_model(x, gen, positions, mask, context)
        return self.llm2vae(hidden[:, 1:-1]).float()

    def guided_velocity(
        self,
        tokens: torch.Tensor,
        sigma: torch.Tensor,
        context: Context,
        empty: Context,
        grid: tuple[int, int],
        text_scale: float = CFG_TEXT,
        image_scale: float = CFG_IMAGE,
        interval: tuple[float, float] = CFG_INTERVAL,
        detach_uncond: bool = False,
    ) -> torch.Tensor:
        """BAGEL's guided text-to-image velocity [B, h·w, 2·2·C] (`velocity`'s shapes): where
        interval[0] < σ ≤ interval[1], `cfg_velocity` of the conditional velocity (over `context`) and
        the text-unconditional one (over `empty`, the empty contexts); elsewhere the conditional one.
        The image-CFG branch of a prompt without an input image has the prompt's own context, so its
        velocity is the conditional one (the reference runs it as a third, identical forward).
        `detach_uncond`: no gradient through the unconditional velocity (the same values)."""
        cond = self.velocity(tokens, sigma, context, grid)
        active = (sigma > interval[0]) & (sigma <= interval[1])
        if text_scale <= 1.0 or not bool(active.any()):
            return cond
        uncond = self.velocity(tokens, sigma, empty, grid)
        if detach_uncond:
            uncond = uncond.detach()
        rows = [
            cfg_velocity(c, u, c, text_scale, image_scale) if on else c
            for c, u, on in zip(cond, uncond, active.tolist(), strict=True)
        ]
        return torch.stack(rows)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`guided_velocity`, so a data-parallel wrapper's forward reaches it."""
        return self.guided_velocity(*args, **kwargs)

    def vit_embeddings(self, pixels: torch.Tensor) -> torch.Tensor:
        """An image [3, H, W] in [−1, 1] (sides multiples of 14) → its tokens in the language model's
        width [H/14 · W/14, hidden]: ViT, connector, plus the sin-cos position of each patch."""
        patch = self.config.vit["patch_size"]
        positions = flattened_positions(
            pixels.shape[1] // patch,
            pixels.shape[2] // patch,
            self.config.vit_max_patches_per_side,
            pixels.device,
        )
        features = self.vit_model(patchify(pixels.to(self.dtype), patch)[None], positions[None])[0]
        return self.connector(features) + self.vit_pos_embed(positions)

    def understanding_logits(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """Next-token logits [T, vocab] of every text token of one interleaved sequence: `pieces` are token
        ids [n] (a text chunk: causal, one RoPE position a token) or images [3, H, W] in [−1, 1] (an
        image chunk `<|vision_start|>` ViT tokens `<|vision_end|>`: full attention within, one RoPE
        position for the chunk), all through the understanding expert."""
        device = self.vae2llm.weight.device
        embeds, positions, chunks, text = [], [], [], []
        rope = 0
        for piece in pieces:
            if piece.dtype == torch.long:
                embeds.append(self._embed(piece.to(device)))
                positions.append(torch.arange(rope, rope + len(piece), device=device))
                chunks.append((len(piece), True))
                text.append(torch.ones(len(piece), dtype=torch.bool, device=device))
                rope += len(piece)
                continue
            markers = self._embed(torch.tensor(self.config.image_markers, device=device))
            embeds.append(torch.cat([markers[:1], self.vit_embeddings(piece.to(device)), markers[1:]]))
            n = embeds[-1].shape[0]
            positions.append(torch.full((n,), rope, device=device))
            chunks.append((n, False))
            text.append(torch.zeros(n, dtype=torch.bool, device=device))
            rope += 1
        total = sum(n for n, _ in chunks)
        mask = torch.zeros(total, total, dtype=torch.bool, device=device)
        start = 0
        for n, causal in chunks:
            block = torch.ones(n, n, dtype=torch.bool, device=device)
            mask[start : start + n, :start] = True
            mask[start : start + n, start : start + n] = block.tril() if causal else block
            start += n
        x = torch.cat(embeds)[None]
        gen = torch.zeros(1, total, dtype=torch.bool, device=device)
        hidden, _ = self.language_model(x, gen, torch.cat(positions)[None], mask[None, None])
        return self.language_model.lm_head(hidden[0][torch.cat(text)]).float()


def cfg_velocity(
    cond: torch.Tensor,
    uncond_text: torch.Tensor,
    uncond_image: torch.Tensor,
    text_scale: float,
    image_scale: float,
) -> torch.Tensor:
    """BAGEL's guidance of one sample's velocity [h·w, d] ("global" renorm, minimum 0): text CFG, then
    image CFG towards the text-guided one, then rescaled so its norm is at most the conditional's
    (the norm over the sample's whole latent: the reference's, which samples one image at a time)."""
    if text_scale <= 1.0:
        return cond
    text = uncond_text + text_scale * (cond - uncond_text)
    guided = uncond_image + image_scale * (text - uncond_image) if image_scale > 1.0 else text
    scale = (torch.linalg.vector_norm(cond) / (torch.linalg.vector_norm(guided) + 1e-8)).clamp(0.0, 1.0)
    return guided * scale


def sigmas(num_steps: int, shift: float = TIMESTEP_SHIFT) -> torch.Tensor:
    """BAGEL's σ schedule [num_steps + 1]: linspace(1, 0) shifted as s·t / (1 + (s − 1)·t)."""
    t = torch.linspace(1, 0, num_steps + 1)
    return (shift * t / (1 + (shift - 1) * t)).float()


# ----------------------------------------------------------------------------- loading and building


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserInputError(
            f"{path}: missing; a BAGEL folder holds {LLM_CONFIG}, {VIT_CONFIG}, {WEIGHTS}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserInputError(f"{path}: not a readable JSON config ({error})") from None


LLM_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "vocab_size",
)
VIT_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "image_size",
    "patch_size",
)
SIZED_BY = ("vae2llm.weight", "latent_pos_embed.pos_embed", "vit_pos_embed.pos_embed")


def _token_ids(tokenizer: Any) -> dict[str, tuple[int, int]]:
    """`BagelConfig`'s marker token ids, from the tokenizer."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, IMAGE_START, IMAGE_END)]
    return {"prompt_ends": (ids[0], ids[1]), "image_markers": (ids[2], ids[3])}


def read_config(folder: str | Path, weights: dict[str, torch.Tensor], tokenizer: Any) -> BagelConfig:
    """The config of a BAGEL folder: its two config files, the table sizes and latent width its weights
    have and the tokenizer's prompt and image-chunk markers. A key or weight these need that is missing
    is a one-line UserInputError naming the file."""
    folder = Path(folder)
    llm, vit = _read_json(folder / LLM_CONFIG), _read_json(folder / VIT_CONFIG)
    for name, config, keys in ((LLM_CONFIG, llm, LLM_KEYS), (VIT_CONFIG, vit, VIT_KEYS)):
        absent = [key for key in keys if key not in config]
        if absent:
            raise UserInputError(
                f"{folder / name}: lacks {', '.join(absent)}; pass a BAGEL checkpoint folder"
            )
    absent = [name for name in SIZED_BY if name not in weights]
    if absent:
        raise UserInputError(f"{folder / WEIGHTS}: lacks {', '.join(absent)}; pass a BAGEL checkpoint folder")
    return BagelConfig(
        llm=llm,
        vit=vit,
        max_latent_size=math.isqrt(weights["latent_pos_embed.pos_embed"].shape[0]),
        vit_max_patches_per_side=math.isqrt(weights["vit_pos_embed.pos_embed"].shape[0]),
        latent_channels=weights["vae2llm.weight"].shape[1] // LATENT_PATCH**2,
        **_token_ids(tokenizer),
    )


def load_bagel(folder: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Bagel, Any]:
    """The model of a BAGEL folder (released layout) in `dtype`, eval mode, and its tokenizer. Every
    weight of `ema.safetensors` must fill one parameter and every parameter must be filled: else a
    one-line UserInputError naming the first mismatch."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    folder = Path(folder)
    path = folder / WEIGHTS
    if not path.is_file():
        raise UserInputError(f"{path}: missing; a BAGEL folder holds {LLM_CONFIG}, {VIT_CONFIG}, {WEIGHTS}")
    weights = load_file(path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = read_config(folder, weights, tokenizer)
    with torch.device("meta"):
        model = Bagel(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which BAGEL does not"
        raise UserInputError(f"{path}: {what} ({len(missing)} missing, {len(unexpected)} unexpected weights)")
    for name, tensor in expected.items():
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise UserInputError(
                f"{path}: {name} is {tuple(weights[name].shape)}, the configs make it {tuple(tensor.shape)}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, assign=True)
    model.language_model.model.rotary = Rotary(config.head_dim, config.llm.get("rope_theta", 10000.0))
    return model.eval().requires_grad_(False), tokenizer


def prompt_ids(tokenizer: Any, config: BagelConfig, prompt: str) -> list[int]:
    """A prompt as BAGEL's context holds it: `<|im_start|>`, its tokens, `<|im_end|>`."""
    bos, eos = config.prompt_ends
    return [bos, *tokenizer.encode(prompt, add_special_tokens=False), eos]


def _ldm_vae_names(state: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL state dict under the names Black Forest Labs' `ae.safetensors` uses
    (the LDM layout; attention projections as 1×1 convolutions), as diffusers' single-file loader reads them back."""
    renamed = {}
    for name, tensor in state.items():
        new = name.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        new = new.replace(".mid_block.resnets.0.", ".mid.block_1.").replace(
            ".mid_block.resnets.1.", ".mid.block_2."
        )
        if ".mid_block.attentions.0." in new:
            new = new.replace(".mid_block.attentions.0.", ".mid.attn_1.")
            new = (
                new.replace("group_norm", "norm")
                .replace("to_q", "q")
                .replace("to_k", "k")
                .replace("to_v", "v")
            )
            new = new.replace("to_out.0", "proj_out")
            if tensor.ndim == 2:
                tensor = tensor[:, :, None, None]
        parts = new.split(".")
        if parts[1] in ("down_blocks", "up_blocks"):
            index = int(parts[2]) if parts[1] == "down_blocks" else levels - 1 - int(parts[2])
            kind = {"resnets": "block", "downsamplers": "downsample", "upsamplers": "upsample"}[parts[3]]
            rest = parts[5:] if kind != "block" else parts[4:]
            new = ".".join([parts[0], "down" if parts[1] == "down_blocks" else "up", str(index), kind, *rest])
        renamed[new] = tensor.contiguous()
    return renamed


def load_autoencoder(folder: str | Path) -> Any:
    """The FLUX.1 autoencoder of a BAGEL folder's `ae.safetensors` (Black Forest Labs' layout) as a
    diffusers `AutoencoderKL` (scaling 0.3611, shift 0.1159, no quant convs); its widths are read off
    the weights, its GroupNorms have 32 groups (FLUX's), or one a channel when the first level is narrower."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import load_file

    weights = load_file(Path(folder) / AUTOENCODER)
    base = weights["encoder.conv_in.weight"].shape[0]
    levels = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("encoder.down."))
    channels = [weights[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] for i in range(levels)]
    blocks = 1 + max(int(k.split(".")[4]) for k in weights if k.startswith("encoder.down.0.block."))
    config = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(channels),
        layers_per_block=blocks,
        latent_channels=weights["decoder.conv_in.weight"].shape[1],
        norm_num_groups=math.gcd(32, base),
        scaling_factor=AE_SCALE,
        shift_factor=AE_SHIFT,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    vae = AutoencoderKL(**config)
    vae.load_state_dict(convert_ldm_vae_checkpoint(weights, vae.config))
    return vae.eval().requires_grad_(False)


def _configs(spec: BagelSize, tokenizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """llm_config.json and vit_config.json of a size, with the released files' keys."""
    llm = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.eos_token_id,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": 32768,
        "max_window_layers": spec.layers,
        "model_type": "qwen2",
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": spec.rope_theta,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec.vocab or len(tokenizer),
    }
    vit = {
        "architectures": ["SiglipVisionModel"],
        "attention_dropout": 0.0,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": spec.vit_hidden,
        "image_size": spec.vit_image_size,
        "intermediate_size": spec.vit_intermediate,
        "layer_norm_eps": 1e-06,
        "model_type": "siglip_vision_model",
        "num_attention_heads": spec.vit_heads,
        "num_channels": 3,
        "num_hidden_layers": spec.vit_layers,
        "patch_size": spec.vit_patch,
        "torch_dtype": "bfloat16",
    }
    return llm, vit


def make_bagel(size: str, seed: int, tokenizer: Any = None) -> Bagel:
    """The BAGEL model of `size` with seeded random weights (the generation expert's own, not a copy of
    the understanding one's, so tests tell them apart), unsaved."""
    from stages.models.tokenizers import build_qwen2_tokenizer

    spec: BagelSize = choose_size(FAMILY, size, SIZES)
    tokenizer = tokenizer or build_qwen2_tokenizer()
    llm, vit = _configs(spec, tokenizer)
    config = BagelConfig(
        llm=llm,
        vit=vit,
        max_latent_size=spec.max_latent_size,
        vit_max_patches_per_side=spec.vit_image_size // spec.vit_patch,
        latent_channels=spec.latent_channels,
        **_token_ids(tokenizer),
    )
    with seeded(seed, "bagel"):
        model = Bagel(config)
        norms = {id(m.weight) for m in model.modules() if isinstance(m, (RMSNorm, nn.LayerNorm))}
        for parameter in model.parameters():
            if parameter.requires_grad:  # not the fixed sin-cos tables
                norm = id(parameter) in norms
                nn.init.normal_(parameter, mean=1.0 if norm else 0.0, std=0.05 if norm else 0.02)
    return model


def save_folder(out: Path, model: Bagel, vae: Any, tokenizer: Any) -> None:
    """Write `model`, its autoencoder and tokenizer into folder `out` in the released layout (what
    `load_bagel` and `load_autoencoder` read)."""
    from safetensors.torch import save_file

    (out / LLM_CONFIG).write_text(json.dumps(model.config.llm, indent=2) + "\n")
    (out / VIT_CONFIG).write_text(json.dumps(model.config.vit, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / WEIGHTS)
    levels = len(vae.config.block_out_channels)
    save_file(_ldm_vae_names(vae.state_dict(), levels), out / AUTOENCODER)
    tokenizer.save_pretrained(out)


def build_bagel(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Write a random-weight BAGEL folder of `size` in the released layout: llm_config.json,
    vit_config.json, ema.safetensors, ae.safetensors (BFL names), the Qwen2 tokenizer and the model card."""
    from stages.models.tokenizers import build_qwen2_tokenizer

    spec: BagelSize = choose_size(FAMILY, size, SIZES)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen2_tokenizer()
    model = make_bagel(size, seed, tokenizer)
    vae = autoencoder_kl(
        seed,
        channels=spec.vae_channels,
        groups=spec.vae_groups,
        layers_per_block=spec.vae_layers_per_block,
        latent_channels=spec.latent_channels,
        scaling_factor=AE_SCALE,
        shift_factor=AE_SHIFT,
    )
    save_folder(out, model, vae, tokenizer)
    return finish_model_dir(
        out,
        family=FAMILY,
        size=size,
        seed=seed,
        pipeline_class=PIPELINE_CLASS,
        parameters={
            "language_model": parameter_count(model.language_model),
            "vit_model": parameter_count(model.vit_model),
            "vae": parameter_count(vae),
        },
        details={
            "architecture": asdict(spec),
            "vocab_size": len(tokenizer),
            # `sample`'s default side: the whole latent position table
            "image_size": spec.max_latent_size * LATENT_PATCH * 2 ** (len(spec.vae_channels) - 1),
        },
    )


# ----------------------------------------------------------------------------- the stages' family


def autoencoder_scale(folder: str | Path) -> int:
    """The spatial factor of a BAGEL folder's autoencoder (2 per level after the first), read off the
    names in `ae.safetensors`' header alone (no weights read)."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / AUTOENCODER), framework="pt") as f:
        levels = 1 + max(int(k.split(".")[2]) for k in f.keys() if k.startswith("encoder.down."))  # noqa: SIM118
    return 2 ** (levels - 1)


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

    def set_progress_bar_config(self, **_: Any) -> None:
        """Nothing to set: loading and sampling a BAGEL folder show no progress bars."""

    def save_pretrained(self, out: str | Path, **_: Any) -> None:
        """Write the pipeline as a released BAGEL folder (`save_folder`; `export` of a merged LoRA)."""
        Path(out).mkdir(parents=True, exist_ok=True)
        save_folder(Path(out), self.transformer, self.vae, self.tokenizer)


def _context(branch: Tensors) -> Context:
    """`Context` of a collated branch ("keys"/"values" [B, layers, kv_heads, L, head_dim], "valid" [B, L])."""
    valid = branch["valid"]
    return Context(list(branch["keys"].unbind(1)), list(branch["values"].unbind(1)), valid, valid.sum(1))


class BagelAdapter(FamilyAdapter):
    """BAGEL's text-to-image generation as a diffusion family. Conditioning is the understanding expert's
    keys/values of the prompt (`Bagel.encode_context`; the negative branch: the negative prompt's, the
    empty context for ""), the velocity `Bagel.guided_velocity` with --guidance as the text CFG scale and
    BAGEL's image CFG 1.5 and interval, σ `sigmas` (shift 3). LoRA goes on the generation expert alone,
    so the stored conditioning stays valid for every adapter; it is saved as a PEFT folder."""

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
        most = model.config.max_latent_size * LATENT_PATCH * factor
        if max(h, w) > model.config.max_latent_size * LATENT_PATCH:
            raise UserInputError(
                f"--resolution {format_resolution(resolution)}: this BAGEL generates at most {most} pixels a side "
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
