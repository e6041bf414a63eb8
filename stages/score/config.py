"""`score`'s and `serve-reward`'s settings as typed configs, and the names their knobs take; torch-free.

`ScoreConfig` and `ServeRewardConfig` are the single declarations of every `omnirl score` and `omnirl
serve-reward` option (help, choices, panel), from which the CLI generates their options
(`omnirl_cli.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages import knobs
from stages.knobs import knob
from stages.score.registry import ENTRY_POINT_GROUP

ON_ERROR_MODES = ("fail", "zero")
# The built-in rewards, offered by completion (plugins are accepted beside them); the registry
# registers them when their modules load (`stages.score.registry._BUILTIN_MODULES`).
BUILTIN_REWARDS = (
    "accuracy",
    "aesthetic",
    "bleu",
    "clipscore",
    "edit_preservation",
    "format_boxed",
    "format_think_answer",
    "geneval",
    "geneval_exact",
    "geneval_shapes",
    "geneval_shapes_exact",
    "geneval_shapes_strict",
    "geneval_strict",
    "hpsv2",
    "image_similarity",
    "imagereward",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "length_penalty",
    "meteor",
    "ocr",
    "ocr_edit",
    "omnirl_accuracy",
    "omnirl_length",
    "pickscore",
    "repetition_penalty",
    "rouge_1",
    "rouge_l",
    "rouge_l_recall",
    "temporal_consistency",
    "text_similarity",
    "video_ocr",
    "vlm_judge",
)
DEFERRED = "Deferred media"


@dataclass
class ScoreConfig:
    """Every setting of the `score` stage (`omnirl score`)."""

    inputs: list[Path] | None = knobs.inputs()
    out: Path | None = knobs.out()
    reward: list[str] | None = knob(
        None,
        "A built-in image reward (jpeg_compressibility, "
        "jpeg_incompressibility, ocr, pickscore, clipscore, image_similarity, aesthetic, hpsv2, imagereward, "
        "geneval, geneval_strict, geneval_exact, geneval_shapes, geneval_shapes_strict, geneval_shapes_exact, "
        "vlm_judge), an edit reward of an editing rollout (edit_preservation: 1 - mean |result - source| outside "
        "the row's edit_mask / edit_boxes; ocr_edit: the text changed as asked; vlm_judge preset=edit), for video rollouts an image "
        "reward on the frames with @frames=mean|min|first|last (e.g. pickscore@frames=mean=0.5) or a video "
        "reward (temporal_consistency: CLIP cosine of consecutive frames; video_ocr: flow_grpo's Wan OCR "
        "over every 4th frame), or a text reward for VLM rollouts "
        "(format_think_answer, format_boxed, accuracy, bleu, rouge_1, rouge_l, rouge_l_recall, meteor, "
        "text_similarity, length_penalty, repetition_penalty, omnirl_accuracy, omnirl_length), remote:http://HOST:PORT/NAME (a reward served by `omnirl "
        "serve-reward`), module:function or path/file.py:function, or an 'omnirl.rewards' entry point. The "
        "total is the weighted sum.",
        short="-r",
        names=BUILTIN_REWARDS,
        entry_points=ENTRY_POINT_GROUP,
        metavar="NAME[@frames=AGG][=WEIGHT]",
    )
    reward_args: list[str] | None = knob(
        None,
        "An argument of reward NAME (YAML: score: reward_args: "
        "{NAME: {KEY: VALUE}}). The CLIP rewards take model=PATH (a local folder, or a Hub id in the local "
        "HF cache; required), processor=PATH (default: model), device=, dtype=fp32|bf16|fp16, batch_size=N. "
        "pickscore: exp(logit_scale)*cos(text, image)/26 with model=PickScore_v1 and processor=the "
        "CLIP-ViT-H-14 folder (~0.8-0.9). clipscore: CLIP logits_per_image/100 with model=openai "
        "clip-vit-large-patch14 (the cosine, ~0.2-0.35). image_similarity: CLIP image-image cosine to the "
        "prompt row's reference_image file, or to reference=IMAGE. aesthetic: LAION MLP on the normalised "
        "CLIP ViT-L/14 image embedding, mlp=sac+logos+ava1-l14-linearMSE.pth or .safetensors (~1-10). "
        "hpsv2: HPS v2.1, cos(image, text) of the ViT-H-14 in model=HPS_v2.1_compressed.pt (read with "
        "weights_only=True), image letterboxed to 224 as hpsv2 does, tokenizer=a CLIP tokenizer folder "
        "(default: laion/CLIP-ViT-H-14-laion2B-s32B-b79K in the HF cache) (~0.2-0.35). imagereward: "
        "ImageReward v1.0's normalised score (MLP on BLIP's image-grounded [CLS] - 0.1672)/1.0333 with "
        "model=ImageReward.pt, tokenizer=a bert-base-uncased folder (default: google-bert/bert-base-uncased "
        "in the HF cache) (~-2..2). "
        "temporal_consistency takes the CLIP arguments; video_ocr frame_interval=N (4). NAME@frames=AGG uses "
        "NAME's arguments. "
        "Model paths are part of the output's identity (with their content digests). omnirl_accuracy: "
        "bleu=, rouge=, meteor= (metric weights, OmniRL 0.5/0.5/0), require_answer=true; omnirl_length: "
        "target= (500 characters), decay= (0.9), scale= (500).",
        flag="--reward-arg",
        metavar="NAME.KEY=VALUE",
    )
    batch_size: int = knob(32, "Samples per scorer call.", low=1)
    on_error: str = knob(
        "fail",
        "fail (default): stop on a failed/NaN score; zero: record 0 and flag the row in the "
        "column reward_failed, counted as reward_failed (--json, manifest): reward statistics leave it "
        "out, advantage gives it 0 and leaves it out of every group/batch statistic, update skips it. "
        "There is no nan mode: score never writes NaN; a NaN reward in a set from another tool is "
        "treated as a flagged one.",
        choices=ON_ERROR_MODES,
    )
    mixed_precision: str | None = knobs.mixed_precision(
        "the rewards' model forwards on this process's device (CLIP rewards, vlm_judge); recorded for "
        "rewards that are not torch models or run remotely"
    )
    model: str | None = knob(
        None,
        f"Deferred media (`sample --defer-decode`): the pipeline whose VAE decodes the final latents, "
        f"{knobs.WEIGHTS_FROM} (default: the model folder the rollout's manifest records; ignored for a rollout "
        "that stores its media).",
        short="-m",
        metavar=knobs.WEIGHTS_METAVAR,
        panel=DEFERRED,
    )
    keep_media: bool = knob(
        False,
        "Deferred media: also write the decoded media (image PNG / video MP4, and frames where the "
        "rollout asked for --save-frames) in this command's output, where `omnirl report` finds them.",
        panel=DEFERRED,
    )
    vae_tiling: bool = knob(
        False,
        "Deferred media: decode in overlapping spatial tiles (as `sample --vae-tiling`); ignored for a "
        "rollout that stores its media.",
        panel=DEFERRED,
    )
    vae_slicing: bool = knob(
        False,
        "Deferred media: decode one sample at a time (as `sample --vae-slicing`); ignored for a rollout "
        "that stores its media.",
        panel=DEFERRED,
    )
    fmt: str = knobs.shard_format()
    report_to: list[str] | None = knobs.report_to()
    run_name: str | None = knobs.run_name()
    overwrite: bool = knobs.overwrite()


@dataclass
class ServeRewardConfig:
    """Every setting of the reward server (`omnirl serve-reward`)."""

    reward: list[str] | None = knob(
        None,
        "A reward to serve (built-in, module:function, path/file.py:function or entry point), as `omnirl "
        "score --reward` takes it. POST /NAME scores one, POST /score all (the weighted sum in `reward`).",
        short="-r",
        names=BUILTIN_REWARDS,
        entry_points=ENTRY_POINT_GROUP,
        metavar="NAME[=WEIGHT]",
    )
    reward_args: list[str] | None = knob(
        None,
        "An argument of reward NAME, as `omnirl score --reward-arg`.",
        flag="--reward-arg",
        metavar="NAME.KEY=VALUE",
    )
    host: str = knobs.host()
    port: int = knobs.port(18090)
    token_env: str | None = knobs.token_env()
    max_request_mb: int = knobs.max_request_mb(64)
    max_batch: int = knobs.max_batch(256)
    max_connections: int = knobs.max_connections()
    workers: int = knobs.workers()
    request_timeout: float = knobs.request_timeout()
