"""BAGEL (ByteDance-Seed's unified understanding and generation model), written from its published
architecture (its layers: `stages.models.bagel_layers`; its released folder: `stages.models.bagel_folder`).

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

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.loaders.peft import PeftAdapterMixin
from torch import nn

from stages.models.bagel_layers import (
    BagelConfig,
    Context,
    LanguageModel,
    MLPConnector,
    PositionTable,
    SiglipViT,
    TimestepEmbedder,
    flattened_positions,
    patchify,
)

# BAGEL's text-to-image sampling defaults (its demo): 50 σ points shifted by 3, text CFG 4 and image
# CFG 1.5 while σ ∈ (0.4, 1], the guided velocity rescaled to the conditional one's global norm.
TIMESTEP_SHIFT = 3.0
CFG_TEXT, CFG_IMAGE, CFG_INTERVAL = 4.0, 1.5, (0.4, 1.0)


# ----------------------------------------------------------------------------- the model


class Bagel(nn.Module, PeftAdapterMixin):
    """BAGEL under the released state-dict names: `language_model`, the generation path
    (`time_embedder`, `vae2llm`, `llm2vae`, `latent_pos_embed`) and the understanding path
    (`vit_model`, `connector`, `vit_pos_embed`). LoRA adapters attach as on a diffusers model
    (`add_adapter`, `load_lora_adapter`, `disable_adapters`); its forward is `guided_velocity`."""

    # the repeated blocks: what FSDP2 shards one by one and `omnirl plan` estimates activations by
    _no_split_modules = ("MoTLayer",)

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
        width [H/14 · W/14, hidden] (`vit_tokens` of its patches)."""
        patch = self.config.vit["patch_size"]
        grid = (pixels.shape[1] // patch, pixels.shape[2] // patch)
        return self.vit_tokens(patchify(pixels, patch), grid)

    def vit_tokens(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """An image's patches [h·w, 3·p·p] (`patchify`) on an h×w grid → its tokens [h·w, hidden]: ViT,
        connector, plus the sin-cos position of each patch."""
        positions = flattened_positions(*grid, self.config.vit_max_patches_per_side, patches.device)
        features = self.vit_model(patches.to(self.dtype)[None], positions[None])[0]
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
