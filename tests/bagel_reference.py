"""ByteDance-Seed's BAGEL reference implementation, imported for tests only (the oracle of
tests/test_models_bagel.py), from a checkout named by ``OMNIRL_BAGEL_REFERENCE``
(``git clone https://github.com/ByteDance-Seed/Bagel`` at commit 056b5fd, the one compared); the
tests skip without it. Nothing of it is copied into the project.

It cannot run here unchanged, so while it imports:

- ``flash_attn`` (a CUDA-only kernel) is a module whose ``flash_attn_varlen_func`` is plain PyTorch
  attention with the same contract: packed [T, heads, dim] sequences cut by ``cu_seqlens``, grouped
  k/v heads, ``causal`` aligned to the bottom right (a query chunk after its cached keys), fp32.
- its navit modules cast q/k/v (and the generation expert's input) to bfloat16 in their inference
  path; their source is read with ``torch.bfloat16`` as ``torch.float32``, so both run in fp32.
- transformers 5 dropped the "default" RoPE initialiser its Qwen2 rotary embedding looks up; while
  the model is built, it is there as transformers 4 defined it (1/θ^(2i/d), attention scale 1).
- transformers 5's `ModelOutput` renames a ``past_key_values`` argument to ``cache``, which the
  reference's output dataclass lacks; its `BaseNavitOutputWithPast` is a plain dataclass of the same
  two fields.
- ``einops`` (its autoencoder only, not used) and ``transformers.modeling_attn_mask_utils`` (its
  SigLIP text model, gone in transformers 5, not used) are empty stand-ins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

ENV = "OMNIRL_BAGEL_REFERENCE"
CAST_IN_SOURCE = ("modeling.bagel.qwen2_navit", "modeling.bagel.siglip_navit")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
) -> torch.Tensor:
    """flash-attn's variable-length attention in plain PyTorch (see the module docstring)."""
    outputs = []
    for index in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[index] : cu_seqlens_q[index + 1]].transpose(0, 1)
        ks = k[cu_seqlens_k[index] : cu_seqlens_k[index + 1]].transpose(0, 1)
        vs = v[cu_seqlens_k[index] : cu_seqlens_k[index + 1]].transpose(0, 1)
        mask = None
        if causal:
            lq, lk = qs.shape[1], ks.shape[1]
            mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


class _Fp32Loader(importlib.machinery.SourceFileLoader):
    def source_to_code(self, data: Any, path: Any, *, _optimize: int = -1) -> Any:  # type: ignore[override]
        return super().source_to_code(bytes(data).replace(b"torch.bfloat16", b"torch.float32"), path)


class _Fp32Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in CAST_IN_SOURCE:
            return None
        file = self.root.joinpath(*fullname.split(".")).with_suffix(".py")
        return importlib.util.spec_from_file_location(fullname, file, loader=_Fp32Loader(fullname, str(file)))


@dataclasses.dataclass
class _NavitOutput:
    packed_query_sequence: torch.Tensor | None = None
    past_key_values: Any = None


def _stand_in(name: str, **attributes: Any) -> None:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    sys.modules[name] = module


def import_reference() -> types.ModuleType:
    """The reference's `modeling` package, fp32 and SDPA as above; skip the test without a checkout."""
    root = os.environ.get(ENV)
    if not root or not (Path(root) / "modeling" / "bagel" / "bagel.py").is_file():
        pytest.skip(f"BAGEL reference checkout not found: set {ENV} to a clone of ByteDance-Seed/Bagel")
    if "modeling.bagel" in sys.modules:
        return sys.modules["modeling"]
    _stand_in("flash_attn", flash_attn_varlen_func=flash_attn_varlen_func)
    _stand_in("einops", rearrange=None)
    try:
        importlib.import_module("transformers.modeling_attn_mask_utils")
    except ImportError:
        _stand_in("transformers.modeling_attn_mask_utils", _prepare_4d_attention_mask=None)
    sys.path.insert(0, root)
    sys.meta_path.insert(0, _Fp32Finder(Path(root)))
    modeling = importlib.import_module("modeling")
    modeling.bagel.qwen2_navit.BaseNavitOutputWithPast = _NavitOutput
    return modeling


def _default_rope_parameters(config: Any, device: Any = None, **_: Any) -> tuple[torch.Tensor, float]:
    dim = config.hidden_size // config.num_attention_heads
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim
    return 1.0 / (config.rope_theta**exponents), 1.0


@contextlib.contextmanager
def _default_rope() -> Iterator[None]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    added = "default" not in ROPE_INIT_FUNCTIONS
    ROPE_INIT_FUNCTIONS.setdefault("default", _default_rope_parameters)
    try:
        yield
    finally:
        if added:
            del ROPE_INIT_FUNCTIONS["default"]


def reference_model(folder: Path) -> Any:
    """The reference `Bagel` built from a BAGEL folder as its demo (app.py) builds it, fp32, eval."""
    from safetensors.torch import load_file

    import_reference()
    from modeling.bagel import (
        Bagel,
        BagelConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    llm_config = Qwen2Config.from_json_file(str(folder / "llm_config.json"))
    llm_config.qk_norm = True
    llm_config.tie_word_embeddings = False
    llm_config.layer_module = "Qwen2MoTDecoderLayer"
    llm_config.pad_token_id = getattr(llm_config, "pad_token_id", None)  # transformers 4's default
    vit_config = SiglipVisionConfig.from_json_file(str(folder / "vit_config.json"))
    vit_config.rope = False
    vit_config.num_hidden_layers -= 1
    weights = load_file(folder / "ema.safetensors")
    config = BagelConfig(
        visual_gen=True,
        visual_und=True,
        llm_config=llm_config,
        vit_config=vit_config,
        vae_config=types.SimpleNamespace(downsample=8, z_channels=16),
        vit_max_num_patch_per_side=int(weights["vit_pos_embed.pos_embed"].shape[0] ** 0.5),
        connector_act="gelu_pytorch_tanh",
        latent_patch_size=2,
        max_latent_size=int(weights["latent_pos_embed.pos_embed"].shape[0] ** 0.5),
    )
    with _default_rope():
        model = Bagel(Qwen2ForCausalLM(llm_config), SiglipVisionModel(vit_config), config)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    model.float()
    return model, weights
