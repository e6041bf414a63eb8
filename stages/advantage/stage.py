"""The `advantage` stage: group-normalised advantages over a whole rollout, one row per sample.

Normalisation needs every group (and, for flow_grpo's global std, every reward), so the stage reads
all shards, then writes advantages back in the samples' shard layout.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import torch

from stages.advantage.config import AdvantageConfig
from stages.advantage.estimators import (
    ESTIMATORS,
    advantage_stats,
    broadcast_steps,
    estimated_rows,
    get_estimator,
    multi_reward_advantages,
    zero_std_mask,
)
from stages.advantage.gardo import GATE_COLUMN, uncertainty_gate
from stages.errors import UserInputError
from stages.finite import check_finite
from stages.outputs import check_format, open_inputs, plugin_files, run_config
from stages.score.registry import reward_column
from stages.score.scoring import FAILED_COLUMN, failed_rewards
from stages.shards.reader import rollout_modality, slice_batch
from stages.shards.writer import ShardSetWriter


def compute_advantages(
    data: dict[str, Any],
    *,
    estimator: str = "grpo",
    clip: float | None = None,
    drop_zero_std: bool = False,
    num_steps: int | None = None,
    weights: dict[str, float] | None = None,
    std_ddof: int | None = None,
    features: str = "final_latent",
    gate_rewards: list[str] | None = None,
    gate_fraction: float = 0.1,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Columns sample_id, advantages [N, K] (and train_mask [N], reward_failed [N]) plus summary stats.

    data: sample_id, group_id, reward [N], and reward_failed [N] where `score --on-error zero` wrote it;
    K comes from `num_steps` (stored steps of the rollout). With `weights` (reward name → weight),
    advantages are aggregated per reward (MixGRPO's `advantage_aggr`): each `reward.<name>` column is
    normalised on its own, then weighted and summed. `std_ddof` (0 or 1) replaces the built-in
    estimator's Bessel setting (`EstimatorPreset.unbiased`). An estimator that `needs_features` (gardo)
    gets the column `features` of `data`. With `gate_rewards`, `kl_gate` [N] holds GARDO's uncertainty gate of the
    scored rows (`stages.advantage.gardo`): `reward` against each `reward.<name>`, `gate_fraction` of them.

    A failed reward (flagged, or NaN/±inf: `failed_rewards`) is left out: the estimator runs over the
    `estimated_rows` alone and every other row gets advantage 0. `reward_failed` is passed on (so
    `update` skips those rows) and counted in the stats.
    """
    for col in ("sample_id", "group_id", "reward"):
        if col not in data:
            hint = "the output of `omnirl score`" if col == "reward" else "the output of `omnirl sample`"
            raise UserInputError(f"--in: column '{col}' is missing; pass {hint}")
    groups = list(data["group_id"])
    ids = list(data["sample_id"])
    rewards = _numbers(data, "reward")
    per_reward: dict[str, torch.Tensor] = {}
    if std_ddof is not None and estimator not in ESTIMATORS:
        raise UserInputError(
            f"--std-ddof {std_ddof}: --estimator {estimator} has no group std; use a built-in group estimator "
            f"({', '.join(ESTIMATORS)}) or drop it"
        )
    if weights:
        if estimator not in ESTIMATORS:
            raise UserInputError(
                f"--aggregation advantage_aggr works with a built-in --estimator, not {estimator!r}"
            )
        missing = [name for name in weights if reward_column(name) not in data]
        if missing:
            raise UserInputError(
                f"--in: column '{reward_column(missing[0])}' is missing; score with --reward {missing[0]}"
            )
        per_reward = {name: _numbers(data, reward_column(name)) for name in weights}
    flags = {FAILED_COLUMN: data[FAILED_COLUMN]} if FAILED_COLUMN in data else {}
    columns = {"reward": rewards, **{reward_column(n): v for n, v in per_reward.items()}, **flags}
    failed = failed_rewards(columns, len(ids))
    scored = ~failed
    if not bool(scored.any()):
        raise UserInputError(
            f"--in: all {len(ids)} rewards failed (reward_failed or NaN); there is nothing to learn from, "
            "re-score the rollout"
        )
    preset = ESTIMATORS.get(estimator)  # a built-in one (the only kind --std-ddof and weights take)
    if preset is not None and std_ddof is not None:
        preset = replace(preset, unbiased=bool(std_ddof))
    estimate = preset if preset is not None else get_estimator(estimator)
    rows = estimated_rows(groups, failed)
    picked = rows.nonzero().flatten().tolist()
    sub_groups, sub_ids = [groups[i] for i in picked], [ids[i] for i in picked]
    adv = torch.zeros(len(ids), dtype=torch.float32)
    if picked and weights:
        adv[rows] = multi_reward_advantages(
            {name: values[rows] for name, values in per_reward.items()},
            weights,
            sub_groups,
            aggregation="advantage_aggr",
            std=preset.std,
            eps=preset.eps,
            unbiased=preset.unbiased,
            clip=clip,
            sample_ids=sub_ids,
        )
    elif picked:
        extra = {}
        if getattr(estimate, "needs_features", False):
            if features not in data:
                raise UserInputError(
                    f"--estimator {estimator}: --in has no column '{features}' for --diversity-features; "
                    "pass the samples shard set (final_latent) or name a column it has"
                )
            extra["features"] = data[features][rows]
        adv[rows] = estimate(rewards[rows], sub_groups, clip=clip, sample_ids=sub_ids, **extra)
    check_finite({"advantages": adv}, ids, hint=f"--estimator {estimator} produced it; fix the estimator")
    kept = scored.nonzero().flatten().tolist()
    stats = {
        **advantage_stats(rewards[scored], adv[scored], [groups[i] for i in kept]),
        "num_samples": len(ids),
        FAILED_COLUMN: int(failed.sum()),
    }
    out: dict[str, Any] = {
        "sample_id": ids,
        "advantages": broadcast_steps(adv, max(1, num_steps or 1)),
    }
    if drop_zero_std:
        keep = rows.clone()
        if picked:
            keep[rows] = ~zero_std_mask(rewards[rows], sub_groups)
        out["train_mask"] = keep
        stats["dropped_samples"] = int((scored & ~keep).sum())
    if flags or bool(failed.any()):
        out[FAILED_COLUMN] = failed
    if gate_rewards:
        out[GATE_COLUMN] = _gate(data, rewards, scored, gate_rewards, gate_fraction)
        stats["kl_gated"] = int(out[GATE_COLUMN].sum())
    return out, stats


