"""`export`'s settings as one typed config (`omnirl export`); torch-free, so --help stays fast."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages.knobs import DTYPES, WEIGHTS_FROM, WEIGHTS_METAVAR, knob


@dataclass(frozen=True)
class ExportConfig:
    """Every setting of `omnirl export`: which adapter, onto which base, into which folder and dtype."""

    adapter: str | None = knob(
        None,
        "The adapter folder `omnirl update` (or `online`) wrote: a LoRA, merged into the base weights, or full "
        f"weights, put into the base's folder layout; also a diffusers or PEFT LoRA folder with --model. "
        f"Where: {WEIGHTS_FROM}.",
        argument=True,
        metavar="ADAPTER",
    )
    out: Path | None = knob(
        None,
        "The folder to write: a diffusers pipeline folder (every component, the trained one merged) or a "
        "transformers model folder with its processor. It must not exist: an export never replaces a folder.",
        short="-o",
        required=True,
    )
    model: str | None = knob(
        None,
        "The base model the adapter was trained from. Default: the one its omnirl_adapter.json records "
        "(`base_model`, or its Hub id and revision in the local cache); a --model other than a recorded base "
        f"that exists is refused; needed for a LoRA folder another tool wrote. Where: {WEIGHTS_FROM}.",
        short="-m",
        metavar=WEIGHTS_METAVAR,
    )
    dtype: str = knob(
        "fp32",
        "Dtype of every exported weight. The merge itself runs in fp32 whatever this says (W + scale·B·A, "
        "then one cast), so bf16 / fp16 round the merged weights once.",
        choices=DTYPES,
    )
