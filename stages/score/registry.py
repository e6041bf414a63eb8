"""Reward registry: scorers looked up by name, by `module:attribute`, or by entry point.

A scorer is a callable ``scorer(images, prompts, meta) -> list[float | None]``:

- ``images[i]`` is the decoded output of sample i: a ``PIL.Image.Image`` for image rollouts; for video
  rollouts the list of its frames (``list[PIL.Image.Image]``, RGB, in order); text and VLM scorers
  receive whatever their stage decodes, possibly ``None``, and read ``meta[i]``;
- ``prompts[i]`` is its text condition, ``meta[i]`` its task metadata dict (``prompt_meta``);
- it returns one value per sample, ``None`` meaning "could not score this sample". The caller
  (`stages.score.scoring.score_batch`) reports ``None``; it never silently becomes 0. A value is a
  real number (int, float, a NumPy scalar, a 0-d array or tensor): a string such as ``"0.25"`` or a
  bool is refused, not converted (`score_value`).

Scorers are called once per batch, so a model-backed scorer loads its model lazily on first call and
keeps it (see `stages.score.ocr`). Built-in scorers live in the modules listed in `_BUILTIN_MODULES`,
imported on the first lookup; a new family of rewards (text, VLM, remote) adds its module there and
decorates its scorers with `register_reward`.

Reward arguments. A registered (or plugin) *class* is a configurable reward: ``get_reward(name, args)``
instantiates ``cls(**args)`` once per process for each distinct ``args`` (``--reward-arg
NAME.KEY=VALUE``, or a preset's ``score: reward_args: {NAME: {KEY: VALUE}}``, parsed by
`parse_reward_args`). The valid keys are the constructor's keyword parameters; a string value is
converted to the type of the parameter's default (int, float, bool). A function takes no arguments.

Users add scorers without forking, in two ways:

- ``--reward mypkg.rewards:my_scorer`` imports ``mypkg.rewards`` and takes ``my_scorer``;
- an installed package declares an entry point in group ``omnirl.rewards`` (``name = "pkg.mod:attr"``).

``--reward remote:http://host:port/NAME`` is a reward computed by a server (`omnirl serve-reward`, or
another protocol): `stages.score.remote.RemoteReward`, configured by reward arguments like a class.

A plugin attribute that is a class is instantiated like a registered class (so it can hold a model).

Reward kinds. A scorer declares what it scores (``register_reward(kind=...)``, or a plugin's
``reward_kind`` attribute): ``"image"`` (the default), ``"text"`` or ``"video"`` (frame lists). The
rollout's modality must match (`stages.score.stage`).

Frame aggregation. ``NAME@frames=AGG`` turns image reward NAME into a video reward: NAME scores the
frames of every video and AGG reduces them to one value per video: ``mean``, ``min`` (over all frames),
``first`` or ``last`` (only that frame is scored). A frame NAME could not score makes the video's value
``None``. The weight follows as usual: ``--reward pickscore@frames=mean=0.5``; NAME's reward arguments
apply (``--reward-arg pickscore.model=...``); its column is ``reward.pickscore@frames=mean``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import json
import logging
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stages.errors import UserInputError
from stages.plugins import entry_point_names, is_file_spec, load_entry_point, load_object
from stages.score import REMOTE_PREFIX

logger = logging.getLogger(__name__)

Scorer = Callable[[Sequence[Any], Sequence[str], Sequence[dict]], Sequence[float | None]]
RewardArgs = Mapping[str, Mapping[str, Any]]
_F = TypeVar("_F")

ENTRY_POINT_GROUP = "omnirl.rewards"
_BUILTIN_MODULES = (
    "stages.score.image_rewards",
    "stages.score.ocr",
    "stages.score.text_rewards",
    "stages.score.clip_rewards",
    "stages.score.hps",
    "stages.score.imagereward",
    "stages.score.geneval_shapes",
    "stages.score.vlm_judge",
    "stages.score.geneval_detect",
    "stages.score.edit_rewards",
)
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")

REWARD_KINDS = ("image", "text", "video")
FRAME_AGGREGATIONS = ("mean", "min", "first", "last")
# `NAME@KEY=VALUE` spec modifiers: the values each key takes
MODIFIERS: dict[str, tuple[str, ...]] = {"frames": FRAME_AGGREGATIONS}
_SPEC_RE = re.compile(r"(?P<name>.*?)(?P<mods>(?:@[A-Za-z_]+=[A-Za-z0-9_.\-]*)*)(?:=(?P<weight>[^=]*))?")
_MODIFIER_RE = re.compile(r"@([A-Za-z_]+)=([A-Za-z0-9_.\-]*)")

_REGISTRY: dict[str, Any] = {}  # name -> scorer function, or a scorer class configured by reward args
_KINDS: dict[str, str] = {}
_PLUGINS: dict[tuple[str, str], Scorer] = {}  # (name, args as JSON) -> loaded plugin or class instance
_lock = threading.RLock()
_builtins_loaded = False


def register_reward(name: str, *, kind: str = "image") -> Callable[[_F], _F]:
    """Decorator registering a scorer under `name` (letters, digits, `_`, `-`).

    `kind` says what the scorer's first argument holds: ``"image"`` (decoded samples), ``"video"``
    (one list of frames per sample) or ``"text"`` (response strings, see `stages.score.text_rewards`);
    `reward_kind` reports it.
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


