"""What a bug report needs to know about the installation omnirl runs in: versions, extras, trackers, the
source checkout, devices, the accelerate config and the run-steering environment (`omnirl env`)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# Environment variables that steer a run: omnirl's own, Accelerate's (a launcher passes its settings
# this way), the Hugging Face cache and offline switches, torchrun's rank layout, device visibility.
ENV_PREFIXES = ("OMNIRL_", "ACCELERATE_", "HF_")
ENV_NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")


def _version(name: str) -> str | None:
    """The installed version of distribution `name`; None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _requirement_name(spec: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", spec).group(0)  # type: ignore[union-attr]


def packages() -> tuple[dict[str, str | None], dict[str, dict[str, Any]]]:
    """Installed versions of omnirl's dependencies, and per extra whether all its packages are present
    (both read from omnirl's own package metadata, so the lists follow pyproject.toml)."""
    try:
        requires = metadata.metadata("omnirl").get_all("Requires-Dist") or []
    except metadata.PackageNotFoundError:
        requires = []
    core: dict[str, str | None] = {}
    extras: dict[str, dict[str, str | None]] = {}
    for spec in requires:
        name = _requirement_name(spec)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", spec)
        (extras.setdefault(extra.group(1), {}) if extra else core)[name] = _version(name)
    return core, {
        extra: {"installed": all(v is not None for v in found.values()), "packages": found}
        for extra, found in extras.items()
    }


def trackers() -> dict[str, str | None]:
    """Each experiment tracker `--report-to` takes (`stages.tracking.KNOWN`): its package's version, or
    "installed" when it imports without package metadata, None when it cannot be used here."""
    from stages.tracking import KNOWN, PIP_PACKAGES, installed

    found: dict[str, str | None] = {}
    for name in KNOWN:
        usable = installed(name)
        found[name] = (_version(PIP_PACKAGES.get(name, name)) or "installed") if usable else None
    return found


def source() -> dict[str, Any]:
    """Where the running omnirl code lives and, for a git checkout (an editable install or PYTHONPATH),
    its commit and whether tracked files differ from it; commit None for an installed copy."""
    root = Path(__file__).resolve().parents[1]
    info: dict[str, Any] = {"path": str(root), "commit": None, "modified": None}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    if (root / ".git").exists() and (commit := git("rev-parse", "HEAD")):
        changes = git("status", "--porcelain", "--untracked-files=no")
        info.update(commit=commit, modified=None if changes is None else bool(changes))
    return info


def devices() -> dict[str, Any]:
    """The accelerator torch sees (type, count, names), CPU cores and torch's thread count."""
    import torch  # out-of-tree backends (torch_npu) register themselves through torch's backend autoload

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "accelerator": None,
        "count": 0,
        "names": [],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        count = torch.accelerator.device_count()
        module = torch.get_device_module(kind)
        names = (
            [module.get_device_name(i) for i in range(count)] if hasattr(module, "get_device_name") else []
        )
        info.update(accelerator=kind, count=count, names=names)
    return info


def accelerate_config() -> dict[str, Any]:
    """The config file `accelerate launch` reads without --config_file, and what it holds."""
    import yaml
    from accelerate.commands.config.config_args import default_config_file

    path = Path(default_config_file)
    config = None
    if path.is_file():
        try:
            config = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            config = f"unreadable: {type(exc).__name__}"
    return {"path": str(path), "exists": path.is_file(), "config": config}


def environment() -> dict[str, str]:
    """The run-steering environment variables that are set; values of secrets are redacted."""
    found = {
        name: value
        for name, value in os.environ.items()
        if name.startswith(ENV_PREFIXES) or name in ENV_NAMES or name.endswith("_VISIBLE_DEVICES")
    }
    return {
        name: "<redacted>" if any(word in name.upper() for word in SECRET_WORDS) else value
        for name, value in sorted(found.items())
    }


def describe_installation() -> dict[str, Any]:
    """Everything above as one JSON-ready dict (the keys `omnirl env --json` prints)."""
    core, extras = packages()
    return {
        "omnirl": _version("omnirl"),
        "source": source(),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "packages": core,
        "extras": extras,
        "trackers": trackers(),
        "devices": devices(),
        "accelerate_config": accelerate_config(),
        "environment": environment(),
    }
