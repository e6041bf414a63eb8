"""σ schedules of flow-matching pipelines: the tables every sampler step, replay and loss reads.

They live with the models because a family's adapter owns its schedule (dynamic shift, custom
lists); the samplers only consume the table.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from stages.errors import UserInputError


def flow_match_sigmas(
    scheduler, num_steps: int, *, device: torch.device | str | None = None, mu: float | None = None
) -> Tensor:
    """The pipeline's own σ schedule: float32 [num_steps + 1], from σ_0 = 1 down to a final 0.

    Calls `scheduler.set_timesteps` the way the diffusers pipelines do, so the values equal diffusers bit
    for bit: `set_timesteps(num_steps)` for a fixed shift (SD3/SD3.5), or, for a scheduler with dynamic
    shifting (FLUX, Qwen-Image), σ = linspace(1, 1/N, N) shifted by the resolution-dependent `mu`.
    """
    if num_steps < 1:
        raise UserInputError(f"num_steps={num_steps}: the number of sampling steps must be at least 1")
    if scheduler.config.get("use_dynamic_shifting", False):
        if mu is None:
            raise ValueError("this scheduler uses dynamic shifting: pass mu (the resolution-dependent shift)")
        sigmas = None
        if not scheduler.config.get("use_flow_sigmas", False):
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        scheduler.set_timesteps(num_steps, device=device, sigmas=sigmas, mu=mu)
    else:
        scheduler.set_timesteps(num_steps, device=device)
    return scheduler.sigmas.to(dtype=torch.float32).clone()


def dynamic_shift_mu(image_seq_len: int, config: Any) -> float:
    """The resolution-dependent time shift `mu` of FLUX.1, Qwen-Image and Z-Image: linear in the number
    of packed image tokens, from `base_shift` at `base_image_seq_len` to `max_shift` at
    `max_image_seq_len` (the scheduler config's values; diffusers' defaults 256 → 0.5, 4096 → 1.15),
    computed in the pipelines' own order of operations so the float is the same."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    slope = (config.get("max_shift", 1.15) - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)
