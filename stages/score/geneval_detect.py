"""GenEval rewards over a transformers object detector and a CLIP colour classifier.

GenEval scores an image with Mask2Former (Swin-S, COCO) detections and a CLIP ViT-L/14 colour
classifier; here the detector is a transformers object-detection checkpoint and the colours come from
a CLIP checkpoint, and `stages.score.geneval` turns the detections into the numbers:

- ``geneval``: Flow-GRPO's partial-credit training reward (``GenEvalResult.score``; negative when far
  too many objects are found);
- ``geneval_strict``: GenEval's benchmark correctness, 1.0 or 0.0 (``GenEvalResult.strict``);
- ``geneval_exact``: the reward server's exact correctness, 1.0 or 0.0 (``GenEvalResult.exact``: exact
  counts, so an extra object fails it where strict lets it pass).

Reward arguments (``--reward-arg geneval.KEY=VALUE``, the same for ``geneval_strict`` and ``geneval_exact``):

- ``detector`` (required): a checkpoint folder or cached Hub id; its ``config.json`` ``model_type``
  picks the kind. ``detr``: `DetrForObjectDetection` and its image processor, a closed vocabulary
  (``id2label``; a prompt naming a class outside it is a bad prompt file). ``owlv2``:
  `Owlv2ForObjectDetection` and `Owlv2Processor`, open vocabulary: one text query
  ``"a photo of a {class}"`` per class the prompt names (include and exclude), a box taking the
  query it scores highest (sigmoid). OWLv2's processor needs scipy (or torchvision) to resize.
- ``clip`` (required): the CLIP checkpoint of the colour classifier (GenEval's is openai
  ``clip-vit-large-patch14``), loaded as `stages.score.clip_rewards` loads CLIP.
- ``threshold`` (0.3) and ``counting_threshold`` (0.9, for the "counting" tag): GenEval's confidence
  cut-offs; a detection counts when its confidence is strictly above. They were set for
  Mask2Former's scores: OWLv2's sigmoid scores run lower, so lower them with OWLv2.
- ``device`` (default: the device `stages.dist.device` gives), ``batch_size`` (images per detector
  forward and crops per CLIP forward, default 16).

Detections: the processor's ``post_process_object_detection`` at the original image size gives
boxes (x0, y0, x1, y1) in pixels, clamped here to the image, and a confidence (DETR: the softmax
probability of the best class, no-object excluded). Labels become GenEval's class names: lower case,
``_``/``-`` as spaces, then `LABEL_ALIASES`. DETR's COCO ``id2label`` says ``mouse``, ``remote`` and
``keyboard`` where GenEval says "computer mouse", "tv remote" and "computer keyboard"; its
"dining table", "potted plant", "tv", "couch", "motorcycle", "airplane", "hair drier" and "donut"
are already GenEval's. The aliases also take the Pascal VOC spellings ("tvmonitor", "diningtable",
"pottedplant", "sofa", "motorbike", "aeroplane") and "hair dryer", "doughnut", "cellphone". A
label left as "n/a" (DETR's unused slots) is dropped.

Colours, as GenEval's classifier: for each class a colour clause names, its detections that GenEval
keeps (confidence above the cut-off, the 16 most confident) are cropped from the RGB image at their
box (PIL's rounding; at least one pixel; box detectors give no mask, so GenEval's grey background
outside the mask does not apply) and embedded by CLIP's image tower (L2-normalised). Each of
`GENEVAL_COLORS` has a text embedding: the mean of the L2-normalised embeddings of the three
`COLOR_TEMPLATES` for the class, normalised again. A crop's colour is the argmax of the cosines.

A sample whose metadata has no include clause is ``None`` with a logged reason (never a silent 0);
a colour outside `GENEVAL_COLORS` is a bad prompt file (`UserInputError`). Per-tag accuracy:
``tag_accuracy(reward.evaluate_batch(...))`` (`stages.score.geneval`); a scorer returns one number
per sample, so the scoring stage records the per-sample values only.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image

from stages.errors import UserInputError
from stages.safe_files import refuse_pickled_weights
from stages.score.clip_rewards import ClipReward, local_path
from stages.score.geneval import (
    COUNTING_TAG,
    COUNTING_THRESHOLD,
    MAX_OBJECTS,
    THRESHOLD,
    Box,
    Detection,
    GenEvalResult,
    evaluate,
    has_include,
    parse_clauses,
)
from stages.score.registry import register_reward

logger = logging.getLogger(__name__)

GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = (
    "a photo of a {color} {label}",
    "a photo of a {color}-colored {label}",
    "a photo of a {color} object",
)
OWL_QUERY_TEMPLATE = "a photo of a {label}"
DETECTOR_KINDS = ("detr", "owlv2")

# GenEval's 80 class names (COCO's, in COCO order, with GenEval's spelling).
_GENEVAL_NAMES = (
    "person,bicycle,car,motorcycle,airplane,bus,train,truck,boat,traffic light,fire hydrant,stop sign,"
    "parking meter,bench,bird,cat,dog,horse,sheep,cow,elephant,bear,zebra,giraffe,backpack,umbrella,"
    "handbag,tie,suitcase,frisbee,skis,snowboard,sports ball,kite,baseball bat,baseball glove,"
    "skateboard,surfboard,tennis racket,bottle,wine glass,cup,fork,knife,spoon,bowl,banana,apple,"
    "sandwich,orange,broccoli,carrot,hot dog,pizza,donut,cake,chair,couch,potted plant,bed,"
    "dining table,toilet,tv,laptop,computer mouse,tv remote,computer keyboard,cell phone,microwave,"
    "oven,toaster,sink,refrigerator,book,clock,vase,scissors,teddy bear,hair drier,toothbrush"
)
GENEVAL_CLASSES: tuple[str, ...] = tuple(_GENEVAL_NAMES.split(","))
LABEL_ALIASES: dict[str, str] = {
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",
    "tvmonitor": "tv",
    "tv monitor": "tv",
    "diningtable": "dining table",
    "pottedplant": "potted plant",
    "sofa": "couch",
    "motorbike": "motorcycle",
    "aeroplane": "airplane",
    "hair dryer": "hair drier",
    "doughnut": "donut",
    "cellphone": "cell phone",
}
_UNUSED_LABEL = "n/a"


def geneval_class(label: str) -> str | None:
    """GenEval's name for detector label `label` (module docstring); None for an unused slot ("N/A")."""
    name = " ".join(label.lower().replace("_", " ").replace("-", " ").split())
    name = LABEL_ALIASES.get(name, name)
    return None if not name or name == _UNUSED_LABEL else name


