"""Trainer state as each rank's shards: safetensors files written and read through
torch.distributed.checkpoint (DCP), with a JSON index; nothing in the folder is ever unpickled.

Under FSDP2 with `fsdp_state_dict_type: SHARDED_STATE_DICT` the AdamW moments, the EMA and DiffusionNFT's
old policy stay sharded when saved: every rank writes the pieces it holds to its own safetensors file
(DCP's `HuggingFaceStorageWriter`, which records each piece's offset in the file's JSON header), so no rank
ever holds them whole. The values that are not tensors (the optimizer's param_groups: lr, betas, parameter
names) go to `index.json`, which rank 0 writes last, once every rank's file is complete: a folder without
it is incomplete. Loading rebuilds DCP's metadata from the safetensors headers (`HuggingFaceStorageReader`),
never from DCP's pickled `.metadata`, so a crafted folder can at most be refused. Optimizer state is keyed
by parameter name (torch's `get_optimizer_state_dict`), so DCP reshards on load: a run resumes on the same
or another world size, under FSDP2, DDP or in one process. The learning-rate schedule and the data order
are functions of the saved step and `--seed`, so the step (state.json) is all they need.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from stages.dist import world_and_rank
from stages.errors import UserInputError
from stages.shards.atomic import atomic_write_bytes

SHARDED_DIR = "sharded"
INDEX = "index.json"
FORMAT = "omnirl-sharded-trainer-state"
VERSION = 1
# the parts of a trainer state that are tensors laid out like the trained parameters
PARAM_PARTS = ("ema", "old_weights", "ref_weights")
# what DCP's own (pickle) format leaves in a folder; omnirl wrote it before this format and never reads it
LEGACY_INDEX = ".metadata"


@contextmanager
def _alone() -> Iterator[bool]:
    """Whether DCP runs without a process group (one process); DCP's warning that it then does is muted."""
    alone = world_and_rank()[0] == 1
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", "torch.distributed is .*unavailable or uninitialized")
        yield alone


def _split(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A nested dict split into (its tensors, everything else), both keeping the nesting. Only dicts are
    descended into: a list or tuple is a value (the optimizer's betas, a param group's parameter names)."""
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            t, v = _split(value)
            if t:
                tensors[key] = t
            if v:
                values[key] = v
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            values[key] = value
    return tensors, values


def _jsonable(value: Any) -> Any:
    """A non-tensor state value as JSON (tuples become lists; `_restore` turns them back)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"trainer state value {value!r} ({type(value).__name__}) has no JSON form")


def _restore(expected: Any, saved: Any, where: str) -> Any:
    """`saved` (from index.json) in the shape and types of `expected` (this run's value), or a
    UserInputError naming `where`: an index can change the values, never their structure or kinds."""
    if isinstance(expected, dict):
        if not isinstance(saved, dict) or set(saved) != {str(k) for k in expected}:
            raise ValueError(f"{where} has other keys than this run's")
        return {k: _restore(v, saved[str(k)], f"{where}.{k}") for k, v in expected.items()}
    if isinstance(expected, list | tuple):
        if not isinstance(saved, list) or len(saved) != len(expected):
            raise ValueError(f"{where} has another length than this run's")
        items = [_restore(e, s, f"{where}[{i}]") for i, (e, s) in enumerate(zip(expected, saved))]
        return type(expected)(items)
    if expected is None or saved is None:
        if expected is not None or saved is not None:
            raise ValueError(f"{where} is {saved!r} where this run has {expected!r}")
        return None
    # the kinds a saved value may take where this run has a bool, an int, a float or a str
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(type(expected))
    if kinds is None:
        raise ValueError(f"{where} holds a {type(expected).__name__}, which no index can restore")
    if not isinstance(saved, kinds) or (isinstance(saved, bool) and type(expected) is not bool):
        raise ValueError(f"{where} is {saved!r} where this run has a {type(expected).__name__}")
    return type(expected)(saved)


def collect(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, dict[str, torch.Tensor] | None],
) -> dict[str, Any]:
    """The sharded trainer state to `save`: the optimizer's state by parameter name and each non-None
    part of `tensors` (ema, old_weights, ref_weights: dicts of this rank's DTensor shards), all left as they are."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state: dict[str, Any] = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    state.update({k: v for k, v in tensors.items() if v is not None})
    return state


def save(folder: Path, state: dict[str, Any]) -> list[str]:
    """Write `collect`'s state under `folder`/sharded (a collective: every rank calls it and writes its
    own safetensors file; rank 0 then writes index.json). Returns the parts written, for state.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    world, rank = world_and_rank()
    tensors, values = _split(state)
    target = folder / SHARDED_DIR
    with _alone() as no_dist:
        writer = HuggingFaceStorageWriter(str(target), save_distributed=True)
        dcp.save(tensors, storage_writer=writer, no_dist=no_dist)
    if rank == 0:  # DCP's save ends in a collective, so every rank's file is complete by now
        files = sorted(p.name for p in target.glob("*.safetensors"))
        index = {"format": FORMAT, "version": VERSION, "world_size": world, "files": files}
        atomic_write_bytes(
            target / INDEX, json.dumps({**index, "values": _jsonable(values)}, indent=1).encode()
        )
    return sorted(state)


