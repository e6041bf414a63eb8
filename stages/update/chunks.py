"""The micro-batches ("chunks") an objective trains on, and what the diffusion objectives do per chunk.

An objective splits the data into chunks each epoch (`split_chunks`) and lays them out as optimizer steps
over the ranks (`steps`, by default `fixed_steps`); `share` weighs a chunk's mean loss in its optimizer
step and `rows_of` names the data rows it reads (objectives.py describes the protocol).
The diffusion families share the prompt conditioning of a chunk (`condition`), the context their KL
reference runs in (`kl_reference`) and GARDO's gate of the KL rows (`gardo_gate`, `gated_kl`).
"""

from __future__ import annotations

from typing import Any

import torch

from stages.advantage.gardo import GATE_COLUMN
from stages.models.diffusion import FlowPolicy
from stages.sample.rollout import SampleConfig

Chunk = list[int]
LossItem = tuple[torch.Tensor, list[float]]


def condition(policy: FlowPolicy, data: dict[str, Any], idx: Chunk, sample_cfg: SampleConfig) -> Any:
    """The encoded prompts of a chunk's rows, with their negative prompts and condition images."""
    prompts = [data["prompt"][i] for i in idx]
    negatives = [data["negative_prompt"][i] for i in idx] if "negative_prompt" in data else None
    images = policy.images_of([data["group_id"][i] for i in idx]) if "group_id" in data else None
    return policy.encode(
        prompts, negatives, policy.needs_negative(sample_cfg.guidance), sample_cfg.max_sequence_length, images
    )


def sample_share(idx: Chunk, step: list[Chunk], slots: int) -> float:
    """The chunk's share of the samples of its optimizer step (its loss is a mean over its samples)."""
    return len(idx) / sum(len(c) for c in step)


def chunk_rows(idx: Chunk) -> Chunk:
    """The data rows a chunk reads: the chunk itself, for objectives whose chunks are row numbers."""
    return idx


def fixed_steps(chunks: list[Chunk], accum: int, ranks: int) -> list[list[list[Chunk]]]:
    """The optimizer steps of an epoch's `chunks`, each as its `ranks` ranks' micro-batches: `accum`
    chunks per rank, rank-major (a short last step fills the first ranks; the others get fewer or none)."""
    slots = accum * ranks
    return [
        [chunks[first + r * accum : first + (r + 1) * accum] for r in range(ranks)]
        for first in range(0, len(chunks), slots)
    ]


def split_chunks(order: list[int], size: int) -> list[Chunk]:
    """`order` cut into chunks of `size` rows (the last one shorter)."""
    return [order[i : i + size] for i in range(0, len(order), size)]


def kl_reference(policy: FlowPolicy, weights: dict[str, torch.Tensor] | None) -> Any:
    """The context the KL reference runs in: GARDO's reset weights when set, else the base model."""
    return policy.weights(weights) if weights is not None else policy.reference()


def gardo_gate(data: dict[str, Any], index: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """GARDO's `kl_gate` of the micro-batch's rows, bool [B]; None when the advantages carry no gate."""
    if GATE_COLUMN not in data:
        return None
    return torch.as_tensor(data[GATE_COLUMN])[index].to(device).bool()


def gated_kl(kl: torch.Tensor, data: dict[str, Any], index: torch.Tensor) -> torch.Tensor | None:
    """The KL rows to penalise: the gated ones when the advantages carry GARDO's gate (None when it marks
    none of this micro-batch: no KL term, as the reference's Flow-GRPO), else all [B]."""
    gate = gardo_gate(data, index, kl.device)
    if gate is None:
        return kl
    return kl[gate] if bool(gate.any()) else None
