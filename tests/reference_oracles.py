"""The reference implementations of HPSv2 and ImageReward, imported for tests only (the oracles of
tests/test_reference_rewards.py).

They live outside the project's environment, in `ORACLE_DIR` (`make install` puts them there from
tests/reference-oracles.txt with ``pip --target --no-deps``), and join ``sys.path`` only while a test imports them, because:

- open_clip, hpsv2 and ImageReward import torchvision, and the torchvision wheel available for torch
  2.13 here (0.28.0, a CUDA build) cannot load its C++ operators on a CPU-only torch. Its
  ``_meta_registrations`` then fails at import with "operator torchvision::nms does not exist", and as
  transformers imports torchvision whenever it is installed, having it in the environment would break
  every transformers import of the project. `_tolerate_missing_torchvision_ops` wraps
  ``torch.library.register_fake`` so that the decorator it returns skips an operator that does not
  exist (a RuntimeError) instead of raising, while torchvision imports: it then imports, its
  pure-Python transforms (all the oracles use) work, and only its compiled operators (nms, roi_align,
  ...) stay missing. transformers' own torchvision check is settled (False) before, so the rest of the
  test process sees the project's environment.
- image-reward 1.5 pins timm 0.6.13 while open_clip needs timm ≥ 1.0.17, and hpsv2 1.2.0 pins
  pytest 7.2 and protobuf < 4: neither resolves beside the project's pins, hence ``--no-deps``.
- the packages' ``__init__`` modules import what the oracles do not need and cannot run here (hpsv2's
  tokenizer reads a vocabulary its wheel lacks, ImageReward's imports OpenAI's ``clip`` package):
  `_bare_package` registers those packages without running their ``__init__`` so that the submodules
  holding the model, transform and tokenizer import on their own.
- ImageReward's BLIP text encoder (``med.py``) is written against transformers 4: it imports three
  helpers transformers 5 moved or removed, and its model calls ``init_weights`` without ``post_init`` and
  ``get_head_mask``/``invert_attention_mask`` in its forward. `_transformers_4_helpers` and
  `_med_on_transformers_5` supply them (as transformers 4 defined them) without changing the numbers.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ORACLE_DIR = Path(__file__).resolve().parents[1] / ".venv" / "reference-oracles"


@contextlib.contextmanager
def _tolerate_missing_torchvision_ops() -> Iterator[None]:
    """While torchvision imports: a `register_fake` whose decorator skips an operator that does not exist."""
    register_fake = torch.library.register_fake

    def tolerant(*args: Any, **kwargs: Any) -> Any:
        decorate = register_fake(*args, **kwargs)

        def apply(fn: Any) -> Any:
            try:
                return decorate(fn)
            except RuntimeError:  # "operator torchvision::... does not exist": no compiled kernels
                return fn

        return apply

    torch.library.register_fake = tolerant
    try:
        yield
    finally:
        torch.library.register_fake = register_fake


def _bare_package(name: str) -> None:
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(ORACLE_DIR.joinpath(*name.split(".")))]
        sys.modules[name] = package


def _transformers_4_helpers() -> None:
    import transformers.modeling_utils as modeling_utils
    import transformers.pytorch_utils as pytorch_utils

    modeling_utils.apply_chunking_to_forward = pytorch_utils.apply_chunking_to_forward
    modeling_utils.prune_linear_layer = pytorch_utils.prune_linear_layer
    if not hasattr(modeling_utils, "find_pruneable_heads_and_indices"):  # only head pruning calls it

        def find_pruneable_heads_and_indices(*args: Any) -> Any:
            raise NotImplementedError("head pruning is not part of the oracle")

        modeling_utils.find_pruneable_heads_and_indices = find_pruneable_heads_and_indices


def _med_on_transformers_5(med: types.ModuleType) -> None:
    model = med.BertPreTrainedModel

    def get_head_mask(self: Any, head_mask: Any, layers: int) -> list[None]:
        assert head_mask is None, "head masks are not part of the oracle"
        return [None] * layers

    def invert_attention_mask(self: Any, mask: torch.Tensor) -> torch.Tensor:
        extended = (mask[:, None, :, :] if mask.dim() == 3 else mask[:, None, None, :]).to(self.dtype)
        return (1.0 - extended) * torch.finfo(self.dtype).min

    model.all_tied_weights_keys = {}  # what transformers 5's post_init sets before init_weights ties weights
    model.get_head_mask = get_head_mask
    model.invert_attention_mask = invert_attention_mask


def oracle_modules(*names: str) -> list[types.ModuleType]:
    """The reference modules `names` (e.g. ``open_clip``, ``hpsv2.src.open_clip.transform``), or a
    pytest skip when `ORACLE_DIR` has not been installed."""
    if not ORACLE_DIR.is_dir():
        pytest.skip(f"reference implementations not installed in {ORACLE_DIR}: run make install")
    from transformers.utils import import_utils

    # Settle transformers' (cached) torchvision check before torchvision becomes importable, so that the
    # rest of the process keeps the project's environment: no torchvision-backed image processors.
    import_utils.is_torchvision_available()
    for package in ("hpsv2", "hpsv2.src", "hpsv2.src.open_clip", "ImageReward", "ImageReward.models"):
        _bare_package(package)
    _transformers_4_helpers()
    # On sys.path only while importing: worker processes the project spawns copy the parent's sys.path,
    # and torchvision must stay invisible to them. (Appended: fairscale ships a `benchmarks` package.)
    sys.path.append(str(ORACLE_DIR))
    try:
        with _tolerate_missing_torchvision_ops():
            import torchvision  # noqa: F401
        modules = [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(ORACLE_DIR))
    med = sys.modules.get("ImageReward.models.BLIP.med")
    if med is not None:
        _med_on_transformers_5(med)
    return modules
