"""Rollout engines: where a diffusion rollout batch is computed, looked up by name.

An engine turns one batch of planned samples (prompts, per-sample seeds, prompt groups) into the
trajectory columns of `stages.sample.rollout.rollout_batch`: `final_latent`, `image` and, for a
stochastic sampler, the stored window's `latents`, `log_probs`, `timesteps` and `sigmas`. Every
engine runs the same family adapter and `samplers.step`, so a sample does not depend on the engine.

Built in:

- ``diffusers``: the pipeline in this process, on this process's device (the default);
- ``remote``: an `omnirl serve` rollout server over HTTP (`stages.sample.remote_engine`), which owns
  its device; its samples equal the in-process ones bit for bit on the same device and threads;
- ``vllm-omni``: vLLM-Omni (`stages.sample.vllm_omni_engine`): its images API over HTTP (images only,
  no trajectory), or in process with omnirl's custom pipeline (RL mode, the same trajectories).

A package adds an engine with `register_engine` or an entry point in group ``omnirl.engines``
(``name = "pkg.module:EngineClass"``); ``module:Class`` names one directly.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from stages.errors import UserInputError
from stages.plugins import entry_point_names, load_entry_point, load_object
from stages.sample.config import DEFAULT_ENGINE
from stages.sample.config import ENGINE_ENTRY_POINTS as ENTRY_POINT_GROUP

if TYPE_CHECKING:
    from stages.models.conditioning import Entries, Key
    from stages.models.families import Resolution
    from stages.models.kernels import Kernels
    from stages.parallelism import ModelParallel
    from stages.sample.config import SampleConfig

# the modules registering the built-in engines besides diffusers (`stages.sample.config.DIFFUSION_ENGINES`)
_BUILTIN_MODULES = ("stages.sample.remote_engine", "stages.sample.vllm_omni_engine")
TRAJECTORY_ABSENT = "absent"  # `describe()["trajectory"]` of an engine that returns media only
_ENGINES: dict[str, type[RolloutEngine]] = {}
_E = TypeVar("_E", bound="type[RolloutEngine]")


@dataclass
class EngineOptions:
    """How to open an engine: the weights it samples with and, for a server, how to reach it.

    Derived from the resolved command options (`from_options`); the transport knobs never change a
    sample, only whether and how soon it arrives.
    """

    model: Path
    adapter: Path | None = None
    dtype: str = "fp32"
    server_url: str | None = None
    served_model: str | None = None  # the model name a vLLM-Omni server serves (its /v1/models)
    token_env: str | None = None  # the environment variable holding the server's bearer token
    startup_timeout: float = 120.0  # seconds to wait for the server's /health before giving up (exit 2)
    request_timeout: float = 600.0  # seconds to wait for one reply
    retries: int = 8  # further tries of a request after a connection error, 502, 503 or 504
    vae_tiling: bool = False  # decode in spatial tiles (`FlowPolicy.vae_memory`; the diffusers engine)
    vae_slicing: bool = False  # decode one sample at a time
    defer_decode: bool = False  # no VAE decode: final latents only, decoded by `score` (the diffusers engine)
    # The run pushes its own weights to the engine (`push_weights`; `online`): a server's adapter is not
    # checked against --adapter, and each sample records the weights version the engine used.
    pushed_weights: bool = False
    # the name the run's pushed weights go under on a shared server (several trainers on one server)
    weights_name: str | None = None
    OPTION_NAMES: ClassVar[dict[str, str]] = {
        "server_token_env": "token_env",
        "server_startup_timeout": "startup_timeout",
        "server_timeout": "request_timeout",
        "server_retries": "retries",
    }

    def token(self) -> str | None:
        """The server's bearer token, from the environment variable --server-token-env names."""
        from stages.web import env_token

        return env_token(self.token_env, f"--server-token-env {self.token_env}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> EngineOptions:
        """The options of resolved command options (`OPTION_NAMES` maps the differently named ones)."""
        names = {f.name for f in fields(cls)}
        values = {cls.OPTION_NAMES.get(k, k): v for k, v in options.items()}
        return cls(**{k: v for k, v in values.items() if k in names})


class RolloutEngine(ABC):
    """A place where diffusion rollouts run; `open` it, `rollout` batches, then `close` it."""

    name: ClassVar[str]
    takes_pushed_weights: ClassVar[bool] = False  # `push_weights` and `pin_weights` work (`online`)
    # `conditioning` gives the prompt conditioning of every batch rolled out (`online`'s trainer then
    # loads no text encoder)
    returns_conditioning: bool = False
    # `rollout` takes `images=`: each prompt's condition images (an editing model's source images)
    takes_condition_images: ClassVar[bool] = False
    family: str  # the model family it samples (`FamilyAdapter.name`), recorded in the manifest

    @classmethod
    @abstractmethod
    def open(cls, options: EngineOptions, device: Any) -> RolloutEngine:
        """The engine for `options`; `device` is this process's device (an engine may use its own)."""

    @classmethod
    def same_samples(cls, options: EngineOptions) -> bool:
        """Whether this engine, opened with `options`, draws the diffusers engine's samples (the same
        family adapter and `samplers.step`): then where a rollout runs is no part of its identity, and a
        run resumes on any such engine. An engine that samples otherwise returns False."""
        return True

    @abstractmethod
    def rollout(
        self,
        cfg: Any,
        prompts: list[str],
        negatives: list[str],
        seeds: list[int],
        init_seeds: list[int],
        *,
        groups: Sequence[Hashable],
        sample_ids: Sequence[str],
    ) -> dict[str, Any]:
        """One batch of B samples under `SampleConfig` `cfg`: the columns of `rollout_batch`. An engine that
        `takes_condition_images` also takes `images=`: per sample its prompt's condition images (encoded
        files), given only when some prompt has any."""

    @abstractmethod
    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        """The stored latent of one sample of `resolution` (a side or (height, width)) and `frames` frames."""

    def describe(self) -> dict[str, Any]:
        """What the manifest records about the engine (`extra["engine"]`)."""
        return {"name": self.name}

    def conditioning(self, keys: list[Key]) -> Entries | None:
        """The prompt conditioning the engine's rollouts used for `keys` (`stages.models.conditioning`),
        for `sample` to store once; None for an engine that cannot return it (the later stages then
        encode the prompts themselves)."""
        return None

    def push_weights(self, lora: bytes, version: int) -> dict[str, Any]:
        """Make the engine sample with a LoRA (the bytes of a diffusers LoRA file,
        `stages.models.lora_weights`) as weights `version`, for an engine that holds its own copy of the
        weights (a server); opened with `EngineOptions.pushed_weights`, its rollouts then return each
        sample's `policy_version`."""
        raise UserInputError(f"--engine {self.name}: it does not take pushed weights")

    def pin_weights(self, version: int | None) -> None:
        """Sample the following batches with pushed weights `version` only (None: whatever the engine
        holds), so one iteration of `online` never mixes versions; for an engine that takes pushes."""
        raise UserInputError(f"--engine {self.name}: it does not take pushed weights")

    def close(self) -> None:  # noqa: B027  (most engines hold nothing to release)
        """Release what the engine holds (connections, models)."""


def register_engine(name: str) -> Callable[[_E], _E]:
    """Class decorator registering an engine under `name` (a taken name is a programming error)."""

    def decorator(cls: _E) -> _E:
        existing = _ENGINES.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"engine {name!r} is already registered by {existing!r}")
        cls.name = name
        _ENGINES[name] = cls
        return cls

    return decorator


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def engine_names() -> list[str]:
    """Registered and entry-point engine names."""
    _load_builtins()
    return sorted(set(_ENGINES) | set(entry_point_names(ENTRY_POINT_GROUP)))


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine `name`: registered, an ``omnirl.engines`` entry point, or ``module:Class``."""
    _load_builtins()
    if name in _ENGINES:
        return _ENGINES[name]
    obj = (
        load_object(name, "--engine")
        if ":" in name
        else load_entry_point(ENTRY_POINT_GROUP, name, "--engine")
    )
    if obj is None:
        raise UserInputError(
            f"--engine {name}: not a diffusion rollout engine; choose one of {', '.join(engine_names())} "
            "(or a plugin 'package.module:Class')"
        )
    if not (isinstance(obj, type) and issubclass(obj, RolloutEngine)):
        raise UserInputError(f"--engine {name}: {obj!r} is not a RolloutEngine subclass")
    return obj


def check_engine_options(
    c: SampleConfig, engine_type: type[RolloutEngine], parallel: ModelParallel, kernels: Kernels
) -> None:
    """Refuse what only the in-process engine (`DiffusersEngine`) does for an engine that runs its model
    elsewhere: --vae-tiling / --vae-slicing, --defer-decode, model `parallel`ism (`ModelParallel`) and
    `kernels` (`Kernels`); a VAE option beside --defer-decode (no decode here); kernels this torch cannot
    run (`Kernels.validate`)."""
    from stages.models.kernels import Kernels

    vae_options = [name for name in ("vae_tiling", "vae_slicing") if getattr(c, name)]
    local = issubclass(engine_type, DiffusersEngine)
    if vae_options and not local:
        raise UserInputError(
            f"--{vae_options[0].replace('_', '-')}: --engine {engine_type.name} decodes elsewhere; drop it "
            "(a server's VAE is set where it runs)"
        )
    if c.defer_decode and not local:
        raise UserInputError(f"--defer-decode: --engine {engine_type.name} returns decoded media; drop it")
    if c.defer_decode and vae_options:
        option = f"--{vae_options[0].replace('_', '-')}"
        raise UserInputError(f"{option}: --defer-decode runs no decode here; pass {option} to `omnirl score`")
    if (parallel.degree > 1 or kernels != Kernels()) and not local:
        raise UserInputError(
            f"--sp-degree / --tp-degree / --attention-backend / --compile: --engine {engine_type.name} runs "
            "its model elsewhere; drop it"
        )
    kernels.validate()


def open_engine(name: str, options: EngineOptions, device: Any) -> RolloutEngine:
    """Open the engine `name` (see `engine_class`)."""
    return engine_class(name).open(options, device)


@register_engine(DEFAULT_ENGINE)
class DiffusersEngine(RolloutEngine):
    """The diffusers pipeline in this process (`FlowPolicy`), on the given device."""

    takes_condition_images = True

    def __init__(self, policy: Any, *, decode: bool = True):
        from stages.models.folders import TEXT_PREFIXES

        self.policy = policy
        self.family = policy.family.name
        self.decode = decode  # False: rollouts return no media (`EngineOptions.defer_decode`)
        # not when an adapter put LoRA layers on a text encoder: the stored conditioning would then
        # depend on that adapter, not on --model alone
        self.returns_conditioning = not any(
            name.startswith(TEXT_PREFIXES) for name in policy.untrained_loras()
        )

    @classmethod
    def open(cls, options: EngineOptions, device: Any) -> DiffusersEngine:
        from stages.models.diffusion import FlowPolicy

        policy = FlowPolicy.load(options.model, adapter=options.adapter, device=device, dtype=options.dtype)
        policy.vae_memory(tiling=options.vae_tiling, slicing=options.vae_slicing)
        return cls(policy, decode=not options.defer_decode)

    def rollout(
        self,
        cfg: Any,
        prompts: list[str],
        negatives: list[str],
        seeds: list[int],
        init_seeds: list[int],
        *,
        groups: Sequence[Hashable],
        sample_ids: Sequence[str],
        on_step: Callable[[int], None] | None = None,
        images: list[list[bytes]] | None = None,
    ) -> dict[str, Any]:
        """`rollout_batch` on this engine's policy; `on_step(i)` before each denoising step may stop it."""
        from stages.sample.rollout import rollout_batch

        return rollout_batch(
            self.policy,
            cfg,
            prompts,
            negatives,
            seeds,
            init_seeds,
            groups=groups,
            sample_ids=sample_ids,
            decode=self.decode,
            on_step=on_step,
            images=images,
        )

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        return self.policy.latent_shape(resolution, frames)

    def conditioning(self, keys: list[Key]) -> Entries | None:
        """The policy's cached conditioning of `keys`; None when it `returns_conditioning` not."""
        return self.policy.conditioning(keys) if self.returns_conditioning else None

    def describe(self) -> dict[str, Any]:
        """The engine and its device type (not the index: under a launcher each rank has its own, and
        the shard set is the same bytes as one process's)."""
        return {"name": self.name, "device": self.policy.device.type}


def check_replayable(manifests: Sequence[Any], option: str = "--in") -> None:
    """Refuse a rollout whose manifest records no trajectory (vLLM-Omni images mode): nothing to replay."""
    for manifest in manifests:
        engine = (getattr(manifest, "extra", None) or {}).get("engine") or {}
        if engine.get("trajectory") == TRAJECTORY_ABSENT:
            raise UserInputError(
                f"{option}: sampled by {engine.get('name')} in {engine.get('mode')} mode, which returns images "
                "only (no trajectory to replay); train it with nft, awm or dpo after `omnirl encode`, or "
                "sample with --engine remote / vllm-omni RL mode"
            )
