"""Resolved configuration of a command: flags > --set > OMNIRL_* variables > YAML (--config) > defaults.

A YAML preset may serve several commands: top-level scalar keys apply to every command that has an
option of that name, and a mapping named after the command (`sample:`, `update:` ...) applies to that
command only, where every key must be one of its options; a top-level key that is neither an option of
some command nor a command's section is refused (a typo would otherwise run silently). The command line (flags, --set) beats the
environment, the environment beats the preset files. Values from YAML and --set are parsed and checked
as the flag would be (type, range, choice), and options a command requires are checked once all
sources are merged.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import typer
import yaml

from stages.errors import UserInputError
from stages.knobs import knobs

C = TypeVar("C")
# One preset layer as read, and how messages name it: (values, "--config PATH" or "--set").
Layer = tuple[dict[str, Any], str]


@dataclass(frozen=True)
class Presets:
    """The preset sections a command hands on to configs of other commands (`omnirl online`'s stage
    sections; `generate.config_command(shared=)`) come from: `layers`, the preset layers resolution
    read (the --config YAML first, then --set), and `sections`, the names every command's section has
    (dashes as underscores)."""

    layers: list[Layer]
    sections: frozenset[str]


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


def _check_top_level(
    ctx: typer.Context, preset: dict[str, Any], origin: str, shared: Collection[str]
) -> None:
    """Refuse a top-level key of a preset that nothing reads: neither an option of some omnirl command
    (its parameter or long flag name), nor one of the `shared` settings, nor a section named after a
    command. A typo (`stepps: 3`) would otherwise run silently with the default."""
    root = ctx.find_root().command
    commands = getattr(root, "commands", None)
    if commands is None:  # a command run on its own (no group): its own options and any section
        commands, sections = {ctx.command.name or "": ctx.command}, None
    else:
        sections = command_sections(ctx)
    known = {
        _key(name)
        for command in commands.values()
        for p in command.params
        for name in (p.name or "", *(opt[2:] for opt in p.opts if opt.startswith("--")))
    } - set(META_PARAMS) | {_key(name) for name in shared}
    for key, value in preset.items():
        k = _key(str(key))
        if k in known or (isinstance(value, dict) and (sections is None or k in sections)):
            continue
        what = "a command's section" if isinstance(value, dict) else "an option of any omnirl command"
        close = difflib.get_close_matches(k, sorted(known | (sections or set())), n=1)
        hint = f"did you mean '{close[0]}'?" if close else "check the spelling"
        raise UserInputError(f"{origin}: top-level key '{key}' is not {what}; {hint}")


def command_sections(ctx: typer.Context) -> frozenset[str]:
    """The names of the sections a preset may hold: the commands of the app `ctx` runs in (dashes as
    underscores); a command run on its own (no group) has its own only."""
    commands = getattr(ctx.find_root().command, "commands", None) or {ctx.command.name or "": None}
    return frozenset(_key(name) for name in commands)


def coerce(name: str, value: Any, default: Any, origin: str) -> Any:
    """`value` (from YAML or --set) as the type of the option's `default` (YAML reads 2e-3 as a
    string); one that does not convert is a usage error naming it."""
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


def choices_of(param: Any) -> tuple[str, ...] | None:
    """The names a choice option accepts (a `Literal` / Enum type), None for any other option."""
    desc = getattr(param, "type_descriptor", None)  # typer's own parameter types (typer 0.29)
    if desc is not None:
        return tuple(map(str, desc.choices)) if desc.is_choice and desc.choices else None
    return tuple(getattr(getattr(param, "type", None), "choices", None) or ()) or None  # click's Choice


def _check_choice(flag: str, value: Any, choices: tuple[str, ...], origin: str) -> Any:
    """`value` as one of `choices`; YAML 1.1 reads a bare no/yes/off/on as a bool, taken back here."""
    if isinstance(value, bool):
        spelled = [c for c in choices if c in (("yes", "on", "true") if value else ("no", "off", "false"))]
        value = spelled[0] if spelled else value
    if value is None or value in choices:
        return value
    raise UserInputError(f"{origin}: {flag} {value!r}: choose one of {', '.join(choices)}")


def _convert(ctx: typer.Context, param: Any, flag: str, value: Any, origin: str) -> Any:
    """A preset's value as the option's own type would parse the flag (a Path, a number in range, one
    of the names of a choice); a list or mapping is left as `coerce` made it, and one other value of a
    repeatable option is a list of one, as the flag given once."""
    if getattr(param, "multiple", False) and value is not None and not isinstance(value, (list, tuple, dict)):
        value = [value]
    choices = choices_of(param)
    if choices is not None:
        return _check_choice(flag, value, choices, origin)
    if value is None or isinstance(value, (list, tuple, dict)):
        return value
    try:
        return param.process_value(ctx, value)
    except typer.BadParameter as exc:
        reason = exc.format_message().split(": ", 1)[-1]
        raise UserInputError(f"{origin}: {flag} {value!r}: {reason}") from None


def resolve(
    ctx: typer.Context,
    command: str,
    required: tuple[str, ...] = (),
    shared: Collection[str] = (),
    given: dict[str, str] | None = None,
    read: list[Layer] | None = None,
) -> dict[str, Any]:
    """Merge defaults, the --config YAML, OMNIRL_* variables, --set overrides and flags for `command`.

    `required` names options without a default that some source must give (checked here, after the
    merge, rather than by typer, so a preset can supply them): a missing one is a `UserInputError`.
    `shared` names top-level --set keys the command hands on to another reader (omnirl online's stages),
    so they are not refused as unknown here. `given`, when passed, is filled with each option some
    source gave and how a message names it there: the flag as typed, the environment variable, or
    `KEY (from --config PATH)` / `KEY (from --set)` for the preset layer whose value was taken. `read`,
    when passed, is filled with the preset layers as read (the --config YAML, then --set), for a
    command that hands their `shared` settings on.
    """
    params = dict(ctx.params)
    source = {name: getattr(ctx.get_parameter_source(name), "name", "") for name in params}
    explicit = {name for name in params if source[name] == "COMMANDLINE"}
    from_env = {name for name in params if source[name] == "ENVIRONMENT"}
    if given is not None:
        given.update({name: _typed_flag(ctx, name) for name in explicit})
        given.update({name: _envvar(ctx, name) for name in from_env})
    defaults = {p.name: p.default for p in ctx.command.params if p.name}
    # YAML and --set may use an option's long flag name (format, group-size) as well as its parameter name.
    aliases = {
        _key(opt[2:]): p.name for p in ctx.command.params if p.name for opt in p.opts if opt.startswith("--")
    }
    resolved = {k: v for k, v in params.items() if k not in META_PARAMS}
    # how errors name each parameter: an option by its long flag, a positional argument by its metavar
    flags = {
        p.name: p.opts[0] if p.param_type_name == "option" else (p.metavar or p.name.upper())
        for p in ctx.command.params
        if p.name and p.opts
    }
    options = {p.name: p for p in ctx.command.params if p.name}
    envvars = {p.name: p.envvar for p in ctx.command.params if p.name and isinstance(p.envvar, str)}
    layers: list[tuple[dict[str, Any], str, set[str]]] = []  # (values, origin, options it may not replace)
    if params.get("config"):
        preset, origin = load_yaml(params["config"]), f"--config {params['config']}"
        _check_top_level(ctx, preset, origin, shared)
        layers.append((preset, origin, explicit | from_env))
    if params.get("set_"):
        sets = parse_set(list(params["set_"]))
        unknown = [
            k
            for k, v in sets.items()
            if aliases.get(k, k) not in params and k not in shared and not isinstance(v, dict)
        ]
        if unknown:
            raise UserInputError(f"--set {unknown[0]}=...: not an option of `omnirl {command}`")
        layers.append((sets, "--set", explicit))
    if read is not None:
        read.extend((values, origin) for values, origin, _ in layers)
    for layer, origin, kept in layers:
        for name, value in _layer(layer, command, params, aliases, origin).items():
            if name in kept or name in META_PARAMS:
                continue
            if given is not None:
                given[name] = f"{name} (from {origin})"
            value = coerce(name, value, defaults.get(name), origin)
            resolved[name] = _convert(ctx, options[name], flags.get(name, name), value, origin)
    for name in required:
        if resolved.get(name) in (None, [], ()):
            flag = flags.get(name, name)
            env = f", in {envvars[name]}" if name in envvars else ""
            raise UserInputError(
                f"{flag} is required: pass it as a flag{env}, or as `{_key(flag.lstrip('-'))}` in the "
                "--config YAML or --set"
            )
    for name, value in resolved.items():
        _check_finite(flags.get(name, name), value)
    _locate_weights(resolved, flags)
    return resolved


def resolve_config(
    ctx: typer.Context,
    command: str,
    configs: tuple[type[C], ...],
    choose: Callable[[dict[str, Any]], type[C]] | None = None,
    shared: Collection[str] = (),
    read: list[Layer] | None = None,
) -> C:
    """`resolve` for a command whose options are generated from dataclasses `configs`
    (`omnirl_cli.generate`): their knobs declared `required` are checked once every source is merged,
    and the result is one instance of the config `choose` picks from the resolved values (the only
    one without `choose`). A knob of another config given from any source (flag, OMNIRL_* variable,
    preset, --set) is a `UserInputError` naming it and the chosen config's `KIND`, rather than unused.
    `shared` and `read` are `resolve`'s: the settings a command hands on, and the preset layers read."""
    declared = {field.name: spec for config in configs for field, spec in knobs(config)}
    given: dict[str, str] = {}
    required = tuple(n for n, spec in declared.items() if spec.required)
    resolved = resolve(ctx, command, required=required, shared=shared, given=given, read=read)
    # typer gives () for a repeatable option that no source set: it keeps the field's default instead
    defaults = {f.name: f.default for config in configs for f, _ in knobs(config)}
    resolved.update({n: None for n, v in resolved.items() if v == () and defaults.get(n, ()) is None})
    chosen = choose(resolved) if choose else configs[0]
    own = [field.name for field, _ in knobs(chosen)]
    foreign = [name for name in declared if name not in own and name in given]
    if foreign:
        raise UserInputError(f"{given[foreign[0]]}: {chosen.KIND} and never reads it; drop it")  # type: ignore[attr-defined]
    return chosen(**{name: resolved[name] for name in own})


def _typed_flag(ctx: typer.Context, name: str) -> str:
    """The flag of option `name` as the command line gave it (`--no-FLAG` for a two-way flag turned off)."""
    param = next(p for p in ctx.command.params if p.name == name)
    off = ctx.params[name] is False and param.secondary_opts
    return param.secondary_opts[0] if off else param.opts[0]


def _envvar(ctx: typer.Context, name: str) -> str:
    """The environment variable that gave option `name`."""
    param = next(p for p in ctx.command.params if p.name == name)
    return str(param.envvar)


def _locate_weights(resolved: dict[str, Any], flags: dict[str, str]) -> None:
    """Replace each weights option (--model, --adapter, taken as the string typed) with the folder it
    names: a path that exists, else the snapshot folder the local Hugging Face cache holds for the Hub id
    it spells, so every stage loads and hashes a folder; a missing path is refused
    (`stages.models.hub.locate`)."""
    from stages.models.hub import locate
    from stages.outputs import CONTENT_OPTIONS

    for name in CONTENT_OPTIONS:
        if resolved.get(name) is not None:
            resolved[name] = locate(resolved[name], flags.get(name, f"--{name}"))


def _check_finite(flag: str, value: Any) -> None:
    """NaN and ±inf are never meaningful option values (and cannot be recorded in a manifest's JSON)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):
            raise UserInputError(f"{flag} {v}: must be a finite number")
