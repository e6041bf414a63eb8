"""Plumbing shared by the stage commands: device, input shard sets, output writers, policy versions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.errors import UserInputError

from .console import progress


def quiet_libraries() -> None:
    """Silence library loading bars and advisory warnings (omnirl draws its own progress); no imports."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def device() -> Any:
    """The device Accelerate picks for this process (CUDA, NPU or CPU); never hard-coded."""
    from accelerate import PartialState

    return PartialState().device


def policy_version(adapter: Path | None) -> int:
    """The optimizer step of the adapter that samples (0 for the base model)."""
    if adapter is None:
        return 0
    from stages.models.diffusion import read_adapter_config

    return int(read_adapter_config(adapter).get("step", 0))


def policy_info(model: Path, adapter: Path | None) -> dict[str, Any]:
    return {
        "model": str(model),
        "adapter": str(adapter) if adapter else None,
        "version": policy_version(adapter),
    }


def open_inputs(paths: list[Path] | None) -> Any:
    """Zip the --in shard sets of one rollout row by row."""
    if not paths:
        raise UserInputError("--in: at least one input shard set is required")
    from stages.shards.reader import open_inputs as open_zipped

    return open_zipped(paths)


def map_shards(
    src: Any, writer: Any, label: str, columns: list[str], fn: Callable[..., dict[str, Any]], *, bar: bool
) -> None:
    """Write fn(input shard, advance) as output shard i for every input shard i not already done.

    Shards finished by an earlier (crashed) run are skipped, so every per-shard stage resumes.
    """
    with progress(bar) as display:
        task = display.add_task(label, total=src.num_rows, rate="")
        for s in range(src.num_shards):
            if writer.shard_done(s):
                display.advance(task, src.manifests[0].shards[s].rows)
                continue
            writer.write_shard(s, fn(src.read_shard(s, columns=columns), lambda n: display.advance(task, n)))


def check_format(fmt: str) -> str:
    if fmt not in ("parquet", "webdataset"):
        raise UserInputError(f"--format {fmt}: choose parquet or webdataset")
    return fmt


def run_config(resolved: dict[str, Any], adapter: Path | None = None) -> dict[str, Any]:
    """The config recorded (and hashed) for an output: resolved options plus the adapter's identity.

    Input shard sets enter the output's fingerprint through their manifest hashes (the writer's
    lineage); the adapter's hash is added here so a re-run under changed weights is not mistaken for
    a finished one.
    """
    import hashlib

    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return str(v) if isinstance(v, Path) else v

    config = {k: plain(v) for k, v in resolved.items() if k not in ("json_", "overwrite")}
    if adapter is not None:
        from stages.models.diffusion import ADAPTER_CONFIG

        config["adapter_sha256"] = hashlib.sha256((Path(adapter) / ADAPTER_CONFIG).read_bytes()).hexdigest()
    return config
