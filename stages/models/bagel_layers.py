"""BAGEL's building blocks, written from its published architecture: Qwen2's norms, MLP and rotary
embedding, the Mixture-of-Transformers attention and layer shared by the two experts, the SigLIP2 ViT,
the connector, the position tables and timestep embedder, and the latent/patch layouts
(`stages.models.bagel_model` assembles them into the model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

LATENT_PATCH = 2


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
        self.checkpointing = False  # recompute each layer in the backward (non-reentrant)

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
            if self.checkpointing and torch.is_grad_enabled():
                x, kv = checkpoint(layer, x, gen, rope, mask, past, use_reentrant=False)
            else:
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
