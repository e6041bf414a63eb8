"""`sample`'s settings as typed configs, one per kind of model, and the names their knobs take; torch-free.

`SampleRun` declares what both kinds of `omnirl sample` take (prompts, group size, seed, batch size,
output, engine ...); `SampleConfig` (a diffusion pipeline: images or videos) and `VLMSampleConfig` (a
vision-language model: text responses) add each kind's own knobs. The CLI generates the union of both as
the options of `omnirl sample` and resolves every source into the config of the kind its --model is
(`omnirl_cli.generate`), so a knob of the other kind is refused by construction.

Each config also is the record a rollout keeps for replay (`RECORDED`: the manifest's `sample_config` /
`vlm_sample_config`, and the rollout protocol's `sampling_params`), read back with `from_record`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from stages import knobs
from stages.errors import UserInputError
from stages.knobs import ENGINE, IO, MAX_FRAMES, MIXED_PRECISION_MODES, SAMPLING, WINDOW_STRATEGIES, knob

# Closed sets, validated by the torch modules that act on them (samplers, windows, rollout, vlm_data).
SAMPLERS = ("ode", "sde", "cps", "dance")
LATENT_DTYPE_NAMES = ("fp32", "bf16")  # dtypes of the stored latents (`stages.sample.rollout`)
LAYOUTS = ("verl", "easyr1")  # VLM prompt tables (`stages.sample.vlm_data`)
# Built-in rollout engines: a diffusion engine registry (`stages.sample.engines`, plugins beside them)
# and the VLM engines (`stages.sample.vlm_stage`).
DEFAULT_ENGINE = "diffusers"
DIFFUSION_ENGINES = (DEFAULT_ENGINE, "remote", "vllm-omni")
VLM_ENGINES = ("hf", "openai", "sglang")  # openai: vLLM's dialect of the chat API (`openai_engine`)
ENGINES = (*DIFFUSION_ENGINES, *VLM_ENGINES)
ENGINE_ENTRY_POINTS = "omnirl.engines"

MODEL = "Model"
VLM = "Vision-language models"
VIDEO = "Video"


@dataclass
class SampleRun:
    """What both kinds of `omnirl sample` take: the run's input and output, its weights and engine, and
    the sampling settings a text rollout reads too (--iteration is read by diffusion only, but every
    recipe passes it to every stage)."""

    out: Path | None = knobs.out()
    model: str | None = knobs.model(
        "Diffusers pipeline, or a transformers VLM (Qwen2.5-VL, a Qwen3-Omni thinker, or a whole Qwen3-Omni "
        "folder, of which only the thinker loads): text responses",
        MODEL,
    )
    adapter: str | None = knobs.adapter(panel=MODEL)
    dtype: str = knobs.dtype(trains=False, panel=MODEL)
    mixed_precision: str | None = knobs.mixed_precision(
        "the model forwards (text encoders, transformer, VAE decode, also on an `omnirl serve` server; VLM: "
        "generate with --engine hf; only recorded where a server samples its own way: --engine openai / sglang, "
        "vllm-omni images); `logprob` replays under the rollout's setting",
        MODEL,
    )
    prompts: list[str] | None = knob(
        None,
        "Prompt source: a .txt/.jsonl/.csv/.parquet file, a folder or glob of .parquet/.jsonl files, "
        "a save_to_disk folder (FOLDER@SPLIT for several splits) or a Hugging Face dataset NAME@SPLIT / "
        "NAME:CONFIG@SPLIT from the local cache (never downloaded). Repeat to read several, in order. "
        "For a VLM: verl (or --layout easyr1) rows with images.",
        metavar="SOURCE",
        panel=IO,
        required=True,
    )
    num_prompts: int | None = knob(None, "Draw this many prompts with --seed (default: all).", panel=SAMPLING)
    group_size: int = knob(4, "Samples per prompt (the GRPO group).", short="-n", low=1, panel=SAMPLING)
    iteration: int = knob(
        0,
        "RL iteration: places the progressive window and, with --seed, seeds the random one.",
        low=0,
        panel=SAMPLING,
    )
    seed: int = knob(
        0,
        "Base seed: the same seed and --iteration give bit-identical samples; --batch-size, --num-shards and "
        "--shard-index change a sample only by float rounding (noise and SDE windows are drawn per sample "
        "and prompt group).",
        panel=SAMPLING,
    )
    batch_size: int = knobs.batch_size()
    engine: str | None = knob(
        None,
        "Rollout engine. Diffusion: diffusers (in this process, the default), remote (an `omnirl serve` "
        "rollout server at --server-url: same samples, its own device) or vllm-omni (a `vllm serve --omni` "
        "at --server-url: images only, --sampler ode; without --server-url, vLLM-Omni in this process with "
        "omnirl's pipeline: replayable trajectories); a plugin engine by name or module:Class. VLM: hf "
        "(transformers generate, the default), openai (a `vllm serve` / OpenAI-compatible server at "
        "--server-url) or sglang (an SGLang server at --server-url, its sampling fields; docs/vlm.md).",
        names=ENGINES,
        entry_points=ENGINE_ENTRY_POINTS,
        panel=ENGINE,
    )
    server_url: str | None = knobs.server_url()
    server_token_env: str | None = knobs.server_token_env()
    server_timeout: float = knobs.server_timeout()
    server_startup_timeout: float = knobs.server_startup_timeout()
    server_retries: int = knobs.server_retries()
    served_model: str | None = knob(
        None, "Model name the server serves (its /v1/models; vllm-omni: default its only one).", panel=ENGINE
    )
    num_shards: int | None = knobs.num_shards()
    shard_rows: int = knobs.shard_rows()
    shard_index: int | None = knob(
        None, "Write only this shard (Slurm arrays); the manifest appears once all exist.", panel=IO
    )
    fmt: str = knobs.shard_format()
    overwrite: bool = knobs.overwrite()
    # each kind's config says which model it is for in `KIND`, as a refusal of its options words it;
    # the fields a rollout records for replay (`record`), in the order it records them
    RECORDED: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if self.mixed_precision is None:  # --mixed-precision not given: the launcher's, else no
            self.mixed_precision = knobs.launcher_mixed_precision()

    def validate(self) -> None:
        """Refuse, in one line naming the option, settings no rollout can run."""
        if self.mixed_precision not in MIXED_PRECISION_MODES:
            raise UserInputError(
                f"--mixed-precision {self.mixed_precision} (or accelerate launch's --mixed_precision): "
                f"choose one of {', '.join(MIXED_PRECISION_MODES)}"
            )

    def record(self) -> dict[str, Any]:
        """The settings a rollout records for replay (`RECORDED`)."""
        return {name: getattr(self, name) for name in self.RECORDED}

    @classmethod
    def from_record(cls, recorded: Mapping[str, Any]) -> Any:
        """The config of recorded settings (a manifest's, a rollout request's); a list is a tuple."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()})


