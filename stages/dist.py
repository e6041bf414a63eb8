"""Which process this is in a distributed run, and the few collectives the stages need.

A launcher (torchrun, `accelerate launch`) sets WORLD_SIZE; `join` then initialises torch.distributed
through Accelerate, which picks the backend and device of this machine's accelerator (gloo on a CPU),
so no stage names one. Lower layers (models, update, online) import this module, never the trainer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from functools import cache
from typing import Any

import torch

logger = logging.getLogger(__name__)


def world_and_rank() -> tuple[int, int]:
    """(world size, rank) of an initialised torch.distributed group, else (1, 0)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def device() -> torch.device:
    """The device Accelerate picks for this process (an accelerator or the CPU); never hard-coded.

    Under a launcher this also joins its process group (Accelerate's `PartialState`). Accelerate then
    names the CPU `cpu:0`, and `.to("cpu:0")` copies every tensor that lives on `cpu` — a checkpoint's
    memory-mapped weights would become a second, private copy of the whole model on every rank — so the
    CPU is always plain `cpu`.
    """
    from accelerate import PartialState

    on = PartialState(cpu=not torch.accelerator.is_available()).device
    return torch.device("cpu") if on.type == "cpu" else on


class Wrapped:
    """A trained module as the code that runs it sees it during data-parallel training: calls go
    through the parallel `wrapper` (DDP's forward, which prepares the gradient all-reduce), every
    attribute (config, dtype, adapters, parameters) is the `module`'s own."""

    def __init__(self, module: torch.nn.Module, wrapper: torch.nn.Module):
        self.module = module
        self.wrapper = wrapper

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


def unwrap(module: Any) -> Any:
    """The module itself, whether or not it is `Wrapped` for data-parallel training."""
    return module.module if isinstance(module, Wrapped) else module


def join() -> tuple[int, int]:
    """Join the launcher's process group if there is one, and return (world size, rank).

    Without a launcher (WORLD_SIZE unset or 1) nothing is initialised or imported: (1, 0).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device()
    return world_and_rank()


# Ranks that run one model replica together (sequence or tensor parallelism, `stages.parallelism`):
# consecutive ranks, the same samples; 1 when every rank is its own replica.
_model_parallel = 1


def set_model_parallel(ranks: int) -> None:
    """Record that groups of `ranks` consecutive ranks each run one model replica (`stages.parallelism`)."""
    global _model_parallel
    _model_parallel = ranks


def data_parallel() -> tuple[int, int]:
    """(number of data-parallel replicas, this rank's replica): the launcher's (world, rank) when every
    rank is its own replica; with model-parallel groups of k ranks, (world / k, rank // k)."""
    world, rank = world_and_rank()
    return world // _model_parallel, rank // _model_parallel


def writes_outputs() -> bool:
    """Whether this rank writes what its replica computes: the first rank of each model-parallel group
    (every rank without model parallelism); the others compute the same and drop it."""
    return world_and_rank()[1] % _model_parallel == 0


def replicas(values: list[Any]) -> list[Any]:
    """The entries of one per data-parallel replica among every rank's `values` (as `gather` returns them)."""
    return values[::_model_parallel]


def rank_shards(indices: Iterable[int], what: str = "shards") -> list[int]:
    """The shards of `indices` this process makes: shard s belongs to data-parallel replica s % dp (all
    of them without a launcher; `data_parallel`). Every shard has one owner and each owner gets its
    shards in order. A rank left with none says so on stderr (it still joins the collectives), naming
    how to give every rank work."""
    join()
    world, rank = data_parallel()
    indices = list(indices)
    mine = [s for s in indices if s % world == rank]
    if world > 1 and not mine:
        logger.warning(
            "rank %d of %d has none of the %d %s to work on and waits for the others; %s",
            rank,
            world,
            len(indices),
            what,
            "give --num-shards a multiple of the number of ranks (sample, pairs) so every rank has work",
        )
    return mine


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for in a single process)."""
    if world_and_rank()[0] > 1:
        torch.distributed.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's picklable `obj` on every rank (`obj` itself in a single process); what the other ranks
    pass is ignored. Only for values this launch's own rank 0 built, never bytes a user passed."""
    if world_and_rank()[0] == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order, on every rank (`[obj]` in a single process)."""
    world = world_and_rank()[0]
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


@cache
def _holds_float64(dev: torch.device) -> bool:
    try:
        torch.zeros(1, dtype=torch.float64, device=dev)
    except (TypeError, RuntimeError):
        return False
    return True


def all_reduce_sum(values: torch.Tensor, on: torch.device, group: Any = None) -> torch.Tensor:
    """`values` summed over ranks (all of them, or those of process `group`), communicated on device
    `on`: the one the group's backend moves data on (the device of the trained parameters; some
    backends reject host tensors). The sum is taken in float64 where that device holds float64, else
    float32. Returns a new tensor on `values`' device and dtype; `values` is left as it is.
    """
    if world_and_rank()[0] == 1:
        return values
    wire = values.to(device=on, dtype=torch.float64 if _holds_float64(on) else torch.float32, copy=True)
    torch.distributed.all_reduce(wire, group=group)
    return wire.to(device=values.device, dtype=values.dtype)
