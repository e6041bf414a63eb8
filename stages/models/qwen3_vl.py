"""Random-weight Qwen3-VL folders, dense (`qwen3_vl`) and mixture-of-experts (`qwen3_vl_moe`), shaped
like the published checkpoints but tiny.

What is kept, because rollout and training code depends on it: the 16-px patches with 2x2 spatial
merge and temporal patch 2 (an image of h x w pixels, both multiples of 32, becomes h*w/1024
`<|image_pad|>` tokens), learned vision position embeddings, deepstack features of chosen vision blocks
added to the first text layers, interleaved M-RoPE over (temporal, height, width), video frames
separated by their timestamps (`<0.5 seconds>`, each temporal patch its own vision span), the Qwen2
byte-level tokenizer layout with the ChatML and vision special tokens, ChatML without a default system
turn. The MoE variant replaces every text MLP by top-k routed experts (fused expert tensors, no shared
expert, `router_aux_loss_coef`), the rest unchanged. What shrinks: widths, depths, experts (4, top-2),
the vocabulary (`stages.models.tokenizers.build_qwen2_tokenizer`) and the image pixel budget (64x64 to
128x128 pixels, i.e. 4 to 16 image tokens).

The processor is `Qwen3VLImageTextProcessor`: transformers' `Qwen3VLProcessor` with the frames video
processor of `stages.models.qwen2_5_vl` (transformers builds its own only with torchvision); the
policy code (`stages.models.vlm`) is the one Qwen2.5-VL uses.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoProcessor,
    GenerationConfig,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stages.models.factory import choose_size, finish_model_dir, no_progress_bars, parameter_count, seeded
from stages.models.qwen2_5_vl import FramesVideoProcessing, QwenVLFramesVideoProcessor, chat_template
from stages.models.tokenizers import build_qwen2_tokenizer

FAMILY = "qwen3_vl"
MOE_FAMILY = "qwen3_vl_moe"  # also its config.json model_type
PATCH_SIZE = 16
SPATIAL_MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
ROPE_THETA = 5_000_000.0
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)  # Qwen3-VL normalises pixels to [-1, 1]
CHAT_TEMPLATE = chat_template(None)


class Qwen3VLImageTextProcessor(FramesVideoProcessing, Qwen3VLProcessor):
    """`Qwen3VLProcessor` with `QwenVLFramesVideoProcessor` as its video processor: same prompt
    expansion (video frames behind their timestamps), pixel values, grids and `mm_token_type_ids`, but
    it builds and loads without torchvision."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        video_processor: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=chat_template,
            **kwargs,
        )


# Keyed by a name, so real checkpoints keep resolving to transformers' own processor.
AutoProcessor.register("omnirl-qwen3_vl-image-text", Qwen3VLImageTextProcessor, exist_ok=True)


