"""Sequence (context) and tensor parallelism of a diffusion transformer, through diffusers' own configs.

The launcher's W ranks form a 2-D mesh dp × k, k the sequence-parallel degree (`--sp-degree`) or the
tensor-parallel degree (`--tp-degree`; the two do not combine, as diffusers' `ParallelConfig` refuses).
The k consecutive ranks of one model-parallel group run one replica of the model on the same samples:
under sp each holds 1/k of every sequence (diffusers' `ContextParallelConfig`: Ulysses all-to-all over
heads, ring passing keys/values round, or unified = both), under tp 1/k of every planned weight
(`TensorParallelConfig`). Data (shards, rows, seeds, optimizer slots) is split over dp alone
(`stages.dist.data_parallel`), and only the first rank of each group writes (`stages.dist.writes_outputs`).

Gradients: diffusers gathers the transformer's output over the group (`proj_out`) and routes each
rank's backward to its own part of the sequence only, so a rank's parameter gradients are its share
and the group's true gradient is their *sum*. DDP / FSDP2 over all W ranks average, and the trainer
scales each loss by W (not dp), which makes that average exactly the sum over each group, averaged
over the dp groups (tests/test_parallelism.py checks it against one process). Under tp a rank's
gradient of a split weight is already the group's, except the QK-norms', which each rank applies to its
own heads (`head_split_parameters`; `stages.update.parallel` sums those over the group), so the
replicas are averaged over the mesh's dp dimension alone and each loss is scaled by dp.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cache
from typing import Any

import torch

from stages.dist import device, join, set_model_parallel, world_and_rank
from stages.errors import UserInputError
from stages.knobs import SP_KINDS

# attention backends that cannot return the log-sum-exp ring attention merges partial results with
NO_LSE_BACKENDS = ("native", "_native_math", "_native_efficient", "_native_npu", "_native_xla", "xformers")
MAX_LISTED_DEGREE = 16  # the sp degrees a refused sequence length lists, 2 to this
LAUNCH = "torchrun --nproc_per_node N (or accelerate launch)"


@dataclass(frozen=True)
class ModelParallel:
    """How one model replica is spread over a group of ranks: `sp_degree` ranks share its sequence
    (`sp_kind`), or `tp_degree` ranks its weights. Both 1: no model parallelism."""

    sp_degree: int = 1
    sp_kind: str = "ulysses"
    tp_degree: int = 1

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ModelParallel:
        """The settings among resolved command options (`--sp-degree`, `--sp-kind`, `--tp-degree`)."""
        return cls(**{f.name: options[f.name] for f in fields(cls) if options.get(f.name) is not None})

    @property
    def degree(self) -> int:
        """Ranks per model replica (1 without model parallelism)."""
        return self.sp_degree * self.tp_degree

    def validate(self, world: int, ranks_option: str | None = None) -> None:
        """Refuse in one line settings `world` ranks cannot run; `ranks_option` names the option that
        gave `world` (None: the launcher)."""
        if self.sp_kind not in SP_KINDS:
            raise UserInputError(f"--sp-kind {self.sp_kind}: choose one of {', '.join(SP_KINDS)}")
        for name, value in (("--sp-degree", self.sp_degree), ("--tp-degree", self.tp_degree)):
            if value < 1:
                raise UserInputError(f"{name} {value}: give a positive number of ranks")
        if self.sp_degree > 1 and self.tp_degree > 1:
            raise UserInputError(
                f"--sp-degree {self.sp_degree} with --tp-degree {self.tp_degree}: diffusers combines "
                "context and tensor parallelism in no model; choose one of them"
            )
        if self.sp_kind == "unified" and self.sp_degree > 1 and _ring_ulysses(self.sp_degree)[0] == 1:
            raise UserInputError(
                f"--sp-kind unified --sp-degree {self.sp_degree}: unified runs ring × Ulysses, which needs "
                "a degree with two factors > 1 (4, 6, 8, ...); pass another --sp-degree or --sp-kind"
            )
        if world % self.degree:
            option = (
                f"--sp-degree {self.sp_degree}" if self.sp_degree > 1 else f"--tp-degree {self.tp_degree}"
            )
            if ranks_option is not None:
                raise UserInputError(
                    f"{option}: {ranks_option} {world} is not dp × sp × tp; pass a multiple of it"
                )
            launch = f"{LAUNCH}, N a multiple of it" if world == 1 else "a multiple of it as the launcher's N"
            raise UserInputError(
                f"{option}: {world} rank(s) are not dp × sp × tp for a whole dp; launch with {launch}"
            )

    def mesh_shape(self, world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The device mesh's shape and dimension names: (dp, ring, ulysses) under sp, (dp, tp) under tp.
        dp is outermost, so a model-parallel group is `degree` consecutive ranks."""
        dp = world // self.degree
        if self.tp_degree > 1:
            return (dp, self.tp_degree), ("dp", "tp")
        if self.sp_kind == "ring":
            ring, ulysses = self.sp_degree, 1
        elif self.sp_kind == "unified":
            ring, ulysses = _ring_ulysses(self.sp_degree)
        else:
            ring, ulysses = 1, self.sp_degree
        return (dp, ring, ulysses), ("dp", "ring", "ulysses")


