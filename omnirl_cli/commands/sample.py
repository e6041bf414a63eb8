"""`omnirl sample`: roll out a group of images per prompt and record the trainable SDE steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Annotated, Any

import typer

from stages.knobs import ENGINE, PARALLELISM, WEIGHTS_METAVAR

from ..choices import (
    ENGINE_ENTRY_POINTS,
    ENGINES,
    Dtype,
    LatentDtype,
    Layout,
    Sampler,
    WindowStrategy,
    complete,
)
from ..config import resolve
from ..console import emit_json, print_result, progress
from ..errors import handle_errors
from ..options import (
    ADAPTER_HELP,
    REQUIRED,
    AttentionBackendOpt,
    BatchSizeOpt,
    CompileOpt,
    ConfigOpt,
    FormatOpt,
    FramesOpt,
    GuidanceOpt,
    JsonOpt,
    NumShardsOpt,
    OutOpt,
    OverwriteOpt,
    ResolutionOpt,
    ServerRetriesOpt,
    ServerStartupTimeoutOpt,
    ServerTimeoutOpt,
    ServerTokenEnvOpt,
    ServerUrlOpt,
    SetOpt,
    ShardRowsOpt,
    SpDegreeOpt,
    SpKindOpt,
    TpDegreeOpt,
    mixed_precision_opt,
    model_opt,
)
from ..runtime import (
    ROLLOUT_PLACEMENT,
    check_format,
    device,
    policy_info,
    policy_version,
    report_complete,
    resolve_num_shards,
    run_config,
)

SAMPLING = "Sampling"
MODEL = "Model"
VLM = "Vision-language models"
VIDEO = "Video"
# Sampling options a vision-language model's text rollout reads too (and --iteration, which it does not
# read but every recipe passes to every stage); the rest of the Sampling and Video panels are the
# diffusion rollout's own, and the Vision-language panel is the text rollout's own.
SHARED_SAMPLING = frozenset({"num_prompts", "group_size", "seed", "batch_size", "iteration"})
# Least memory a diffusion rollout holds per sample before any model output: every sample is planned
# up front (ids and seeds, about 270 bytes each, measured for `stages.sample.stage.plan_rows`).
PLANNED_SAMPLE_BYTES = 256


@handle_errors
def sample(
    ctx: typer.Context,
    out: OutOpt = None,
    model: model_opt(
        "Diffusers pipeline, or a transformers VLM (Qwen2.5-VL, a Qwen3-Omni thinker, or a whole Qwen3-Omni "
        "folder, of which only the thinker loads): text responses",
        MODEL,
    ) = None,
    adapter: Annotated[
        str | None,
        typer.Option(
            "--adapter",
            metavar=WEIGHTS_METAVAR,
            help=f"Adapter: {ADAPTER_HELP} (default: the base model).",
            rich_help_panel=MODEL,
        ),
    ] = None,
    dtype: Annotated[
        Dtype, typer.Option("--dtype", envvar="OMNIRL_DTYPE", help="Weights dtype.", rich_help_panel=MODEL)
    ] = "fp32",
    mixed_precision: mixed_precision_opt(
        "the model forwards (text encoders, transformer, VAE decode, also on an `omnirl serve` server; VLM: "
        "generate with --engine hf; only recorded where a server samples its own way: --engine openai, "
        "vllm-omni images); `logprob` replays under the rollout's setting",
        MODEL,
    ) = None,
    prompts: Annotated[
        list[str] | None,
        typer.Option(
            "--prompts",
            metavar="SOURCE",
            help="Prompt source: a .txt/.jsonl/.csv/.parquet file, a folder or glob of .parquet/.jsonl files, "
            "a save_to_disk folder (FOLDER@SPLIT for several splits) or a Hugging Face dataset NAME@SPLIT / "
            "NAME:CONFIG@SPLIT from the local cache (never downloaded). Repeat to read several, in order. "
            "For a VLM: verl (or --layout easyr1) rows with images. " + REQUIRED,
            rich_help_panel="Input / output",
        ),
    ] = None,
    num_prompts: Annotated[
        int | None,
        typer.Option(
            "--num-prompts",
            help="Draw this many prompts with --seed (default: all).",
            rich_help_panel=SAMPLING,
        ),
    ] = None,
    group_size: Annotated[
        int,
        typer.Option(
            "-n",
            "--group-size",
            min=1,
            help="Samples per prompt (the GRPO group).",
            rich_help_panel=SAMPLING,
        ),
    ] = 4,
    steps: Annotated[int, typer.Option("--steps", help="Denoising steps.", rich_help_panel=SAMPLING)] = 10,
    guidance: GuidanceOpt = 4.5,
    guidance_2: Annotated[
        float | None,
        typer.Option(
            "--guidance-2",
            help="Guidance of the low-noise expert of a two-expert model (Wan 2.2 A14B; WanPipeline's "
            "guidance_scale_2), recorded for replay. Default: --guidance.",
            rich_help_panel=SAMPLING,
        ),
    ] = None,
    resolution: ResolutionOpt = None,
    frames: FramesOpt = 1,
    sampler: Annotated[
        Sampler,
        typer.Option(
            "--sampler",
            help="ode (Euler), sde (Flow-GRPO), cps (coefficients-preserving) or dance (DanceGRPO).",
            rich_help_panel=SAMPLING,
        ),
    ] = "sde",
    noise_level: Annotated[
        float, typer.Option("--noise-level", help="a (sde/cps) or η (dance).", rich_help_panel=SAMPLING)
    ] = 0.7,
    sde_window: Annotated[
        int,
        typer.Option(
            "--sde-window",
            help="Only W consecutive steps are stochastic and stored (0: all).",
            rich_help_panel=SAMPLING,
        ),
    ] = 0,
    sde_window_range: Annotated[
        tuple[int, int] | None,
        typer.Option(
            "--sde-window-range",
            help="LO HI: the random window starts uniformly in [LO, HI−W], drawn per prompt group from "
            "(--seed, --iteration, group), so batching never moves it (Flow-GRPO-Fast: one per pipeline call).",
            rich_help_panel=SAMPLING,
        ),
    ] = None,
    window_strategy: Annotated[
        WindowStrategy,
        typer.Option(
            "--window-strategy",
            help="random (Flow-GRPO-Fast), progressive (MixGRPO: slides with --iteration) or fixed.",
            rich_help_panel=SAMPLING,
        ),
    ] = "random",
    window_start: Annotated[
        int | None,
        typer.Option(
            "--window-start",
            help="First window start (progressive) or the start (fixed).",
            rich_help_panel=SAMPLING,
        ),
    ] = None,
    iteration: Annotated[
        int,
        typer.Option(
            "--iteration",
            min=0,
            help="RL iteration: places the progressive window and, with --seed, seeds the random one.",
            rich_help_panel=SAMPLING,
        ),
    ] = 0,
    iters_per_group: Annotated[
        int,
        typer.Option(
            "--iters-per-group",
            min=1,
            help="Iterations before the progressive window moves (MixGRPO 25).",
            rich_help_panel=SAMPLING,
        ),
    ] = 25,
    window_stride: Annotated[
        int,
        typer.Option(
            "--window-stride",
            min=0,
            help="Steps the progressive window moves each time (MixGRPO 1).",
            rich_help_panel=SAMPLING,
        ),
    ] = 1,
    roll_back: Annotated[
        bool,
        typer.Option(
            "--roll-back/--no-roll-back",
            help="Progressive window returns to its start at the end.",
            rich_help_panel=SAMPLING,
        ),
    ] = True,
    same_noise: Annotated[
        bool,
        typer.Option(
            "--same-noise", help="One initial noise per group (DanceGRPO).", rich_help_panel=SAMPLING
        ),
    ] = False,
    seed: Annotated[
        int,
        typer.Option(
            "--seed",
            help="Base seed: the same seed and --iteration give bit-identical samples; --batch-size, "
            "--num-shards and --shard-index change a sample only by float rounding (noise and SDE windows "
            "are drawn per sample and prompt group).",
            rich_help_panel=SAMPLING,
        ),
    ] = 0,
    batch_size: BatchSizeOpt = 8,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            autocompletion=complete(ENGINES, ENGINE_ENTRY_POINTS),
            help="Rollout engine. Diffusion: diffusers (in this process, the default), remote (an "
            "`omnirl serve` rollout server at --server-url: same samples, its own device) or vllm-omni "
            "(a `vllm serve --omni` at --server-url: images only, --sampler ode; without --server-url, "
            "vLLM-Omni in this process with omnirl's pipeline: replayable trajectories); a plugin "
            "engine by name or module:Class. VLM: hf (transformers generate, the default) or openai (a "
            "`vllm serve` / OpenAI-compatible server at --server-url).",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    server_url: ServerUrlOpt = None,
    server_token_env: ServerTokenEnvOpt = None,
    server_timeout: ServerTimeoutOpt = 600.0,
    server_startup_timeout: ServerStartupTimeoutOpt = 120.0,
    server_retries: ServerRetriesOpt = 8,
    served_model: Annotated[
        str | None,
        typer.Option(
            "--served-model",
            help="Model name the server serves (its /v1/models; vllm-omni: default its only one).",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    temperature: Annotated[
        float, typer.Option("--temperature", help="Sampling temperature (verl 1.0).", rich_help_panel=VLM)
    ] = 1.0,
    top_p: Annotated[
        float, typer.Option("--top-p", help="Nucleus sampling (1: off).", rich_help_panel=VLM)
    ] = 1.0,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="Response length cap.", rich_help_panel=VLM)
    ] = 64,
    max_prompt_length: Annotated[
        int,
        typer.Option(
            "--max-prompt-length",
            min=1,
            help="Prompt tokens incl. image tokens; a longer prompt is an error (verl 512).",
            rich_help_panel=VLM,
        ),
    ] = 512,
    layout: Annotated[
        Layout,
        typer.Option(
            "--layout",
            help="VLM prompt table: verl (prompt, images, videos, reward_model.ground_truth, ...) or "
            "easyr1 (--prompt-key, --answer-key, --image-key, --video-key). A row without images or "
            "videos is text-only; each <image>/<video> placeholder takes the next item of its column.",
            rich_help_panel=VLM,
        ),
    ] = "verl",
    prompt_key: Annotated[str, typer.Option("--prompt-key", rich_help_panel=VLM)] = "problem",
    answer_key: Annotated[str, typer.Option("--answer-key", rich_help_panel=VLM)] = "answer",
    image_key: Annotated[str, typer.Option("--image-key", rich_help_panel=VLM)] = "images",
    video_key: Annotated[
        str,
        typer.Option(
            "--video-key",
            help="Column of a row's videos: each a list of frames or a video file (MP4 needs PyAV).",
            rich_help_panel=VLM,
        ),
    ] = "videos",
    audio_key: Annotated[
        str,
        typer.Option(
            "--audio-key",
            help="Omni models: the column listing each row's audio clips (paths, bytes, or arrays with a "
            "sampling rate), taken in the order of the <audio> placeholders (needs PyAV).",
            rich_help_panel=VLM,
        ),
    ] = "audios",
    fps: Annotated[
        float,
        typer.Option(
            "--fps",
            min=0.001,
            help="Frames per second of a video family's MP4 `video` column (Wan 2.1: 16, Wan 2.2 TI2V-5B: 24); "
            "image families ignore it.",
            rich_help_panel=VIDEO,
        ),
    ] = 16.0,
    save_frames: Annotated[
        bool,
        typer.Option(
            "--save-frames",
            help="A video family also stores every decoded frame losslessly: a `frames` column of PNGs per "
            "sample (score then reads them instead of decoding the MP4).",
            rich_help_panel=VIDEO,
        ),
    ] = False,
    latent_dtype: Annotated[
        LatentDtype,
        typer.Option(
            "--latent-dtype",
            help="Dtype of the stored latents and final latent. bf16 halves the largest columns (video); "
            "the rollout then carries its latents in bf16 between steps, so its log-probs are those of the "
            "stored latents and `omnirl logprob` replays them exactly.",
            rich_help_panel=SAMPLING,
        ),
    ] = "fp32",
    vae_tiling: Annotated[
        bool,
        typer.Option(
            "--vae-tiling",
            help="Decode in overlapping spatial tiles (the VAE's enable_tiling()): less memory for large "
            "videos; pixels at tile seams may differ slightly. The diffusers engine only.",
            rich_help_panel=VIDEO,
        ),
    ] = False,
    vae_slicing: Annotated[
        bool,
        typer.Option(
            "--vae-slicing",
            help="Decode one sample of a batch at a time (the VAE's enable_slicing()): less memory; each sample "
            "decodes as it would alone (a batched decode differs by float rounding). The diffusers engine only.",
            rich_help_panel=VIDEO,
        ),
    ] = False,
    defer_decode: Annotated[
        bool,
        typer.Option(
            "--defer-decode",
            help="Skip the VAE decode: write each sample's final latent and no image/video column (the "
            "manifest records the media as deferred); `omnirl score` decodes the latents to the same pixels "
            "(--keep-media there stores them). Saves the decode's time and memory, and the media's disk. "
            "The diffusers engine only.",
            rich_help_panel=VIDEO,
        ),
    ] = False,
    sp_degree: SpDegreeOpt = 1,
    sp_kind: SpKindOpt = "ulysses",
    tp_degree: TpDegreeOpt = 1,
    attention_backend: AttentionBackendOpt = None,
    compile: CompileOpt = False,
    num_shards: NumShardsOpt = None,
    shard_rows: ShardRowsOpt = 256,
    shard_index: Annotated[
        int | None,
        typer.Option(
            "--shard-index",
            help="Write only this shard (Slurm arrays); the manifest appears once all exist.",
            rich_help_panel="Input / output",
        ),
    ] = None,
    fmt: FormatOpt = "parquet",
    overwrite: OverwriteOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Sample GROUP images per prompt and write trajectories: stored latents, log-probs, σ, final latent, PNG.

    A video family (its decode gives frame lists) writes an MP4 `video` column at --fps instead of the PNG.
    --defer-decode writes no media: `omnirl score` decodes the final latents.

    Each sample has its own seed, so a sample never depends on the batch size (nor on --sp-degree: the
    S ranks of a sequence-parallel group draw the same samples and its first rank writes them; shards
    are split over the ranks / S groups). A re-run skips shards
    that are complete and verified; over a finished --out it samples nothing and says so (`"skipped":
    true` with --json).

    The in-process engine also stores each unique prompt's text conditioning once per shard
    (conditioning-*.safetensors, listed in the manifest), so `logprob` and `update` load no text encoder
    (docs/real-checkpoints.md, "What each stage loads"); so does --engine remote, with the conditioning
    the server returns when it runs at this --dtype.

    An editing model (qwen_image_edit, flux_kontext) edits each prompt row's source image: column `image`,
    or `images` for several references (a path relative to the table, the file's bytes or a `datasets`
    Image; docs/data-format.md). They are stored once per prompt group (condition-images-*.parquet, a
    table `datasets` loads), and `logprob`, `update` and `online` condition on them; a text-only model
    refuses them. FLUX.2 (flux2, flux2_klein) takes rows with none (text-to-image) or up to 10 references;
    Wan I2V (wan2_1_i2v, wan2_2_a14b_i2v) starts each clip from the row's `image`, given at the clip's
    --resolution.

    With a vision-language --model (Qwen2.5-VL), GROUP text responses per (images, question) row of a
    verl/EasyR1 table: prompt and response token ids, response text, rollout log-probs, images once per
    prompt; the diffusion options (--steps, --guidance, the sampler, video) are refused, as the
    Vision-language ones are for a diffusion --model.

    Example: [bold]omnirl sample --model models/sd3-tiny --prompts prompts.txt -n 8 --steps 10 \\
    --resolution 64 --sampler sde --noise-level 0.7 --out run/it0/samples[/]

    Video (Wan): [bold]omnirl sample --model models/wan-tiny --prompts prompts.txt -n 4 --resolution 32 \\
    --frames 5 --out run/it0/samples[/]

    VLM: [bold]omnirl sample --model models/vlm-tiny --prompts geo3k.parquet -n 5 --max-new-tokens 256 --out run/it0/samples[/]
    """
    c = resolve(ctx, "sample", required=("model", "prompts", "out"))
    from stages.models.factory import DEFAULT_RESOLUTION, native_resolution
    from stages.models.families import resolution_identity
    from stages.models.vlm import is_vlm_model
    from stages.precision import resolve_mixed_precision

    vlm = is_vlm_model(c["model"])
    _refuse_foreign_options(ctx, c, vlm)

    c["mixed_precision"] = resolve_mixed_precision(c["mixed_precision"])  # the launcher's enters the identity
    resolution = c["resolution"] or native_resolution(c["model"]) or DEFAULT_RESOLUTION
    c["resolution"] = resolution_identity(resolution)

    if vlm:
        _sample_vlm(c, json_)
        return
    from stages.errors import UserInputError
    from stages.media import output_modality
    from stages.media.deferred import deferred_record
    from stages.models.condition_images import condition_images_record
    from stages.models.conditioning import conditioning_record
    from stages.models.factory import default_text_length
    from stages.models.families import adapter_class
    from stages.models.folders import check_pipeline_folder, pipeline_index
    from stages.models.kernels import Kernels, prepare
    from stages.parallelism import ModelParallel, layout
    from stages.sample.engines import DEFAULT_ENGINE, DiffusersEngine, EngineOptions, engine_class
    from stages.sample.prompts import sample_prompts
    from stages.sample.rollout import SampleConfig
    from stages.sample.sources import PromptSource
    from stages.sample.stage import KINDS, run_sample

    check_pipeline_folder(c["model"])  # before anything reads or hashes what may be any folder
    # the T5 length the model was made for (its card's text_length, else 128), recorded for replay
    cfg = SampleConfig.from_options({**c, "max_sequence_length": default_text_length(c["model"])})
    cfg.validate()
    engine_type = engine_class(c["engine"] or DEFAULT_ENGINE)
    vae_options = [name for name in ("vae_tiling", "vae_slicing") if c[name]]
    if vae_options and not issubclass(engine_type, DiffusersEngine):
        raise UserInputError(
            f"--{vae_options[0].replace('_', '-')}: --engine {engine_type.name} decodes elsewhere; drop it "
            "(a server's VAE is set where it runs)"
        )
    if c["defer_decode"] and not issubclass(engine_type, DiffusersEngine):
        raise UserInputError(f"--defer-decode: --engine {engine_type.name} returns decoded media; drop it")
    if c["defer_decode"] and vae_options:
        option = f"--{vae_options[0].replace('_', '-')}"
        raise UserInputError(f"{option}: --defer-decode runs no decode here; pass {option} to `omnirl score`")
    parallel, kernels = ModelParallel.from_options(c), Kernels.from_options(c)
    if (parallel.degree > 1 or kernels != Kernels()) and not issubclass(engine_type, DiffusersEngine):
        raise UserInputError(
            f"--sp-degree / --tp-degree / --attention-backend / --compile: --engine {engine_type.name} runs "
            "its model elsewhere; drop it"
        )
    kernels.validate()
    layout(parallel)  # before the shards are split over the data-parallel ranks
    source = PromptSource(c["prompts"])
    picked = sample_prompts(source, c["num_prompts"], c["seed"])
    family = adapter_class(pipeline_index(c["model"])["_class_name"], str(c["model"]))
    for _, prompt in picked:  # before any output: condition images the model cannot take
        family.check_condition_images(len(prompt.images), prompt.text)
    _check_memory(
        c,
        len(picked) * c["group_size"],
        PLANNED_SAMPLE_BYTES,
        f"planning {len(picked)} prompts × {c['group_size']} samples",
    )
    resolve_num_shards(c, len(picked), c["group_size"])
    options = EngineOptions.from_options(c)
    # an engine drawing other samples than diffusers (vLLM-Omni's images API) joins the run's identity
    placement = ROLLOUT_PLACEMENT if engine_type.same_samples(options) else ("server_url",)
    writer = _writer(c, KINDS, json_, source, exclude=placement)
    if writer is None:
        return
    engine = engine_type.open(options, device())
    try:
        if isinstance(engine, DiffusersEngine):
            prepare(engine.policy.parts, parallel, kernels)
        extra = {"sample_config": asdict(cfg), "family": engine.family, "engine": engine.describe()}
        if c["defer_decode"]:  # no media column to tell the modality: the family's decode does
            extra.update(modality=engine.policy.family.media, **deferred_record(c["model"], c["dtype"]))

        def with_modality(columns: list) -> dict:
            # the prompt conditioning each shard stored (an engine that returns none stores nothing)
            stored = conditioning_record(
                writer.out_dir,
                writer.num_shards,
                writer.content_id,
                model=c["model"],
                dtype=c["dtype"],
                max_sequence_length=cfg.max_sequence_length,
            )
            # the prompt groups' condition images (an editing model's rollout), once per group
            images = condition_images_record(writer.out_dir, writer.num_shards, writer.content_id)
            return {
                "modality": output_modality([col.kind for col in columns]),
                **extra,
                **(stored or {}),
                **(images or {}),
            }

        _run(c, json_, writer, len(picked), "images", with_modality, partial(run_sample, engine, cfg, picked))
    finally:
        engine.close()


