"""The one check that stops a stage on NaN or ±inf, naming the sample and the column.

Every stage calls it on the float columns it reads and on those it produces, so a non-finite value
is reported where it first appears (a corrupt rollout, weights that overflow) and is never written
or trained on silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stages.errors import NonFiniteError

MODEL_HINT = "the weights give non-finite values; check --model, --adapter and --dtype (fp16 overflows)"


def check_finite(
    columns: Mapping[str, Any],
    sample_ids: Sequence[str] | None,
    *,
    hint: str,
    where: str | None = None,
) -> None:
    """Raise `NonFiniteError` for the first row holding NaN or ±inf in a float tensor column [N, ...].

    Other columns (strings, ids, integer tensors) are skipped, so a whole batch can be passed. The
    message names `where` (a file, an option or a stage), the column, the sample (`sample_ids[row]`,
    or the row number without ids) and the offending value, then `hint`: what to do.
    """
    for name, values in columns.items():
        if not isinstance(values, torch.Tensor) or not values.dtype.is_floating_point or values.numel() == 0:
            continue
        bad = ~torch.isfinite(values.detach().reshape(values.shape[0], -1)).all(dim=1)
        if not bool(bad.any()):
            continue
        row = int(bad.nonzero()[0])
        value = values[row].reshape(-1)
        first = float(value[~torch.isfinite(value)][0])
        who = f"sample {sample_ids[row]!r}" if sample_ids is not None else f"row {row}"
        prefix = f"{where}: " if where else ""
        raise NonFiniteError(f"{prefix}{name} of {who} is {first}; {hint}")
