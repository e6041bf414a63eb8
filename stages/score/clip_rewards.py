"""CLIP-based image rewards: PickScore, CLIP score, CLIP image similarity, LAION aesthetic.

Every scorer is a class registered with `register_reward`, configured by reward arguments
(``--reward-arg NAME.KEY=VALUE``, see `stages.score.registry`):

- ``model``: the checkpoint, a local folder (`from_pretrained`, ``local_files_only``: nothing is
  downloaded) or a Hub id the local Hugging Face cache holds. Required.
- ``processor``: where the CLIP processor lives when the model folder has none (PickScore_v1 uses
  the CLIP-H processor of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``); default: ``model``.
- ``device`` (default: the device `stages.dist.device` gives), ``dtype`` (fp32, bf16, fp16; default
  fp32), ``batch_size`` (images per forward, default 32).

The model loads on the first call and stays for the process; it runs in eval mode without gradients.
Images go through the checkpoint's `CLIPProcessor` as the references do (RGB, bicubic resize of the
shortest side, centre crop, CLIP mean/std); prompts through its tokenizer, padded and truncated to
the text tower's length (77). Embeddings are L2-normalised in float32. The numbers, per sample:

- ``pickscore``: s·cos(text, image)/26, s = exp(logit_scale) of PickScore_v1 (≈100), so about
  0.8–0.9 for typical images (flow_grpo's scale).
- ``clipscore``: s·cos(text, image)/100 = the diagonal of CLIP's logits_per_image /100; with openai
  CLIP ViT-L/14 (s = 100) that is the cosine, in [−1, 1], typically 0.2–0.35.
- ``image_similarity``: cos(image, reference image) in [−1, 1], both through the CLIP image tower.
- ``aesthetic``: LAION's MLP (``sac+logos+ava1-l14-linearMSE``) on the normalised CLIP ViT-L/14 image
  embedding; the raw predicted rating, about 1–10 (typically 4–7).
- ``temporal_consistency`` (a video reward): the mean over t of cos(frame t, frame t+1) of the CLIP
  image embeddings of a video's frames, in [−1, 1] (1: no visible change); ``None`` for a one-frame video.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from stages.errors import UserInputError
from stages.models.hub import cached_snapshot, download_hint, split_hub_id
from stages.safe_files import refuse_pickled_weights
from stages.score.registry import register_reward

REFERENCE_META_KEY = "reference_image"
PICKSCORE_DIVISOR = 26.0
CLIPSCORE_DIVISOR = 100.0
DTYPE_NAMES = ("fp32", "bf16", "fp16")


def local_path(reward: str, key: str, value: str | None, what: str) -> Path:
    """The local file or folder reward argument `key` names: a path, or a Hub id (`org/name[@revision]`)
    resolved in the local Hugging Face cache (`stages.models.hub`, never downloaded). A missing or
    unknown value is a `UserInputError` saying which ``--reward-arg`` to pass."""
    hint = f"pass --reward-arg {reward}.{key}=PATH ({what})"
    if value is None or not str(value).strip():
        raise UserInputError(f"reward {reward!r} needs its {key}: {hint}")
    path = Path(str(value)).expanduser()
    if path.exists():
        return path
    hub = split_hub_id(str(value))
    snapshot = cached_snapshot(*hub) if hub else None
    if snapshot is not None:
        return snapshot
    fetch = f" (fetch it with {download_hint(*hub)})" if hub else ""
    raise UserInputError(
        f"reward {reward!r}: {key}={value} is neither a file or folder nor a Hub id in the local "
        f"Hugging Face cache{fetch}; {hint}"
    )


def _features(output: Any) -> torch.Tensor:
    """Projected CLIP features [N, D] from `get_*_features`: a tensor, or a model output whose
    `pooler_output` holds them (transformers ≥ 5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _normalized(features: torch.Tensor) -> torch.Tensor:
    features = features.float()
    return features / features.norm(dim=-1, keepdim=True)


class ModelReward:
    """A reward computed by a model that loads once from local files: the arguments every model-based reward
    takes (``model``, ``device``, ``dtype``, ``batch_size``), checked when the scorer is built, and loading on
    first use behind a lock. Subclasses define `_load` and `scores`."""

    reward = "model"
    model_help = "a checkpoint"

    def __init__(
        self, model: str | None = None, device: str | None = None, dtype: str = "fp32", batch_size: int = 32
    ):
        self.model_path = local_path(self.reward, "model", model, self.model_help)
        if dtype not in DTYPE_NAMES:
            raise UserInputError(
                f"reward {self.reward!r}: dtype={dtype} is not one of {', '.join(DTYPE_NAMES)}; "
                f"pass --reward-arg {self.reward}.dtype=fp32"
            )
        if batch_size < 1:
            raise UserInputError(
                f"reward {self.reward!r}: batch_size={batch_size} must be at least 1; "
                f"pass --reward-arg {self.reward}.batch_size=32"
            )
        self.device_name = device
        self.dtype = dtype
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self._loaded: Any = None

    def set_heads(self, vision_heads: int, text_heads: int, published: str) -> None:
        """Attention head counts of a checkpoint whose weight shapes do not tell them (`published`: the
        released model's, named in the error)."""
        if vision_heads < 1 or text_heads < 1:
            raise UserInputError(
                f"reward {self.reward!r}: vision_heads={vision_heads}, text_heads={text_heads} must be at "
                f"least 1; {published}"
            )
        self.vision_heads = vision_heads
        self.text_heads = text_heads

    @property
    def weight_paths(self) -> dict[str, Path]:
        """The local files whose content determines this reward's numbers (for a run's identity)."""
        return {"model": self.model_path}

    def load(self) -> Any:
        """What `_load` returns (the model, its processor, the device), loaded on first use."""
        with self._lock:
            if self._loaded is None:
                self._loaded = self._load()
            return self._loaded

    def _load(self) -> Any:
        raise NotImplementedError

    def device(self) -> torch.device:
        """The ``device`` argument, else the device `stages.dist.device` gives."""
        from stages.dist import device as default_device

        return torch.device(self.device_name) if self.device_name else default_device()

    def scores(
        self, images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
    ) -> torch.Tensor:
        """One score per sample, float32 [N]; each reward defines it."""
        raise NotImplementedError

    def __call__(
        self, images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
    ) -> list[float]:
        return [float(v) for v in self.scores(images, prompts, meta)] if len(images) else []


class ClipReward(ModelReward):
    """Shared loading and embedding of the CLIP rewards; subclasses define `scores`."""

    reward = "clip"
    model_help = "a CLIP checkpoint folder or cached Hub id"

    def __init__(
        self,
        model: str | None = None,
        processor: str | None = None,
        device: str | None = None,
        dtype: str = "fp32",
        batch_size: int = 32,
    ):
        super().__init__(model, device, dtype, batch_size)
        self.processor_path = (
            local_path(self.reward, "processor", processor, "the folder of the CLIP processor")
            if processor is not None
            else self.model_path
        )

    @property
    def weight_paths(self) -> dict[str, Path]:
        return {"model": self.model_path, "processor": self.processor_path}

    def load(self) -> tuple[Any, Any, torch.device]:
        """(CLIPModel in eval mode without gradients, CLIPProcessor, device), loaded on first use."""
        return super().load()

    def _load(self) -> tuple[Any, Any, torch.device]:
        from transformers import CLIPModel, CLIPProcessor

        from stages.models.diffusion import DTYPES
        from stages.models.factory import no_progress_bars

        device = self.device()
        refuse_pickled_weights(self.model_path, f"reward {self.reward!r}: model")
        try:
            with no_progress_bars():
                model = CLIPModel.from_pretrained(
                    self.model_path, local_files_only=True, dtype=DTYPES[self.dtype], use_safetensors=True
                )
            processor = CLIPProcessor.from_pretrained(self.processor_path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UserInputError(
                f"reward {self.reward!r}: cannot load a CLIP model from {self.model_path} "
                f"(processor {self.processor_path}): {' '.join(str(exc).split())[:300]}"
            ) from exc
        model = model.to(device).eval()
        model.requires_grad_(False)
        return model, processor, device

    def pixel_values(self, processor: Any, images: Sequence[Image.Image]) -> torch.Tensor:
        """Model inputs [N, 3, S, S] of `images` through the checkpoint's CLIP image processor (RGB)."""
        chunk = [image.convert("RGB") for image in images]
        return processor.image_processor(images=chunk, return_tensors="pt")["pixel_values"]

    def tokens(self, processor: Any, prompts: Sequence[str], length: int) -> Any:
        """`input_ids` and `attention_mask` [N, L] of `prompts`, padded to the longest, truncated to `length`."""
        return processor.tokenizer(
            list(prompts), padding=True, truncation=True, max_length=length, return_tensors="pt"
        )

    @torch.inference_mode()
    def image_embeddings(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """L2-normalised CLIP image embeddings, float32 [N, D] on the CPU, `batch_size` images per forward."""
        model, processor, device = self.load()
        parts = []
        for start in range(0, len(images), self.batch_size):
            pixels = self.pixel_values(processor, images[start : start + self.batch_size])
            output = model.get_image_features(pixel_values=pixels.to(device, model.dtype))
            parts.append(_normalized(_features(output)).cpu())
        return torch.cat(parts) if parts else torch.zeros(0, model.config.projection_dim)

    @torch.inference_mode()
    def text_embeddings(self, prompts: Sequence[str]) -> torch.Tensor:
        """L2-normalised CLIP text embeddings, float32 [N, D] on the CPU (padded to the longest prompt of
        each forward, truncated to the text tower's length)."""
        model, processor, device = self.load()
        length = model.config.text_config.max_position_embeddings
        parts = []
        for start in range(0, len(prompts), self.batch_size):
            tokens = self.tokens(processor, prompts[start : start + self.batch_size], length)
            output = model.get_text_features(
                input_ids=tokens["input_ids"].to(device), attention_mask=tokens["attention_mask"].to(device)
            )
            parts.append(_normalized(_features(output)).cpu())
        return torch.cat(parts) if parts else torch.zeros(0, model.config.projection_dim)

    def logit_scale(self) -> float:
        """exp(logit_scale): the checkpoint's learned temperature (100 for openai CLIP)."""
        return float(self.load()[0].logit_scale.float().exp())


class TextImageScore(ClipReward):
    """exp(logit_scale)·cos(text, image)/`divisor`: CLIP's logits_per_image diagonal over a constant."""

    divisor: float

    def scores(
        self, images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
    ) -> torch.Tensor:
        cosine = (self.text_embeddings(prompts) * self.image_embeddings(images)).sum(-1)
        return self.logit_scale() * cosine / self.divisor


@register_reward("pickscore")
class PickScore(TextImageScore):
    """PickScore (Kirstain et al. 2023) as flow_grpo trains on it: exp(logit_scale)·cos(text, image)/26.

    model: the PickScore_v1 folder; processor: the CLIP-H processor folder when the model has none.
    """

    reward = "pickscore"
    model_help = "the PickScore_v1 folder, with processor= the CLIP-ViT-H-14 processor folder"
    divisor = PICKSCORE_DIVISOR


@register_reward("clipscore")
class ClipScore(TextImageScore):
    """CLIP score: CLIP's logits_per_image diagonal /100, i.e. exp(logit_scale)·cos(text, image)/100
    (the cosine for openai CLIP ViT-L/14)."""

    reward = "clipscore"
    model_help = "the openai/clip-vit-large-patch14 folder"
    divisor = CLIPSCORE_DIVISOR


@register_reward("image_similarity")
class ImageSimilarity(ClipReward):
    """cos(CLIP image embedding of the sample, of its reference image) in [−1, 1] (editing tasks).

    The reference is the image file at ``meta["reference_image"]`` (a prompt-file column), else the
    ``reference`` argument (one image for every sample); a path is absolute or relative to the
    working directory. Each distinct reference of a batch is embedded once.
    """

    reward = "image_similarity"
    model_help = "a CLIP checkpoint folder, e.g. openai/clip-vit-large-patch14"

    def __init__(
        self,
        model: str | None = None,
        processor: str | None = None,
        device: str | None = None,
        dtype: str = "fp32",
        batch_size: int = 32,
        reference: str | None = None,
    ):
        super().__init__(model, processor, device, dtype, batch_size)
        self.reference = (
            local_path(self.reward, "reference", reference, "an image file")
            if reference is not None
            else None
        )

    @property
    def weight_paths(self) -> dict[str, Path]:
        paths = super().weight_paths
        if self.reference is not None:
            paths["reference"] = self.reference
        return paths

    def _reference_of(self, item: dict, prompt: str) -> Path:
        value = item.get(REFERENCE_META_KEY) if isinstance(item, dict) else None
        if value is None:
            if self.reference is None:
                raise UserInputError(
                    f"reward 'image_similarity': prompt {prompt!r} has no reference_image in its metadata; "
                    "add a reference_image column to the prompt file or pass "
                    "--reward-arg image_similarity.reference=IMAGE"
                )
            return self.reference
        path = Path(str(value)).expanduser()
        if not path.is_file():
            raise UserInputError(
                f"reward 'image_similarity': reference_image {value} of prompt {prompt!r} is not a file; "
                "give a path absolute or relative to the working directory"
            )
        return path

    def scores(
        self, images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
    ) -> torch.Tensor:
        references = [self._reference_of(item, prompt) for item, prompt in zip(meta, prompts, strict=True)]
        unique = list(dict.fromkeys(references))
        table = dict(zip(unique, self.image_embeddings([_open_image(path) for path in unique]), strict=True))
        reference = torch.stack([table[path] for path in references])
        return (self.image_embeddings(images) * reference).sum(-1)


@register_reward("temporal_consistency", kind="video")
class TemporalConsistency(ClipReward):
    """Mean CLIP image-embedding cosine of consecutive frames of each video (temporal consistency).

    All frames of a batch go through the image tower together (`batch_size` per forward).
    """

    reward = "temporal_consistency"
    model_help = "a CLIP checkpoint folder, e.g. openai/clip-vit-large-patch14"

    def __call__(
        self, videos: Sequence[Sequence[Image.Image]], prompts: Sequence[str], meta: Sequence[dict]
    ) -> list[float | None]:
        embeddings = self.image_embeddings([frame for frames in videos for frame in frames])
        out: list[float | None] = []
        start = 0
        for frames in videos:
            e = embeddings[start : start + len(frames)]
            start += len(frames)
            out.append(float((e[:-1] * e[1:]).sum(-1).double().mean()) if len(frames) > 1 else None)
        return out


def _open_image(path: Path) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except Exception:  # PIL raises several types for an unreadable file
        raise UserInputError(
            f"reward 'image_similarity': reference image {path} is not a readable image file; fix the path"
        ) from None


def read_state_dict(reward: str, key: str, path: Path, what: str) -> dict[str, torch.Tensor]:
    """The tensors of the weights file reward argument `key` names: safetensors, or a torch checkpoint read
    with ``torch.load(weights_only=True)`` (never unpickling code). A checkpoint that wraps its weights in
    ``{"state_dict": ...}`` (HPSv2's) is unwrapped and a DataParallel ``module.`` prefix dropped. Anything
    else is a `UserInputError` naming the file and `what` it should be."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(path))
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for a file it cannot read safely
            raise UserInputError(
                f"reward {reward!r}: {key}={path} is not a tensor state dict ({type(exc).__name__}); "
                f"pass {what}"
            ) from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserInputError(f"reward {reward!r}: {key}={path} holds no tensor state dict; pass {what}")
    return {k.removeprefix("module."): v for k, v in state.items()}


def layer_count(state: dict[str, torch.Tensor], prefix: str) -> int:
    """How many numbered blocks ``{prefix}{i}.*`` a state dict holds (the depth of a tower)."""
    indices = {int(k[len(prefix) :].split(".")[0]) for k in state if k.startswith(prefix)}
    return max(indices) + 1 if indices else 0


def load_aesthetic_mlp(path: Path) -> torch.nn.Module:
    """LAION's aesthetic MLP from `path`: safetensors, or the published `.pth` state dict read with
    ``torch.load(weights_only=True)``. The layer widths come from the weights; eval mode."""
    from stages.models.clip import AestheticMLP

    state = read_state_dict(
        "aesthetic", "mlp", path, "the sac+logos+ava1-l14-linearMSE .pth or a .safetensors file"
    )
    first = state.get("layers.0.weight")
    if first is None or first.ndim != 2:
        raise UserInputError(
            f"reward 'aesthetic': mlp={path} has no layers.0.weight; expected LAION's keys "
            "layers.{0,2,4,6,7}.{weight,bias}"
        )
    mlp = AestheticMLP(int(first.shape[1]))
    try:
        mlp.load_state_dict(state)
    except RuntimeError as exc:
        raise UserInputError(
            f"reward 'aesthetic': mlp={path} does not match LAION's layout "
            f"(Linear D→1024→128→64→16→1): {' '.join(str(exc).split())[:300]}"
        ) from exc
    mlp.requires_grad_(False)
    return mlp.float().eval()


@register_reward("aesthetic")
class Aesthetic(ClipReward):
    """LAION aesthetic predictor: MLP(normalised CLIP ViT-L/14 image embedding), a ~1–10 rating.

    model: the openai/clip-vit-large-patch14 folder; mlp: ``sac+logos+ava1-l14-linearMSE.pth`` (or a
    safetensors copy). The MLP runs in float32 on the model's device.
    """

    reward = "aesthetic"
    model_help = "the openai/clip-vit-large-patch14 folder"

    def __init__(
        self,
        model: str | None = None,
        mlp: str | None = None,
        processor: str | None = None,
        device: str | None = None,
        dtype: str = "fp32",
        batch_size: int = 32,
    ):
        super().__init__(model, processor, device, dtype, batch_size)
        self.mlp_path = local_path(
            self.reward, "mlp", mlp, "LAION's sac+logos+ava1-l14-linearMSE.pth or a .safetensors copy"
        )
        self._mlp: torch.nn.Module | None = None

    @property
    def weight_paths(self) -> dict[str, Path]:
        return {**super().weight_paths, "mlp": self.mlp_path}

    def _head(self) -> torch.nn.Module:
        model, _, device = self.load()
        with self._lock:
            if self._mlp is None:
                mlp = load_aesthetic_mlp(self.mlp_path)
                width = model.config.projection_dim
                if mlp.layers[0].in_features != width:
                    raise UserInputError(
                        f"reward 'aesthetic': mlp={self.mlp_path} takes {mlp.layers[0].in_features}-wide "
                        f"embeddings but model={self.model_path} gives {width}; pair the MLP with its CLIP"
                    )
                self._mlp = mlp.to(device)
            return self._mlp

    @torch.inference_mode()
    def scores(
        self, images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
    ) -> torch.Tensor:
        head = self._head()
        embedding = self.image_embeddings(images)
        device = next(head.parameters()).device
        return head(embedding.to(device)).squeeze(-1).cpu()