def _memory_limit() -> int | None:
    """Bytes this process may use: the least of physical memory and its address-space limit
    (`ulimit -v`); None where neither is known."""
    import contextlib
    import os

    limits = []
    with contextlib.suppress(AttributeError, ValueError, OSError):  # sysconf is POSIX-only
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    with contextlib.suppress(ImportError):  # no `resource` module on Windows
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    return min(limits, default=None)


def _check_memory(c: dict, samples: int, bytes_each: int, what: str) -> None:
    """Refuse a group size whose samples cannot fit in memory before any model is loaded: a mistyped
    `-n 100000000` would otherwise end in MemoryError after minutes of work."""
    limit = _memory_limit()
    need = samples * bytes_each
    if limit is not None and need > limit:
        from stages.errors import UserInputError

        raise UserInputError(
            f"-n/--group-size {c['group_size']}: {what} would need at least {need / 2**30:.1f} GiB of "
            f"memory, more than the {limit / 2**30:.1f} GiB this process may use; lower it"
        )


def _shard_indices(c: dict) -> list[int]:
    shards = list(range(c["num_shards"])) if c["shard_index"] is None else [c["shard_index"]]
    if any(not 0 <= s < c["num_shards"] for s in shards):
        from stages.errors import UserInputError

        raise UserInputError(
            f"--shard-index {c['shard_index']}: must lie in [0, --num-shards={c['num_shards']})"
        )
    return shards


