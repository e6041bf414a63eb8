"""Trainer state as each rank's shards: a torch.distributed.checkpoint (DCP) folder.

Under FSDP2 with `fsdp_state_dict_type: SHARDED_STATE_DICT` the AdamW moments, the EMA and DiffusionNFT's
old policy stay sharded when saved: every rank writes the pieces it holds (`__<rank>_0.distcp`) and rank 0
the index (`.metadata`), so no rank ever holds them whole. Optimizer state is keyed by parameter name
(torch's `get_optimizer_state_dict`), so DCP reshards on load: a run resumes on the same or another world
size, under FSDP2, DDP or in one process. The learning-rate schedule and the data order are functions of
the saved step and `--seed`, so the step (state.json) is all they need.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from stages.dist import world_and_rank

SHARDED_DIR = "sharded"
# the parts of a trainer state that are tensors laid out like the trained parameters
PARAM_PARTS = ("ema", "old_weights")


@contextmanager
def _alone() -> Iterator[bool]:
    """Whether DCP runs without a process group (one process); DCP's warning that it then does is muted."""
    alone = world_and_rank()[0] == 1
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", "torch.distributed is .*unavailable or uninitialized")
        yield alone


def collect(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, dict[str, torch.Tensor] | None],
) -> dict[str, Any]:
    """The sharded trainer state to `save`: the optimizer's state by parameter name and each non-None
    part of `tensors` (ema, old_weights: dicts of this rank's DTensor shards), all left as they are."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state: dict[str, Any] = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    state.update({k: v for k, v in tensors.items() if v is not None})
    return state


def save(folder: Path, state: dict[str, Any]) -> list[str]:
    """Write `collect`'s state under `folder`/sharded (a collective: every rank calls it and writes its
    own shards). Returns the parts written, for state.json."""
    import torch.distributed.checkpoint as dcp

    with _alone() as no_dist:
        dcp.save(state, checkpoint_id=folder / SHARDED_DIR, no_dist=no_dist)
    return sorted(state)


def load(
    folder: Path,
    parts: list[str],
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    named: dict[str, torch.Tensor],
) -> dict[str, dict[str, torch.Tensor]]:
    """Read a `save`d state into this run's layout (every rank calls it): the optimizer's state is loaded
    in place; returns the other `parts` as tensors laid out like `named` (the trained parameters: this
    rank's shards under FSDP2, whole tensors otherwise)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    template: dict[str, Any] = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    for part in parts:
        if part in PARAM_PARTS:
            template[part] = {k: torch.zeros_like(p, dtype=torch.float32) for k, p in named.items()}
    with _alone() as no_dist:
        dcp.load(template, checkpoint_id=folder / SHARDED_DIR, no_dist=no_dist)
    set_optimizer_state_dict(module, optimizer, template.pop("optimizer"))
    return template
