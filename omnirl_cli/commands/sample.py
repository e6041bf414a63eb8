"""`omnirl sample`: roll out a group of images per prompt and record the trainable SDE steps.

Its options are the union of the two kinds' configs (`stages.sample.config`): `SampleConfig` for a
diffusion pipeline, `VLMSampleConfig` for a vision-language model, which `_kind` picks from --model once
every source is resolved; an option of the other kind, given from any source, is refused there.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from stages.outputs import ROLLOUT_PLACEMENT
from stages.sample.config import SampleConfig, SampleRun, VLMSampleConfig
from stages.sample.run_plan import check_memory, identity, num_shards

from ..generate import config_command
from ..runtime import device
from .sample_shards import open_writer, run_shards
from .sample_vlm import sample_vlm

# Least memory a diffusion rollout holds per sample before any model output: every sample is planned
# up front (ids and seeds, about 270 bytes each, measured for `stages.sample.stage.plan_rows`).
PLANNED_SAMPLE_BYTES = 256


def _kind(resolved: dict[str, Any]) -> type[SampleRun]:
    """The config of the model kind --model is: a vision-language model's, else a diffusion pipeline's; a
    folder of both kinds (BAGEL) samples images unless --understand."""
    from stages.models.vlm_families import is_vlm_model, understands

    model = resolved["model"]
    vlm = is_vlm_model(model) or (bool(resolved.get("understand")) and understands(model))
    return VLMSampleConfig if vlm else SampleConfig


def run(c: SampleRun, json_: bool) -> None:
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
    prompt; the diffusion options (--steps, --guidance, the sampler, video, parallelism and kernels) are
    refused, from a flag, a preset, --set or the environment, as the Vision-language ones are for a
    diffusion --model.
    A BAGEL folder is both: it generates images, or with --understand answers the table's questions
    with its understanding expert (docs/families.md, BAGEL).

    Example: [bold]omnirl sample --model models/sd3-tiny --prompts prompts.txt -n 8 --steps 10 \\
    --resolution 64 --sampler sde --noise-level 0.7 --out run/it0/samples[/]

    Video (Wan): [bold]omnirl sample --model models/wan-tiny --prompts prompts.txt -n 4 --resolution 32 \\
    --frames 5 --out run/it0/samples[/]

    VLM: [bold]omnirl sample --model models/vlm-tiny --prompts geo3k.parquet -n 5 --max-new-tokens 256 --out run/it0/samples[/]
    """
    (sample_vlm if isinstance(c, VLMSampleConfig) else _sample_diffusion)(c, json_)


def _sample_diffusion(c: SampleConfig, json_: bool) -> None:
    """`sample` for a diffusion pipeline: GROUP images (or videos) per prompt, with their trajectories."""
    from stages.media import output_modality
    from stages.media.deferred import deferred_record
    from stages.models.condition_images import condition_images_record
    from stages.models.conditioning import conditioning_record
    from stages.models.factory import DEFAULT_RESOLUTION, default_text_length, native_resolution
    from stages.models.families import adapter_class, resolution_identity
    from stages.models.folders import check_pipeline_folder, pipeline_index
    from stages.models.kernels import Kernels, prepare
    from stages.parallelism import ModelParallel, layout
    from stages.sample.engines import DiffusersEngine, EngineOptions, check_engine_options, engine_class
    from stages.sample.prompts import sample_prompts
    from stages.sample.sources import PromptSource
    from stages.sample.stage import KINDS, run_sample

    c.validate()
    check_pipeline_folder(c.model)  # before anything reads or hashes what may be any folder
    # the model's native resolution unless given, and the T5 length it was made for (its card's
    # text_length, else 128), recorded for replay
    c = replace(
        c,
        resolution=c.resolution or native_resolution(c.model) or DEFAULT_RESOLUTION,
        max_sequence_length=default_text_length(c.model),
    )
    engine_type = engine_class(c.engine)
    parallel = ModelParallel(sp_degree=c.sp_degree, sp_kind=c.sp_kind, tp_degree=c.tp_degree)
    kernels = Kernels(attention_backend=c.attention_backend, compile=c.compile)
    check_engine_options(c, engine_type, parallel, kernels)
    layout(parallel)  # before the shards are split over the data-parallel ranks
    source = PromptSource(c.prompts)
    picked = sample_prompts(source, c.num_prompts, c.seed)
    index = pipeline_index(c.model)
    family = adapter_class(index["_class_name"], str(c.model))
    for _, prompt in picked:  # before any output: condition images the model cannot take
        family.check_condition_images(len(prompt.images), prompt.text, family.variant_name(index))
    check_memory(
        c,
        len(picked) * c.group_size,
        PLANNED_SAMPLE_BYTES,
        f"planning {len(picked)} prompts × {c.group_size} samples",
    )
    c = replace(c, num_shards=num_shards(c, len(picked)))
    options = EngineOptions.from_options(vars(c))
    # an engine drawing other samples than diffusers (vLLM-Omni's images API) joins the run's identity
    placement = ROLLOUT_PLACEMENT if engine_type.same_samples(options) else ("server_url",)
    run_identity = identity(c, placement, resolution=resolution_identity(c.resolution))
    writer = open_writer(c, run_identity, KINDS, json_, source)
    if writer is None:
        return
    engine = engine_type.open(options, device())
    try:
        if isinstance(engine, DiffusersEngine):
            prepare(engine.policy.parts, parallel, kernels)
        extra = {"sample_config": c.record(), "family": engine.family, "engine": engine.describe()}
        if c.defer_decode:  # no media column to tell the modality: the family's decode does
            extra.update(modality=engine.policy.family.media, **deferred_record(c.model, c.dtype))

        def with_modality(columns: list) -> dict:
            # the prompt conditioning each shard stored (an engine that returns none stores nothing)
            stored = conditioning_record(
                writer.out_dir,
                writer.num_shards,
                writer.content_id,
                model=c.model,
                dtype=c.dtype,
                max_sequence_length=c.max_sequence_length,
            )
            # the prompt groups' condition images (an editing model's rollout), once per group
            images = condition_images_record(writer.out_dir, writer.num_shards, writer.content_id)
            return {
                "modality": output_modality([col.kind for col in columns]),
                **extra,
                **(stored or {}),
                **(images or {}),
            }

        run_shards(
            c, json_, writer, len(picked), "images", with_modality, partial(run_sample, engine, c, picked)
        )
    finally:
        engine.close()


sample = config_command((SampleConfig, VLMSampleConfig), "sample", run, choose=_kind)