def _writer(c: dict, kinds: dict[str, str], json_: bool, source: Any, exclude: tuple[str, ...] = ()) -> Any:
    """The output writer (the prompt source in its lineage), or None (after saying so) when the output
    is already complete; the options in `exclude` stay out of the output's identity (`run_config`)."""
    _shard_indices(c)  # a bad --shard-index fails before any model is loaded
    from stages.shards.writer import ShardSetWriter

    writer = ShardSetWriter(
        c["out"],
        num_shards=c["num_shards"],
        format=check_format(c["fmt"]),
        command="sample",
        config=run_config(c, exclude),
        parents=[source],
        policy=policy_info(c["model"], c["adapter"]),
        kinds=kinds,
        overwrite=c["overwrite"],
    )
    if writer.complete:
        report_complete(c["out"], json_)
        return None
    return writer


def _run(
    c: dict,
    json_: bool,
    writer: Any,
    num_prompts: int,
    unit: str,
    extra: dict | Callable[[list], dict],
    sample_fn: Callable[..., dict],
) -> None:
    """Sample this process's shards with a progress bar, write the manifest once every shard exists,
    then report. `sample_fn(group_size, writer, num_shards=, shard_indices=, policy_version=, on_batch=)`.
    `extra` is the manifest's extra, or a function of the written columns giving it (the rollout's
    modality follows from its media columns).

    Under a launcher (torchrun, `accelerate launch`) rank r samples the shards s with s % world == r;
    after every rank is done (one without a shard too), rank 0 writes the manifest and reports for all.
    """
    from stages.dist import gather, join, rank_shards, replicas

    shards = rank_shards(_shard_indices(c))
    t0, done = time.perf_counter(), [0]
    with progress() as bar:
        task = bar.add_task("sampling", total=num_prompts * c["group_size"] * len(shards) // c["num_shards"])

        def advance(n: int) -> None:
            done[0] += n
            bar.update(task, advance=n, rate=f"{done[0] / (time.perf_counter() - t0):.2f} {unit}/s")

        mine = sample_fn(
            c["group_size"],
            writer,
            num_shards=c["num_shards"],
            shard_indices=shards,
            policy_version=policy_version(c["adapter"]),
            on_batch=advance,
        )
    # every replica's counts (a model-parallel group's ranks count the same); also waits for every shard
    results = replicas(gather(mine))
    if join()[1] != 0:
        return
    result = _combine(results, unit)
    manifest = None
    if all(writer.shard_done(s) for s in range(c["num_shards"])):
        manifest = writer.finalize(extra=extra(writer.columns) if callable(extra) else extra)
    result.update(out=str(c["out"]), complete=manifest is not None, skipped=False)
    if json_:
        emit_json(result)
    else:
        speed = result.get(f"{unit}_per_s")
        rate = f", {speed:.2f} {unit}/s" if speed else ""
        state = "complete" if manifest else "partial (other shards pending)"
        resumed = result["rows"] - result["rows_written"]
        kept = f"; {resumed} already there" if resumed else ""
        print_result(f"[green]wrote[/] {result['rows_written']} samples to {c['out']} ({state}{kept}{rate})")


def _combine(results: list[dict], unit: str) -> dict:
    """The counts of every rank's `sample_fn` result as one: rows and shards added, the longest time,
    the ranks' rates added (they sample at once)."""
    if len(results) == 1:
        return results[0]
    rates = [r[f"{unit}_per_s"] for r in results if r[f"{unit}_per_s"] is not None]
    counts = ("rows", "rows_written", "shards_written", "shards_resumed")
    combined = {k: sum(r[k] for r in results) for k in counts}
    combined.update(
        {"seconds": max(r["seconds"] for r in results), f"{unit}_per_s": sum(rates) if rates else None}
    )
    return combined


def _refuse_foreign_options(ctx: typer.Context, c: dict, vlm: bool) -> None:
    """An option the other kind of model reads (a diffusion --steps for a VLM, a --temperature for a
    diffusion pipeline), set away from its default, is a `UserInputError` rather than silently unused."""
    from stages.errors import UserInputError

    for param in ctx.command.params:
        panel = getattr(param, "rich_help_panel", None)
        foreign = (
            panel == VLM
            if not vlm
            else panel in (SAMPLING, VIDEO, PARALLELISM) and param.name not in SHARED_SAMPLING
        )
        value = c.get(param.name) if param.name else param.default
        if not foreign or value == param.default:
            continue
        kind = "a vision-language --model samples text" if vlm else "a diffusion --model samples media"
        source = ctx.get_parameter_source(param.name) if param.name else None
        if source is not None and source.name == "COMMANDLINE":
            flag = param.secondary_opts[0] if value is False and param.secondary_opts else param.opts[0]
            raise UserInputError(f"{flag}: {kind} and never reads it; drop it")
        key = param.opts[0].lstrip("-").replace("-", "_")
        raise UserInputError(f"{key} (from --config or --set): {kind} and never reads it; drop it there")


def _sample_vlm(c: dict, json_: bool) -> None:
    """`sample` for a vision-language model: text responses per (images, question) prompt."""
    from stages.models.vlm import VLMPolicy, model_type
    from stages.sample.sources import PromptSource
    from stages.sample.vlm_data import sample_vlm_prompts
    from stages.sample.vlm_stage import KINDS, VLMSampleConfig, run_vlm_sample

    c["engine"] = c["engine"] or "hf"
    cfg = VLMSampleConfig(
        engine=c["engine"],
        temperature=c["temperature"],
        top_p=c["top_p"],
        max_new_tokens=c["max_new_tokens"],
        max_prompt_length=c["max_prompt_length"],
        seed=c["seed"],
        batch_size=c["batch_size"],
        server_url=c["server_url"],
        served_model=c["served_model"],
        mixed_precision=c["mixed_precision"],
    )
    cfg.validate()
    source = PromptSource(c["prompts"])
    picked = sample_vlm_prompts(
        source,
        c["num_prompts"],
        c["seed"],
        layout=c["layout"],
        prompt_key=c["prompt_key"],
        answer_key=c["answer_key"],
        image_key=c["image_key"],
        video_key=c["video_key"],
        audio_key=c["audio_key"],
    )
    # A group's padded token columns stay in memory until its shard is written: an int64 id and a bool
    # mask per prompt and response position, an fp32 log-prob per response position.
    token_bytes = 9 * cfg.max_prompt_length + 13 * cfg.max_new_tokens
    what = f"holding the token columns of one group of {c['group_size']} responses"
    _check_memory(c, c["group_size"], token_bytes, what)
    resolve_num_shards(c, len(picked), c["group_size"])
    writer = _writer(c, KINDS, json_, source)
    if writer is None:
        return
    policy = (
        VLMPolicy.load(c["model"], adapter=c["adapter"], device=device(), dtype=c["dtype"])
        if cfg.engine == "hf"
        else VLMPolicy.for_prompts(c["model"])
    )
    _run(
        c,
        json_,
        writer,
        len(picked),
        "responses",
        {"vlm_sample_config": asdict(cfg), "family": model_type(c["model"]), "modality": "text"},
        partial(run_vlm_sample, policy, cfg, picked),
    )
