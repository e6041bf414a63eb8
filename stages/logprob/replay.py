"""The `logprob` stage: replay every stored step of a rollout under given weights.

Diffusion rollouts: the replay calls the same `FlowPolicy.velocity` and `samplers.step` as the
rollout, in the same batches, so under the sampling weights it reproduces the rollout log-probs
exactly (fp32 math on the latents as stored, fp32 or bf16: `--latent-dtype`). Text rollouts (VLM): one forward over prompt + response per sampling batch gives every
response token's log-prob; it matches the incremental (KV-cached) rollout to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.finite import MODEL_HINT, check_finite
from stages.models.diffusion import FlowPolicy
from stages.models.vlm import VLMPolicy
from stages.sample.rollout import SampleConfig
from stages.sample.samplers import step
from stages.sample.vlm_stage import VLMSampleConfig

CORRUPT = "the stored rollout is corrupt; sample it again into a new --out"


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

    With `reference`, also the frozen base model's step means `ref_means` [B, K, *latent] (for KL);
    with `means`, the step means under `policy` itself, `old_means` [B, K, *latent] (GRPO-Guard); a
    latent is [C, h, w] for images and [C, F, h, w] for video.
    """
    latents, sigmas = batch["latents"], batch["sigmas"]
    k = latents.shape[1] - 1
    cond = policy.encode(
        list(batch["prompt"]),
        list(batch.get("negative_prompt") or []) or None,
        policy.needs_negative(cfg.guidance),
        cfg.max_sequence_length,
    )
    sigma_safe = policy.sigmas(cfg.steps, cfg.resolution)[1]
    log_probs, ref_means, old_means = [], [], []
    for j in range(k):
        x = latents[:, j].to(policy.device).float()
        x_next = latents[:, j + 1].to(policy.device).float()
        v = policy.velocity(x, sigmas[:, j], cond, cfg.guidance, cfg.guidance_2)
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
                v_ref = policy.velocity(x, sigmas[:, j], cond, cfg.guidance, cfg.guidance_2)
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
    where: str = "--in",
    on_batch: Any = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Replay one shard in the sampling batch size; returns its columns and |Δ logp| vs the rollout.

    Non-finite stored values (`where` names the input) or replayed values stop it, naming the sample.
    """
    from stages.shards.reader import concat_batches, slice_batch

    ids = list(shard["sample_id"])
    check_finite(shard, ids, where=where, hint=CORRUPT)
    n = len(ids)
    parts = []
    for start in range(0, n, cfg.batch_size):
        part = slice_batch(shard, start, min(n, start + cfg.batch_size))
        parts.append(replay_batch(policy, cfg, part, reference=reference, means=means))
        if on_batch:
            on_batch(len(part["sample_id"]))
    cols = concat_batches(parts)
    check_finite(cols, ids, where="logprob", hint=MODEL_HINT)
    return cols, delta_stats(cols["old_log_probs"], shard["log_probs"])


def delta_stats(
    replayed: torch.Tensor, rollout: torch.Tensor, valid: torch.Tensor | None = None
) -> dict[str, float]:
    """Sum, max and count of |replayed − rollout| log-probs (over `valid` entries when given)."""
    delta = (replayed - rollout.float()).abs()
    if valid is not None:
        delta = delta[valid]
    return {
        "abs_delta_sum": float(delta.sum()),
        "abs_delta_max": float(delta.max()) if delta.numel() else 0.0,
        "count": delta.numel(),
    }


@torch.no_grad()
def replay_token_shard(
    policy: VLMPolicy,
    cfg: VLMSampleConfig,
    shard: dict[str, Any],
    *,
    reference: bool = False,
    where: str = "--in",
    on_batch: Any = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Token log-probs [N, T] of a text rollout's responses under `policy` (0 at padding).

    Replays in the sampling batches (whole groups, `prompts_per_call` per batch), so under the
    sampling weights the prompts are padded as in the rollout. With `reference`, also the frozen base
    model's `ref_log_probs` [N, T] (KL). Stats compare with the rollout log-probs on valid tokens.
    """
    from stages.sample.vlm_stage import prompt_inputs, response_batch, row_media, row_prompts, token_column
    from stages.shards.reader import concat_batches, slice_batch

    check_finite(shard, shard["sample_id"], where=where, hint=CORRUPT)
    ids = list(shard["group_id"])
    n = ids.count(ids[0]) if ids else 1
    rows_per_batch = cfg.prompts_per_call(n) * n
    media = row_media(shard, where)
    parts = []
    for start in range(0, len(ids), rows_per_batch):
        stop = min(len(ids), start + rows_per_batch)
        part = slice_batch(shard, start, stop)
        inputs = prompt_inputs(
            policy, row_prompts(part), media[start:stop], part["prompt_ids"], part["prompt_mask"], where
        )
        tokens, mask = response_batch(part, policy.device)
        width = part["response_ids"].shape[1]
        cols = {
            "sample_id": list(part["sample_id"]),
            "old_log_probs": token_column(
                policy.response_log_probs(inputs, tokens, mask, cfg.temperature), mask, width
            ),
        }
        if reference:
            with policy.reference():
                ref = policy.response_log_probs(inputs, tokens, mask, cfg.temperature)
            cols["ref_log_probs"] = token_column(ref, mask, width)
        parts.append(cols)
        if on_batch:
            on_batch(stop - start)
    cols = concat_batches(parts)
    check_finite(cols, cols["sample_id"], where="logprob", hint=MODEL_HINT)
    return cols, delta_stats(cols["old_log_probs"], shard["log_probs"], shard["response_mask"].bool())
