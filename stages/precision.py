"""Mixed precision as Accelerate names it: which autocast the forward runs under.

The setting is a command's --mixed-precision, else the launcher's (`accelerate launch --mixed_precision`
or the `accelerate config` file, which set ACCELERATE_MIXED_PRECISION), else the command's fallback ("no";
`logprob`: the rollout's). `update` trains under it, `sample`, `score` and `encode` run their model
forwards under it, and `logprob` replays under it, so old log-probs carry the rollout's or trainer's numerics.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from stages.errors import UserInputError
from stages.knobs import MIXED_PRECISION_MODES, launcher_mixed_precision

# --mixed-precision → the autocast dtype (None: no autocast). fp16 trains with a dynamic loss scale.
MIXED_PRECISIONS: dict[str, torch.dtype | None] = dict(
    zip(MIXED_PRECISION_MODES, (None, torch.bfloat16, torch.float16), strict=True)
)


def resolve_mixed_precision(value: str | None, default: str = "no") -> str:
    """`value` (a --mixed-precision), else the launcher's, else `default`; refused in one line unless
    Accelerate names it."""
    mode = launcher_mixed_precision(default) if value is None else value
    if mode not in MIXED_PRECISIONS:
        raise UserInputError(
            f"--mixed-precision {mode} (or accelerate launch's --mixed_precision): "
            f"choose one of {', '.join(MIXED_PRECISIONS)}"
        )
    return mode


def autocast(mode: str, device: torch.device) -> AbstractContextManager[Any]:
    """The context a forward runs in: autocast to `mode`'s dtype on `device`'s type (none for "no")."""
    dtype = MIXED_PRECISIONS[mode]
    return nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)