def _ring_ulysses(degree: int) -> tuple[int, int]:
    """(ring, ulysses) degrees of unified sp: ring the smallest factor > 1 with ulysses > 1, else (1, degree)."""
    for ring in range(2, degree):
        if degree % ring == 0:
            return ring, degree // ring
    return 1, degree


@cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device().type, shape, mesh_dim_names=names)


def layout(parallel: ModelParallel) -> Any:
    """Check `parallel` against the launcher's world, record the model-parallel group size with
    `stages.dist` (so shards, rows and optimizer slots are split over dp) and return the device mesh
    (None without model parallelism). Call it before any work is split; calling it again is free."""
    world = join()[0]
    parallel.validate(world)
    set_model_parallel(parallel.degree)
    if parallel.degree == 1:
        return None
    return _mesh(*parallel.mesh_shape(world))


def parallelize(parts: Mapping[str, torch.nn.Module], parallel: ModelParallel) -> None:
    """Spread each trained transformer in `parts` (pipeline attribute → module; adapters already on
    it, so diffusers' hooks wrap the LoRA layers too) by `parallel`, in place; one line refuses a module
    it cannot spread before anything is changed. Call it once per module. The modules must then be
    called with `return_dict=False` (every family adapter does): diffusers' output hooks take tuples."""
    if parallel.degree == 1:
        return
    for name, module in parts.items():
        _check(f"{name} {type(module).__name__}", module, parallel)
    mesh = layout(parallel)
    from diffusers import ContextParallelConfig, TensorParallelConfig

    for module in parts.values():
        if parallel.sp_degree > 1:
            cp_mesh = mesh["ring", "ulysses"]
            ring, ulysses = cp_mesh.mesh.shape
            _enable(module, ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=cp_mesh))
            guard_splits(module, parallel.sp_degree)
        else:
            _enable(module, TensorParallelConfig(mesh=mesh["tp"]))


