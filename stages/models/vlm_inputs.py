"""The inputs a VLM policy's forward takes: chat inputs built by the model's processor from prompts and
their media, those extended by sampled responses, and the same packed into one row of real tokens
(`stages.models.vlm.VLMPolicy` builds and runs them)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from stages.errors import UserInputError

# The processor argument that takes each media type's items (one flat list over the batch), and the
# processor part a type beyond images needs (Qwen2.5-VL has no feature extractor; folders built before
# the frames video processor have no video processor).
PROCESSOR_ARGS = {"image": "images", "video": "videos", "audio": "audio"}
PROCESSOR_PARTS = {"video": "video_processor", "audio": "feature_extractor"}


def media_parts(messages: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The `{"type": kind}` content parts of chat messages, in order."""
    return [
        part
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == kind
    ]


def user_turn(question: str, num_images: int) -> list[dict[str, Any]]:
    """A plain question as chat messages: one user turn, its images first, then the text."""
    parts = [{"type": "image"} for _ in range(num_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def chat_inputs(
    processor: Any,
    prompts: Sequence[str | list[dict[str, Any]]],
    images: list[list[Any]],
    *,
    videos: list[list[Any]] | None = None,
    audios: list[list[Any]] | None = None,
    model_path: str = "",
    token_types: bool = False,
) -> dict[str, Any]:
    """Left-padded processor inputs, one row per prompt: its chat messages (typed content parts,
    `stages.sample.vlm_data.build_messages`; a plain question is `user_turn`) through the chat
    template with the generation prompt, and its media in the order of their parts.

    images[k]: prompt k's PIL images; videos[k]: its videos, each a list of PIL frames whose frame
    rate is the `fps` of its video part (required: it times the video's temporal patches); audios[k]:
    its audio clips as float32 waveforms [S] at the processor's sampling rate (omni models). Every
    media type is passed to the processor as one flat list (None when no prompt has any), so a batch
    may mix text-only prompts with prompts that have media; the processor's outputs (pixel values,
    grids, frame timing, audio features) go to the model as they are.
    """
    media = {
        "image": images,
        "video": videos or [[] for _ in prompts],
        "audio": audios or [[] for _ in prompts],
    }
    texts, fps = [], []
    for k, prompt in enumerate(prompts):
        messages = user_turn(prompt, len(images[k])) if isinstance(prompt, str) else prompt
        for kind, items in media.items():
            parts = media_parts(messages, kind)
            if len(parts) != len(items[k]):
                raise UserInputError(
                    f"prompt {k}: {len(parts)} {kind} parts in its messages but {len(items[k])} {kind}s"
                )
            if kind == "video":
                if not all(isinstance(part.get("fps"), (int, float)) for part in parts):
                    raise UserInputError(f"prompt {k}: a video part has no frame rate ('fps')")
                fps += [float(part["fps"]) for part in parts]
        texts.append(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    flat = {PROCESSOR_ARGS[kind]: [x for row in items for x in row] or None for kind, items in media.items()}
    for kind, part in PROCESSOR_PARTS.items():
        if flat[PROCESSOR_ARGS[kind]] and getattr(processor, part, None) is None:
            raise UserInputError(
                f"--model {model_path}: its processor has no {part} and takes no {kind}s; "
                f"sample {kind} prompts with a model whose processor has one"
            )
    extra: dict[str, Any] = {}
    if flat["videos"]:
        from transformers.video_utils import VideoMetadata

        extra["video_metadata"] = [
            VideoMetadata(total_num_frames=len(v), fps=r, frames_indices=list(range(len(v))))
            for v, r in zip(flat["videos"], fps)
        ]
        extra["do_sample_frames"] = False
    inputs = processor(
        text=texts,
        **{arg: items for arg, items in flat.items() if items},
        **extra,
        return_tensors="pt",
        padding=True,
        padding_side="left",
    )
    if "mm_token_type_ids" not in inputs and token_types:
        raise UserInputError("the processor gave no mm_token_type_ids; image positions would be wrong")
    return inputs


def response_inputs(
    prompt: dict[str, torch.Tensor], response_ids: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Prompt inputs extended by the responses: ids, mask and, where the processor gives them,
    `mm_token_type_ids` (response tokens are text, even a sampled `<|image_pad|>`, as in `generate`);
    every other processor output (pixel values, grids, frame timing, audio features) is passed on as
    it is."""
    ids = torch.cat([prompt["input_ids"], response_ids], dim=1)
    mask = torch.cat([prompt["attention_mask"], response_mask.to(prompt["attention_mask"].dtype)], dim=1)
    out = {"input_ids": ids, "attention_mask": mask}
    if "mm_token_type_ids" in prompt:
        types = prompt["mm_token_type_ids"]
        out["mm_token_type_ids"] = torch.cat(
            [types, torch.zeros_like(response_ids, dtype=types.dtype)], dim=1
        )
    return {**{k: v for k, v in prompt.items() if k not in out}, **out}


def pack_inputs(inner: Any, inputs: dict[str, Any], t: int) -> tuple[dict[str, Any], torch.Tensor]:
    """The forward inputs as one row of every sequence's real tokens back to back [1, N] (no padding),
    and the packed index [B·T] of the position predicting each of the last t (response) tokens.

    The M-RoPE positions [3, B, L] are computed on the padded batch, as the padded forward computes
    them, and packed with the tokens; a fourth leading row restarts at 0 with each sequence, from
    which transformers builds the block-diagonal causal mask (no token attends across sequences).
    """
    mask = inputs["attention_mask"].bool()
    wanted = inspect.signature(inner.compute_3d_position_ids).parameters
    given = {"inputs_embeds": None, "cache": None, **inputs}
    positions = inner.compute_3d_position_ids(**{k: given.get(k) for k in wanted})
    width = mask.shape[1]
    if positions is None:  # text only: the positions the model counts itself
        positions = torch.arange(width, device=mask.device).expand(3, mask.shape[0], -1)
    lengths = mask.sum(1).tolist()
    restart = torch.cat([torch.arange(n, device=mask.device) for n in lengths])
    position_ids = torch.cat([restart[None], positions[:, mask]])[:, None]  # [4, 1, N]
    index = (mask.flatten().cumsum(0) - 1).view_as(mask)[:, width - t - 1 : width - 1]
    packed = {k: inputs[k][mask][None] for k in ("input_ids", "mm_token_type_ids") if k in inputs}
    rest = {k: v for k, v in inputs.items() if k not in (*packed, "attention_mask")}
    return {**rest, **packed, "position_ids": position_ids}, index.flatten()