@dataclass
class SampleConfig(SampleRun):
    """How a diffusion pipeline samples; `record()` goes into the output manifest so that `logprob` and
    `update` replay the same math. `resolution` is (height, width) in pixels once given (a side or
    "HxW" is parsed); None is the model's native one, which `omnirl sample` fills in."""

    steps: int = knob(10, "Denoising steps.", panel=SAMPLING)
    guidance: float = knobs.guidance()
    guidance_2: float | None = knob(
        None,
        "Guidance of the low-noise expert of a two-expert model (Wan 2.2 A14B; WanPipeline's "
        "guidance_scale_2), recorded for replay. Default: --guidance.",
        panel=SAMPLING,
    )
    # given as a side or "HxW" (the option's type), held as (height, width) once parsed
    resolution: str | None = knobs.resolution()
    frames: int = knobs.frames()
    sampler: str = knob(
        "sde",
        "ode (Euler), sde (Flow-GRPO), cps (coefficients-preserving) or dance (DanceGRPO).",
        choices=SAMPLERS,
        panel=SAMPLING,
    )
    noise_level: float = knob(0.7, "a (sde/cps) or η (dance).", panel=SAMPLING)
    window: int = knob(
        0, "Only W consecutive steps are stochastic and stored (0: all).", flag="--sde-window", panel=SAMPLING
    )
    window_range: tuple[int, int] | None = knob(
        None,
        "LO HI: the random window starts uniformly in [LO, HI−W], drawn per prompt group from (--seed, "
        "--iteration, group), so batching never moves it (Flow-GRPO-Fast: one per pipeline call).",
        flag="--sde-window-range",
        panel=SAMPLING,
    )
    window_strategy: str = knob(
        "random",
        "random (Flow-GRPO-Fast), progressive (MixGRPO: slides with --iteration) or fixed.",
        choices=WINDOW_STRATEGIES,
        panel=SAMPLING,
    )
    window_start: int | None = knob(
        None, "First window start (progressive) or the start (fixed).", panel=SAMPLING
    )
    iters_per_group: int = knob(
        25, "Iterations before the progressive window moves (MixGRPO 25).", low=1, panel=SAMPLING
    )
    window_stride: int = knob(
        1, "Steps the progressive window moves each time (MixGRPO 1).", low=0, panel=SAMPLING
    )
    roll_back: bool = knob(
        True, "Progressive window returns to its start at the end.", negative=True, panel=SAMPLING
    )
    same_noise: bool = knob(False, "One initial noise per group (DanceGRPO).", panel=SAMPLING)
    latent_dtype: str = knob(
        "fp32",
        "Dtype of the stored latents and final latent. bf16 halves the largest columns (video); the rollout "
        "then carries its latents in bf16 between steps, so its log-probs are those of the stored latents "
        "and `omnirl logprob` replays them exactly.",
        choices=LATENT_DTYPE_NAMES,
        panel=SAMPLING,
    )
    fps: float = knob(
        16.0,
        "Frames per second of a video family's MP4 `video` column (Wan 2.1: 16, Wan 2.2 TI2V-5B: 24); image "
        "families ignore it.",
        low=0.001,
        panel=VIDEO,
    )
    save_frames: bool = knob(
        False,
        "A video family also stores every decoded frame losslessly: a `frames` column of PNGs per sample "
        "(score then reads them instead of decoding the MP4).",
        panel=VIDEO,
    )
    vae_tiling: bool = knob(
        False,
        "Decode in overlapping spatial tiles (the VAE's enable_tiling()): less memory for large videos; "
        "pixels at tile seams may differ slightly. The diffusers engine only.",
        panel=VIDEO,
    )
    vae_slicing: bool = knob(
        False,
        "Decode one sample of a batch at a time (the VAE's enable_slicing()): less memory; each sample "
        "decodes as it would alone (a batched decode differs by float rounding). The diffusers engine only.",
        panel=VIDEO,
    )
    defer_decode: bool = knob(
        False,
        "Skip the VAE decode: write each sample's final latent and no image/video column (the manifest "
        "records the media as deferred); `omnirl score` decodes the latents to the same pixels (--keep-media "
        "there stores them). Saves the decode's time and memory, and the media's disk. The diffusers engine "
        "only.",
        panel=VIDEO,
    )
    sp_degree: int = knobs.sp_degree()
    sp_kind: str = knobs.sp_kind()
    tp_degree: int = knobs.tp_degree()
    attention_backend: str | None = knobs.attention_backend()
    compile: bool = knobs.compile()
    # the T5 length prompts are encoded at: the model's (`omnirl sample` sets it), recorded for replay
    max_sequence_length: int = 128
    KIND: ClassVar[str] = "a diffusion --model samples media"
    RECORDED: ClassVar[tuple[str, ...]] = (
        "steps",
        "guidance",
        "guidance_2",
        "resolution",
        "frames",
        "sampler",
        "noise_level",
        "window",
        "window_range",
        "window_strategy",
        "window_start",
        "iteration",
        "iters_per_group",
        "window_stride",
        "roll_back",
        "same_noise",
        "seed",
        "batch_size",
        "max_sequence_length",
        "fps",
        "save_frames",
        "mixed_precision",
        "latent_dtype",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.resolution is not None:
            from stages.models.families import parse_resolution

            self.resolution = parse_resolution(self.resolution)  # type: ignore[assignment]
        if self.window_range is not None:  # a preset's list, as the flag's pair
            self.window_range = tuple(self.window_range)  # type: ignore[assignment]
        self.engine = self.engine or DEFAULT_ENGINE

    def validate(self) -> None:
        super().validate()
        from stages.media.video import fps_fraction

        if self.sampler not in SAMPLERS:
            raise UserInputError(f"--sampler {self.sampler}: choose one of {', '.join(SAMPLERS)}")
        if self.steps < 1:
            raise UserInputError(f"--steps {self.steps}: must be at least 1")
        if self.latent_dtype not in LATENT_DTYPE_NAMES:
            raise UserInputError(
                f"--latent-dtype {self.latent_dtype}: choose one of {', '.join(LATENT_DTYPE_NAMES)}"
            )
        if not 1 <= self.frames <= MAX_FRAMES:
            raise UserInputError(f"--frames {self.frames}: must lie in [1, {MAX_FRAMES}]")
        if self.window < 0:
            raise UserInputError(f"--sde-window {self.window}: must be >= 0")
        fps_fraction(self.fps)  # a positive frame rate, as the MP4 writer needs it
        if self.window:
            self.schedule()

    def schedule(self) -> Any:
        """The SDE-window schedule these settings describe (`stages.sample.windows.WindowSchedule`);
        validates them."""
        from stages.sample.windows import WindowSchedule

        return WindowSchedule(
            self.steps,
            self.window_strategy,
            window=self.window,
            window_range=self.window_range,
            start=self.window_start,
            iters_per_group=self.iters_per_group,
            stride=self.window_stride,
            roll_back=self.roll_back,
        )


@dataclass
class VLMSampleConfig(SampleRun):
    """How a vision-language model samples responses; `record()` goes into the manifest as
    `vlm_sample_config` for replay."""

    temperature: float = knob(1.0, "Sampling temperature (verl 1.0).", panel=VLM)
    top_p: float = knob(1.0, "Nucleus sampling (1: off).", panel=VLM)
    max_new_tokens: int = knob(64, "Response length cap.", low=1, panel=VLM)
    max_prompt_length: int = knob(
        512, "Prompt tokens incl. image tokens; a longer prompt is an error (verl 512).", low=1, panel=VLM
    )
    layout: str = knob(
        "verl",
        "VLM prompt table: verl (prompt, images, videos, reward_model.ground_truth, ...) or easyr1 "
        "(--prompt-key, --answer-key, --image-key, --video-key). A row without images or videos is "
        "text-only; each <image>/<video> placeholder takes the next item of its column.",
        choices=LAYOUTS,
        panel=VLM,
    )
    prompt_key: str = knob("problem", "--layout easyr1: the column of a row's question.", panel=VLM)
    answer_key: str = knob("answer", "--layout easyr1: the column of a row's ground truth.", panel=VLM)
    image_key: str = knob("images", "Column of a row's images.", panel=VLM)
    video_key: str = knob(
        "videos",
        "Column of a row's videos: each a list of frames or a video file (MP4 needs PyAV).",
        panel=VLM,
    )
    understand: bool = knob(
        False,
        "A --model that both generates images and understands them (BAGEL): answer the table's questions "
        "(this kind, with the understanding expert) instead of generating images. A VLM always answers.",
        panel=VLM,
    )
    audio_key: str = knob(
        "audios",
        "Omni models: the column listing each row's audio clips (paths, bytes, or arrays with a sampling "
        "rate), taken in the order of the <audio> placeholders (needs PyAV).",
        panel=VLM,
    )
    KIND: ClassVar[str] = "a vision-language --model samples text"
    RECORDED: ClassVar[tuple[str, ...]] = (
        "engine",
        "temperature",
        "top_p",
        "max_new_tokens",
        "max_prompt_length",
        "seed",
        "batch_size",
        "server_url",
        "served_model",
        "mixed_precision",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.engine = self.engine or VLM_ENGINES[0]

    def validate(self) -> None:
        super().validate()
        if self.engine not in VLM_ENGINES:
            raise UserInputError(f"--engine {self.engine}: choose one of {', '.join(VLM_ENGINES)}")
        if self.layout not in LAYOUTS:
            raise UserInputError(f"--layout {self.layout}: choose one of {', '.join(LAYOUTS)}")
        if not self.temperature > 0:
            raise UserInputError(f"--temperature {self.temperature}: must be > 0")
        if not 0 < self.top_p <= 1:
            raise UserInputError(f"--top-p {self.top_p}: must lie in (0, 1]")
        if self.max_new_tokens < 1 or self.max_prompt_length < 1:
            raise UserInputError("--max-new-tokens and --max-prompt-length must be at least 1")
        if self.engine != "hf" and not (self.server_url and self.served_model):
            raise UserInputError(f"--engine {self.engine} needs --server-url and --served-model")

    def prompts_per_call(self, group_size: int) -> int:
        return max(1, self.batch_size // group_size)
