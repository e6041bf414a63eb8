"""A policy directory on disk: the adapter `update` and `online` write, and the trainer state in it.

`save_policy` writes the directory atomically (weights, metrics, omnirl_adapter.json, then the trainer
state); `trainer_state` / `save_state` / `load_state` carry the optimizer, the EMA, DiffusionNFT's old
policy and the fp16 loss scale from one update to the next (`trainer.Trainer` builds and steps them).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stages.dist import barrier, gather, world_and_rank
from stages.safe_files import load_tensors
from stages.shards.atomic import recover_dir, replace_dir
from stages.update import sharded_state
from stages.update.parallel import Parallel

if TYPE_CHECKING:
    from stages.models.diffusion import FlowPolicy
    from stages.models.vlm import VLMPolicy
    from stages.update.config import UpdateConfig
    from stages.update.ema import EMA

STATE_DIR = "trainer_state"
METRICS = "metrics.jsonl"


def save_policy(
    policy: FlowPolicy | VLMPolicy,
    out: Path,
    state: dict[str, Any] | Callable[[], dict[str, Any]],
    metrics: list[dict[str, Any]],
    step: int,
    cfg: UpdateConfig,
    *,
    extra: dict[str, Any],
    weights: Callable[[], dict[str, torch.Tensor] | None] | None = None,
) -> None:
    """Write a policy directory atomically (every rank calls it): metrics, weights and
    omnirl_adapter.json, then the trainer state (`trainer_state`).

    `weights` gathers the trained module's whole state dict when it is sharded (None: the module's own),
    and `state` may be a function that gathers the trainer state; both are collectives, called on every
    rank, one after the other: the weights are written and dropped before the state is gathered, so
    under FSDP2 rank 0 never holds both whole.

    Everything is written into a hidden sibling, which then replaces `out` in one step: a kill leaves
    the previous adapter (or none) and litter that the next update of `out` removes. Rank 0 writes all
    of it, except a sharded trainer state, whose shards every rank writes into the same sibling.
    """
    rank = world_and_rank()[1]
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    failed = None
    if rank == 0:
        try:
            recover_dir(out)
            tmp.mkdir(parents=True)
        except OSError as e:
            failed = e
    # every rank learns rank 0's folder (or its failure) before writing into it
    name, failed = gather((tmp.name, failed))[0]
    if failed is not None:
        raise failed
    tmp = out.parent / name
    try:
        whole = weights() if weights is not None else None
        if rank == 0:
            with open(tmp / METRICS, "w") as fh:
                for record in metrics:
                    fh.write(json.dumps(record) + "\n")
            policy.save_adapter(
                tmp,
                kind="full" if cfg.full else "lora",
                extra={"step": step, "algo": cfg.algo, "update_config": cfg.settings(), **extra},
                state=whole,
            )
        del whole
        save_state(tmp, state() if callable(state) else state, step, cfg)
        if rank == 0:
            for path in tmp.rglob("*.safetensors"):
                canonical_safetensors_header(path)
            replace_dir(tmp, out)
    finally:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()


def canonical_safetensors_header(path: Path) -> None:
    """Sort the keys of a safetensors file's `__metadata__` in place, so equal weights give equal bytes.

    safetensors writes its metadata map in a per-process random order; the header keeps its length
    (same keys, same values), so only the header bytes are rewritten.
    """
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        raw = f.read(size)
        header = json.loads(raw)
        if "__metadata__" in header:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > size:
            return
        f.seek(8)
        f.write(text.ljust(size, b" "))


def resume_sharded(
    state: dict[str, Any], par: Parallel, optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """`state` with a sharded checkpoint (`load_state`'s "sharded": its folder and parts) read into this
    run's layout: the optimizer loaded in place, ema's shadow and old_weights filled (this rank's shards
    under FSDP2, whole tensors otherwise)."""
    folder, parts = state["sharded"]["folder"], state["sharded"]["parts"]
    loaded = sharded_state.load(folder, parts, par.module, optimizer, named)
    ema = state.get("ema")
    return {
        **state,
        "sharded": None,
        "ema": {**ema, "shadow": loaded["ema"]} if ema is not None and "ema" in loaded else None,
        "old_weights": loaded.get("old_weights"),
        "reference": {**state["reference"], "weights": loaded.get("ref_weights")},
    }


def trainer_state(
    par: Parallel,
    optimizer: torch.optim.Optimizer,
    ema: EMA | None,
    old_weights: dict[str, torch.Tensor] | None,
    scaler: torch.amp.GradScaler,
    reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the next update resumes from (every rank calls it), in `load_state`'s form: optimizer, ema
    ({shadow, updates}), old_weights (NFT), grad_scaler (fp16) and reference ({weights, age, pending}:
    GARDO's reset reference), each possibly None, whole (under FSDP2 gathered onto rank 0, the rank that
    writes them). When `par.sharded_state`, "shards" holds this rank's shards of the optimizer, ema,
    old_weights and reference weights instead (`sharded_state.collect`), and the others keep their counters."""
    ref = reference or {"weights": None, "age": 0, "pending": False}
    if par.sharded_state:
        shadow = ema.shadow if ema is not None else None
        parts = {"ema": shadow, "old_weights": old_weights, "ref_weights": ref["weights"]}
        return {
            "shards": sharded_state.collect(par.module, optimizer, parts),
            "optimizer": None,
            "ema": {"shadow": None, "updates": ema.updates} if ema is not None else None,
            "old_weights": None,
            "grad_scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "reference": {**ref, "weights": None},
        }
    return {
        "optimizer": par.optimizer_state(optimizer),
        "ema": {"shadow": par.gather(ema.shadow), "updates": ema.updates} if ema is not None else None,
        "old_weights": par.gather(old_weights) if old_weights is not None else None,
        "grad_scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "reference": {**ref, "weights": par.gather(ref["weights"]) if ref["weights"] is not None else None},
    }


def save_state(out: Path, state: dict[str, Any], step: int, cfg: UpdateConfig) -> None:
    """Write a `trainer_state` (every rank calls it): optimizer (torch format, read back with
    weights_only=True), EMA, NFT old policy and GARDO reference (safetensors), counters; rank 0 writes them all. A sharded
    state goes to a DCP folder instead, each rank writing its own shards (`sharded_state.save`)."""
    from safetensors.torch import save_file

    folder = out / STATE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    sharded = sharded_state.save(folder, state["shards"]) if state.get("shards") else None
    if world_and_rank()[1] != 0:
        return
    if state.get("optimizer") is not None:
        torch.save(state["optimizer"], folder / "optimizer.pt")
    ema = state.get("ema")
    if ema is not None and ema["shadow"] is not None:
        save_file({k: v.contiguous() for k, v in ema["shadow"].items()}, folder / "ema.safetensors")
    if state.get("old_weights") is not None:
        save_file(
            {k: v.contiguous() for k, v in state["old_weights"].items()}, folder / "old_weights.safetensors"
        )
    ref = state.get("reference") or {}
    if ref.get("weights") is not None:
        save_file({k: v.contiguous() for k, v in ref["weights"].items()}, folder / "ref_weights.safetensors")
    info = {
        "step": step,
        "reference": {"age": ref.get("age", 0), "pending": ref.get("pending", False)},
        "ema_updates": ema["updates"] if ema else 0,
        "grad_scaler": state.get("grad_scaler"),
        "update_config": cfg.settings(),
        **({"sharded": sharded, "sharded_world_size": world_and_rank()[0]} if sharded else {}),
    }
    (folder / "state.json").write_text(json.dumps(info, indent=2, sort_keys=True))


def load_state(adapter: Path | None) -> tuple[dict[str, Any], int]:
    """What the update that wrote `adapter` left for the next one, and its step.

    Keys: optimizer, ema ({shadow, updates}), old_weights (NFT) and grad_scaler (fp16), each None when
    absent, and reference ({weights or None, age, pending}: GARDO's reset reference, `Trainer`). A sharded state (`sharded_state`) is read later, into the sharded run (`Trainer`): "sharded"
    then names its folder and parts, and ema's shadow is None until then.
    """
    from safetensors.torch import load_file

    state: dict[str, Any] = {
        "optimizer": None,
        "ema": None,
        "old_weights": None,
        "grad_scaler": None,
        "reference": {"weights": None, "age": 0, "pending": False},
    }
    folder = Path(adapter) / STATE_DIR if adapter else None
    if folder is None or not (folder / "state.json").is_file():
        return state, 0
    info = json.loads((folder / "state.json").read_text())
    state["reference"].update(info.get("reference") or {})
    if info.get("sharded"):
        parts = list(info["sharded"])
        sharded_state.check(folder, f"--adapter {adapter}")
        state["sharded"] = {"folder": folder, "parts": parts}
        if "ema" in parts:
            state["ema"] = {"shadow": None, "updates": info.get("ema_updates", 0)}
        state["grad_scaler"] = info.get("grad_scaler")
        return state, int(info.get("step", 0))
    if (folder / "optimizer.pt").is_file():
        state["optimizer"] = load_tensors(folder / "optimizer.pt", f"--adapter {adapter}")
    if (folder / "ema.safetensors").is_file():
        state["ema"] = {
            "shadow": load_file(folder / "ema.safetensors"),
            "updates": info.get("ema_updates", 0),
        }
    if (folder / "old_weights.safetensors").is_file():
        state["old_weights"] = load_file(folder / "old_weights.safetensors")
    if (folder / "ref_weights.safetensors").is_file():
        state["reference"]["weights"] = load_file(folder / "ref_weights.safetensors")
    state["grad_scaler"] = info.get("grad_scaler")
    return state, int(info.get("step", 0))
