"""User extensions by name: `package.module:attribute` specs and entry points.

Registries (rewards, advantage estimators, losses) resolve names they do not know through here, so
a user adds their own without forking.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from stages.errors import UserInputError


def load_object(spec: str, what: str) -> Any:
    """The object named by 'package.module:attribute' (attribute may be dotted); `what` names it in errors."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserInputError(f"{what} {spec!r}: a plugin is written 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserInputError(
            f"{what} {spec!r}: cannot import module {module_name!r} ({exc}); install it or add its directory to PYTHONPATH"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserInputError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
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