def check(folder: Path, where: str = "--adapter") -> dict[str, Any]:
    """The non-tensor values of the sharded state `save` wrote under `folder`, once its index.json and
    every shard file it names are checked whole; a UserInputError naming `where` and the file otherwise.
    Reads JSON and safetensors headers only."""
    from safetensors import SafetensorError, safe_open

    target = folder / SHARDED_DIR
    index_file = target / INDEX
    if not index_file.is_file():
        if (target / LEGACY_INDEX).exists():
            raise UserInputError(
                f"{where}: {target} is in torch.distributed.checkpoint's pickle format (written by an older "
                "omnirl), which omnirl never unpickles; resume from an adapter written by this version, "
                "or start without this --adapter"
            )
        raise UserInputError(
            f"{where}: {target} has no {INDEX}; it is incomplete, resume from an earlier adapter"
        )
    try:
        index = json.loads(index_file.read_text())
        files = index["files"]
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ValueError(f"format {index.get('format')!r} version {index.get('version')!r}")
        if not isinstance(files, list) or not all(isinstance(f, str) and Path(f).name == f for f in files):
            raise ValueError("'files' is not a list of file names")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise UserInputError(f"{where}: {index_file} is not an omnirl sharded-state index ({exc})") from None
    present = sorted(p.name for p in target.glob("*.safetensors"))
    if present != sorted(files):
        raise UserInputError(
            f"{where}: {target} holds the shard files {present}, but its {INDEX} names {sorted(files)}; "
            "resume from an adapter whose trainer state is whole"
        )
    for name in files:
        try:
            with safe_open(str(target / name), framework="pt") as f:
                f.metadata()
        except (SafetensorError, OSError) as exc:
            raise UserInputError(
                f"{where}: {target / name} is not a whole safetensors file ({exc}); it is truncated or "
                "corrupt, resume from another adapter"
            ) from None
    return index.get("values", {})


def load(
    folder: Path,
    parts: list[str],
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    named: dict[str, torch.Tensor],
    where: str = "--adapter",
) -> dict[str, dict[str, torch.Tensor]]:
    """Read a `save`d state into this run's layout (every rank calls it): the optimizer's state is loaded
    in place; returns the other `parts` as tensors laid out like `named` (the trained parameters: this
    rank's shards under FSDP2, whole tensors otherwise). A folder that is incomplete, corrupt or holds
    another model's state is refused in one line naming `where` and the file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    target = folder / SHARDED_DIR
    saved_values = check(folder, where)
    template: dict[str, Any] = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    dropped = _drop_stateless(template["optimizer"]["state"], target, saved_values)
    for part in parts:
        if part in PARAM_PARTS:
            template[part] = {k: torch.zeros_like(p, dtype=torch.float32) for k, p in named.items()}
    tensors, values = _split(template)
    try:
        values = _restore(values, saved_values, INDEX)
        with _alone() as no_dist:
            dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(target)), no_dist=no_dist)
    except (CheckpointException, ValueError, KeyError, RuntimeError, AssertionError, IndexError) as exc:
        # DCP wraps each rank's failure (a size or key the files do not have) in a CheckpointException
        causes = [e for e, _ in exc.failures.values()] if isinstance(exc, CheckpointException) else [exc]
        why = "; ".join(
            dict.fromkeys(str(e).strip().splitlines()[0] if str(e).strip() else repr(e) for e in causes)
        )
        raise UserInputError(
            f"{where}: the sharded trainer state in {target} does not fit this run ({why}); resume with "
            "the model, --full/LoRA settings and algorithm that wrote it"
        ) from None
    _merge(tensors, values)
    # torch refuses a trained parameter without state unless told it may lack one (those `dropped`)
    options = StateDictOptions(strict=not dropped)
    set_optimizer_state_dict(module, optimizer, tensors.pop("optimizer"), options=options)
    return tensors


def _drop_stateless(state: dict[str, Any], target: Path, saved_values: dict[str, Any]) -> bool:
    """Leave out of this run's optimizer `state` (the template DCP fills, which torch gives every
    parameter) the parameters the saved run had no AdamW state for: trained ones that never got a
    gradient (Qwen-Image's last block feeds nothing from its text stream). They are named in the saved
    param groups and have no tensor in the files; AdamW starts their moments at their first gradient, as
    in the run that saved them. A parameter the saved run does not name stays, and is refused on load.
    Returns whether any was left out."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    groups = saved_values.get("optimizer", {}).get("param_groups", [])
    named = {n for g in groups if isinstance(g, dict) for n in g.get("params", []) if isinstance(n, str)}
    try:
        saved = HuggingFaceStorageReader(str(target)).read_metadata().state_dict_metadata
    except (OSError, ValueError, KeyError, RuntimeError):
        return False  # DCP's load names what is wrong with the files
    with_state = {key.removeprefix("optimizer.state.").rsplit(".", 1)[0] for key in saved}
    stateless = [n for n in state if n in named and n not in with_state]
    for name in stateless:
        del state[name]
    return bool(stateless)


def _merge(tensors: dict[str, Any], values: dict[str, Any]) -> None:
    """Put `_split`'s values back beside its tensors, in place."""
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(tensors.get(key), dict):
            _merge(tensors[key], value)
        else:
            tensors[key] = value
