"""A tiny random CLIP model with its processor, and a tiny LAION-style aesthetic MLP, built offline.

The CLIP rewards (`stages.score.clip_rewards`) load real checkpoints (PickScore_v1, openai CLIP
ViT-L/14) with `from_pretrained`; tests need a folder of the same form without the network. This
builder writes one: a seeded `CLIPModel` (`save_pretrained`, safetensors), the local CLIP tokenizer of
`stages.models.tokenizers`, and an image-processor config of the published form (resize the shortest
side, centre crop, OpenAI CLIP mean/std) at the tiny image size. Beside them, `aesthetic_mlp.safetensors`
holds an MLP laid out like LAION's `sac+logos+ava1-l14-linearMSE` (`layers.{0,2,4,6,7}`: Linear
D→1024→128→64→16→1 with Dropouts at 1, 3, 5), its input width D being the tiny projection width.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from stages.errors import UserInputError
from stages.models.factory import no_progress_bars, parameter_count, seeded

# OpenAI CLIP's image normalisation, used by every CLIP checkpoint the rewards load.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the resampling of CLIP's processor

AESTHETIC_MLP_FILE = "aesthetic_mlp.safetensors"
AESTHETIC_HIDDEN = (1024, 128, 64, 16)
AESTHETIC_DROPOUT = (0.2, 0.2, 0.1)

TINY = {"width": 32, "layers": 2, "heads": 2, "ff": 64, "projection": 16, "image_size": 32, "patch": 8}
# A ViT-B/32-shaped model at a quarter of its width: big enough that scoring time is the model's (benchmarks).
SMALL = {"width": 192, "layers": 6, "heads": 4, "ff": 768, "projection": 128, "image_size": 224, "patch": 32}


class AestheticMLP(torch.nn.Module):
    """LAION's aesthetic head: Linear(D, 1024) Drop(0.2) Linear(1024, 128) Drop(0.2) Linear(128, 64)
    Drop(0.1) Linear(64, 16) Linear(16, 1), no activations; [N, D] → [N, 1]. State-dict keys
    `layers.{0,2,4,6,7}.{weight,bias}`, as the published `.pth`."""

    def __init__(self, input_width: int = 768):
        super().__init__()
        widths = (input_width, *AESTHETIC_HIDDEN)
        modules: list[torch.nn.Module] = []
        for index, (a, b) in enumerate(pairwise(widths)):
            modules.append(torch.nn.Linear(a, b))
            if index < len(AESTHETIC_DROPOUT):
                modules.append(torch.nn.Dropout(AESTHETIC_DROPOUT[index]))
        modules.append(torch.nn.Linear(widths[-1], 1))
        self.layers = torch.nn.Sequential(*modules)

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.layers(embedding)


def image_processor_config(image_size: int) -> dict[str, Any]:
    """The `preprocessor_config.json` of a CLIP checkpoint at `image_size`: bicubic resize of the
    shortest side to `image_size`, centre crop to a square, rescale by 1/255, normalise by CLIP's mean/std."""
    return {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "CLIPProcessor",
        "do_resize": True,
        "size": {"shortest_edge": image_size},
        "resample": BICUBIC,
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "do_convert_rgb": True,
    }


def fresh_dir(path: str | Path) -> Path:
    """`path` as a new or empty folder (created); anything else there is a one-line UserInputError."""
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"{out} already exists and is not an empty directory; choose a new folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def tower_configs(tokenizer: Any, size: dict[str, int], text_length: int) -> tuple[dict, dict]:
    """(text_config, vision_config) of a tiny CLIP-style model (CLIP, OWLv2) of `size` with the locally
    built CLIP `tokenizer` and `text_length` positions."""
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tower = {
        "hidden_size": size["width"],
        "intermediate_size": size["ff"],
        "num_hidden_layers": size["layers"],
        "num_attention_heads": size["heads"],
    }
    text = {
        **tower,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": text_length,
        "eos_token_id": eos,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|startoftext|>"),
        "pad_token_id": eos,
    }
    return text, {**tower, "image_size": size["image_size"], "patch_size": size["patch"]}


def build_tiny_clip(path: str | Path, seed: int = 0, size: dict[str, int] = TINY) -> dict[str, Any]:
    """Write a random `CLIPModel` of `size` (TINY for tests, SMALL for benchmarks) + processor + aesthetic
    MLP into the new or empty folder `path`.

    `CLIPModel.from_pretrained(path)` and `CLIPProcessor.from_pretrained(path)` read it back; the MLP is
    `path/AESTHETIC_MLP_FILE`. The same seed writes the same weights. Returns a summary (parameters,
    projection width, image size).
    """
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPModel

    from stages.models.tokenizers import build_clip_tokenizer

    out = fresh_dir(path)
    tokenizer = build_clip_tokenizer()
    text, vision = tower_configs(tokenizer, size, tokenizer.model_max_length)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=size["projection"])
    with seeded(seed, "clip"):
        model = CLIPModel(config)
    with seeded(seed, "aesthetic_mlp"):
        mlp = AestheticMLP(size["projection"])
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps(image_processor_config(size["image_size"]), indent=2) + "\n"
    )
    save_file({k: v.contiguous() for k, v in mlp.state_dict().items()}, str(out / AESTHETIC_MLP_FILE))
    return {
        "out_dir": str(out),
        "seed": seed,
        "projection_dim": size["projection"],
        "image_size": size["image_size"],
        "parameters": {"clip": parameter_count(model), "aesthetic_mlp": parameter_count(mlp)},
    }