def clamp_box(box: Sequence[float], width: int, height: int) -> Box:
    """`box` (x0, y0, x1, y1) clamped to the image [0, width] × [0, height]."""
    x0, y0, x1, y1 = (float(v) for v in box)
    return (
        min(max(x0, 0.0), width),
        min(max(y0, 0.0), height),
        min(max(x1, 0.0), width),
        min(max(y1, 0.0), height),
    )


def crop_box(box: Box, width: int, height: int) -> tuple[int, int, int, int]:
    """The integer crop of an in-image `box`: rounded as PIL's `Image.crop` rounds, widened to at
    least one pixel so a degenerate box still has a colour."""
    x0, y0, x1, y1 = (round(v) for v in box)
    x0, y0 = min(x0, width - 1), min(y0, height - 1)
    return x0, y0, max(x1, x0 + 1), max(y1, y0 + 1)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


class _ColorClip(ClipReward):
    """GenEval's colour classifier CLIP: `ClipReward`'s loading and embeddings under the reward's name."""

    def __init__(self, reward: str, model: Path, device: str | None, batch_size: int):
        self.reward = reward
        super().__init__(model=str(model), device=device, batch_size=batch_size)


class DetectorGenEval:
    """Shared detector, colour classifier and GenEval evaluation of the ``geneval`` rewards."""

    reward = "geneval"

    def __init__(
        self,
        detector: str | None = None,
        clip: str | None = None,
        threshold: float = THRESHOLD,
        counting_threshold: float = COUNTING_THRESHOLD,
        device: str | None = None,
        batch_size: int = 16,
    ):
        self.detector_path = local_path(
            self.reward, "detector", detector, "a DETR or OWLv2 object-detection checkpoint folder"
        )
        self.clip_path = local_path(
            self.reward,
            "clip",
            clip,
            "a CLIP checkpoint folder for the colours, e.g. openai/clip-vit-large-patch14",
        )
        for key, value in (("threshold", threshold), ("counting_threshold", counting_threshold)):
            if not 0.0 <= value < 1.0:
                raise UserInputError(
                    f"reward {self.reward!r}: {key}={value} must be in [0, 1); "
                    f"pass --reward-arg {self.reward}.{key}=0.3"
                )
        if batch_size < 1:
            raise UserInputError(
                f"reward {self.reward!r}: batch_size={batch_size} must be at least 1; "
                f"pass --reward-arg {self.reward}.batch_size=16"
            )
        self.kind, self.vocabulary = self._read_config()
        self.threshold = threshold
        self.counting_threshold = counting_threshold
        self.device_name = device
        self.batch_size = batch_size
        self.clip = _ColorClip(self.reward, self.clip_path, device, batch_size)
        self._lock = threading.Lock()
        self._detector: tuple[Any, Any, torch.device] | None = None
        self._color_text: dict[str, torch.Tensor] = {}

    @property
    def weight_paths(self) -> dict[str, Path]:
        """The local files whose content determines this reward's numbers (for a run's identity)."""
        return {"detector": self.detector_path, "clip": self.clip_path}

    def _read_config(self) -> tuple[str, frozenset[str] | None]:
        """The detector's kind from its ``config.json``, and its class vocabulary (None: open, OWLv2)."""
        path = self.detector_path / "config.json"
        hint = f"pass --reward-arg {self.reward}.detector=PATH (a DETR or OWLv2 checkpoint folder)"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UserInputError(
                f"reward {self.reward!r}: cannot read {path} ({type(exc).__name__}); {hint}"
            ) from None
        kind = config.get("model_type") if isinstance(config, dict) else None
        if kind not in DETECTOR_KINDS:
            raise UserInputError(
                f"reward {self.reward!r}: detector {self.detector_path} has model_type {kind!r}, "
                f"not one of {', '.join(DETECTOR_KINDS)}; {hint}"
            )
        if kind != "detr":
            return kind, None
        names = {geneval_class(str(label)) for label in (config.get("id2label") or {}).values()}
        return kind, frozenset(name for name in names if name is not None)

    def load_detector(self) -> tuple[Any, Any, torch.device]:
        """(detector in eval mode without gradients, its processor, device), loaded on first use."""
        with self._lock:
            if self._detector is None:
                self._detector = self._load_detector()
            return self._detector

    def _load_detector(self) -> tuple[Any, Any, torch.device]:
        from transformers import (
            AutoImageProcessor,
            DetrForObjectDetection,
            Owlv2ForObjectDetection,
            Owlv2Processor,
        )

        from stages.dist import device as default_device
        from stages.models.factory import no_progress_bars

        device = torch.device(self.device_name) if self.device_name else default_device()
        path = self.detector_path
        refuse_pickled_weights(path, f"reward {self.reward!r}: detector")
        try:
            with no_progress_bars():
                if self.kind == "detr":
                    model = DetrForObjectDetection.from_pretrained(
                        path, local_files_only=True, use_safetensors=True
                    )
                    processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
                else:
                    model = Owlv2ForObjectDetection.from_pretrained(
                        path, local_files_only=True, use_safetensors=True
                    )
                    processor = Owlv2Processor.from_pretrained(path, local_files_only=True)
        except ImportError as exc:
            raise UserInputError(
                f"reward {self.reward!r}: the {self.kind} detector {path} needs a package that is not "
                f"installed; install it: {_one_line(exc)}"
            ) from exc
        except (OSError, ValueError) as exc:
            raise UserInputError(
                f"reward {self.reward!r}: cannot load a {self.kind} detector from {path}: {_one_line(exc)}"
            ) from exc
        model = model.to(device).eval()
        model.requires_grad_(False)
        return model, processor, device

    def _preprocess(self, processor: Any, **inputs: Any) -> Any:
        try:
            return processor(**inputs, return_tensors="pt")
        except ImportError as exc:
            raise UserInputError(
                f"reward {self.reward!r}: the {self.kind} processor of {self.detector_path} needs a "
                f"package that is not installed; install it: {_one_line(exc)}"
            ) from exc

    def _label_names(self, model: Any) -> dict[int, str | None]:
        return {int(i): geneval_class(str(label)) for i, label in model.config.id2label.items()}

    @torch.inference_mode()
    def detect(
        self, images: Sequence[Image.Image], classes: Sequence[Sequence[str]]
    ) -> list[list[Detection]]:
        """Detections of each RGB image (colour None), in the detector's order: GenEval class names,
        boxes clamped to the image, confidence above the lower cut-off. `classes[i]`: the classes
        image i's prompt names (OWLv2's queries; DETR detects its whole vocabulary)."""
        model, processor, device = self.load_detector()
        cutoff = min(self.threshold, self.counting_threshold)
        names = self._label_names(model) if self.kind == "detr" else {}
        found: list[list[Detection]] = []
        for start in range(0, len(images), self.batch_size):
            chunk = images[start : start + self.batch_size]
            queries = [list(c) for c in classes[start : start + self.batch_size]]
            sizes = [(image.height, image.width) for image in chunk]
            if self.kind == "detr":
                inputs = self._preprocess(processor, images=list(chunk))
                outputs = model(**{key: value.to(device) for key, value in inputs.items()})
                raw = SimpleNamespace(
                    logits=outputs.logits.float().cpu(), pred_boxes=outputs.pred_boxes.float().cpu()
                )
                results = processor.post_process_object_detection(raw, threshold=cutoff, target_sizes=sizes)
                labels = [names for _ in chunk]
            else:
                texts = [[OWL_QUERY_TEMPLATE.format(label=c) for c in q] for q in queries]
                inputs = self._preprocess(processor, text=texts, images=list(chunk), truncation=True)
                outputs = model(**{key: value.to(device) for key, value in inputs.items()})
                # The processor pads every image's queries to the longest list with " ", a query the
                # model scores like any other: each image keeps only the logits of its own queries.
                results = [
                    processor.image_processor.post_process_object_detection(
                        SimpleNamespace(
                            logits=outputs.logits[i : i + 1, :, : len(q)].float().cpu(),
                            pred_boxes=outputs.pred_boxes[i : i + 1].float().cpu(),
                        ),
                        threshold=cutoff,
                        target_sizes=[sizes[i]],
                    )[0]
                    for i, q in enumerate(queries)
                ]
                labels = [dict(enumerate(q)) for q in queries]
            for result, (height, width), table in zip(results, sizes, labels, strict=True):
                detections = []
                for score, label, box in zip(
                    result["scores"].tolist(),
                    result["labels"].tolist(),
                    result["boxes"].tolist(),
                    strict=True,
                ):
                    name = table.get(int(label))
                    if name is not None:
                        detections.append(Detection(name, clamp_box(box, width, height), None, float(score)))
                found.append(detections)
        return found

    def color_classifier(self, label: str) -> torch.Tensor:
        """float32 [len(GENEVAL_COLORS), D]: per colour, the normalised mean of the normalised CLIP text
        embeddings of `COLOR_TEMPLATES` for class `label`; cached per class."""
        with self._lock:
            cached = self._color_text.get(label)
        if cached is not None:
            return cached
        texts = [t.format(color=c, label=label) for c in GENEVAL_COLORS for t in COLOR_TEMPLATES]
        mean = self.clip.text_embeddings(texts).view(len(GENEVAL_COLORS), len(COLOR_TEMPLATES), -1).mean(1)
        classifier = mean / mean.norm(dim=-1, keepdim=True)
        with self._lock:
            return self._color_text.setdefault(label, classifier)

    def color_detections(
        self,
        images: Sequence[Image.Image],
        meta: Sequence[Mapping[str, Any]],
        detections: Sequence[Sequence[Detection]],
    ) -> list[list[Detection]]:
        """`detections` with a colour on each one GenEval keeps of a class a colour clause names."""
        out = [list(items) for items in detections]
        jobs: list[tuple[int, int]] = []
        crops: list[Image.Image] = []
        for i, (image, item, items) in enumerate(zip(images, meta, out, strict=True)):
            include, _ = parse_clauses(item)
            cutoff = self.counting_threshold if item.get("tag") == COUNTING_TAG else self.threshold
            for label in dict.fromkeys(c.label for c in include if c.color is not None):
                kept = [j for j, d in enumerate(items) if d.label == label and d.confidence > cutoff]
                for j in sorted(kept, key=lambda j: -items[j].confidence)[:MAX_OBJECTS]:
                    jobs.append((i, j))
                    crops.append(image.crop(crop_box(items[j].box, image.width, image.height)))
        if not crops:
            return out
        embeddings = self.clip.image_embeddings(crops)
        for (i, j), embedding in zip(jobs, embeddings, strict=True):
            scores = self.color_classifier(out[i][j].label) @ embedding
            out[i][j] = replace(out[i][j], color=GENEVAL_COLORS[int(scores.argmax())])
        return out

    def _check(self, item: Mapping[str, Any]) -> list[str]:
        """The classes `item` names (include, then exclude, once each); a class the detector cannot
        detect or a colour GenEval has no classifier for is a bad prompt file."""
        include, exclude = parse_clauses(item)
        for clause in [*include, *exclude]:
            if self.vocabulary is not None and clause.label not in self.vocabulary:
                raise UserInputError(
                    f"reward {self.reward!r}: GenEval class {clause.label!r} is not a label of detector "
                    f"{self.detector_path}; use GenEval's COCO class names or an OWLv2 detector"
                )
            if clause.color is not None and clause.color not in GENEVAL_COLORS:
                raise UserInputError(
                    f"reward {self.reward!r}: GenEval colour {clause.color!r} is not one of "
                    f"{', '.join(GENEVAL_COLORS)}; fix the prompt file's GenEval columns"
                )
        return list(dict.fromkeys(c.label for c in [*include, *exclude]))

    def evaluate_batch(
        self, images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[Mapping[str, Any]]
    ) -> list[GenEvalResult | None]:
        """GenEval verdict per image (None, logged, where the metadata has no include clause)."""
        results: list[GenEvalResult | None] = [None] * len(images)
        todo: list[int] = []
        classes: list[list[str]] = []
        for index, (prompt, item) in enumerate(zip(prompts, meta, strict=True)):
            if not has_include(item):
                logger.warning(
                    "reward %r: batch item %d (prompt %r) has no GenEval 'include' clauses in its "
                    "prompt_meta; scored None",
                    self.reward,
                    index,
                    prompt,
                )
                continue
            classes.append(self._check(item))
            todo.append(index)
        if not todo:
            return results
        rgb = [images[i].convert("RGB") for i in todo]
        items = [meta[i] for i in todo]
        detections = self.color_detections(rgb, items, self.detect(rgb, classes))
        for index, item, found in zip(todo, items, detections, strict=True):
            results[index] = evaluate(
                item, found, threshold=self.threshold, counting_threshold=self.counting_threshold
            )
        return results

    def value(self, result: GenEvalResult) -> float:
        """The reward's number for one verdict; each reward defines it."""
        raise NotImplementedError

    def __call__(
        self, images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
    ) -> list[float | None]:
        return [None if r is None else self.value(r) for r in self.evaluate_batch(images, prompts, meta)]


@register_reward("geneval")
class GenEval(DetectorGenEval):
    """GenEval partial-credit score per image (Flow-GRPO's training reward; negative for far too many
    objects), from a DETR/OWLv2 detector and a CLIP colour classifier."""

    reward = "geneval"

    def value(self, result: GenEvalResult) -> float:
        return result.score


@register_reward("geneval_strict")
class GenEvalStrict(DetectorGenEval):
    """GenEval's benchmark correctness per image, 1.0 or 0.0, from a DETR/OWLv2 detector and a CLIP
    colour classifier."""

    reward = "geneval_strict"

    def value(self, result: GenEvalResult) -> float:
        return float(result.strict)


@register_reward("geneval_exact")
class GenEvalExact(DetectorGenEval):
    """Flow-GRPO's reward-server correctness per image (its logged strict accuracy), 1.0 or 0.0: exact
    counts and colour counts, from a DETR/OWLv2 detector and a CLIP colour classifier."""

    reward = "geneval_exact"

    def value(self, result: GenEvalResult) -> float:
        return float(result.exact)
