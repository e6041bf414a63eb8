"""Mixture-of-experts routing: per-layer expert load statistics and the load-balancing auxiliary loss.

A top-k router sends each token to k of E experts. The load of expert e in a layer is the share of the
layer's k·N assignments (N valid tokens) that go to e, so loads sum to 1 and a balanced layer has 1/E
each. Two statistics per layer summarise it: the load entropy normalised by log E (1 = balanced, 0 =
one expert takes everything) and the largest load (1/E balanced, 1/k when k experts take all).

The auxiliary loss is the one the model config defines (transformers' `load_balancing_loss_func`,
Switch Transformer eq. 4-6: E · Σ_e load_e · mean router probability_e, over all layers' valid tokens),
weighted by `router_aux_loss_coef`; training adds it when `output_router_logits` is set in the config
or a coefficient is given (`omnirl update --router-aux-loss-coef`).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def expert_load(router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """Expert loads [layers, E] from each layer's router logits [B·L, E] over the valid tokens of `mask` [B, L]."""
    valid = mask.reshape(-1).bool()
    loads = []
    for logits in router_logits:
        chosen = logits[valid.to(logits.device)].detach().float().topk(top_k, dim=-1).indices
        counts = torch.bincount(chosen.reshape(-1), minlength=logits.shape[-1]).float()
        loads.append(counts / counts.sum().clamp(min=1.0))
    return torch.stack(loads)


def load_metrics(load: torch.Tensor) -> dict[str, float]:
    """`moe/load_entropy` and `moe/max_load`, averaged over layers and per layer (`.../layer<i>`)."""
    experts = load.shape[-1]
    logs = torch.where(load > 0, load.log(), torch.zeros((), device=load.device))
    entropy = -(load * logs).sum(-1) / math.log(experts)
    biggest = load.max(-1).values
    out = {"moe/load_entropy": float(entropy.mean()), "moe/max_load": float(biggest.mean())}
    for i, (h, m) in enumerate(zip(entropy.tolist(), biggest.tolist())):
        out[f"moe/load_entropy/layer{i}"] = h
        out[f"moe/max_load/layer{i}"] = m
    return out


def metric_keys(layers: int) -> tuple[str, ...]:
    """The keys `load_metrics` returns for a model of `layers` MoE layers, plus `moe/aux_loss`."""
    per_layer = [f"moe/{name}/layer{i}" for name in ("load_entropy", "max_load") for i in range(layers)]
    return ("moe/load_entropy", "moe/max_load", "moe/aux_loss", *per_layer)


def aux_loss_coef(config: Any, override: float | None) -> float:
    """The auxiliary loss weight of a training run: `override` when given, else the text config's
    `router_aux_loss_coef` if its `output_router_logits` is set (as transformers trains), else 0."""
    if override is not None:
        return float(override)
    text = config.get_text_config()
    return float(text.router_aux_loss_coef) if getattr(text, "output_router_logits", False) else 0.0


def aux_loss(
    router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor, num_experts: int, top_k: int
) -> torch.Tensor:
    """transformers' load-balancing loss of the routed forward (a scalar with gradient to the routers)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import load_balancing_loss_func

    return load_balancing_loss_func(router_logits, num_experts, top_k, mask)


def sparse_layers(text_config: Any) -> int:
    """How many decoder layers of a text config route through experts (`decoder_sparse_step`,
    `mlp_only_layers` as transformers' Qwen MoE models read them)."""
    step = int(getattr(text_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(text_config, "mlp_only_layers", None) or [])
    return sum(1 for i in range(text_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
