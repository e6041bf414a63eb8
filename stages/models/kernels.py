"""Which attention kernel a diffusion transformer runs and whether it is compiled (--attention-backend,
--compile), and the one place a stage sets its trained transformers up: kernel, model parallelism
(`stages.parallelism`), compilation, in that order (diffusers checks the kernel when it applies
context parallelism, and compilation traces the spread modules).

Backends are diffusers' attention dispatch (`set_attention_backend`): native (torch SDPA, the default),
flash, sage, ... whichever this machine has installed; the `*_hub` ones, which download kernels, are
left out. Compilation is torch.compile, regional (each repeated block compiled once and reused,
diffusers' `compile_repeated_blocks`) where the model lists its `_repeated_blocks`, else whole.
Neither changes the numbers beyond rounding, except the quantized attention of the sage backends.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from stages.errors import UserInputError
from stages.parallelism import ModelParallel, parallelize

# backends whose attention is quantized (int8 / fp8): their numbers differ from native beyond rounding
QUANTIZED_PREFIXES = ("sage", "_sage")


def installed_backends() -> list[str]:
    """The attention backends diffusers can use here without downloading anything, sorted."""
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
    )

    usable = []
    for backend in AttentionBackendName:
        if backend.value.endswith("_hub"):
            continue
        try:
            _check_attention_backend_requirements(backend)
        except RuntimeError:
            continue
        usable.append(backend.value)
    return sorted(usable)


def active_backend(backend: str | None) -> str:
    """The backend a transformer runs under `--attention-backend backend`: that one, else diffusers'
    default, which DIFFUSERS_ATTN_BACKEND in the environment sets (native when unset)."""
    return backend if backend is not None else os.environ.get("DIFFUSERS_ATTN_BACKEND", "native")


def changes_numbers(backend: str | None) -> bool:
    """Whether `backend` computes other attention than native beyond rounding (a quantized one), so that
    it belongs to an output's identity."""
    return backend is not None and backend.startswith(QUANTIZED_PREFIXES)


@dataclass(frozen=True)
class Kernels:
    """The attention backend (None: diffusers' active one, native unless DIFFUSERS_ATTN_BACKEND says
    otherwise) and whether the trained transformer is compiled."""

    attention_backend: str | None = None
    compile: bool = False

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Kernels:
        """The settings among resolved command options (`--attention-backend`, `--compile`)."""
        return cls(**{f.name: options[f.name] for f in fields(cls) if options.get(f.name) is not None})

    def validate(self) -> None:
        """Refuse, listing the installed ones, a backend this machine does not have."""
        if self.attention_backend is None:
            return
        usable = installed_backends()
        if self.attention_backend not in usable:
            raise UserInputError(
                f"--attention-backend {self.attention_backend}: not installed here (or not a diffusers "
                f"backend); choose one of {', '.join(usable)}"
            )


def prepare(parts: Mapping[str, torch.nn.Module], parallel: ModelParallel, kernels: Kernels) -> None:
    """Set up a stage's trained transformers (`parts`: pipeline attribute → module, adapters on) in
    place: the attention backend, then model parallelism, then compilation."""
    kernels.validate()
    # diffusers also makes the backend its process-wide default (every transformer of this process then
    # runs it): a stage's process holds the pipelines of one model, all run with the same kernels
    if kernels.attention_backend is not None:
        for module in parts.values():
            module.set_attention_backend(kernels.attention_backend)
    parallelize(parts, parallel)
    if kernels.compile:
        for module in parts.values():
            if getattr(module, "_repeated_blocks", None):
                module.compile_repeated_blocks()
            else:
                module.compile()