def _check(what: str, module: torch.nn.Module, parallel: ModelParallel) -> None:
    """Refuse in one line a module (`what`: its attribute and class) diffusers cannot spread by `parallel`."""
    if parallel.sp_degree > 1:
        option = f"--sp-degree {parallel.sp_degree}"
        if getattr(module, "_cp_plan", None) is None:
            raise UserInputError(
                f"{option}: the {what} has no context-parallel plan (_cp_plan) in diffusers; sequence "
                "parallelism runs FLUX, Qwen-Image and Wan, drop --sp-degree"
            )
        backend = _backend(module)
        if parallel.sp_kind != "ulysses" and backend in NO_LSE_BACKENDS:
            raise UserInputError(
                f"--sp-kind {parallel.sp_kind}: ring attention needs an attention backend that returns the "
                f"log-sum-exp and the active one ({backend}) does not (so no CPU runs it); use --sp-kind "
                "ulysses, or a flash/cuDNN backend on an accelerator"
            )
        heads_split = parallel.mesh_shape(parallel.degree)[0][2]  # Ulysses splits the heads
    else:
        option = f"--tp-degree {parallel.tp_degree}"
        if getattr(module, "_tp_plan", None) is None:
            raise UserInputError(
                f"{option}: the {what} has no tensor-parallel plan (_tp_plan) in diffusers; tensor "
                "parallelism runs FLUX and Qwen-Image, drop --tp-degree"
            )
        if any("lora_" in n for n, _ in module.named_parameters()):
            raise UserInputError(
                f"{option}: the {what} carries LoRA layers, which diffusers' tensor-parallel plan does not "
                "shard; use --sp-degree (or --full without an --adapter)"
            )
        heads_split = parallel.tp_degree
    heads = getattr(module.config, "num_attention_heads", None)
    if heads is not None and heads % heads_split:
        raise UserInputError(
            f"{option}: the {what} has {heads} attention heads, which {heads_split} ranks cannot split "
            "evenly; pass a degree that divides it"
        )
    if parallel.tp_degree > 1:
        _check_blocks(option, what, module, parallel.tp_degree)


def _check_blocks(option: str, what: str, module: torch.nn.Module, degree: int) -> None:
    """Refuse in one line a planned weight with a block (its whole split dimension, or one part of a
    fused projection) `degree` ranks cannot split evenly, which diffusers refuses with a ValueError."""
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    for name, spec in resolve_tp_shard_specs(module, module._tp_plan, 1).items():
        blocks = spec.block_sizes or []
        if any(b % degree for b in blocks):
            shape = f"the fused blocks {' + '.join(map(str, blocks))}" if len(blocks) > 1 else f"{blocks[0]}"
            raise UserInputError(
                f"{option}: the {what}'s {name} splits {shape} along dim {spec.dim}, which {degree} ranks "
                f"cannot split evenly; {_divisors(math.gcd(*blocks))}"
            )


def sequence_shards(module: torch.nn.Module) -> int:
    """How many ranks split `module`'s sequence (1 without sequence parallelism): diffusers splits every
    planned sequence evenly, so a family that sizes a sequence itself (Qwen-Image pads its text per
    batch) pads it to a multiple of this, with masked-out tokens."""
    cp = getattr(getattr(module, "_parallel_config", None), "context_parallel_config", None)
    return 1 if cp is None else cp.ring_degree * cp.ulysses_degree


def tensor_parallel_mesh(module: torch.nn.Module) -> Any:
    """The "tp" dimension of the mesh `module`'s planned weights are split over (None without tensor
    parallelism); its root mesh's "dp" dimension holds the replicas (`mesh_shape`)."""
    tp = getattr(getattr(module, "_parallel_config", None), "tensor_parallel_config", None)
    return None if tp is None else tp.mesh


def tensor_parallel_degree(module: torch.nn.Module) -> int:
    """How many ranks split `module`'s planned weights (1 without tensor parallelism)."""
    mesh = tensor_parallel_mesh(module)
    return 1 if mesh is None else mesh.size()


def packed_blocks(module: torch.nn.Module) -> dict[str, tuple[int, list[int]]]:
    """Parameter name → (dim, block sizes) of `module`'s parameters that diffusers' tensor-parallel plan
    splits block by block (a fused projection, e.g. FLUX's single-block `proj_out` over [attention |
    MLP]: each block's rows or columns split over the ranks): their DTensor's gathered local shards are
    in rank order, not the tensor's (`rank_order`). Empty without tensor parallelism."""
    degree = tensor_parallel_degree(module)
    if degree == 1:
        return {}
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    specs = resolve_tp_shard_specs(module, module._tp_plan, degree)
    return {n: (s.dim, s.block_sizes) for n, s in specs.items() if s.block_sizes and len(s.block_sizes) > 1}


