"""The `logprob` stage: replay every stored step of a rollout under given weights.

The replay calls the same `FlowPolicy.velocity` and `samplers.step` as the rollout, in the same
batches, so under the sampling weights it reproduces the rollout log-probs exactly (fp32).
"""

from __future__ import annotations

from typing import Any

import torch

from stages.models.diffusion import FlowPolicy
from stages.sample.rollout import SampleConfig
from stages.sample.samplers import step


@torch.no_grad()
def replay_batch(
    policy: FlowPolicy,
    cfg: SampleConfig,
    batch: dict[str, Any],
    *,
    reference: bool = False,
    means: bool = False,
) -> dict[str, Any]:
    """Log-probs [B, K] of the stored transitions latents[:, j] → latents[:, j+1] under `policy`.

    With `reference`, also the frozen base model's step means `ref_means` [B, K, C, h, w] (for KL);
    with `means`, the step means under `policy` itself, `old_means` [B, K, C, h, w] (GRPO-Guard).
    """
    latents, sigmas = batch["latents"], batch["sigmas"]
    k = latents.shape[1] - 1
    cond = policy.encode(
        list(batch["prompt"]),
        list(batch.get("negative_prompt") or []) or None,
        cfg.guidance > 1.0,
        cfg.max_sequence_length,
    )
    sigma_safe = policy.sigmas(cfg.steps)[1]
    log_probs, ref_means, old_means = [], [], []
    for j in range(k):
        x = latents[:, j].to(policy.device).float()
        x_next = latents[:, j + 1].to(policy.device).float()
        v = policy.velocity(x, sigmas[:, j], cond, cfg.guidance)
        out = step(
            cfg.sampler,
            v,
            x,
            sigmas[:, j],
            sigmas[:, j + 1],
            noise_level=cfg.noise_level,
            sigma_max_safe=sigma_safe,
            prev_sample=x_next,
        )
        log_probs.append(out.log_prob)
        if means:
            old_means.append(out.mean)
        if reference:
            with policy.reference():
                v_ref = policy.velocity(x, sigmas[:, j], cond, cfg.guidance)
            ref = step(
                cfg.sampler,
                v_ref,
                x,
                sigmas[:, j],
                sigmas[:, j + 1],
                noise_level=cfg.noise_level,
                sigma_max_safe=sigma_safe,
                prev_sample=x_next,
            )
            ref_means.append(ref.mean)
    out_cols: dict[str, Any] = {
        "sample_id": list(batch["sample_id"]),
        "old_log_probs": torch.stack(log_probs, dim=1).float().cpu(),
    }
    if reference:
        out_cols["ref_means"] = torch.stack(ref_means, dim=1).float().cpu()
    if means:
        out_cols["old_means"] = torch.stack(old_means, dim=1).float().cpu()
    return out_cols


def replay_shard(
    policy: FlowPolicy,
    cfg: SampleConfig,
    shard: dict[str, Any],
    *,
    reference: bool = False,
    means: bool = False,
    on_batch: Any = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Replay one shard in the sampling batch size; returns its columns and |Δ logp| vs the rollout."""
    from stages.shards.reader import concat_batches, slice_batch

    n = len(shard["sample_id"])
    parts = []
    for start in range(0, n, cfg.batch_size):
        part = slice_batch(shard, start, min(n, start + cfg.batch_size))
        parts.append(replay_batch(policy, cfg, part, reference=reference, means=means))
        if on_batch:
            on_batch(len(part["sample_id"]))
    cols = concat_batches(parts)
    delta = (cols["old_log_probs"] - shard["log_probs"].float()).abs()
    stats = {
        "abs_delta_sum": float(delta.sum()),
        "abs_delta_max": float(delta.max()) if delta.numel() else 0.0,
        "count": delta.numel(),
    }
    return cols, stats
