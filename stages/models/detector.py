"""Tiny random object detectors built offline: a DETR with COCO's labels and an OWLv2, each with its processor.

The detector-backed GenEval rewards (`stages.score.geneval_detect`) load transformers checkpoints
(``facebook/detr-resnet-50``, ``google/owlv2-base-patch16-ensemble``) with `from_pretrained`; tests
need folders of the same form without the network. Each builder writes a seeded model
(`save_pretrained`, safetensors) and a processor config of the published form at a tiny image size.

- `build_tiny_detr`: `DetrForObjectDetection` with DETR's 91-slot COCO ``id2label`` (`COCO_ID2LABEL`,
  "N/A" in the unused slots) and a transformers ResNet backbone (a `ResNetConfig`, so neither timm
  nor a download is needed), plus a ``DetrImageProcessor`` config (resize shortest edge 64, longest
  96; ImageNet mean/std; pad). A freshly initialised DETR gives every query nearly the same box and
  class (zero decoder inputs, query embeddings of std 0.02, a near-zero class head), so the builder
  redraws, under the seed, the query embeddings (std `QUERY_STD`) and the class head (std
  `CLASS_HEAD_STD`) with the other layers at std `INIT_STD`: the queries then disagree in class,
  box and confidence (about 0.3–0.95), which is what the plumbing tests need.
- `build_tiny_owlv2`: `Owlv2ForObjectDetection` with the local CLIP tokenizer of
  `stages.models.tokenizers` (16-token queries, as OWLv2's) and an ``Owlv2ImageProcessor`` config
  (pad to a square with grey 0.5, CLIP mean/std) with resizing *off*: OWLv2's processor needs scipy
  or torchvision to resize, which the tiny folder avoids, so its images must be at most
  `OWL_TINY["image_size"]` pixels on their long side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from stages.models.clip import fresh_dir, tower_configs
from stages.models.factory import no_progress_bars, parameter_count, seeded

# DETR's COCO label slots (facebook/detr-resnet-50's id2label): category ids 0..90, "N/A" where COCO
# has no category.
_COCO_SLOTS = (
    "N/A,person,bicycle,car,motorcycle,airplane,bus,train,truck,boat,traffic light,fire hydrant,N/A,"
    "stop sign,parking meter,bench,bird,cat,dog,horse,sheep,cow,elephant,bear,zebra,giraffe,N/A,"
    "backpack,umbrella,N/A,N/A,handbag,tie,suitcase,frisbee,skis,snowboard,sports ball,kite,"
    "baseball bat,baseball glove,skateboard,surfboard,tennis racket,bottle,N/A,wine glass,cup,fork,"
    "knife,spoon,bowl,banana,apple,sandwich,orange,broccoli,carrot,hot dog,pizza,donut,cake,chair,"
    "couch,potted plant,bed,N/A,dining table,N/A,N/A,toilet,N/A,tv,laptop,mouse,remote,keyboard,"
    "cell phone,microwave,oven,toaster,sink,refrigerator,N/A,book,clock,vase,scissors,teddy bear,"
    "hair drier,toothbrush"
)
COCO_ID2LABEL: dict[int, str] = dict(enumerate(_COCO_SLOTS.split(",")))

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

INIT_STD = 0.3
QUERY_STD = 10.0
CLASS_HEAD_STD = 1.0
DETR_TINY = {"d_model": 32, "ffn": 64, "heads": 2, "layers": 1, "queries": 20, "shortest": 64, "longest": 96}
OWL_TINY = {"width": 32, "layers": 2, "heads": 2, "ff": 64, "image_size": 32, "patch": 8}
OWL_QUERY_LENGTH = 16


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def detr_processor_config(shortest_edge: int, longest_edge: int) -> dict[str, Any]:
    """The `preprocessor_config.json` of a DETR checkpoint: bilinear resize to `shortest_edge` (long
    side at most `longest_edge`), rescale by 1/255, ImageNet mean/std, pad the batch with a pixel mask."""
    return {
        "image_processor_type": "DetrImageProcessor",
        "format": "coco_detection",
        "do_resize": True,
        "size": {"shortest_edge": shortest_edge, "longest_edge": longest_edge},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(IMAGENET_MEAN),
        "image_std": list(IMAGENET_STD),
        "do_pad": True,
        "do_convert_annotations": True,
    }


def build_tiny_detr(path: str | Path, seed: int = 0) -> dict[str, Any]:
    """Write a random tiny `DetrForObjectDetection` (COCO labels, ResNet backbone) and its image
    processor config into the new or empty folder `path`; `from_pretrained(path)` reads both back
    offline. The same seed writes the same weights. Returns a summary (parameters, labels, sizes)."""
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

    out = fresh_dir(path)
    size = DETR_TINY
    backbone = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", out_features=["stage2"]
    )
    config = DetrConfig(
        backbone_config=backbone,
        d_model=size["d_model"],
        encoder_layers=size["layers"],
        decoder_layers=size["layers"],
        encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"],
        encoder_ffn_dim=size["ffn"],
        decoder_ffn_dim=size["ffn"],
        num_queries=size["queries"],
        init_std=INIT_STD,
        id2label=COCO_ID2LABEL,
        label2id={name: i for i, name in COCO_ID2LABEL.items() if name != "N/A"},
    )
    with seeded(seed, "detr"):
        model = DetrForObjectDetection(config)
        with torch.no_grad():
            model.model.query_position_embeddings.weight.normal_(0.0, QUERY_STD)
            model.class_labels_classifier.weight.normal_(0.0, CLASS_HEAD_STD)
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
    _write_json(out / "preprocessor_config.json", detr_processor_config(size["shortest"], size["longest"]))
    return {
        "out_dir": str(out),
        "seed": seed,
        "model_type": "detr",
        "num_queries": size["queries"],
        "labels": len(COCO_ID2LABEL),
        "parameters": parameter_count(model),
    }


def owlv2_processor_config(image_size: int, *, resize: bool) -> dict[str, Any]:
    """The `preprocessor_config.json` of an OWLv2 checkpoint: pad to a square with grey 0.5, resize to
    `image_size` (when `resize`), rescale by 1/255, CLIP mean/std."""
    from stages.models.clip import CLIP_MEAN, CLIP_STD

    return {
        "image_processor_type": "Owlv2ImageProcessor",
        "processor_class": "Owlv2Processor",
        "do_pad": True,
        "do_resize": resize,
        "size": {"height": image_size, "width": image_size},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
    }


def build_tiny_owlv2(path: str | Path, seed: int = 0) -> dict[str, Any]:
    """Write a random tiny `Owlv2ForObjectDetection`, its tokenizer and processor configs into the new
    or empty folder `path` (`Owlv2Processor.from_pretrained(path)` reads them back offline; resizing
    is off, see the module docstring). The same seed writes the same weights. Returns a summary."""
    from transformers import Owlv2Config, Owlv2ForObjectDetection

    from stages.models.tokenizers import build_clip_tokenizer

    out = fresh_dir(path)
    tokenizer = build_clip_tokenizer()
    tokenizer.model_max_length = OWL_QUERY_LENGTH
    size = OWL_TINY
    text, vision = tower_configs(tokenizer, size, OWL_QUERY_LENGTH)
    # OWLv2's class head compares queries at the text width
    config = Owlv2Config(text_config=text, vision_config=vision, projection_dim=size["width"])
    with seeded(seed, "owlv2"):
        model = Owlv2ForObjectDetection(config)
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    _write_json(out / "preprocessor_config.json", owlv2_processor_config(size["image_size"], resize=False))
    _write_json(out / "processor_config.json", {"processor_class": "Owlv2Processor"})
    return {
        "out_dir": str(out),
        "seed": seed,
        "model_type": "owlv2",
        "image_size": size["image_size"],
        "parameters": parameter_count(model),
    }
