"""How `update` spreads the trained module over the launcher's processes: one process, DDP or FSDP2.

The strategy is `--strategy` (auto, ddp, fsdp2), else the launcher's: `accelerate launch` with an FSDP
config (fsdp_version 2) means FSDP2, any other multi-process launch means DDP. DeepSpeed, Megatron-LM,
FSDP1 and torch.compile settings are refused with one line, never silently ignored.

- DDP is Accelerate's (`Accelerator.prepare`): the trained module is wrapped once per `train` call, its
  gradients are all-reduced in the last backward of an optimizer step (`no_sync` before it).
- FSDP2 is torch's `fully_shard`, applied per block (the launcher's `fsdp_transformer_layer_cls_to_wrap`,
  else the module's `_no_split_modules`) and at the root, on a mesh of Accelerate's device type, with
  the launcher's FSDP settings read through Accelerate's `FullyShardedDataParallelPlugin` (CPU offload,
  reshard after forward). Accelerate itself never shards on a CPU, so omnirl applies the plugin's
  settings itself: the same code runs on CPU (gloo, in the tests) and on GPUs/NPUs.

Both reduce with a mean over ranks; the trainer scales each loss by the ranks averaged over
(`Parallel.averaged`) so that gradients are sums over the whole optimizer step divided by its exact
weight (torchtune's scale-grads rule).

Under tensor parallelism (`--tp-degree`) diffusers has already split the planned weights over each
tensor-parallel group as DTensors on the "tp" dimension of the 2-D mesh dp × tp, and each rank's
gradient is its group's (of its own shards): the replicas are averaged over the "dp" dimension only,
and each loss is scaled by dp. One group alone ("tp") wraps nothing. DDP refuses DTensor parameters, so
over dp replicas "ddp" is torch's composable `replicate` (FSDP2's machinery without sharding: one
all-reduce over dp in the step's last backward), and "fsdp2" is `fully_shard` over the dp dimension
(torch's 2-D recipe: each tp shard sharded again over dp). The QK-norms, which each rank applies to its
own heads, get a share each, summed over the tp group after the step's last backward.
Trainer state (optimizer, EMA, DiffusionNFT's old policy) is saved as full tensors in the single-process
layout, so a run may resume under another strategy or world size; under FSDP2 with the launcher's
`fsdp_state_dict_type: SHARDED_STATE_DICT` each rank writes its own shards instead (`sharded_state.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from stages.dist import Wrapped, all_reduce_sum, device, world_and_rank
from stages.errors import UserInputError
from stages.knobs import STRATEGIES
from stages.parallelism import (
    head_split_parameters,
    packed_blocks,
    rank_order,
    tensor_parallel_degree,
    tensor_parallel_mesh,
)

# `accelerate launch` settings update cannot honour: variable → the setting's name.
UNSUPPORTED_LAUNCHER = {
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("true", "1", "yes")


def launcher_strategy() -> str | None:
    """The strategy an `accelerate launch` config asks for ("fsdp2"), None when it names none.

    Refuses (one line) what update cannot honour: DeepSpeed, Megatron-LM, FSDP version 1 and a
    torch.compile backend.
    """
    for var, name in UNSUPPORTED_LAUNCHER.items():
        if _flag(var):
            raise UserInputError(
                f"accelerate launch: {name} ({var}={os.environ[var]}) is not supported by update; use an "
                "FSDP2 (fsdp_version: 2) or DDP accelerate config (recipes/accelerate/)"
            )
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
    if backend.lower() != "no":
        raise UserInputError(
            f"accelerate launch: dynamo backend {backend} (ACCELERATE_DYNAMO_BACKEND) is not supported by "
            "update; launch with --dynamo_backend no"
        )
    if not _flag("ACCELERATE_USE_FSDP"):
        return None
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise UserInputError(
            f"accelerate launch: FSDP version {version} (FSDP_VERSION) is not supported by update; set "
            "fsdp_version: 2 in the accelerate config (recipes/accelerate/fsdp2_8gpu.yaml)"
        )
    launcher_state_dict_type()
    return "fsdp2"


def launcher_checkpointing() -> bool:
    """Whether the accelerate config asks FSDP for activation checkpointing (fsdp_activation_checkpointing):
    update honours it as --gradient-checkpointing."""
    return _flag("ACCELERATE_USE_FSDP") and _flag("FSDP_ACTIVATION_CHECKPOINTING")


def launcher_state_dict_type() -> str:
    """The trainer-state layout the launcher asks for: "sharded" for `fsdp_state_dict_type:
    SHARDED_STATE_DICT` (FSDP_STATE_DICT_TYPE), else "full" (also when unset: Accelerate's own FSDP2
    default is sharded, omnirl's stays full). LOCAL_STATE_DICT (FSDP1's) is refused with one line."""
    value = os.environ.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT").upper()
    names = {"1": "FULL_STATE_DICT", "2": "LOCAL_STATE_DICT", "3": "SHARDED_STATE_DICT"}
    value = names.get(value, value)
    if value == "FULL_STATE_DICT":
        return "full"
    if value == "SHARDED_STATE_DICT":
        return "sharded"
    raise UserInputError(
        f"accelerate launch: fsdp_state_dict_type {value} (FSDP_STATE_DICT_TYPE) is not supported by update; "
        "use FULL_STATE_DICT or SHARDED_STATE_DICT"
    )


def resolve_strategy(strategy: str, world: int) -> str:
    """ "none", "ddp" or "fsdp2" for `--strategy` (auto: the launcher's, else DDP over >1 process)."""
    if strategy not in STRATEGIES:
        raise UserInputError(f"--strategy {strategy}: choose one of {', '.join(STRATEGIES)}")
    launched = launcher_strategy()
    if strategy == "auto":
        strategy = launched or "ddp"
    elif launched is not None and launched != strategy:
        raise UserInputError(
            f"--strategy {strategy} contradicts the accelerate config ({launched}); drop one of them"
        )
    alone = world == 1 and not torch.distributed.is_initialized() and "LOCAL_RANK" not in os.environ
    if strategy == "fsdp2" and alone:
        raise UserInputError(
            "--strategy fsdp2 needs a launcher, even on one device: torchrun --nproc_per_node N -m omnirl_cli "
            "update ... or accelerate launch (recipes/accelerate/)"
        )
    return strategy if world > 1 or strategy == "fsdp2" else "none"


def _accelerator() -> Any:
    """Accelerate's accelerator for this process (device and process group from the launcher).

    Mixed precision is left to the trainer's autocast (`UpdateConfig.autocast`), so one process may
    train runs of different precisions one after another. DDP looks for parameters a forward leaves
    unused (some families' last block computes a text stream nothing reads).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    return Accelerator(
        cpu=device().type == "cpu",
        mixed_precision="no",
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )


def _blocks(module: torch.nn.Module, names: list[str] | None) -> list[torch.nn.Module]:
    """The submodules FSDP2 shards one by one: instances of the named classes (the launcher's
    `fsdp_transformer_layer_cls_to_wrap`, else the model's `_no_split_modules`)."""
    if not names:
        inner = module
        while not getattr(inner, "_no_split_modules", None) and hasattr(inner, "base_model"):
            inner = inner.base_model if inner.base_model is not inner else inner.model
        names = list(getattr(inner, "_no_split_modules", None) or [])
    wanted = set(names)
    return [m for m in module.modules() if type(m).__name__ in wanted]


class Parallel:
    """The trained module of one `train` call, spread by `kind` ("none", "ddp", "fsdp2")."""

    def __init__(self, kind: str, module: torch.nn.Module):
        self.kind = kind
        self.module = module
        self.world = world_and_rank()[0]
        self.wrapper: Any = None
        self.plugin: Any = None
        self.tp_mesh = tensor_parallel_mesh(module)
        self.tp = tensor_parallel_degree(module)
        self.packed = packed_blocks(module)  # tensor-parallel parameters split block by block
        # tensor-parallel parameters whose gradients are shares, by name: wrapping replaces the parameters
        names = {id(p): n for n, p in module.named_parameters()}
        self.head_split_names = [names[id(p)] for p in head_split_parameters(module)]
        self.head_split: list[torch.nn.Parameter] = []

    @property
    def averaged(self) -> int:
        """The ranks the strategy averages gradients over (each loss is scaled by it): all of them under
        DDP and FSDP2 (a sequence-parallel group's shares then add up to its replica's), the dp replicas
        under tensor parallelism, none in one process or one tensor-parallel group."""
        return self.world // self.tp if self.kind in ("ddp", "fsdp2") else 1

    @property
    def spread(self) -> bool:
        """Whether the trained parameters are DTensors (FSDP2 shards or tensor-parallel splits), which
        `gather` makes whole for saving and `shard_like` lays out again on resuming."""
        return self.kind == "fsdp2" or self.tp > 1

    @property
    def sharded_state(self) -> bool:
        """Whether trainer state is saved as each rank's shards (FSDP2 with a sharded state dict type);
        under DDP or one process the state is whole on every rank anyway."""
        return self.kind == "fsdp2" and launcher_state_dict_type() == "sharded"

    @classmethod
    def setup(cls, module: torch.nn.Module, strategy: str, *, swaps_weights: bool = False) -> Parallel:
        """Spread `module` (its trained parameters already marked and fp32) by `strategy`.

        swaps_weights: the objective runs other weights through the module between a forward and its
        backward (DiffusionNFT's old policy, AWM's EMA). Call before the optimizer is made: FSDP2
        replaces the parameters by their shards.
        """
        world = world_and_rank()[0]
        kind = resolve_strategy(strategy, world)
        degree = tensor_parallel_degree(module)
        if degree > 1 and kind == "ddp" and world == degree:
            kind = "tp"  # one tensor-parallel group: no replica to average with
        par = cls(kind, module)
        if kind == "ddp" and degree > 1:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(module, mesh=par._data_parallel_mesh())
        elif kind == "ddp":
            par.wrapper = _accelerator().prepare_model(module)
        elif kind == "fsdp2":
            par._shard(swaps_weights)
        named = dict(module.named_parameters())
        par.head_split = [named[n] for n in par.head_split_names]
        return par

    def _data_parallel_mesh(self) -> Any:
        """The mesh gradients are averaged over: the "dp" dimension of the tensor-parallel mesh's root
        (dp × tp), else all ranks in one dimension."""
        if self.tp_mesh is not None:
            return self.tp_mesh._get_root_mesh()["dp"]
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device().type, (self.world,))

    def _shard(self, swaps_weights: bool) -> None:
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        self.plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        if swaps_weights and not self.plugin.reshard_after_forward:
            raise UserInputError(
                "accelerate config: fsdp_reshard_after_forward false keeps a forward's gathered weights, "
                "but this --algo runs its old/EMA policy in between; set fsdp_reshard_after_forward: true"
            )
        on = device()
        if on.type == "cpu":
            _pin_mmap_threshold()
        mesh = self._data_parallel_mesh()
        offload = self.plugin.cpu_offload if on.type != "cpu" else None
        options = {
            "mesh": mesh,
            "reshard_after_forward": bool(self.plugin.reshard_after_forward),
            "offload_policy": offload if isinstance(offload, CPUOffloadPolicy) else OffloadPolicy(),
        }
        for block in _blocks(self.module, self.plugin.transformer_cls_names_to_wrap):
            fully_shard(block, **options)
        fully_shard(self.module, **options)
        # Buffers are not sharded. One read from the checkpoint is a view of the file's memory map, which
        # keeps the whole map, and every page of it sharding just read, resident on every rank: copy them
        # out so the map closes and a rank holds its shards alone.
        for sub in self.module.modules():
            for name, buffer in sub.named_buffers(recurse=False):
                sub.register_buffer(
                    name, buffer.clone(), persistent=name not in sub._non_persistent_buffers_set
                )

    @contextmanager
    def forwarding(self, policy: Any, attribute: str) -> Iterator[None]:
        """Inside the block the policy's `attribute` (its trained module) runs through the DDP
        wrapper; FSDP2 and one process need nothing (the sharded module is its own forward)."""
        if self.wrapper is None:
            yield
            return
        setattr(policy, attribute, Wrapped(self.module, self.wrapper))
        try:
            yield
        finally:
            setattr(policy, attribute, self.module)

    def sync(self, enabled: bool) -> Any:
        """The context a forward and its backward run in: DDP all-reduces only when `enabled` (the
        step's last backward), and so does tensor parallelism its head-split gradients; FSDP2
        reduce-scatters every backward into the sharded gradients."""
        if self.tp > 1:
            return self._tensor_parallel_sync(enabled)
        if self.wrapper is None or enabled:
            return nullcontext()
        return self.wrapper.no_sync()

    @contextmanager
    def _tensor_parallel_sync(self, enabled: bool) -> Iterator[None]:
        """`replicate` all-reduces over dp only when `enabled`; after that backward, the head-split
        parameters' gradients (this rank's part of them) summed over the tp group (one all-reduce)."""
        if self.kind == "ddp":
            self.module.set_requires_gradient_sync(enabled)
        yield
        grads = [local_tensor(p.grad) for p in self.head_split if enabled and p.grad is not None]
        if grads:
            flat = torch.cat([g.flatten() for g in grads])
            summed = all_reduce_sum(flat, device(), group=self.tp_mesh.get_group())
            for g, part in zip(grads, summed.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the gradients to `max_norm` over all ranks' shards; the total norm before clipping."""
        if self.tp == 1:
            return full(torch.nn.utils.clip_grad_norm_(params, max_norm))
        # tensor parallelism mixes plain gradients and DTensors of two meshes (tp, and dp × tp under
        # FSDP2 or replicate), which torch's clipping cannot take: each rank's sum of squares counts a
        # part once over the ranks that hold a copy of it (those its placements do not split), and one
        # all-reduce adds them up
        on = params[0].device
        grads = [p.grad for p in params if p.grad is not None]
        squares = torch.zeros(1, device=on)
        for g in grads:
            copies = self.world
            if is_sharded(g):
                for size, placement in zip(g.device_mesh.shape, g.placements, strict=True):
                    copies //= 1 if placement.is_replicate() else size  # Shard or FSDP2's _StridedShard
            squares += local_tensor(g).float().square().sum() / copies
        norm = all_reduce_sum(squares, on)[0].sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            local_tensor(g).mul_(coef)
        return norm

    def memory(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Bytes this rank holds of the trained parameters and of their optimizer state (shards only)."""
        local = [local_tensor(p) for p in params]
        moments = [
            local_tensor(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        ]
        return {
            "memory/param_bytes": float(sum(t.numel() * t.element_size() for t in local)),
            "memory/optimizer_bytes": float(sum(t.numel() * t.element_size() for t in moments)),
        }

    # ------------------------------------------------------------ full tensors for saving and resuming
    def gather(self, tensors: dict[str, torch.Tensor], of: str | None = None) -> dict[str, torch.Tensor]:
        """`tensors` whole on rank 0, the rank that writes them: shards are gathered one at a time into host
        memory (a collective under FSDP2: every rank calls it) and the other ranks drop each at once, so
        only rank 0 ever holds them all; tensors that are not sharded are returned as they are. Each key
        names its parameter, or `of` does (the moments of one parameter)."""
        keep = world_and_rank()[1] == 0
        out = {}
        for k, v in tensors.items():
            if not is_sharded(v):
                out[k] = v
                continue
            whole = full(v)
            packed = self.packed.get(of or k)
            if packed is not None:
                whole = rank_order(whole, *packed, self.tp, inverse=True)
            if keep:
                out[k] = whole.detach().cpu()
        return out

    def _names(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The parameter names of the optimizer's parameters, in its state's index order."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]

    def module_state(self, trained_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The trained module's state dict, whole on rank 0 (`gather`), when it is sharded, else None (the
        module's own state_dict is whole). trained_only: only the parameters that train (a LoRA's), not
        the frozen base weights an adapter does not hold."""
        if not self.spread:
            return None
        state = self.module.state_dict()
        if trained_only:
            wanted = {n for n, p in self.module.named_parameters() if p.requires_grad}
            state = {k: v for k, v in state.items() if k in wanted}
        return self.gather(state)

    def shard_like(
        self, tensors: dict[str, torch.Tensor], named: dict[str, torch.Tensor], of: str | None = None
    ) -> dict[str, torch.Tensor]:
        """`tensors` (full) laid out as the parameters of the same name: this rank's shards under FSDP2 or
        tensor parallelism. `of`: the name of the parameter whose moments they are, where keys are not."""
        from torch.distributed.tensor import distribute_tensor

        out = {}
        for k, v in tensors.items():
            p = named[k]
            if is_sharded(v):  # already laid out (a sharded checkpoint, `sharded_state.load`)
                out[k] = v
            elif is_sharded(p):
                packed = self.packed.get(of or k)
                if packed is not None:
                    v = rank_order(v, *packed, self.tp)
                out[k] = distribute_tensor(v.to(p.device, p.dtype), p.device_mesh, p.placements)
            else:
                out[k] = v.to(p.device, p.dtype)
        return out

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state_dict with full tensors (the single-process layout), on rank 0 (`gather`).

        Under FSDP2 the optimizer is spent afterwards (`train` makes a new one each call): each
        parameter's moments leave it as they are gathered, so rank 0 never holds a moment both as its
        shard and whole beyond the one being gathered."""
        state = optimizer.state_dict()
        if not self.spread:
            return state
        optimizer.state.clear()
        moments, names = state["state"], self._names(optimizer)
        return {
            "state": {i: self.gather(moments.pop(i), of=names[i]) for i in list(moments)},
            "param_groups": state["param_groups"],
        }

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a full (single-process layout) optimizer state into this rank's optimizer."""
        if self.spread:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            named, names = {str(i): p for i, p in enumerate(params)}, self._names(optimizer)
            state = {
                "state": {
                    i: {
                        k: self.shard_like({str(i): v}, named, of=names[int(i)])[str(i)] if v.dim() else v
                        for k, v in s.items()
                    }
                    for i, s in state["state"].items()
                },
                "param_groups": state["param_groups"],
            }
        optimizer.load_state_dict(state)


# glibc's mallopt parameter M_MMAP_THRESHOLD, and its initial value (bytes)
M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD = -3, 128 * 1024


def _pin_mmap_threshold() -> None:
    """Keep the C allocator returning large freed tensors to the system, for FSDP2 on CPU ranks.

    glibc serves an allocation above its mmap threshold with a mapping of its own, unmapped when freed,
    and raises the threshold (up to 32 MiB) each time such a mapping is freed. FSDP2 gathers every
    block's weights (whole, tens of MiB at real size) and frees them after each forward and backward, which
    drives the threshold to the top: from then on gradients, activations and the next gathers come from
    the heap, which returns memory only from its end, and a rank's resident memory grows step after
    step (+600 MiB over 6 optimizer steps of the small SD3, docs/real-checkpoints.md). Setting the
    threshold pins it at glibc's own initial value. A no-op where the C library is not glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version"):
        libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD)


def is_sharded(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (a shard of a tensor spread over ranks)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local shard of a DTensor, else `t`."""
    return t.to_local() if is_sharded(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t`: a DTensor gathered from every rank (a collective), else `t`."""
    return t.full_tensor() if is_sharded(t) else t
