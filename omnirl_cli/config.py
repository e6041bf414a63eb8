"""Resolved configuration of a command: flags > --set > YAML (--config) > defaults.

A YAML preset may serve several commands: top-level scalar keys apply to every command that has an
option of that name, and a mapping named after the command (`sample:`, `update:` ...) applies to that
command only, where every key must be one of its options.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import typer
import yaml

from stages.errors import UserInputError

# Parameters that steer config resolution itself and never appear in the resolved config.
META_PARAMS = ("config", "set_", "json_")


def _key(name: str) -> str:
    return name.replace("-", "_")


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML preset; an unreadable or non-mapping file is a usage error naming it."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise UserInputError(f"--config {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise UserInputError(
            f"--config {path}: not valid YAML ({exc.__class__.__name__}); fix the file"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserInputError(f"--config {path}: the top level must be a mapping of option names to values")
    return data


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set a.b=c` items into a nested dict; values are parsed as YAML scalars/lists."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserInputError(f"--set {item!r}: expected key=value, e.g. --set steps=10")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = out
        parts = [_key(p) for p in key.strip().split(".")]
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserInputError(f"--set {item!r}: {part} is set both as a value and as a section")
        node[parts[-1]] = value
    return out


def _layer(
    source: dict[str, Any], command: str, params: dict[str, Any], aliases: dict[str, str], origin: str
) -> dict[str, Any]:
    picked: dict[str, Any] = {}
    for key, value in source.items():
        k = aliases.get(_key(key), _key(key))
        if isinstance(value, dict) and k not in params:
            continue
        if k in params:
            picked[k] = value
    section = source.get(command) or source.get(command.replace("-", "_"))
    if isinstance(section, dict):
        for key, value in section.items():
            k = aliases.get(_key(key), _key(key))
            if k not in params:
                known = ", ".join(sorted(p for p in params if p not in META_PARAMS))
                raise UserInputError(
                    f"{origin}: '{command}.{key}' is not an option of `omnirl {command}` (known: {known})"
                )
            picked[k] = value
    return picked


def _coerce(name: str, value: Any, default: Any, origin: str) -> Any:
    if default is None or value is None:
        return value
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                return value.lower() in ("1", "true", "yes", "on")
            return bool(value)
        if isinstance(default, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, (list, tuple)) and not isinstance(value, (list, tuple)):
            return [value]
        if isinstance(default, Path):
            return Path(value)
    except (TypeError, ValueError):
        raise UserInputError(f"{origin}: {name}={value!r} is not a valid {type(default).__name__}") from None
    return value


def resolve(ctx: typer.Context, command: str) -> dict[str, Any]:
    """Merge defaults, the --config YAML, --set overrides and explicit flags for `command`."""
    params = dict(ctx.params)
    explicit = {
        name
        for name in params
        if getattr(ctx.get_parameter_source(name), "name", "") in ("COMMANDLINE", "ENVIRONMENT")
    }
    defaults = {p.name: p.default for p in ctx.command.params if p.name}
    # YAML and --set may use an option's long flag name (format, group-size) as well as its parameter name.
    aliases = {
        _key(opt[2:]): p.name for p in ctx.command.params if p.name for opt in p.opts if opt.startswith("--")
    }
    resolved = {k: v for k, v in params.items() if k not in META_PARAMS}
    layers: list[tuple[dict[str, Any], str]] = []
    if params.get("config"):
        layers.append((load_yaml(params["config"]), f"--config {params['config']}"))
    if params.get("set_"):
        sets = parse_set(list(params["set_"]))
        unknown = [k for k, v in sets.items() if aliases.get(k, k) not in params and not isinstance(v, dict)]
        if unknown:
            raise UserInputError(f"--set {unknown[0]}=...: not an option of `omnirl {command}`")
        layers.append((sets, "--set"))
    for source, origin in layers:
        for name, value in _layer(source, command, params, aliases, origin).items():
            if name in explicit or name in META_PARAMS:
                continue
            resolved[name] = _coerce(name, value, defaults.get(name), origin)
    flags = {p.name: p.opts[0] for p in ctx.command.params if p.name and p.opts}
    for name, value in resolved.items():
        _check_finite(flags.get(name, name), value)
    _locate_weights(resolved, flags)
    return resolved


def _locate_weights(resolved: dict[str, Any], flags: dict[str, str]) -> None:
    """Replace each weights option (--model, --adapter) that spells a Hub id with the snapshot folder the
    local Hugging Face cache holds for it, so every stage loads and hashes a folder; a path that exists
    wins (`stages.models.hub.locate`)."""
    from stages.models.hub import locate

    from .runtime import CONTENT_OPTIONS

    for name in CONTENT_OPTIONS:
        value = resolved.get(name)
        if value is not None and not Path(value).expanduser().exists():
            resolved[name] = locate(value, flags.get(name, f"--{name}"))


def _check_finite(flag: str, value: Any) -> None:
    """NaN and ±inf are never meaningful option values (and cannot be recorded in a manifest's JSON)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):
            raise UserInputError(f"{flag} {v}: must be a finite number")
