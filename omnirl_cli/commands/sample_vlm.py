"""`omnirl sample` for a vision-language model: text responses per (images, question) prompt."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from stages.sample.config import VLMSampleConfig
from stages.sample.run_plan import check_memory, identity, num_shards

from ..runtime import device
from .sample_shards import open_writer, run_shards


def sample_vlm(c: VLMSampleConfig, json_: bool) -> None:
    """GROUP responses per prompt row of a verl/EasyR1 table, with their tokens and rollout log-probs."""
    from stages.models.vlm import VLMPolicy
    from stages.models.vlm_families import model_type
    from stages.sample.sources import PromptSource
    from stages.sample.vlm_data import sample_vlm_prompts
    from stages.sample.vlm_stage import KINDS, run_vlm_sample

    c.validate()
    source = PromptSource(c.prompts)
    picked = sample_vlm_prompts(
        source,
        c.num_prompts,
        c.seed,
        layout=c.layout,
        prompt_key=c.prompt_key,
        answer_key=c.answer_key,
        image_key=c.image_key,
        video_key=c.video_key,
        audio_key=c.audio_key,
    )
    # A group's padded token columns stay in memory until its shard is written: an int64 id and a bool
    # mask per prompt and response position, an fp32 log-prob per response position.
    token_bytes = 9 * c.max_prompt_length + 13 * c.max_new_tokens
    what = f"holding the token columns of one group of {c.group_size} responses"
    check_memory(c, c.group_size, token_bytes, what)
    c = replace(c, num_shards=num_shards(c, len(picked)))
    writer = open_writer(c, identity(c), KINDS, json_, source)
    if writer is None:
        return
    policy = (
        VLMPolicy.load(c.model, adapter=c.adapter, device=device(), dtype=c.dtype)
        if c.engine == "hf"
        else VLMPolicy.for_prompts(c.model)
    )
    run_shards(
        c,
        json_,
        writer,
        len(picked),
        "responses",
        {"vlm_sample_config": c.record(), "family": model_type(c.model), "modality": "text"},
        partial(run_vlm_sample, policy, c, picked),
    )
