"""Per-token log-probabilities and entropies from logits: the math a language model's policy needs to
replay its sampled tokens, shared by the VLM policy (models/) and the token losses (update/).

Shapes: B responses × T tokens × V vocabulary; inputs in bf16/fp16 are promoted to float32.
"""

from __future__ import annotations

import torch

from stages.errors import UserInputError


def fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in at least float32 (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(tokens[b, t]) under softmax(logits[b, t] / temperature), float32 [B, T].

    `logits` [B, T, V] must already be aligned with `tokens` [B, T]: logits[:, t] is the
    distribution that produced tokens[:, t]. For a causal LM run on prompt+response (length L) with
    T response tokens, that is ``logits[:, L - T - 1 : L - 1]`` against ``input_ids[:, L - T:]``.
    The temperature is the sampling temperature, so the replayed log-probs match the rollout's.
    """
    if logits.ndim != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and tokens [B, T]; got {tuple(logits.shape)} and {tuple(tokens.shape)}"
        )
    if not temperature > 0:
        raise UserInputError(f"temperature must be > 0, got {temperature}")
    scaled = fp32(logits) if temperature == 1.0 else fp32(logits) / temperature
    return scaled.log_softmax(-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy H = logsumexp(z) − Σ_v softmax(z)_v·z_v of each token distribution, z = logits/temperature.

    `logits` [B, T, V] -> float32 [B, T]; differentiable (the entropy bonus needs its gradient).
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got {tuple(logits.shape)}")
    if not temperature > 0:
        raise UserInputError(f"temperature must be > 0, got {temperature}")
    scaled = fp32(logits) / temperature
    return torch.logsumexp(scaled, dim=-1) - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
