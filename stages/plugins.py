"""User extensions by name: `package.module:attribute` or `path/to/file.py:attribute` specs, and entry points.

Registries (rewards, advantage estimators, losses) resolve names they do not know through here, so
a user adds their own without forking. A spec whose left part ends in ``.py`` or holds a path
separator names a Python file (verl's ``custom_reward_function.path``, EasyR1's
``reward_function: path.py:fn``): relative to the current directory or absolute, executed once per
process as its own module.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import re
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from stages.errors import UserInputError

SPEC_FORMS = "'package.module:attribute' or 'path/to/file.py:attribute'"
FILE_MODULE_PREFIX = "omnirl_plugin_file_"

_file_modules: dict[Path, ModuleType] = {}
_file_lock = threading.RLock()  # re-entrant: a plugin file may load another one while it runs


def is_file_spec(source: str) -> bool:
    """True when the part of a spec before ':' names a file rather than a module."""
    return source.endswith(".py") or "/" in source or "\\" in source


def spec_file(spec: str) -> Path | None:
    """The Python file a 'path/to/file.py:attribute' spec names (its source is part of a run's
    identity), or None for a module or entry-point name, or a spec holding a URL (`remote:http://...`)."""
    if "://" in spec:
        return None
    source = spec.rpartition(":")[0]
    return Path(source) if source and is_file_spec(source) else None


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def load_file_module(path: str | Path, spec: str, what: str) -> ModuleType:
    """The module executed from the Python file `path` (once per process per resolved path).

    It runs under a unique name in `sys.modules` (so dataclasses and pickling inside it work);
    `spec` and `what` name it in errors.
    """
    file = Path(path).resolve()
    with _file_lock:
        if file in _file_modules:
            return _file_modules[file]
        if not file.is_file():
            raise UserInputError(
                f"{what} {spec!r}: no such file {file}; give a path relative to the current directory or absolute"
            )
        stem = re.sub(r"\W", "_", file.stem)
        name = f"{FILE_MODULE_PREFIX}{stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:12]}"
        module_spec = importlib.util.spec_from_file_location(name, file)
        if module_spec is None or module_spec.loader is None:
            raise UserInputError(f"{what} {spec!r}: {file} is not a Python source file; use a .py file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise UserInputError(f"{what} {spec!r}: {file} failed to load ({_one_line(exc)})") from exc
        _file_modules[file] = module
        return module


def load_object(spec: str, what: str) -> Any:
    """The object named by 'package.module:attribute' or 'path/to/file.py:attribute' (attribute may
    be dotted); `what` names it in errors."""
    source, _, attr = spec.rpartition(":")
    if not source or not all(part.isidentifier() for part in attr.split(".")):
        raise UserInputError(f"{what} {spec!r}: a plugin is written {SPEC_FORMS}")
    if is_file_spec(source):
        obj: Any = load_file_module(source, spec, what)
        owner = f"file {source!r}"
    else:
        try:
            obj = importlib.import_module(source)
        except ImportError as exc:
            raise UserInputError(
                f"{what} {spec!r}: cannot import module {source!r} ({exc}); install it or add its directory to PYTHONPATH"
            ) from exc
        owner = f"module {source!r}"
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserInputError(f"{what} {spec!r}: {owner} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def entry_point_names(group: str) -> list[str]:
    return sorted(ep.name for ep in importlib.metadata.entry_points(group=group))


def load_entry_point(group: str, name: str, what: str) -> Any | None:
    """The object behind entry point `name` of `group`, or None when there is none."""
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name == name:
            try:
                return ep.load()
            except ImportError as exc:
                raise UserInputError(
                    f"{what} {name!r}: entry point {ep.value!r} failed to import ({exc})"
                ) from exc
    return None