def _parameters(cls: type) -> dict[str, inspect.Parameter] | None:
    """The keyword parameters of `cls`'s constructor (None: it takes any keyword, ``**kwargs``)."""
    params = list(inspect.signature(cls).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p for p in params if p.kind in kinds}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _convert(source: str, key: str, value: Any, default: Any) -> Any:
    """A string `value` as the type of the parameter's `default` (bool, int, float); others unchanged."""
    kind = type(default)
    if not isinstance(value, str) or kind not in (bool, int, float):
        return value
    text = value.strip().lower()
    if kind is bool and text in _TRUE + _FALSE:
        return text in _TRUE
    if kind is not bool:
        with contextlib.suppress(ValueError):
            return kind(text)
    raise UserInputError(
        f"reward {source!r}: argument {key}={value!r} is not of type {kind.__name__}; "
        f"pass --reward-arg {source}.{key}=<{kind.__name__}>"
    )


def resolve_reward_args(obj: Any, source: str, args: Mapping[str, Any] | None) -> dict[str, Any]:
    """`args` checked against what `obj` (a scorer function or class) accepts, strings converted.

    An unknown key, or any key for a function, is a `UserInputError` naming the reward and the valid keys.
    """
    args = dict(args or {})
    if not isinstance(obj, type):
        if args:
            raise UserInputError(
                f"reward {source!r} takes no arguments (got {', '.join(sorted(args))}); "
                f"remove --reward-arg {source}.{sorted(args)[0]}"
            )
        return args
    params = _parameters(obj)
    if params is None:
        return args
    unknown = sorted(set(args) - set(params))
    if unknown:
        valid = ", ".join(sorted(params)) or "none"
        raise UserInputError(f"reward {source!r} has no argument {unknown[0]!r}; valid arguments: {valid}")
    empty = inspect.Parameter.empty
    return {
        key: _convert(source, key, value, None if params[key].default is empty else params[key].default)
        for key, value in sorted(args.items())
    }


def _instantiate(obj: Any, source: str, kwargs: Mapping[str, Any]) -> Scorer:
    """A class becomes one instance configured with `kwargs` (already checked by `resolve_reward_args`);
    anything else must already be callable."""
    if isinstance(obj, type):
        try:
            obj = obj(**kwargs)
        except TypeError as exc:
            detail = f"arguments {dict(kwargs)}" if kwargs else "no arguments"
            raise UserInputError(
                f"reward {source!r}: class {obj.__name__} cannot be constructed with {detail} ({exc})"
            ) from exc
    if not callable(obj):
        raise UserInputError(
            f"reward {source!r} is a {type(obj).__name__}, not a callable scorer(images, prompts, meta)"
        )
    return obj


def _args_key(args: Mapping[str, Any] | None) -> str:
    return json.dumps(dict(args or {}), sort_keys=True, default=str)