@dataclass(frozen=True)
class Qwen3VLSize:
    """Widths and depths of one size; `mrope_section` splits half the text head_dim over (t, h, w)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mrope_section: tuple[int, int, int]
    max_positions: int
    vision_hidden: int
    vision_intermediate: int
    vision_depth: int
    vision_heads: int
    vision_positions: int
    deepstack_layers: tuple[int, ...]
    min_pixels: int
    max_pixels: int
    vocab: int | None = None  # published sizes: the real vocabulary (None: the local tokenizer's length)
    tie_embeddings: bool = True
    # MoE sizes: experts per layer, routed per token, and each expert's width (0 experts: dense)
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0


SIZES: dict[str, Qwen3VLSize] = {
    # head_dim 16 -> 8 rotary pairs = 4+2+2 (the real 24:20:20 is t-heavy too); 64²..128² px -> 4..16
    # image tokens; deepstack from both vision blocks into the first two text layers.
    "tiny": Qwen3VLSize(
        hidden=64,
        intermediate=128,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        mrope_section=(4, 2, 2),
        max_positions=4096,
        vision_hidden=32,
        vision_intermediate=64,
        vision_depth=2,
        vision_heads=2,
        vision_positions=64,
        deepstack_layers=(0, 1),
        min_pixels=64 * 64,
        max_pixels=128 * 128,
    ),
    # Qwen/Qwen3-VL-8B-Instruct (config.json): 36 text layers of 4096 (GQA 32/8), the 27-block vision
    # tower of 1152 with deepstack at blocks 8, 16, 24; lm_head untied.
    "8b": Qwen3VLSize(
        hidden=4096,
        intermediate=12288,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        mrope_section=(24, 20, 20),
        max_positions=262144,
        vision_hidden=1152,
        vision_intermediate=4304,
        vision_depth=27,
        vision_heads=16,
        vision_positions=2304,
        deepstack_layers=(8, 16, 24),
        min_pixels=64 * 64,
        max_pixels=32 * 32 * 16384,
        vocab=151936,
        tie_embeddings=False,
    ),
}
SIZES["full"] = SIZES["8b"]
# The MoE variant: 4 experts of 32, top-2, in every text layer of the tiny shape.
MOE_SIZES: dict[str, Qwen3VLSize] = {
    "tiny": Qwen3VLSize(
        **{**asdict(SIZES["tiny"]), "experts": 4, "experts_per_token": 2, "moe_intermediate": 32}
    )
}


def load_model(model_dir: str | Path, dtype: torch.dtype) -> Qwen3VLForConditionalGeneration:
    """A Qwen3-VL folder's model, dense or MoE by its config's model_type (local files only)."""
    moe = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") == MOE_FAMILY
    cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    return cls.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)


def load_processor(model_dir: str | Path) -> Qwen3VLProcessor:
    """The processor of a Qwen3-VL folder, built here or published (`AutoProcessor`, local files only)."""
    return AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)


def _config(spec: Qwen3VLSize, tokenizer: Any) -> Qwen3VLConfig:
    """Model config (MoE when `spec` has experts) whose special-token ids are the tokenizer's and whose
    vocabulary is exactly its length."""
    names = (
        "<|endoftext|>",
        "<|im_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<|vision_start|>",
        "<|vision_end|>",
    )
    ids = dict(zip(names, tokenizer.convert_tokens_to_ids(list(names))))
    experts = (
        {
            "num_experts": spec.experts,
            "num_experts_per_tok": spec.experts_per_token,
            "moe_intermediate_size": spec.moe_intermediate,
            "decoder_sparse_step": 1,
        }
        if spec.experts
        else {}
    )
    return (Qwen3VLMoeConfig if spec.experts else Qwen3VLConfig)(
        text_config={
            **experts,
            "vocab_size": spec.vocab or len(tokenizer),
            "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "head_dim": spec.head_dim,
            "max_position_embeddings": spec.max_positions,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": ROPE_THETA,
                "mrope_section": list(spec.mrope_section),
                "mrope_interleaved": True,
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": spec.tie_embeddings,
        },
        vision_config={
            "depth": spec.vision_depth,
            "hidden_size": spec.vision_hidden,
            "intermediate_size": spec.vision_intermediate,
            "num_heads": spec.vision_heads,
            "out_hidden_size": spec.hidden,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": SPATIAL_MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "num_position_embeddings": spec.vision_positions,
            "deepstack_visual_indexes": list(spec.deepstack_layers),
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec.tie_embeddings,
    )


def make_qwen3_vl(
    size: str, seed: int, tokenizer: Any = None, *, moe: bool = False
) -> Qwen3VLForConditionalGeneration:
    """The `Qwen3VLForConditionalGeneration` (`moe`: `Qwen3VLMoeForConditionalGeneration`) of `size` with
    seeded random weights and its generation config, its special-token ids those of `tokenizer`
    (default: the local Qwen2 tokenizer), built on the current default device (`torch.device("meta")`:
    the architecture alone, no memory)."""
    spec: Qwen3VLSize = choose_size(MOE_FAMILY, size, MOE_SIZES) if moe else choose_size(FAMILY, size, SIZES)
    tokenizer = tokenizer or build_qwen2_tokenizer(spec.max_positions)
    config = _config(spec, tokenizer)
    with seeded(seed, "model"):
        model = (Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration)(config)
    text = config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=[text.eos_token_id, text.pad_token_id],
        pad_token_id=text.pad_token_id,
    )
    return model


def build_qwen3_vl(out_dir: str | Path, *, size: str, seed: int, moe: bool = False) -> dict[str, Any]:
    """Build and save a `Qwen3VLForConditionalGeneration` folder of `size` ("tiny", or the published
    "8b" = "full"; `moe`: a tiny `Qwen3VLMoeForConditionalGeneration`) into `out_dir`: weights, config,
    generation config, tokenizer, image and video processors and chat template. Returns the factory
    summary (see `stages.models.factory.init_model`).
    """
    spec: Qwen3VLSize = choose_size(MOE_FAMILY, size, MOE_SIZES) if moe else choose_size(FAMILY, size, SIZES)
    out = Path(out_dir)
    tokenizer = build_qwen2_tokenizer(spec.max_positions)
    tokenizer.chat_template = CHAT_TEMPLATE
    sizes = dict(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    layout = dict(
        patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=SPATIAL_MERGE_SIZE
    )
    norm = dict(image_mean=list(IMAGE_MEAN), image_std=list(IMAGE_STD))
    processor = Qwen3VLImageTextProcessor(
        image_processor=Qwen2VLImageProcessorPil(**sizes, **layout, **norm),
        tokenizer=tokenizer,
        video_processor=QwenVLFramesVideoProcessor(**sizes, **layout, **norm),
        chat_template=CHAT_TEMPLATE,
    )
    model = make_qwen3_vl(size, seed, tokenizer, moe=moe)
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
        processor.save_pretrained(out)
    return finish_model_dir(
        out,
        family=MOE_FAMILY if moe else FAMILY,
        size=size,
        seed=seed,
        pipeline_class=type(model).__name__,
        parameters={
            "visual": parameter_count(model.model.visual),
            "language_model": parameter_count(model.model.language_model),
        },
        details={
            "processor_class": type(processor).__name__,
            "vocab_size": len(tokenizer),
            "image_token_id": model.config.image_token_id,
            "pixels_per_image_token": (PATCH_SIZE * SPATIAL_MERGE_SIZE) ** 2,
            "architecture": asdict(spec),
        },
    )


def build_qwen3_vl_moe(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """`build_qwen3_vl` of the MoE variant (tiny only)."""
    return build_qwen3_vl(out_dir, size=size, seed=seed, moe=True)


def make_qwen3_vl_moe(size: str, seed: int, tokenizer: Any = None) -> Qwen3VLMoeForConditionalGeneration:
    """`make_qwen3_vl` of the MoE variant (tiny only)."""
    return make_qwen3_vl(size, seed, tokenizer, moe=True)
