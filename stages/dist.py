"""Which process this is in a distributed run: the one fact about torch.distributed that lower layers
(models, update, online) need, without importing the trainer."""

from __future__ import annotations

import torch


def world_and_rank() -> tuple[int, int]:
    """(world size, rank) of an initialised torch.distributed group, else (1, 0)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0