def _lookup(name: str) -> tuple[Any, str]:
    """The object `name` refers to (a registered scorer or class, a plugin attribute, an entry point)
    and the source to name in errors."""
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name], name
    if name.startswith(REMOTE_PREFIX):
        from stages.score.remote import remote_reward_class

        return remote_reward_class(name[len(REMOTE_PREFIX) :]), name
    if ":" in name:
        return load_object(name, "reward"), name
    obj = load_entry_point(ENTRY_POINT_GROUP, name, "reward")
    if obj is None:
        raise UserInputError(
            f"unknown reward {name!r}; available: {', '.join(available_rewards())} "
            "(or a plugin: 'package.module:function' or 'path/to/file.py:function', or a server: "
            "'remote:http://host:port/NAME')"
        )
    return obj, f"{name} (entry point)"


def _modifiers(spec: str, mods: str) -> dict[str, str]:
    """The ``@KEY=VALUE`` modifiers of `--reward` value `spec`, checked against `MODIFIERS`."""
    found = _MODIFIER_RE.findall(mods)
    for key, value in found:
        if key not in MODIFIERS:
            raise UserInputError(
                f"--reward {spec!r}: unknown modifier @{key}=; use @frames={'|'.join(FRAME_AGGREGATIONS)}"
            )
        if value not in MODIFIERS[key]:
            raise UserInputError(
                f"--reward {spec!r}: @{key}={value} is not one of {', '.join(MODIFIERS[key])}; e.g. @{key}=mean"
            )
    if len(found) > len(dict(found)):
        raise UserInputError(f"--reward {spec!r}: give each @KEY= modifier once")
    return dict(found)


def split_reward_name(name: str) -> tuple[str, dict[str, str]]:
    """A reward name without its trailing ``@KEY=VALUE`` modifiers, and the (checked) modifiers:
    ``"pickscore@frames=mean"`` → ``("pickscore", {"frames": "mean"})``."""
    match = _SPEC_RE.fullmatch(name)
    mods = match.group("mods") if match and match.group("weight") is None else ""
    return name[: len(name) - len(mods)], _modifiers(name, mods)


def frame_indices(count: int, how: str) -> list[int]:
    """The frames of a `count`-frame video that aggregation `how` scores: all, or the first / last."""
    if how == "first":
        return [0] if count else []
    if how == "last":
        return [count - 1] if count else []
    return list(range(count))


def score_value(value: Any) -> float | None:
    """One sample's value from a scorer as a float, or None (it could not score the sample).

    A real number is a score: int, float, a NumPy scalar, a 0-d array or tensor (not a bool one). Anything
    else, a string such as "0.25", a bool or a list, raises TypeError: it is a scorer's mistake, which
    a conversion would hide (True would become a reward of 1).
    """
    if value is None:
        return None
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # np.float32, a 0-d tensor/array
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{value!r} (a {type(value).__name__}) is not a number")


class FrameAggregate:
    """Image reward `scorer` applied to the frames of each video (one call for the whole batch),
    reduced per video by `how` (`FRAME_AGGREGATIONS`): the scorer of ``NAME@frames=HOW``."""

    reward_kind = "video"

    def __init__(self, scorer: Scorer, how: str) -> None:
        self.scorer = scorer
        self.how = how

    @property
    def weight_paths(self) -> Any:
        """The wrapped reward's model files (part of a run's identity), if it declares them."""
        return getattr(self.scorer, "weight_paths", None)

    def __call__(
        self, videos: Sequence[Sequence[Any]], prompts: Sequence[str], meta: Sequence[dict]
    ) -> list[float | None]:
        picks = [frame_indices(len(frames), self.how) for frames in videos]
        owners = [b for b, frames in enumerate(picks) for _ in frames]
        flat = [videos[b][i] for b, frames in enumerate(picks) for i in frames]
        values = (
            list(self.scorer(flat, [prompts[b] for b in owners], [meta[b] for b in owners])) if flat else []
        )
        if len(values) != len(flat):
            raise ValueError(f"the image reward returned {len(values)} scores for {len(flat)} frames")
        out: list[float | None] = []
        start = 0
        for frames in picks:
            part = values[start : start + len(frames)]
            start += len(frames)
            try:
                scores = [score_value(v) for v in part]
            except TypeError as exc:
                raise UserInputError(f"a frame's score: {exc}; scores must be numbers or None") from None
            finite = [v for v in scores if v is not None and math.isfinite(v)]
            if not part or len(finite) < len(part):
                out.append(None)
            else:
                out.append(min(finite) if self.how == "min" else math.fsum(finite) / len(finite))
        return out


