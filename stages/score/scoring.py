"""Score a batch with several weighted rewards: one call per scorer, checked values, a weighted sum.

Output columns (schema v1): ``reward`` = Σ_k w_k·r_k and one ``reward.<name>`` per scorer
(`registry.reward_column`) with the raw value r_k, all float32 [N]. The sum is formed in float64, then cast.

A value a scorer could not produce (``None``, NaN, ±inf, or the scorer raising) is never trained on
silently. With ``on_error="fail"`` (default) it raises `NonFiniteError` naming the scorer and the
sample_id. With ``on_error="zero"`` it is recorded as 0, the row is flagged in the extra column
``reward_failed`` (bool [N]) and a warning names it. There is no "skip": rows of every shard set
of a rollout stay aligned, so a row cannot be dropped here; `advantage` and `update` leave the flagged
rows out instead (`failed_rewards`), as they do rows whose reward is NaN or ±inf (written by another
tool: score itself never writes one). A `UserInputError` raised by a scorer (a bad prompt file, a
missing package) always propagates: it is not a per-sample failure.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stages.errors import NonFiniteError, UserInputError
from stages.score.config import ON_ERROR_MODES
from stages.score.registry import RewardArgs, get_reward, reward_column, score_value

logger = logging.getLogger(__name__)

FAILED_COLUMN = "reward_failed"


def failed_rewards(columns: Mapping[str, Any], num_rows: int) -> torch.Tensor:
    """bool [num_rows]: the rows whose reward failed, i.e. flagged in `FAILED_COLUMN` (``on_error="zero"``)
    or holding NaN/±inf in a reward column (`reward`, `reward.<name>` [N]) among `columns`. Their stored
    value is not a reward: no statistic, advantage or gradient may use it."""
    failed = torch.zeros(num_rows, dtype=torch.bool)
    for key, values in columns.items():
        if key == FAILED_COLUMN:
            failed |= torch.as_tensor(values, dtype=torch.bool)
        elif (key == "reward" or key.startswith("reward.")) and _is_float_vector(values):
            failed |= ~torch.isfinite(values)
    return failed


def _is_float_vector(values: Any) -> bool:
    return isinstance(values, torch.Tensor) and values.dtype.is_floating_point and values.ndim == 1


def _run_scorer(
    name: str,
    images: Sequence[Any],
    prompts: Sequence[str],
    meta: Sequence[dict],
    sample_ids: Sequence[str],
    on_error: str,
    args: Mapping[str, Any] | None = None,
) -> tuple[list[float], list[bool]]:
    """Call one scorer (configured with its reward arguments `args`) on the batch; return its values
    (failures as 0.0) and the failure flags."""
    n = len(sample_ids)
    scorer = get_reward(name, args)
    try:
        raw = scorer(images, prompts, meta)
    except UserInputError as exc:
        if str(exc).startswith(f"reward {name!r}"):
            raise
        raise type(exc)(f"reward {name!r}: {exc}") from exc
    except Exception as exc:
        detail = " ".join(str(exc).split())  # keep the report on one line
        message = (
            f"reward {name!r} raised {type(exc).__name__}: {detail} on the batch of {n} samples "
            f"{sample_ids[0]!r}..{sample_ids[-1]!r}"
        )
        if on_error == "fail":
            raise NonFiniteError(
                f"{message}; fix the scorer, or score with on_error=zero to record 0 and flag the rows"
            ) from exc
        logger.warning("%s; recorded as 0 and flagged in reward_failed", message)
        return [0.0] * n, [True] * n
    try:
        count = len(raw)
    except TypeError:
        raise UserInputError(
            f"reward {name!r} returned a {type(raw).__name__}, not a list of {n} scores"
        ) from None
    if count != n:
        raise UserInputError(
            f"reward {name!r} returned {count} scores for {n} samples; return one score per sample"
        )
    values: list[float] = []
    failed: list[bool] = []
    for value, sample_id in zip(raw, sample_ids, strict=True):
        try:
            score = score_value(value)
        except TypeError:
            raise UserInputError(
                f"reward {name!r} returned {value!r} for sample {sample_id!r}, a {type(value).__name__}; "
                "scores must be numbers or None"
            ) from None
        number = math.nan if score is None else score
        if math.isfinite(number):
            values.append(number)
            failed.append(False)
            continue
        what = "could not score (None)" if value is None else f"returned {number}"
        if on_error == "fail":
            raise NonFiniteError(
                f"reward {name!r} {what} for sample {sample_id!r}; fix the input or the scorer, "
                "or score with on_error=zero to record 0 and flag the row"
            )
        logger.warning(
            "reward %r %s for sample %r; recorded as 0 and flagged in reward_failed", name, what, sample_id
        )
        values.append(0.0)
        failed.append(True)
    return values, failed


def score_batch(
    specs: Sequence[tuple[str, float]],
    images: Sequence[Any],
    prompts: Sequence[str],
    meta: Sequence[dict],
    *,
    sample_ids: Sequence[str],
    on_error: str = "fail",
    reward_args: RewardArgs | None = None,
    seconds: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Score N samples with every (name, weight) in `specs`; `reward_args[name]` configures a reward
    (`registry.get_reward`). `seconds[name]`, when given, accumulates the time each reward took.

    Returns ``{"reward": float32 [N], "reward.<name>": float32 [N] per spec}``, plus
    ``"reward_failed": bool [N]`` when ``on_error="zero"``.
    """
    if on_error not in ON_ERROR_MODES:
        raise UserInputError(f"on_error {on_error!r} is not one of {', '.join(ON_ERROR_MODES)}")
    if not specs:
        raise UserInputError("no reward given; pass at least one --reward NAME[=WEIGHT]")
    names = [name for name, _ in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise UserInputError(
            f"reward {duplicates[0]!r} is given more than once; give each reward once with its weight"
        )
    n = len(sample_ids)
    if not (len(images) == len(prompts) == len(meta) == n):
        raise ValueError(
            f"score_batch got {len(images)} images, {len(prompts)} prompts, {len(meta)} meta and {n} sample_ids"
        )
    columns: dict[str, torch.Tensor] = {}
    total = torch.zeros(n, dtype=torch.float64)
    any_failed = torch.zeros(n, dtype=torch.bool)
    for name, weight in specs:
        args = (reward_args or {}).get(name)
        t0 = time.perf_counter()
        values, failed = (
            _run_scorer(name, images, prompts, meta, sample_ids, on_error, args) if n else ([], [])
        )
        if seconds is not None:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
        column = torch.tensor(values, dtype=torch.float64)
        total += weight * column
        any_failed |= torch.tensor(failed, dtype=torch.bool)
        columns[reward_column(name)] = column.to(torch.float32)
    out = {"reward": total.to(torch.float32), **columns}
    for key, column in out.items():
        bad = (~torch.isfinite(column)).nonzero()
        if len(bad):
            raise NonFiniteError(
                f"{key} of sample {sample_ids[int(bad[0])]!r} does not fit in float32; rescale the reward or its weight"
            )
    if on_error == "zero":
        out[FAILED_COLUMN] = any_failed
    return out
