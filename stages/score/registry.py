"""Reward registry: scorers looked up by name, by `module:attribute`, or by entry point.

A scorer is a callable ``scorer(images, prompts, meta) -> list[float | None]``:

- ``images[i]`` is the decoded output of sample i (a ``PIL.Image.Image`` for image rollouts; text and
  VLM scorers receive whatever their stage decodes, possibly ``None``, and read ``meta[i]``);
- ``prompts[i]`` is its text condition, ``meta[i]`` its task metadata dict (``prompt_meta``);
- it returns one value per sample, ``None`` meaning "could not score this sample". The caller
  (`stages.score.scoring.score_batch`) reports ``None``; it never silently becomes 0.

Scorers are called once per batch, so a model-backed scorer loads its model lazily on first call and
keeps it (see `stages.score.ocr`). Built-in scorers live in the modules listed in `_BUILTIN_MODULES`,
imported on the first lookup; a new family of rewards (text, VLM, remote) adds its module there and
decorates its scorers with `register_reward`.

Users add scorers without forking, in two ways:

- ``--reward mypkg.rewards:my_scorer`` imports ``mypkg.rewards`` and takes ``my_scorer``;
- an installed package declares an entry point in group ``omnirl.rewards`` (``name = "pkg.mod:attr"``).

A plugin attribute that is a class is instantiated once with no arguments (so it can hold a model).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stages.errors import UserInputError
from stages.plugins import entry_point_names, is_file_spec, load_entry_point, load_object

Scorer = Callable[[Sequence[Any], Sequence[str], Sequence[dict]], Sequence[float | None]]
_F = TypeVar("_F")

ENTRY_POINT_GROUP = "omnirl.rewards"
_BUILTIN_MODULES = ("stages.score.image_rewards", "stages.score.ocr", "stages.score.text_rewards")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")

REWARD_KINDS = ("image", "text")

_REGISTRY: dict[str, Scorer] = {}
_KINDS: dict[str, str] = {}
_PLUGINS: dict[str, Scorer] = {}
_lock = threading.RLock()
_builtins_loaded = False


def register_reward(name: str, *, kind: str = "image") -> Callable[[_F], _F]:
    """Decorator registering a scorer under `name` (letters, digits, `_`, `-`).

    `kind` says what the scorer's first argument holds: ``"image"`` (decoded samples) or ``"text"``
    (response strings, see `stages.score.text_rewards`); `reward_kind` reports it.
    Registering a different object under a taken name is a programming error (ValueError), so two
    modules cannot silently shadow each other; re-registering the same object is a no-op.
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"reward name {name!r} must use only letters, digits, '_' and '-'")
    if kind not in REWARD_KINDS:
        raise ValueError(f"reward {name!r}: kind {kind!r} must be one of {', '.join(REWARD_KINDS)}")

    def decorator(fn: _F) -> _F:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"reward {name!r} is already registered by {existing!r}")
        _REGISTRY[name] = fn  # type: ignore[assignment]
        _KINDS[name] = kind
        return fn

    return decorator


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    with _lock:
        if not _builtins_loaded:
            for module in _BUILTIN_MODULES:
                importlib.import_module(module)
            _builtins_loaded = True


def _instantiate(obj: Any, source: str) -> Scorer:
    """A class becomes one instance; anything else must already be callable."""
    if isinstance(obj, type):
        try:
            obj = obj()
        except TypeError as exc:
            raise UserInputError(
                f"reward {source!r}: class {obj.__name__} must be constructible with no arguments ({exc})"
            ) from exc
    if not callable(obj):
        raise UserInputError(
            f"reward {source!r} is a {type(obj).__name__}, not a callable scorer(images, prompts, meta)"
        )
    return obj


def get_reward(name: str) -> Scorer:
    """Return the scorer for `name`: a registered name, a `module:attribute` plugin, or an entry point.

    Plugins are loaded (and classes instantiated) once per process and cached.
    """
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    with _lock:
        if name in _PLUGINS:
            return _PLUGINS[name]
        if ":" in name:
            scorer = _instantiate(load_object(name, "reward"), name)
        else:
            obj = load_entry_point(ENTRY_POINT_GROUP, name, "reward")
            if obj is None:
                raise UserInputError(
                    f"unknown reward {name!r}; available: {', '.join(available_rewards())} "
                    "(or a plugin: 'package.module:function' or 'path/to/file.py:function')"
                )
            scorer = _instantiate(obj, f"{name} (entry point)")
        _PLUGINS[name] = scorer
        return scorer


def reward_kind(name: str) -> str:
    """``"image"`` or ``"text"``: the kind a registered reward was declared with; for a plugin, its
    ``reward_kind`` attribute (set by the `text_rewards` adapters), ``"image"`` when it has none."""
    scorer = get_reward(name)
    registered = _KINDS.get(name) if name in _REGISTRY else None
    kind = registered or getattr(scorer, "reward_kind", "image")
    if kind not in REWARD_KINDS:
        raise UserInputError(
            f"reward {name!r} declares reward_kind {kind!r}; set it to one of {', '.join(REWARD_KINDS)}"
        )
    return kind


def available_rewards() -> list[str]:
    """Names of the built-in, registered and entry-point rewards, sorted."""
    _load_builtins()
    return sorted(set(_REGISTRY) | set(entry_point_names(ENTRY_POINT_GROUP)))


def reward_column(name: str) -> str:
    """The shard-set column of reward `name`: ``reward.<name>``, a file plugin named by its file name
    (``reward.task.py:fn`` for ``path/to/task.py:fn``), since column names cannot hold '/'."""
    source, sep, attr = name.rpartition(":")
    if sep and is_file_spec(source):
        name = f"{Path(source).name}:{attr}"
    return f"reward.{name}"


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """Parse one `--reward` value: ``NAME`` (weight 1) or ``NAME=WEIGHT``.

    NAME may be a plugin ``package.module:attribute``; the weight follows the last ``=``.
    Zero and negative weights are allowed (a zero-weight reward is computed and logged, not trained on).
    """
    text = spec.strip()
    name, sep, weight_text = text.rpartition("=")
    if not sep:
        name, weight_text = text, ""
    name = name.strip()
    if not name:
        raise UserInputError(
            f"--reward {spec!r}: missing reward name; write NAME or NAME=WEIGHT, e.g. ocr=1.0"
        )
    if not sep:
        return name, 1.0
    try:
        weight = float(weight_text)
    except ValueError:
        raise UserInputError(
            f"--reward {spec!r}: weight {weight_text.strip()!r} is not a number; write NAME=WEIGHT, e.g. {name}=0.5"
        ) from None
    if not math.isfinite(weight):
        raise UserInputError(
            f"--reward {spec!r}: weight must be a finite number, got {weight_text.strip()!r}"
        )
    return name, weight
