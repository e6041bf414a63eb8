"""HPS v2.1 (Human Preference Score v2, Wu et al. 2023) as a reward, without open_clip.

HPS v2.1 is an open_clip ViT-H-14 fine-tuned on human preferences; ``HPS_v2.1_compressed.pt`` holds its
open_clip state dict under ``"state_dict"``. This module maps that layout onto a transformers
`CLIPModel` (same architecture: pre-norm ViT and causal text transformer, class-token and end-of-text
pooling, bias-free projections) and reproduces the scoring of the ``hpsv2`` package (``img_score.score``):

- image: RGB, to a float tensor in [0, 1]; the longest side bicubic-resized (antialiased, on the float
  tensor, unclamped) to S (the model's image size, 224) with the other side round(side·S/longest); padded with zeros (black) to
  S×S, centred (left/top get the floor of half the padding); normalised by OpenAI CLIP's mean/std.
  That is open_clip's ``ResizeMaxSize`` validation transform, which ``hpsv2`` builds with
  ``light_augmentation=True``; an image whose longest side already is S is only padded.
- prompt: HTML entities unescaped twice and whitespace collapsed (open_clip's text cleaning, ftfy aside),
  then the CLIP BPE tokenizer: lower-cased, start/end tokens, truncated to 77 tokens.
- score: cos(image embedding, text embedding), the diagonal of normalised image features @ text
  features.T (no logit scale), in [−1, 1]; typically 0.2–0.35 for HPS v2.1.

Reward arguments: ``model`` (the ``.pt``, read with ``torch.load(weights_only=True)``, or a
``.safetensors`` copy of its state dict), ``tokenizer`` (a CLIP tokenizer folder; default the
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` snapshot in the local Hugging Face cache), ``vision_heads`` and
``text_heads`` (16 and 16 for ViT-H-14: attention heads are not in the weights' shapes), and the
``device``/``dtype``/``batch_size`` of every CLIP reward.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from stages.errors import UserInputError
from stages.models.clip import CLIP_MEAN, CLIP_STD
from stages.score.clip_rewards import ClipReward, layer_count, local_path, read_state_dict
from stages.score.registry import register_reward

HPS_TOKENIZER = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, what open_clip builds

# open_clip residual-block names → transformers CLIP encoder-layer names.
_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_IGNORED = ("attn_mask",)  # a buffer some open_clip checkpoints carry; rebuilt by the model


def _map_tower(state: dict[str, torch.Tensor], src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    """Copy the residual blocks `src`resblocks.i.* into `dst`layers.i.*, splitting the fused in-projection."""
    for key, value in state.items():
        if not key.startswith(src):
            continue
        index, _, rest = key[len(src) :].partition(".")
        layer = f"{dst}{index}."
        if rest.startswith("attn.in_proj_"):
            kind = rest.rsplit("_", 1)[-1]  # weight or bias
            for name, part in zip(("q", "k", "v"), value.chunk(3), strict=True):
                out[f"{layer}self_attn.{name}_proj.{kind}"] = part
            continue
        module, _, kind = rest.rpartition(".")
        if module not in _BLOCK:
            raise KeyError(key)
        out[f"{layer}{_BLOCK[module]}.{kind}"] = value


def open_clip_to_transformers(
    state: dict[str, torch.Tensor], vision_heads: int, text_heads: int, tokenizer: Any
) -> tuple[Any, dict[str, torch.Tensor]]:
    """(CLIPConfig, CLIPModel state dict) of an open_clip CLIP state dict (``visual.*``, ``transformer.*``,
    ``token_embedding``, ``positional_embedding``, ``ln_final``, ``text_projection``, ``logit_scale``).

    Widths, depths, patch and image size come from the tensors' shapes, the heads from the arguments,
    the end-of-text id from `tokenizer`. A key outside that layout raises KeyError naming it.
    """
    from transformers import CLIPConfig

    out: dict[str, torch.Tensor] = {}
    vision, text = "vision_model.", "text_model."
    direct = {
        "visual.class_embedding": f"{vision}embeddings.class_embedding",
        "visual.positional_embedding": f"{vision}embeddings.position_embedding.weight",
        "visual.conv1.weight": f"{vision}embeddings.patch_embedding.weight",
        "visual.ln_pre.weight": f"{vision}pre_layrnorm.weight",
        "visual.ln_pre.bias": f"{vision}pre_layrnorm.bias",
        "visual.ln_post.weight": f"{vision}post_layernorm.weight",
        "visual.ln_post.bias": f"{vision}post_layernorm.bias",
        "token_embedding.weight": f"{text}embeddings.token_embedding.weight",
        "positional_embedding": f"{text}embeddings.position_embedding.weight",
        "ln_final.weight": f"{text}final_layer_norm.weight",
        "ln_final.bias": f"{text}final_layer_norm.bias",
        "logit_scale": "logit_scale",
    }
    vision_blocks, text_blocks = "visual.transformer.resblocks.", "transformer.resblocks."
    for key, value in state.items():
        if key in direct:
            out[direct[key]] = value
        elif key == "visual.proj":
            out["visual_projection.weight"] = value.t()
        elif key == "text_projection":
            out["text_projection.weight"] = value.t()
        elif not (key.startswith((vision_blocks, text_blocks)) or key in _IGNORED):
            raise KeyError(key)
    _map_tower(state, vision_blocks, f"{vision}encoder.layers.", out)
    _map_tower(state, text_blocks, f"{text}encoder.layers.", out)

    patch = state["visual.conv1.weight"]
    vision_width, patch_size = int(patch.shape[0]), int(patch.shape[-1])
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    text_width = int(state["token_embedding.weight"].shape[1])
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    config = CLIPConfig(
        text_config={
            "vocab_size": int(state["token_embedding.weight"].shape[0]),
            "hidden_size": text_width,
            "intermediate_size": int(state[f"{text_blocks}0.mlp.c_fc.weight"].shape[0]),
            "num_hidden_layers": layer_count(state, text_blocks),
            "num_attention_heads": text_heads,
            "max_position_embeddings": int(state["positional_embedding"].shape[0]),
            "hidden_act": "gelu",
            "layer_norm_eps": LAYER_NORM_EPS,
            "bos_token_id": tokenizer.convert_tokens_to_ids(tokenizer.bos_token),
            "eos_token_id": eos,
            "pad_token_id": eos,
        },
        vision_config={
            "hidden_size": vision_width,
            "intermediate_size": int(state[f"{vision_blocks}0.mlp.c_fc.weight"].shape[0]),
            "num_hidden_layers": layer_count(state, vision_blocks),
            "num_attention_heads": vision_heads,
            "image_size": grid * patch_size,
            "patch_size": patch_size,
            "hidden_act": "gelu",
            "layer_norm_eps": LAYER_NORM_EPS,
        },
        projection_dim=int(state["text_projection"].shape[1]),
    )
    return config, out


def letterbox_pixels(image: Image.Image, size: int) -> torch.Tensor:
    """HPSv2's image input [3, size, size]: see the module docstring (open_clip's ``ResizeMaxSize``)."""
    rgb = np.asarray(image.convert("RGB"))
    pixels = torch.from_numpy(rgb.copy()).permute(2, 0, 1).float().div(255)
    height, width = pixels.shape[1:]
    scale = size / max(height, width)
    if scale != 1.0:
        shape = (round(height * scale), round(width * scale))
        pixels = torch.nn.functional.interpolate(
            pixels[None], size=shape, mode="bicubic", align_corners=False, antialias=True
        )[0]
        height, width = shape
    pad_h, pad_w = size - height, size - width
    pixels = torch.nn.functional.pad(pixels, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    return (pixels - mean) / std


def clean_prompt(prompt: str) -> str:
    """open_clip's prompt cleaning without ftfy: HTML entities unescaped twice, whitespace collapsed."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(prompt))).strip()


