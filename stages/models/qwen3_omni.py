"""Random-weight Qwen3-Omni thinker folders (the understanding half of Qwen3-Omni), tiny but shaped like it.

What is kept, because rollout and training code depends on it: the MoE text model (sparse blocks with a
top-k router, `router_aux_loss_coef`, no shared expert) with M-RoPE over (temporal, height, width); the
vision tower with 16-px patches, 2x2 merge, temporal patch 2 and deepstack features injected into the
first text layers; the audio tower (Whisper-style log-mel input, windowed attention, 13 tokens per
100 mel frames); ChatML with the vision and audio markers (`<|vision_start|><|image_pad|><|vision_end|>`,
`<|audio_start|><|audio_pad|><|audio_end|>`), the processor expanding each pad to its feature count.
What shrinks: widths, depths, experts (4, top-2), the vocabulary (`build_qwen2_tokenizer`), mel bins
(32), and the image pixel budget (64x64 to 128x128 pixels, i.e. 4 to 16 image tokens).

The processor is `Qwen3OmniThinkerProcessor`: transformers' `Qwen3OmniMoeProcessor` with a locally
configured `WhisperFeatureExtractor` and `QwenVLFramesVideoProcessor` as its video processor
(transformers builds its own only with torchvision, which is not installed here); each video is timed
by its own frame rate. It also extracts each audio's features on its own
(`_process_audio`): the Whisper extractor pads a batch to its longest clip and the STFT frames at a
clip's end then see its neighbours' padding, so a clip's features would depend on the batch it is in
and a replay in other micro-batches would not reproduce the rollout's log-probs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoProcessor,
    GenerationConfig,
    Qwen3OmniMoeForConditionalGeneration,
    Qwen3OmniMoeProcessor,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stages.models.factory import choose_size, finish_model_dir, no_progress_bars, parameter_count, seeded
from stages.models.qwen2_5_vl import FramesVideoProcessing, QwenVLFramesVideoProcessor
from stages.models.tokenizers import QWEN2_SPECIAL_TOKENS, build_qwen2_tokenizer

FAMILY = "qwen3_omni_thinker"
MODEL_TYPE = "qwen3_omni_moe_thinker"
# The model type of a whole Qwen3-Omni checkpoint (thinker + talker + code2wav); the policy is its thinker.
FULL_MODEL_TYPE = "qwen3_omni_moe"
PATCH_SIZE = 16
SPATIAL_MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
ROPE_THETA = 1_000_000.0
SAMPLING_RATE = 16_000
HOP_LENGTH = 160  # 10 ms mel frames
AUDIO_WINDOW = 50  # n_window: the audio tower attends within 2·50 mel frames (1 s)
AUDIO_TOKENS = ("<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
SPECIAL_TOKENS = (*QWEN2_SPECIAL_TOKENS, *AUDIO_TOKENS)
# The attribute names Qwen3-Omni's processor reads from its tokenizer.
NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# ChatML as Qwen3-Omni renders it (no default system turn): image, video and audio parts as their
# start/pad/end markers (the processor expands each pad), `add_generation_prompt` opening the assistant turn.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'audio' or 'audio' in part or 'audio_url' in part -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part.text -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class Qwen3OmniThinkerProcessor(FramesVideoProcessing, Qwen3OmniMoeProcessor):
    """`Qwen3OmniMoeProcessor` for text, images, videos (lists of frames) and audio: same prompt
    expansion, pixel values, grids, log-mel features and `feature_attention_mask`, with three
    differences. The video processor is `QwenVLFramesVideoProcessor` (transformers' needs torchvision),
    or None in folders built before it; each video is timed by its own frame rate (`video_metadata`)
    instead of one `fps` for the batch; and each audio's features are extracted alone, then
    zero-padded to the batch's longest, so they do not depend on which clips share the batch."""

    def __init__(
        self,
        image_processor: Any = None,
        video_processor: Any = None,
        feature_extractor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(image_processor, video_processor, feature_extractor, tokenizer, chat_template)

    def _process_videos(self, videos: Any, **kwargs: Any) -> tuple[dict[str, Any], list[str]]:
        """transformers' video expansion, with `video_second_per_grid` [V] = temporal_patch_size / fps
        of each video's metadata (the time one temporal patch spans, which places its M-RoPE t index).
        Audio taken from a video's own track (`load_audio_from_video`) is not supported."""
        if kwargs.get("load_audio_from_video"):
            raise ValueError("load_audio_from_video is not supported by this processor")
        out, replacements = super()._process_videos(videos, **kwargs)
        metadata = kwargs["videos_kwargs"].get("video_metadata")
        if metadata is not None:
            tps = self.video_processor.temporal_patch_size
            out["video_second_per_grid"] = [tps / m.fps for m in metadata]
        return out, replacements

    def _process_audio(self, audio: Any, **kwargs: Any) -> tuple[dict[str, Any], list[str]]:
        """Per-clip log-mel features [A, mels, F_max] (zero after each clip's own frames), their
        `feature_attention_mask` [A, F_max] and the `<|audio_pad|>` run each clip expands to."""
        clips = [audio] if isinstance(audio, np.ndarray) and audio.ndim == 1 else list(audio)
        kwargs = {**kwargs, "padding": "longest", "return_tensors": "pt", "return_attention_mask": True}
        one = [super(Qwen3OmniThinkerProcessor, self)._process_audio([clip], **kwargs)[0] for clip in clips]
        width = max(int(o["input_features"].shape[-1]) for o in one)
        features = torch.zeros(len(one), one[0]["input_features"].shape[1], width)
        mask = torch.zeros(len(one), width, dtype=one[0]["feature_attention_mask"].dtype)
        for k, o in enumerate(one):
            frames = o["input_features"].shape[-1]
            features[k, :, :frames] = o["input_features"][0]
            mask[k, :frames] = o["feature_attention_mask"][0]
        tokens = torch.cat([o["num_audio_tokens"] for o in one])
        out = {"input_features": features, "feature_attention_mask": mask, "num_audio_tokens": tokens}
        return out, [self.audio_token * int(n) for n in tokens]


# Keyed by a name, so real checkpoints keep resolving to transformers' own processor; `AutoProcessor`
# finds this class through the `processor_class` saved with the folder.
AutoProcessor.register("omnirl-qwen3-omni-thinker", Qwen3OmniThinkerProcessor, exist_ok=True)


@dataclass(frozen=True)
class Qwen3OmniThinkerSize:
    """Widths and depths of one size; `mrope_section` splits half the text head_dim over (t, h, w)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mrope_section: tuple[int, int, int]
    experts: int
    experts_per_token: int
    moe_intermediate: int
    max_positions: int
    vision_hidden: int
    vision_intermediate: int
    vision_depth: int
    vision_heads: int
    vision_positions: int
    deepstack_layers: tuple[int, ...]
    audio_hidden: int
    audio_ffn: int
    audio_layers: int
    audio_heads: int
    audio_downsample: int
    mel_bins: int
    min_pixels: int
    max_pixels: int
    # Published size: the real vocabulary (None: the local tokenizer's length).
    vocab: int | None = None


SIZES: dict[str, Qwen3OmniThinkerSize] = {
    # head_dim 16 -> 8 rotary pairs = 4+2+2 (the real 24:20:20 has the same t-heavy shape);
    # 64²..128² px -> 4..16 image tokens; 0.5 s of audio -> 7 audio tokens.
    "tiny": Qwen3OmniThinkerSize(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        mrope_section=(4, 2, 2),
        experts=4,
        experts_per_token=2,
        moe_intermediate=32,
        max_positions=4096,
        vision_hidden=32,
        vision_intermediate=64,
        vision_depth=3,
        vision_heads=2,
        vision_positions=64,
        deepstack_layers=(0, 1),
        audio_hidden=32,
        audio_ffn=64,
        audio_layers=2,
        audio_heads=2,
        audio_downsample=16,
        mel_bins=32,
        min_pixels=64 * 64,
        max_pixels=128 * 128,
    ),
    # Qwen/Qwen3-Omni-30B-A3B-Instruct's thinker_config: 48 MoE blocks (128 experts of 768, top-8), the
    # 27-block vision tower with deepstack at 8/16/24 and the 32-block Whisper-style audio tower.
    "full": Qwen3OmniThinkerSize(
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        mrope_section=(24, 20, 20),
        experts=128,
        experts_per_token=8,
        moe_intermediate=768,
        max_positions=65536,
        vision_hidden=1152,
        vision_intermediate=4304,
        vision_depth=27,
        vision_heads=16,
        vision_positions=2304,
        deepstack_layers=(8, 16, 24),
        audio_hidden=1280,
        audio_ffn=5120,
        audio_layers=32,
        audio_heads=20,
        audio_downsample=480,
        mel_bins=128,
        min_pixels=64 * 64,
        max_pixels=16 * 16 * 4 * 16384,
        vocab=152064,
    ),
}


def load_model(model_dir: str | Path, dtype: torch.dtype) -> Qwen3OmniMoeThinkerForConditionalGeneration:
    """The thinker of a thinker folder or of a whole Qwen3-Omni folder (`FULL_MODEL_TYPE`: thinker,
    talker and code2wav, the thinker's weights under `thinker.`), local files only.

    A whole folder is loaded as `Qwen3OmniMoeForConditionalGeneration` with `enable_audio_output=False`,
    which builds the thinker alone, so the talker's and code2wav's weights are never materialised;
    the folder's generation config goes with the thinker (its stop ids).
    """
    if json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") != FULL_MODEL_TYPE:
        return Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
            model_dir, dtype=dtype, use_safetensors=True
        )
    whole = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        model_dir, dtype=dtype, enable_audio_output=False, use_safetensors=True
    )
    thinker = whole.thinker
    thinker.generation_config = whole.generation_config
    return thinker


def load_processor(model_dir: str | Path) -> Qwen3OmniMoeProcessor:
    """The processor of a Qwen3-Omni thinker folder, built here or published (`AutoProcessor`, local files only)."""
    return AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)


def _config(spec: Qwen3OmniThinkerSize, tokenizer: Any) -> Qwen3OmniMoeThinkerConfig:
    """Thinker config whose special-token ids are the tokenizer's and whose vocabulary is exactly its length."""
    names = ("<|endoftext|>", "<|im_end|>", *NAMED_TOKENS.values(), "<|im_start|>")
    ids = dict(zip(names, tokenizer.convert_tokens_to_ids(list(names))))
    return Qwen3OmniMoeThinkerConfig(
        text_config={
            "vocab_size": spec.vocab or len(tokenizer),
            "hidden_size": spec.hidden,
            "intermediate_size": spec.moe_intermediate * spec.experts_per_token,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "head_dim": spec.head_dim,
            "max_position_embeddings": spec.max_positions,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": ROPE_THETA,
                "mrope_section": list(spec.mrope_section),
                "interleaved": True,
            },
            "num_experts": spec.experts,
            "num_experts_per_tok": spec.experts_per_token,
            "moe_intermediate_size": spec.moe_intermediate,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
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
        audio_config={
            "num_mel_bins": spec.mel_bins,
            "encoder_layers": spec.audio_layers,
            "encoder_attention_heads": spec.audio_heads,
            "encoder_ffn_dim": spec.audio_ffn,
            "d_model": spec.audio_hidden,
            "output_dim": spec.hidden,
            "n_window": AUDIO_WINDOW,
            "downsample_hidden_size": spec.audio_downsample,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        audio_token_id=ids["<|audio_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        audio_start_token_id=ids["<|audio_start|>"],
        audio_end_token_id=ids["<|audio_end|>"],
        user_token_id=tokenizer.convert_tokens_to_ids("user"),
    )


def make_qwen3_omni_thinker(
    size: str, seed: int, tokenizer: Any = None
) -> Qwen3OmniMoeThinkerForConditionalGeneration:
    """The thinker of `size` with seeded random weights and its generation config, its special-token ids
    those of `tokenizer` (default: the local tokenizer with the audio tokens), built on the current
    default device (`torch.device("meta")`: the architecture alone, no memory)."""
    spec: Qwen3OmniThinkerSize = choose_size(FAMILY, size, SIZES)
    if tokenizer is None:
        tokenizer = build_qwen2_tokenizer(
            spec.max_positions, special_tokens=SPECIAL_TOKENS, named_tokens=NAMED_TOKENS
        )
    config = _config(spec, tokenizer)
    with seeded(seed, "model"):
        model = Qwen3OmniMoeThinkerForConditionalGeneration(config)
    text = config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=[text.eos_token_id, text.pad_token_id],
        pad_token_id=text.pad_token_id,
    )
    return model


def build_qwen3_omni_thinker(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `Qwen3OmniMoeThinkerForConditionalGeneration` folder of `size` ("tiny", or "full"
    = the thinker of Qwen3-Omni-30B-A3B) into
    `out_dir`: weights, config, generation config, tokenizer, image processor, Whisper feature
    extractor and chat template. Returns the factory summary (see `stages.models.factory.init_model`).
    """
    spec: Qwen3OmniThinkerSize = choose_size(FAMILY, size, SIZES)
    out = Path(out_dir)
    tokenizer = build_qwen2_tokenizer(
        spec.max_positions, special_tokens=SPECIAL_TOKENS, named_tokens=NAMED_TOKENS
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=SPATIAL_MERGE_SIZE,
    )
    feature_extractor = WhisperFeatureExtractor(
        feature_size=spec.mel_bins, sampling_rate=SAMPLING_RATE, hop_length=HOP_LENGTH, n_fft=400
    )
    video_processor = QwenVLFramesVideoProcessor(
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=SPATIAL_MERGE_SIZE,
    )
    processor = Qwen3OmniThinkerProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        feature_extractor=feature_extractor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    model = make_qwen3_omni_thinker(size, seed, tokenizer)
    config = model.config
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
        processor.save_pretrained(out)
    inner = model.model
    return finish_model_dir(
        out,
        family=FAMILY,
        size=size,
        seed=seed,
        pipeline_class=type(model).__name__,
        parameters={
            "visual": parameter_count(inner.visual),
            "audio_tower": parameter_count(inner.audio_tower),
            "language_model": parameter_count(inner.language_model) + parameter_count(model.lm_head),
        },
        details={
            "processor_class": type(processor).__name__,
            "vocab_size": len(tokenizer),
            "image_token_id": config.image_token_id,
            "audio_token_id": config.audio_token_id,
            "pixels_per_image_token": (PATCH_SIZE * SPATIAL_MERGE_SIZE) ** 2,
            "sampling_rate": SAMPLING_RATE,
            "architecture": asdict(spec),
        },
    )


def _groups(row_tokens: torch.Tensor, item_tokens: list[int]) -> list[list[int]]:
    """Item indices per prompt: items (images, clips) are in prompt order, prompt b owning the next
    ones until their placeholder tokens add up to row_tokens[b]."""
    groups, item = [], 0
    for total in row_tokens.tolist():
        taken: list[int] = []
        while total > 0:
            taken.append(item)
            total -= item_tokens[item]
            item += 1
        groups.append(taken)
    return groups


# The thinker's visual inputs: patches [sum of grid rows, D], grids [items, 3], the placeholder token id
# (config attribute) and any further per-item tensors.
_VISUAL_INPUTS = (
    ("pixel_values", "image_grid_thw", "image_token_id", ()),
    ("pixel_values_videos", "video_grid_thw", "video_token_id", ("video_second_per_grid",)),
)


def repeat_prompts(inputs: dict[str, torch.Tensor], n: int, config: Any) -> dict[str, torch.Tensor]:
    """Thinker inputs with each prompt repeated n times in place (B prompts -> B·n rows), media included.

    `generate(num_return_sequences=n)` repeats per-item tensors item by item (a prompt with clips
    [a0, a1] would get [a0, a0, a1, a1]); here each prompt's own items are repeated as a group.
    """
    ids = inputs["input_ids"]
    out = {k: inputs[k].repeat_interleave(n, dim=0) for k in ("input_ids", "attention_mask")}
    if "input_features" in inputs:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            _get_feat_extract_output_lengths,
        )

        lengths = inputs["feature_attention_mask"].sum(-1)
        tokens = _get_feat_extract_output_lengths(lengths, config.audio_config.n_window).tolist()
        groups = _groups((ids == config.audio_token_id).sum(-1), tokens)
        order = torch.tensor([i for g in groups for _ in range(n) for i in g], dtype=torch.long)
        for key in ("input_features", "feature_attention_mask"):
            out[key] = inputs[key][order.to(inputs[key].device)]
    merge = config.vision_config.spatial_merge_size
    for pixels, grids, token, per_item in _VISUAL_INPUTS:
        if pixels not in inputs:
            continue
        grid = inputs[grids]
        rows = grid.prod(-1).tolist()
        groups = _groups((ids == getattr(config, token)).sum(-1), [r // merge**2 for r in rows])
        starts = [sum(rows[:i]) for i in range(len(rows))]
        order = [i for g in groups for _ in range(n) for i in g]
        index = torch.tensor(order, dtype=torch.long, device=grid.device)
        out[grids] = grid[index]
        out[pixels] = torch.cat([inputs[pixels][starts[i] : starts[i] + rows[i]] for i in order])
        for key in per_item:
            if key in inputs:
                out[key] = inputs[key][index.to(inputs[key].device)]
    return out