def get_reward(name: str, args: Mapping[str, Any] | None = None) -> Scorer:
    """Return the scorer for `name`: a registered name, a `module:attribute` plugin, or an entry point,
    configured with the reward arguments `args` (a class only; see the module docstring); with an
    ``@frames=AGG`` modifier, that image reward aggregated over each video's frames (`FrameAggregate`).

    Classes and plugins are loaded (and instantiated) once per process per distinct converted `args`
    and cached, so a model-backed scorer loads its model once however its arguments were spelt.
    """
    _load_builtins()
    base, mods = split_reward_name(name)
    if mods:
        reward_kind(name)  # an @frames reward must wrap an image reward
        key = (name, _args_key(args))
        with _lock:
            if key not in _PLUGINS:
                _PLUGINS[key] = FrameAggregate(get_reward(base, args), mods["frames"])
            return _PLUGINS[key]
    registered = _REGISTRY.get(name)
    if registered is not None and not isinstance(registered, type):
        resolve_reward_args(registered, name, args)
        return registered
    given = (name, _args_key(args))
    with _lock:
        if given not in _PLUGINS:
            obj, source = _lookup(name)
            kwargs = resolve_reward_args(obj, name, args)
            key = (name, _args_key(kwargs))
            if key not in _PLUGINS:
                _PLUGINS[key] = _instantiate(obj, source, kwargs)
            _PLUGINS[given] = _PLUGINS[key]
        return _PLUGINS[given]


def reward_kind(name: str) -> str:
    """``"image"``, ``"video"`` or ``"text"``: the kind a registered reward was declared with; for a plugin, its
    ``reward_kind`` attribute (set by the `text_rewards` adapters), ``"image"`` when it has none.

    An ``@frames=AGG`` name is a video reward over an image reward.
    Nothing is instantiated: a configurable reward's kind is known before its arguments are checked."""
    _load_builtins()
    base, mods = split_reward_name(name)
    if mods:
        kind = reward_kind(base)
        if kind != "image":
            raise UserInputError(
                f"reward {name!r}: @frames= aggregates an image reward over video frames, but {base!r} scores {kind}s"
            )
        return "video"
    if name in _REGISTRY:
        kind = _KINDS[name]
    else:
        obj, _ = _lookup(name)
        kind = getattr(obj, "reward_kind", "image")
    if kind not in REWARD_KINDS:
        raise UserInputError(
            f"reward {name!r} declares reward_kind {kind!r}; set it to one of {', '.join(REWARD_KINDS)}"
        )
    return kind


def check_reward_args(names: Sequence[str], reward_args: RewardArgs | None) -> dict[str, dict[str, Any]]:
    """Build every scorer of `names` with its arguments now (constructors check them; models still load
    lazily), so a bad argument stops a run before any work. Returns the arguments with strings
    converted, for the rewards of `names` that have any: the form recorded in a run's identity.

    Arguments for a reward that is not scored are dropped with a warning (a preset may configure more
    rewards than a run's ``--reward`` picks). The arguments of NAME also configure ``NAME@frames=AGG``
    (returned under that name too).
    """
    reward_args = dict(reward_args or {})
    bases = {name: split_reward_name(name)[0] for name in names}
    for extra in sorted(set(reward_args) - set(bases.values())):
        logger.warning("--reward-arg %s.*: %r is not a --reward of this run; ignored", extra, extra)
    resolved: dict[str, dict[str, Any]] = {}
    for name, base in bases.items():
        obj, _ = _lookup(base)
        args = resolve_reward_args(obj, base, reward_args.get(base))
        get_reward(name, args)
        if args:
            resolved[name] = args
    return resolved