def _gate(
    data: dict[str, Any], rewards: torch.Tensor, scored: torch.Tensor, names: list[str], fraction: float
) -> torch.Tensor:
    """GARDO's `uncertainty_gate` over the scored rows, bool [N] (False for a failed reward)."""
    missing = [name for name in names if reward_column(name) not in data]
    if missing:
        raise UserInputError(
            f"--gate-reward {missing[0]}: --in has no column '{reward_column(missing[0])}'; score with "
            f"--reward {missing[0]}=0 (computed, not trained on)"
        )
    aux = [_numbers(data, reward_column(name))[scored] for name in names]
    gate = torch.zeros(len(rewards), dtype=torch.bool)
    gate[scored] = uncertainty_gate(rewards[scored], aux, fraction)
    return gate


def _numbers(data: dict[str, Any], column: str) -> torch.Tensor:
    """A reward column as float32 [N]; a column that does not hold one number per sample (strings,
    JSON, a tensor per row) is a one-line input error naming it."""
    values = data[column]
    if isinstance(values, torch.Tensor) and values.ndim == 1:
        return values.float()
    if isinstance(values, torch.Tensor):
        held = f"a {tuple(values.shape[1:])} tensor per sample"
    else:
        held = f"{type(values[0]).__name__} values" if len(values) else "no numbers"
    raise UserInputError(
        f"--in: column '{column}' holds {held}, not one number per sample; "
        "pass the rewards written by `omnirl score`"
    )


def reward_weights(manifests: list[Any]) -> dict[str, float]:
    """reward name → weight, as `omnirl score --reward NAME[=WEIGHT]` recorded them."""
    from stages.score.registry import parse_reward_spec

    for manifest in manifests:
        if manifest.command == "score":
            return dict(parse_reward_spec(spec) for spec in manifest.config.get("reward") or [])
    raise UserInputError(
        "--aggregation advantage_aggr: none of the --in shard sets was written by `omnirl score`"
    )


def run_advantage(c: AdvantageConfig, display: Any) -> dict[str, Any]:
    """The advantages of the rollout `c.inputs` (its samples and rewards) written to `c.out` (advantages
    [N, K], K the stored steps or 1; train_mask / kl_gate where the estimator writes them), advancing the
    progress `display` per shard; a finished `c.out` is left as it is. Returns the result: out,
    estimator and the statistics (`compute_advantages`')."""
    name = c.estimator_name()
    src = open_inputs(c.inputs)
    writer = ShardSetWriter(
        c.out,
        num_shards=src.num_shards,
        format=check_format(c.fmt),
        command="advantage",
        config=run_config(asdict(c)),
        parents=[*src.paths, *plugin_files([name])],
        policy=src.manifests[0].policy,
        overwrite=c.overwrite,
    )
    steps_col = src.columns.get("log_probs")
    # one advantage per stored denoising step; a text rollout's outcome advantage covers every token
    stepwise = steps_col is not None and steps_col.shape and rollout_modality(src.manifests) != "text"
    num_steps = steps_col.shape[0] if stepwise else 1
    weights = None
    if c.aggregation == "advantage_aggr":
        weights = reward_weights(src.manifests)
    columns = ["sample_id", "group_id", "reward", *(reward_column(n) for n in weights or {})]
    columns += [reward_column(n) for n in c.gate_reward or [] if reward_column(n) in src.columns]
    if getattr(get_estimator(name), "needs_features", False) and c.diversity_features in src.columns:
        columns.append(c.diversity_features)
    columns += [FAILED_COLUMN] if FAILED_COLUMN in src.columns else []
    task = display.add_task("advantages", total=src.num_rows, rate="")
    data = src.read_all(columns=columns)
    cols, stats = compute_advantages(
        data,
        estimator=name,
        clip=c.clip,
        drop_zero_std=c.drop_zero_std,
        num_steps=num_steps,
        weights=weights,
        std_ddof=c.std_ddof,
        features=c.diversity_features,
        gate_rewards=c.gate_reward,
        gate_fraction=c.gate_fraction,
    )
    if not writer.complete:
        start = 0
        for s, info in enumerate(src.manifests[0].shards):
            if not writer.shard_done(s):
                writer.write_shard(s, slice_batch(cols, start, start + info.rows))
            start += info.rows
            display.advance(task, info.rows)
        writer.finalize(extra={"stats": stats})
    return {"out": str(c.out), "estimator": name, **stats}
