"""ImageReward v1.0 (Xu et al. 2023) as a reward, on transformers' BLIP modules.

ImageReward is BLIP: a ViT-L/16 image encoder whose tokens a BERT-base text encoder cross-attends to,
and an MLP (Linear 768→1024→128→64→16→1 with dropouts, no activations) on the text encoder's first
([CLS]) output, normalised by the published mean and std of its scores. ``ImageReward.pt`` holds the
reference module's state dict: ``blip.visual_encoder.*`` (BLIP's timm-style ViT), ``blip.text_encoder.*``
(BLIP's ``med.py`` BERT with cross-attention) and ``mlp.layers.*``. This module loads it, by a key mapping,
into `BlipVisionModel` and `BlipTextModel` (transformers' port of the same BLIP code) plus the
`AestheticMLP` layout, and scores as the ``image-reward`` package's ``inference_rank`` does:

- image: torchvision's ``Resize(224, bicubic)`` on the PIL image (shortest side to 224, the other
  int(224·long/short)), ``CenterCrop(224)`` (offset round((side − 224)/2)), then RGB, [0, 1], OpenAI CLIP
  mean/std (ImageReward's own ``_transform``);
- prompt: the BERT (bert-base-uncased) tokenizer, padded to and truncated at 35 tokens;
- score: (MLP(text_encoder(prompt, cross-attending to all image tokens)[CLS]) − 0.16717362830052426)
  / 1.0333394966054072, a z-score: about −2…2, higher is preferred.

Reward arguments: ``model`` (``ImageReward.pt``, read with ``torch.load(weights_only=True)``, or a
``.safetensors`` copy), ``tokenizer`` (a bert-base-uncased folder; default its snapshot in the local
Hugging Face cache), ``vision_heads`` (16, ViT-L) and ``text_heads`` (12, BERT-base): the heads are not
in the weights' shapes; ``device``, ``dtype``, ``batch_size`` as every model reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from stages.errors import UserInputError
from stages.models.clip import CLIP_MEAN, CLIP_STD, AestheticMLP
from stages.score.clip_rewards import ModelReward, layer_count, local_path, read_state_dict
from stages.score.registry import register_reward

IMAGEREWARD_TOKENIZER = "google-bert/bert-base-uncased"
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
PROMPT_TOKENS = 35
VISION_LAYER_NORM_EPS = 1e-6  # BLIP's ViT builds its LayerNorms with eps 1e-6
TEXT_LAYER_NORM_EPS = 1e-12  # BERT's, from ImageReward's med_config.json

# BLIP ViT block names → transformers BLIP vision encoder-layer names.
_VIT_BLOCK = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_VIT = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VISION, _TEXT, _MLP = "blip.visual_encoder.", "blip.text_encoder.", "mlp."


def _vit_key(key: str) -> str:
    if key in _VIT:
        return _VIT[key]
    head, _, rest = key.partition(".")
    index, _, rest = rest.partition(".")
    module, _, kind = rest.rpartition(".")
    if head != "blocks" or module not in _VIT_BLOCK:
        raise KeyError(f"{_VISION}{key}")
    return f"encoder.layers.{index}.{_VIT_BLOCK[module]}.{kind}"


def split_checkpoint(
    state: dict[str, torch.Tensor], vision_heads: int, text_heads: int
) -> tuple[Any, dict, Any, dict, dict]:
    """(BlipVisionConfig, its state dict, BlipTextConfig, its state dict, MLP state dict) of an
    ``ImageReward.pt`` state dict. Sizes come from the tensors' shapes, the heads from the arguments;
    BLIP's contrastive projections (``blip.vision_proj``/``text_proj``, unused by the score) are skipped.
    A key of a tower outside the BLIP layout raises KeyError naming it."""
    from transformers import BlipTextConfig, BlipVisionConfig

    vision, text, mlp = {}, {}, {}
    for key, value in state.items():
        if key.startswith(_VISION):
            vision[_vit_key(key[len(_VISION) :])] = value
        elif key.startswith(_TEXT):
            name = key[len(_TEXT) :]
            if not name.endswith("position_ids"):  # a buffer, rebuilt by the model
                text[name] = value
        elif key.startswith(_MLP):
            mlp[key[len(_MLP) :]] = value
        elif not key.startswith("blip."):
            raise KeyError(key)
    patch = vision["embeddings.patch_embedding.weight"]
    vision_width, patch_size = int(patch.shape[0]), int(patch.shape[-1])
    grid = round((vision["embeddings.position_embedding"].shape[1] - 1) ** 0.5)
    vision_config = BlipVisionConfig(
        hidden_size=vision_width,
        intermediate_size=int(vision["encoder.layers.0.mlp.fc1.weight"].shape[0]),
        num_hidden_layers=layer_count(vision, "encoder.layers."),
        num_attention_heads=vision_heads,
        image_size=grid * patch_size,
        patch_size=patch_size,
        hidden_act="gelu",
        layer_norm_eps=VISION_LAYER_NORM_EPS,
    )
    words = text["embeddings.word_embeddings.weight"]
    text_config = BlipTextConfig(
        vocab_size=int(words.shape[0]),
        hidden_size=int(words.shape[1]),
        encoder_hidden_size=vision_width,
        intermediate_size=int(text["encoder.layer.0.intermediate.dense.weight"].shape[0]),
        num_hidden_layers=layer_count(text, "encoder.layer."),
        num_attention_heads=text_heads,
        max_position_embeddings=int(text["embeddings.position_embeddings.weight"].shape[0]),
        hidden_act="gelu",
        layer_norm_eps=TEXT_LAYER_NORM_EPS,
        is_decoder=True,  # builds the cross-attention of every layer; called as an encoder (bidirectional)
        bos_token_id=None,  # generation ids ([DEC], [SEP]): the encoder never reads them
        sep_token_id=None,
    )
    return vision_config, vision, text_config, text, mlp


def resize_crop_pixels(image: Image.Image, size: int) -> torch.Tensor:
    """ImageReward's image input [3, size, size]: see the module docstring (torchvision's PIL path)."""
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    if short != size:
        new_long = int(size * long / short)
        image = image.resize(
            (size, new_long) if width <= height else (new_long, size), Image.Resampling.BICUBIC
        )
    top = round((image.height - size) / 2)  # half-to-even, as torchvision
    left = round((image.width - size) / 2)
    rgb = np.asarray(image.crop((left, top, left + size, top + size)).convert("RGB"))
    pixels = torch.from_numpy(rgb.copy()).permute(2, 0, 1).float().div(255)
    return (pixels - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)


def _load_part(module: torch.nn.Module, state: dict, what: str, path: Path) -> None:
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise UserInputError(
            f"reward 'imagereward': model={path} does not match ImageReward's {what}: "
            f"{' '.join(str(exc).split())[:300]}"
        ) from exc


@register_reward("imagereward")
class ImageRewardScore(ModelReward):
    """ImageReward v1.0's normalised score of (prompt, image), as ``ImageReward.inference_rank`` gives it;
    see `stages.score.imagereward`."""

    reward = "imagereward"
    model_help = "ImageReward.pt (or a .safetensors copy of its state dict)"

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str = IMAGEREWARD_TOKENIZER,
        vision_heads: int = 16,
        text_heads: int = 12,
        device: str | None = None,
        dtype: str = "fp32",
        batch_size: int = 32,
    ):
        super().__init__(model, device, dtype, batch_size)
        self.tokenizer_path = local_path(
            self.reward, "tokenizer", tokenizer, f"a BERT tokenizer folder such as {IMAGEREWARD_TOKENIZER}"
        )
        self.set_heads(vision_heads, text_heads, "ImageReward v1.0 has 16 and 12")

    @property
    def weight_paths(self) -> dict[str, Path]:
        return {"model": self.model_path, "tokenizer": self.tokenizer_path}

    def _load(self) -> tuple[Any, Any, torch.nn.Module, Any, torch.device]:
        """(vision model, text model, MLP, tokenizer, device), eval mode, no gradients."""
        from accelerate import init_empty_weights
        from transformers import AutoTokenizer, BlipTextModel, BlipVisionModel

        from stages.models.diffusion import DTYPES

        device = self.device()
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UserInputError(
                f"reward 'imagereward': cannot load a BERT tokenizer from tokenizer={self.tokenizer_path}: "
                f"{' '.join(str(exc).split())[:300]}"
            ) from exc
        state = read_state_dict(self.reward, "model", self.model_path, self.model_help)
        try:
            vision_config, vision_state, text_config, text_state, mlp_state = split_checkpoint(
                state, self.vision_heads, self.text_heads
            )
            mlp = AestheticMLP(int(mlp_state["layers.0.weight"].shape[1]))
        except (KeyError, ValueError) as exc:
            raise UserInputError(
                f"reward 'imagereward': model={self.model_path} is not ImageReward's state dict "
                f"(blip.visual_encoder.*, blip.text_encoder.*, mlp.layers.*): {exc}"
            ) from exc
        with init_empty_weights(include_buffers=False):
            vision = BlipVisionModel(vision_config)
            text = BlipTextModel(text_config, add_pooling_layer=False)
        _load_part(vision, vision_state, "BLIP ViT", self.model_path)
        _load_part(text, text_state, "BLIP text encoder", self.model_path)
        _load_part(mlp, mlp_state, "MLP head", self.model_path)
        parts = []
        for module, dtype in ((vision, DTYPES[self.dtype]), (text, DTYPES[self.dtype]), (mlp, torch.float32)):
            module = module.to(device, dtype).eval()
            module.requires_grad_(False)
            parts.append(module)
        return (*parts, tokenizer, device)

    @torch.inference_mode()
    def scores(
        self, images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
    ) -> torch.Tensor:
        vision, text, mlp, tokenizer, device = self.load()
        size = vision.config.image_size
        out = []
        for start in range(0, len(images), self.batch_size):
            chunk = images[start : start + self.batch_size]
            pixels = torch.stack([resize_crop_pixels(image, size) for image in chunk])
            image_tokens = vision(pixel_values=pixels.to(device, vision.dtype)).last_hidden_state
            tokens = tokenizer(
                list(prompts[start : start + self.batch_size]),
                padding="max_length",
                truncation=True,
                max_length=PROMPT_TOKENS,
                return_tensors="pt",
            )
            hidden = text(
                input_ids=tokens["input_ids"].to(device),
                attention_mask=tokens["attention_mask"].to(device),
                encoder_hidden_states=image_tokens,
                encoder_attention_mask=torch.ones(image_tokens.shape[:-1], dtype=torch.long, device=device),
            ).last_hidden_state
            reward = mlp(hidden[:, 0].float()).squeeze(-1)
            out.append(((reward - IMAGEREWARD_MEAN) / IMAGEREWARD_STD).cpu())
        return torch.cat(out)