def reward_files(name: str, args: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """The local files and folders whose content determines reward `name`'s numbers under `args`, by
    argument name (their digests join a run's identity): the scorer's ``weight_paths`` when it declares
    them, else every argument whose value names an existing path."""
    scorer = get_reward(name, args)
    declared = getattr(scorer, "weight_paths", None)
    if declared is not None:
        return {key: Path(path) for key, path in declared.items()}
    return {
        key: Path(value)
        for key, value in (args or {}).items()
        if isinstance(value, str) and value and Path(value).exists()
    }


def available_rewards() -> list[str]:
    """Names of the built-in, registered and entry-point rewards, sorted."""
    _load_builtins()
    return sorted(set(_REGISTRY) | set(entry_point_names(ENTRY_POINT_GROUP)))


def reward_column(name: str) -> str:
    """The shard-set column of reward `name`: ``reward.<name>``, a file plugin named by its file name
    (``reward.task.py:fn`` for ``path/to/task.py:fn``), a remote reward by its URL without scheme and
    '/' (``reward.remote:127.0.0.1:18090:ocr``), since column names cannot hold '/'."""
    if name.startswith(REMOTE_PREFIX):
        from stages.score.remote import remote_column

        return f"reward.{remote_column(name[len(REMOTE_PREFIX) :])}"
    source, sep, attr = name.rpartition(":")
    if sep and is_file_spec(source):
        name = f"{Path(source).name}:{attr}"
    return f"reward.{name}"


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """Parse one `--reward` value: ``NAME[@frames=AGG][=WEIGHT]`` (weight 1 when absent).

    NAME may be a plugin ``package.module:attribute``; ``@frames=AGG`` (mean, min, first, last) applies
    image reward NAME to video frames (module docstring); the weight follows the last ``=``. The name
    returned keeps the modifier (``pickscore@frames=mean``). Zero and negative weights are allowed (a
    zero-weight reward is computed and logged, not trained on).
    """
    text = spec.strip()
    match = _SPEC_RE.fullmatch(text)
    mods, weight_text = (match.group("mods"), match.group("weight")) if match else ("", None)
    name = (match.group("name") if match else text).strip()
    sep = weight_text is not None
    weight_text = weight_text or ""
    if not name:
        raise UserInputError(
            f"--reward {spec!r}: missing reward name; write NAME or NAME=WEIGHT, e.g. ocr=1.0"
        )
    _modifiers(spec, mods)
    name += mods
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


def parse_reward_args(value: Any) -> dict[str, dict[str, Any]]:
    """Reward arguments from ``--reward-arg NAME.KEY=VALUE`` items (a list of strings) or a preset's
    ``reward_args: {NAME: {KEY: VALUE}}`` mapping, as ``{NAME: {KEY: VALUE}}``.

    NAME may be a plugin (``pkg.mod:Class``): KEY is what follows the last ``.`` before ``=``. VALUE
    stays a string here; `resolve_reward_args` converts it to the parameter's type. A key given twice
    keeps the last value.
    """
    if value is None:
        return {}
    if isinstance(value, Mapping):
        out: dict[str, dict[str, Any]] = {}
        for name, section in value.items():
            if not isinstance(section, Mapping):
                raise UserInputError(
                    f"reward_args.{name}: must be a mapping of argument names to values, e.g. "
                    f"reward_args: {{{name}: {{model: /models/x}}}}"
                )
            out[str(name)] = {str(k): v for k, v in section.items()}
        return out
    items = [value] if isinstance(value, str) else list(value)
    out = {}
    for item in items:
        spec, sep, text = str(item).partition("=")
        name, dot, key = spec.strip().rpartition(".")
        if not sep or not dot or not name or not key.isidentifier():
            raise UserInputError(
                f"--reward-arg {item!r}: expected NAME.KEY=VALUE, e.g. pickscore.model=/models/PickScore_v1"
            )
        out.setdefault(name, {})[key] = text.strip()
    return out