@register_reward("hpsv2")
class HPSv2(ClipReward):
    """HPS v2.1: cos(CLIP ViT-H-14 image, text) of the HPSv2 checkpoint, as ``hpsv2.score`` computes it
    (letterboxed 224² image, no logit scale); see `stages.score.hps`."""

    reward = "hpsv2"
    model_help = "HPS_v2.1_compressed.pt (or a .safetensors copy of its state dict)"

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str = HPS_TOKENIZER,
        vision_heads: int = 16,
        text_heads: int = 16,
        device: str | None = None,
        dtype: str = "fp32",
        batch_size: int = 32,
    ):
        super().__init__(model, None, device, dtype, batch_size)
        self.processor_path = local_path(
            self.reward, "tokenizer", tokenizer, f"a CLIP tokenizer folder such as {HPS_TOKENIZER}"
        )
        self.set_heads(vision_heads, text_heads, "ViT-H-14 has 16 and 16")

    @property
    def weight_paths(self) -> dict[str, Path]:
        return {"model": self.model_path, "tokenizer": self.processor_path}

    def _load(self) -> tuple[Any, Any, torch.device]:
        from accelerate import init_empty_weights
        from transformers import AutoTokenizer, CLIPModel

        from stages.models.diffusion import DTYPES

        device = self.device()
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.processor_path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UserInputError(
                f"reward 'hpsv2': cannot load a CLIP tokenizer from tokenizer={self.processor_path}: "
                f"{' '.join(str(exc).split())[:300]}"
            ) from exc
        state = read_state_dict(self.reward, "model", self.model_path, self.model_help)
        try:
            config, mapped = open_clip_to_transformers(state, self.vision_heads, self.text_heads, tokenizer)
            with init_empty_weights(include_buffers=False):
                model = CLIPModel(config)
            model.load_state_dict(mapped, strict=True, assign=True)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise UserInputError(
                f"reward 'hpsv2': model={self.model_path} is not an open_clip CLIP state dict "
                f"(HPS_v2.1_compressed.pt's layout): {' '.join(str(exc).split())[:300]}"
            ) from exc
        model = model.to(device, DTYPES[self.dtype]).eval()
        model.requires_grad_(False)
        return model, tokenizer, device

    def pixel_values(self, processor: Any, images: Sequence[Image.Image]) -> torch.Tensor:
        size = self.load()[0].config.vision_config.image_size  # 224 for ViT-H-14, from the weights
        return torch.stack([letterbox_pixels(image, size) for image in images])

    def tokens(self, processor: Any, prompts: Sequence[str], length: int) -> Any:
        cleaned = [clean_prompt(prompt) for prompt in prompts]
        return processor(cleaned, padding=True, truncation=True, max_length=length, return_tensors="pt")

    def scores(
        self, images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
    ) -> torch.Tensor:
        return (self.text_embeddings(prompts) * self.image_embeddings(images)).sum(-1)
