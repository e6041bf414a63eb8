"""The `logprob` stage: replay every stored step of a rollout under given weights.

Diffusion rollouts: the replay calls the same `FlowPolicy.velocity` and `samplers.step` as the
rollout, in the same batches, so under the sampling weights it reproduces the rollout log-probs
exactly (fp32 math on the latents as stored, fp32 or bf16: `--latent-dtype`). Text rollouts (VLM): one forward over prompt + response per sampling batch gives every
response token's log-prob; it matches the incremental (KV-cached) rollout to float rounding.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
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
        policy.images_of(list(batch["group_id"])) if "group_id" in batch else None,
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
    subset: set[str] | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Replay one shard in the sampling batch size; returns its columns and the |Δ logp| vs the
    rollout of every replayed step, flat. With `subset` (sample ids, whole sampling batches:
    `pick_batches`), only the batches it holds are replayed and returned.

    Non-finite stored values (`where` names the input) or replayed values stop it, naming the sample.
    """
    from stages.shards.reader import concat_batches, slice_batch

    ids = list(shard["sample_id"])
    check_finite(shard, ids, where=where, hint=CORRUPT)
    parts, rollout = [], []
    for start, stop in batch_bounds(len(ids), cfg.batch_size):
        if subset is not None and ids[start] not in subset:
            continue
        part = slice_batch(shard, start, stop)
        parts.append(replay_batch(policy, cfg, part, reference=reference, means=means))
        rollout.append(part["log_probs"])
        if on_batch:
            on_batch(stop - start)
    if not parts:  # a shard none of whose batches a --fraction replay drew: its columns, no rows
        steps = shard["latents"][:0, 1:].float()
        empty = {"sample_id": [], "old_log_probs": shard["log_probs"][:0].float()}
        empty.update(
            {name: steps for name, asked in (("ref_means", reference), ("old_means", means)) if asked}
        )
        return empty, torch.zeros(0)
    cols = concat_batches(parts)
    check_finite(cols, cols["sample_id"], where="logprob", hint=MODEL_HINT)
    return cols, abs_deltas(cols["old_log_probs"], torch.cat(rollout))


def batch_bounds(rows: int, batch_size: int) -> list[tuple[int, int]]:
    """(start, stop) of the sampling batches of a shard of `rows` rows: `sample` rolls a shard out in
    batches of `batch_size` from its first row, and the replay takes the same ones."""
    return [(start, min(rows, start + batch_size)) for start in range(0, rows, batch_size)]


def pick_batches(shard_ids: Sequence[Sequence[str]], batch_size: int, fraction: float, seed: int) -> set[str]:
    """The sample ids a `logprob --fraction` replay takes: round(fraction × B) (at least one) of the
    rollout's B sampling batches, drawn with `seed` over all shards. Whole batches, so each row is
    replayed in the batch it was sampled in, as a full replay does (a batch's forward and its prompt
    encoding depend on the batch: another grouping would differ by float rounding).

    `shard_ids`: the sample ids of every shard, in order."""
    from stages.errors import UserInputError

    if not 0 < fraction <= 1:
        raise UserInputError(f"--fraction {fraction}: must lie in (0, 1]")
    batches = [ids[a:b] for ids in shard_ids for a, b in batch_bounds(len(ids), batch_size)]
    k = max(1, round(fraction * len(batches)))
    return {sid for i in random.Random(seed).sample(range(len(batches)), k) for sid in batches[i]}


def abs_deltas(
    replayed: torch.Tensor, rollout: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """|replayed − rollout| log-probs, flat (only the `valid` entries when given)."""
    delta = (replayed.float() - rollout.float()).abs()
    return (delta[valid] if valid is not None else delta).flatten()


def delta_summary(deltas: torch.Tensor) -> dict[str, float | None]:
    """Mean, max and 99th percentile (nearest rank) of the |Δ logp| entries, and their count; None
    for each statistic when there are none."""
    n = deltas.numel()
    if not n:
        return {"abs_delta_mean": None, "abs_delta_max": None, "abs_delta_p99": None, "abs_delta_count": 0}
    ordered = deltas.double().sort().values
    return {
        "abs_delta_mean": float(ordered.mean()),
        "abs_delta_max": float(ordered[-1]),
        "abs_delta_p99": float(ordered[math.ceil(0.99 * n) - 1]),
        "abs_delta_count": n,
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
    budget: int | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Token log-probs [N, T] of a text rollout's responses under `policy` (0 at padding).

    Replays in the sampling batches (whole groups, `prompts_per_call` per batch), so under the
    sampling weights the prompts are padded as in the rollout; with a token `budget`
    (--micro-batch-tokens), in micro-batches of at most that many prompt + response tokens instead
    (`balance.budget_bins`; the rows come back in their order). With `reference`, also the frozen base
    model's `ref_log_probs` [N, T] (KL). Also returns |Δ logp| vs the rollout on the valid tokens, flat.
    """
    from stages.sample.vlm_stage import prompt_inputs, response_batch, row_media, row_prompts, token_column
    from stages.shards.reader import concat_batches, take_rows

    check_finite(shard, shard["sample_id"], where=where, hint=CORRUPT)
    media = row_media(shard, where)
    parts, order = [], []
    for rows in _token_batches(shard, cfg, budget):
        part = take_rows(shard, rows)
        inputs = prompt_inputs(
            policy,
            row_prompts(part),
            [media[i] for i in rows],
            part["prompt_ids"],
            part["prompt_mask"],
            where,
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
        order += rows
        if on_batch:
            on_batch(len(rows))
    cols = take_rows(concat_batches(parts), sorted(range(len(order)), key=order.__getitem__))
    check_finite(cols, cols["sample_id"], where="logprob", hint=MODEL_HINT)
    return cols, abs_deltas(cols["old_log_probs"], shard["log_probs"], shard["response_mask"].bool())


def _token_batches(shard: dict[str, Any], cfg: VLMSampleConfig, budget: int | None) -> list[list[int]]:
    """The rows of each forward of `replay_token_shard`: the sampling batches (whole groups,
    `prompts_per_call` per batch), or with a token `budget` groups of at most that many prompt +
    response tokens (a longer row alone, with a warning)."""
    from stages.update.balance import budget_bins, row_tokens, warn_over_budget

    ids = list(shard["group_id"])
    if budget is None:
        n = ids.count(ids[0]) if ids else 1
        size = cfg.prompts_per_call(n) * n
        return [list(range(start, min(len(ids), start + size))) for start in range(0, len(ids), size)]
    tokens = row_tokens(shard)
    warn_over_budget(tokens, budget)
    return budget_bins(tokens, budget)
