"""2×2 patch packing of latents, the token layout of the FLUX.1 and Qwen-Image transformers.

Latents are stored unpacked ([C, h, w] per sample, the VAE's layout); the adapters pack them only
for the transformer's forward and unpack its output, so every stage sees one layout.
"""

from __future__ import annotations

import torch

PATCH = 2


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] → [B, h/2·w/2, 4C]: 2×2 patches as tokens, row-major, channel-major inside a token."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack`: [B, h/2·w/2, 4C] → [B, C, h, w]."""
    b, _, width = tokens.shape
    c = width // (PATCH * PATCH)
    x = tokens.view(b, h // PATCH, w // PATCH, c, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)