def head_split_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The replicated parameters of `module` that tensor parallelism applies to each rank's own attention
    heads only: those of an attention layer whose projections the plan splits, other than the split
    projections (its QK-norms, over head_dim). Each rank's gradient of them is its heads' share, and the
    group's is their sum. Empty without tensor parallelism."""
    if tensor_parallel_degree(module) == 1:
        return []
    from torch.distributed.tensor import DTensor

    found: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        to_q = getattr(sub, "to_q", None)
        if isinstance(getattr(to_q, "weight", None), DTensor):
            found |= {id(p): p for p in sub.parameters() if not isinstance(p, DTensor)}
    return list(found.values())


def rank_order(
    t: torch.Tensor, dim: int, blocks: list[int], ranks: int, inverse: bool = False
) -> torch.Tensor:
    """`t`, whose `dim` is `blocks` each split in `ranks` equal parts, with those parts rank-major (rank
    0's part of every block, then rank 1's, ...): the order a packed DTensor's `full_tensor()` returns
    and `distribute_tensor` must be given. `inverse`: from rank order back to the tensor's own."""
    if not inverse:
        parts = [block.chunk(ranks, dim) for block in t.split(blocks, dim)]
        return torch.cat([parts[j][r] for r in range(ranks) for j in range(len(blocks))], dim)
    parts = [chunk.split([b // ranks for b in blocks], dim) for chunk in t.chunk(ranks, dim)]
    return torch.cat([parts[r][j] for j in range(len(blocks)) for r in range(ranks)], dim)


def check_sequence(module: torch.nn.Module, tokens: int, grid: str) -> None:
    """Refuse in one line a sequence of `tokens` latent tokens (`grid`: how they arise, e.g. "3 × 3
    patches") that `module`'s sequence-parallel group cannot split evenly, before diffusers' splitter
    fails on it with a bare assertion. Free without sequence parallelism."""
    shards = sequence_shards(module)
    if tokens % shards == 0:
        return
    raise UserInputError(
        f"--sp-degree {shards}: a sample's latents are {tokens} tokens ({grid}), which {shards} ranks cannot split "
        f"evenly; {_divisors(tokens)} "
        "(or sample at another --resolution)"
    )


# what each input diffusers' context-parallel plans split is a sequence of, by its forward parameter name
SEQUENCES = {
    "hidden_states": "the latent tokens (the sample's, then any reference image's)",
    "img_ids": "the latent tokens' position ids (the sample's, then any reference image's)",
    "modulate_index": "the latent tokens' modulation index (the sample's, then any reference image's)",
    "timestep": "the per-token timesteps of the latent tokens",
    "encoder_hidden_states": "the prompt's text tokens",
    "txt_ids": "the prompt's text tokens' position ids",
    "encoder_hidden_states_mask": "the prompt's text-token mask",
}


def guard_splits(module: torch.nn.Module, shards: int) -> None:
    """Before each forward of a submodule `module`'s `_cp_plan` splits inputs of, refuse in one line an
    input sequence `shards` ranks cannot split evenly (`check_split`), instead of diffusers' bare assertion.
    Inputs the plan splits after the submodule ran (`split_output`: rotary embeddings) are as long as
    the sequences they embed, which are checked where they enter."""
    from diffusers.hooks.context_parallel import _find_submodule_by_name

    for name, entries in module._cp_plan.items():
        inputs = {k: v for k, v in entries.items() if isinstance(k, str)} if isinstance(entries, dict) else {}
        if not inputs:
            continue
        found = _find_submodule_by_name(module, name)
        for sub in found if isinstance(found, list) else [found]:
            signature = inspect.signature(type(sub).forward)

            def check(
                sub: torch.nn.Module, args: tuple, kwargs: dict, signature=signature, inputs=inputs
            ) -> None:
                given = signature.bind_partial(sub, *args, **kwargs).arguments
                for key, plan in inputs.items():
                    value = given.get(key)
                    listed = isinstance(value, list | tuple) and isinstance(plan, list | tuple)
                    for tensor, how in zip(value, plan, strict=False) if listed else [(value, plan)]:
                        # diffusers leaves a tensor of other dimensions than the plan expects unsplit
                        if (
                            torch.is_tensor(tensor)
                            and not how.split_output
                            and how.expected_dims in (None, tensor.dim())
                        ):
                            check_split(key, tensor.shape[how.split_dim], shards)

            sub.register_forward_pre_hook(check, with_kwargs=True)


def check_split(name: str, length: int, shards: int) -> None:
    """Refuse in one line the input `name` (a forward parameter diffusers' plan splits), a sequence of
    `length` tokens that `shards` ranks cannot split evenly."""
    if length % shards == 0:
        return
    raise UserInputError(
        f"--sp-degree {shards}: {SEQUENCES.get(name, 'a sequence')} ({name}) are {length} tokens, which "
        f"{shards} ranks cannot split evenly; {_divisors(length)}: pass one that divides every sequence"
    )


def _divisors(length: int) -> str:
    """The sp degrees that split a sequence of `length` tokens, as a refusal lists them."""
    fits = [str(d) for d in range(2, MAX_LISTED_DEGREE + 1) if length % d == 0]
    return f"degrees up to {MAX_LISTED_DEGREE} that divide it: {', '.join(fits) or 'none'}"


def _backend(module: torch.nn.Module) -> str:
    """The attention backend `module`'s attention runs on: its processors' own, else diffusers' active one."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    for sub in module.modules():
        chosen = getattr(getattr(sub, "processor", None), "_attention_backend", None)
        if chosen is not None:
            return str(getattr(chosen, "value", chosen))
    return str(_AttentionBackendRegistry.get_active_backend()[0].value)


def _enable(module: Any, config: Any) -> None:
    """diffusers' `enable_parallelism(config=...)` with this process's device.

    diffusers' `_resolve_parallel_config` computes `rank % torch.accelerator.device_count()` for the
    device it records, before it looks at the mesh we pass, and that count is 0 on a CPU-only machine
    (ZeroDivisionError). So for this one call the module's resolver is shadowed by an instance
    attribute that does the same (normalise, `setup` with rank, world and our mesh, record) with the
    device Accelerate gave this process; everything else (checks, hooks, sharding) is diffusers' own.
    """
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    world, rank = world_and_rank()
    mesh = config.mesh

    def resolve(cfg: Any) -> Any:
        key = (
            "context_parallel_config" if isinstance(cfg, ContextParallelConfig) else "tensor_parallel_config"
        )
        whole = ParallelConfig(**{key: cfg})
        whole.setup(rank, world, device(), mesh=mesh)
        module._parallel_config = whole
        return whole

    module._resolve_parallel_config = resolve
    try:
        with _cpu_tensor_parallel(mesh):
            module.enable_parallelism(config=config)
    finally:
        del module._resolve_parallel_config


@contextmanager
def _cpu_tensor_parallel(mesh: Any) -> Iterator[None]:
    """Let diffusers' `apply_tensor_parallel` shard over a CPU (gloo) mesh, for this call only.

    diffusers refuses a mesh whose device type is not in its `_SUPPORTED_TP_DEVICES` (its accelerators,
    Neuron and TPU), an allowlist of where it has been tried, not of what the plan needs: the plan's column- and
    row-parallel linears are torch's own DTensor styles, whose collectives (a broadcast and a scatter to
    place the shards, an all-reduce after each row-parallel projection and in the backward of each
    column-parallel one) gloo has, and on a CPU mesh they compute one process's numbers to fp32 rounding
    (tests/test_parallelism.py). So while a CPU mesh is applied "cpu" joins the allowlist; every other
    check and all the sharding stay diffusers' own.
    """
    from diffusers.hooks import tensor_parallel

    allowed = tensor_parallel._SUPPORTED_TP_DEVICES
    if mesh.device_type != "cpu" or "cpu" in allowed:
        yield
        return
    tensor_parallel._SUPPORTED_TP_DEVICES = (*allowed, "cpu")
    try:
        yield
    finally:
        tensor_parallel._SUPPORTED_TP_DEVICES = allowed
