"""The `sample` stage for vision-language policies: n text responses per (images, question) prompt.

Row layout (one row per response, groups contiguous, a shard holds whole groups):

- sample_id (`<rollout>-g000003-001`), group_id (`<rollout>-g000003`) with the rollout's `rollout_id`,
  prompt (the user turns' text), messages (json: the chat messages as the model saw them, system and
  earlier turns included, images as `{"type": "image"}` parts at their positions), prompt_meta (json:
  ground_truth, data_source, extra_info, max_response_length), seed, policy_version;
- images (image_list): the prompt's encoded image files, in the FIRST row of each group only (the
  others hold []), so images are stored once per prompt (in Parquet `datasets`' List(Image)); sets
  of schema version 1 hold them packed into one binary blob (`unpack_images`) and are still read;
  a text-only prompt holds [] everywhere;
- videos (video_list): likewise the prompt's videos, each a list of encoded frames (Parquet:
  List(List(Image))); each video's frame rate is the `fps` of its part in `messages`. Rollouts
  written before video support have no such column (no videos);
- audios (audio_list): likewise the prompt's audio files (omni models); rollouts written before audio
  support have no such column (no audio);
- prompt_ids int64 [P] / prompt_mask bool [P]: the processor-expanded prompt (image pad tokens
  included), left-padded to `max_prompt_length`; the training forward rebuilds pixel values from the
  images and checks that the processor gives these ids again;
- response_ids int64 [T] / response_mask bool [T] (up to and including the first eos, right-padded
  to `max_new_tokens`), response_text, response_length, log_probs float32 [T] (0 at padding);
  truncated (bool): the response reached `max_new_tokens` without a stop token (OmniRL's
  `max_output_token_length` cut; format rewards score it 0).

The engines: `hf` (transformers `generate` under the policy's weights; the rollout log-probs match a
replay to float rounding), `openai` (a server speaking the OpenAI chat API, e.g. `vllm serve`) and
`sglang` (SGLang's OpenAI-compatible server, `openai_engine.SGLANG`). A server's log-probs come from
it, so `omnirl logprob` recomputes them; an API key is read from OPENAI_API_KEY, never from the
recorded options. A generate call's seed derives from the run seed and its first prompt; samples
depend on the batching (prompts per call = max(1, batch_size // n)),
and with one prompt per call the engines draw the same responses from the same weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from stages.errors import UserInputError
from stages.finite import MODEL_HINT, check_finite
from stages.models.vlm import Rollout, VLMPolicy
from stages.precision import autocast
from stages.sample.config import VLMSampleConfig
from stages.sample.rollout import derive_seed
from stages.sample.stage import in_rollout, rollout_id, split_groups, write_shards
from stages.sample.vlm_audio import decode_audio
from stages.sample.vlm_data import AUDIO, IMAGE, MEDIA_KINDS, VIDEO, VLMPrompt, decode_image, unpack_images
from stages.shards.writer import ShardSetWriter

# The rollout's media columns: one per `MEDIA_KINDS` entry, named by its verl column, and their kinds.
MEDIA_COLUMNS = {IMAGE.column: "image_list", VIDEO.column: "video_list", AUDIO.column: "audio_list"}
KINDS = {**MEDIA_COLUMNS, "prompt_meta": "json", "messages": "json"}


def vlm_sample_config_of(manifests: list[Any]) -> VLMSampleConfig:
    """The `VLMSampleConfig` recorded by `omnirl sample` in one of the input manifests."""
    for manifest in manifests:
        recorded = (manifest.extra or {}).get("vlm_sample_config")
        if recorded:
            return VLMSampleConfig.from_record(recorded)
    raise UserInputError(
        "--in: none of the inputs holds a VLM rollout written by `omnirl sample`; pass its samples first"
    )


def left_pad(
    ids: torch.Tensor, mask: torch.Tensor, length: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids/mask [B, L] → [B, length]; a prompt longer than `length` is an error."""
    real = int(mask.sum(-1).max()) if len(mask) else 0
    if real > length:
        raise UserInputError(
            f"a prompt is {real} tokens (image tokens included) but --max-prompt-length is {length}; "
            "raise it or use smaller images"
        )
    ids, mask = (
        ids[:, ids.shape[1] - min(length, ids.shape[1]) :],
        mask[:, mask.shape[1] - min(length, mask.shape[1]) :],
    )
    pad = length - ids.shape[1]
    ids = torch.cat([torch.full((len(ids), pad), pad_id, dtype=ids.dtype), ids], dim=1)
    mask = torch.cat([torch.zeros(len(mask), pad, dtype=torch.bool), mask.bool()], dim=1)
    return ids, mask


def right_pad(x: torch.Tensor, length: int, value: Any) -> torch.Tensor:
    """[B, T] → [B, length] filled with `value` after the T given positions."""
    return torch.cat([x, torch.full((len(x), length - x.shape[1]), value, dtype=x.dtype)], dim=1)


def row_media(shard: dict[str, Any], where: str) -> list[dict[str, list[Any]]]:
    """Each row's media per column (`MEDIA_COLUMNS`), taken from the first row of its group (where
    `sample` stored them); a column the rollout does not have gives every row none."""
    out: list[dict[str, list[Any]]] = []
    leader: dict[str, dict[str, list[Any]]] = {}
    present = [c for c in MEDIA_COLUMNS if c in shard]
    for r, (sid, gid) in enumerate(zip(shard["sample_id"], shard["group_id"])):
        first = gid not in leader
        for column in present:
            stored = shard[column][r]
            if isinstance(stored, list):
                if first:
                    leader.setdefault(gid, {})[column] = stored
            elif stored:  # schema version 1: images packed into one blob
                leader.setdefault(gid, {})[column] = unpack_images(stored, f"{where}: sample {sid!r}")
        if gid not in leader:
            raise UserInputError(
                f"{where}: sample {sid!r} comes before the first row of its group {gid!r}; "
                "read whole groups in their stored order"
            )
        out.append({c: leader[gid].get(c, []) for c in MEDIA_COLUMNS})
    return out


def decode_media(policy: VLMPolicy, media: dict[str, list[Any]], where: str) -> dict[str, list[Any]]:
    """A row's stored media → the processor's inputs per column: images as RGB PIL images, videos as
    lists of RGB PIL frames, audio clips as mono float32 waveforms [S] at the processor's sampling rate
    (a processor without a feature extractor takes no audio: `VLMPolicy.chat_inputs` says so)."""
    extractor = getattr(policy.processor, "feature_extractor", None)
    rate = getattr(extractor, "sampling_rate", None)
    return {
        IMAGE.column: [decode_image(b, where) for b in media.get(IMAGE.column, [])],
        VIDEO.column: [[decode_image(b, where) for b in video] for video in media.get(VIDEO.column, [])],
        AUDIO.column: [decode_audio(b, rate, where) for b in media.get(AUDIO.column, [])],
    }


def media_inputs(
    policy: VLMPolicy, prompts: list[Any], media: list[dict[str, list[Any]]], where: list[str]
) -> dict[str, torch.Tensor]:
    """`VLMPolicy.chat_inputs` of prompts with their media (`decode_media` per row; `where[k]` names
    row k in an error)."""
    decoded = [decode_media(policy, row, w) for row, w in zip(media, where)]
    return policy.chat_inputs(
        prompts,
        [d[IMAGE.column] for d in decoded],
        videos=[d[VIDEO.column] for d in decoded],
        audios=[d[AUDIO.column] for d in decoded],
    )


def prompt_seed(cfg: VLMSampleConfig, index: int) -> int:
    """The sampling seed of the generate call that starts at prompt `index` (a server gets one per prompt)."""
    return derive_seed(cfg.seed, "vlm", index)


def generate_batch(
    policy: VLMPolicy, cfg: VLMSampleConfig, prompts: list[tuple[int, VLMPrompt]], n: int, seed: int
) -> tuple[dict[str, torch.Tensor], Rollout]:
    """Prompt inputs (one row per prompt) and n responses per prompt from the configured engine."""
    inputs = media_inputs(
        policy,
        [p.messages for _, p in prompts],
        [p.media for _, p in prompts],
        [f"prompt {i}" for i, _ in prompts],
    )
    if cfg.engine == "hf":
        with autocast(cfg.mixed_precision, policy.device):
            rollout = policy.generate(
                inputs,
                n=n,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens,
                seed=seed,
            )
    else:
        from stages.sample.openai_engine import SERVER_APIS, generate_openai

        if any(p.videos or p.audios for _, p in prompts):
            raise UserInputError(
                f"--engine {cfg.engine} sends images only; sample prompts with videos or audio with --engine hf"
            )
        rollout = generate_openai(
            str(cfg.server_url),
            str(cfg.served_model),
            [p.messages for _, p in prompts],
            [p.images for _, p in prompts],
            tokenizer=policy.processor.tokenizer,
            n=n,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            seeds=[prompt_seed(cfg, i) for i, _ in prompts],
            api_key=os.environ.get("OPENAI_API_KEY"),
            api=SERVER_APIS[cfg.engine],
        )
    return inputs, rollout


def sample_vlm_shard(
    policy: VLMPolicy,
    cfg: VLMSampleConfig,
    prompts: list[tuple[int, VLMPrompt]],
    n: int,
    shard_index: int,
    policy_version: int,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Sample one shard's prompt groups; returns its columns (layout in the module docstring)."""
    from stages.shards.reader import concat_batches

    pad_id = policy.processor.tokenizer.pad_token_id
    per_call = cfg.prompts_per_call(n)
    batches = []
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start : start + per_call]
        seed = prompt_seed(cfg, chunk[0][0])
        inputs, out = generate_batch(policy, cfg, chunk, n, seed)
        prompt_ids, prompt_mask = left_pad(
            inputs["input_ids"].cpu(), inputs["attention_mask"].cpu(), cfg.max_prompt_length, pad_id
        )
        groups = [f"g{i:06d}" for i, _ in chunk]
        rows = [(i, p, g, m) for (i, p), g in zip(chunk, groups) for m in range(n)]
        mask = right_pad(out.response_mask.cpu(), cfg.max_new_tokens, False)
        length = mask.sum(-1)
        last = out.response_ids.cpu().gather(
            1, (length.clamp(min=1) - 1).clamp(max=out.response_ids.shape[1] - 1)[:, None]
        )[:, 0]
        stopped = torch.isin(last, torch.tensor(policy.stop_ids, dtype=last.dtype))
        batches.append(
            {
                "sample_id": [f"{g}-{m:03d}" for _, _, g, m in rows],
                "group_id": [g for _, _, g, _ in rows],
                "prompt": [p.question for _, p, _, _ in rows],
                "messages": [p.messages for _, p, _, _ in rows],
                "prompt_meta": [{**p.meta, "max_response_length": cfg.max_new_tokens} for _, p, _, _ in rows],
                **{
                    kind.column: [list(p.media.get(kind.column, [])) if m == 0 else [] for _, p, _, m in rows]
                    for kind in MEDIA_KINDS
                },
                "prompt_ids": prompt_ids.repeat_interleave(n, dim=0),
                "prompt_mask": prompt_mask.repeat_interleave(n, dim=0),
                "response_ids": right_pad(out.response_ids.cpu(), cfg.max_new_tokens, pad_id),
                "response_mask": mask,
                "response_text": list(out.text),
                "response_length": length.to(torch.int64),
                "truncated": (length >= cfg.max_new_tokens) & ~stopped,
                "log_probs": right_pad(out.log_probs.float().cpu(), cfg.max_new_tokens, 0.0),
                "seed": torch.full((len(rows),), seed, dtype=torch.int64),
                "policy_version": torch.full((len(rows),), policy_version, dtype=torch.int64),
            }
        )
        if on_batch:
            on_batch(len(rows))
    cols = concat_batches(batches)
    check_finite(cols, cols["sample_id"], where="sample", hint=MODEL_HINT)
    return cols


def run_vlm_sample(
    policy: VLMPolicy,
    cfg: VLMSampleConfig,
    prompts: list[tuple[int, VLMPrompt]],
    group_size: int,
    writer: ShardSetWriter,
    *,
    num_shards: int,
    shard_indices: list[int],
    policy_version: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Sample the shards in `shard_indices`; resumes finished shards. Returns counts and responses/s."""
    cfg.validate()
    if group_size < 1:
        raise UserInputError(f"-n {group_size}: the group size must be at least 1")
    shards = split_groups(prompts, num_shards)
    rollout = rollout_id(writer)
    return write_shards(
        writer,
        [len(groups) * group_size for groups in shards],
        shard_indices,
        lambda s: in_rollout(
            sample_vlm_shard(policy, cfg, shards[s], group_size, s, policy_version, on_batch), rollout
        ),
        unit="responses",
        on_batch=on_batch,
    )


def row_prompts(shard: dict[str, Any]) -> list[Any]:
    """Each row's prompt as sampled: its chat messages (rollouts written before the `messages` column
    hold only the question, which was asked as one user turn, images first)."""
    return list(shard["messages"] if "messages" in shard else shard["prompt"])


def prompt_inputs(
    policy: VLMPolicy,
    prompts: list[Any],
    media: list[dict[str, list[Any]]],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    where: str,
) -> dict[str, torch.Tensor]:
    """Processor inputs for stored rows (one prompt per row, its media from `row_media`), checked
    against their stored prompt ids.

    The processor rebuilds pixel values from the media; if its ids differ from what `sample` stored
    (another processor, changed media) the log-probs would be of a different prompt, so it is an error.
    """
    inputs = media_inputs(policy, prompts, media, [where] * len(prompts))
    width = int(prompt_mask.sum(-1).max()) if len(prompt_mask) else 0
    ids, mask = inputs["input_ids"].cpu(), inputs["attention_mask"].cpu().bool()
    if ids.shape[1] > prompt_ids.shape[1] or not torch.equal(
        torch.where(mask, ids, -1)[:, -width:] if width else ids[:, :0],
        torch.where(prompt_mask, prompt_ids, -1)[:, -width:] if width else ids[:, :0],
    ):
        raise UserInputError(
            f"{where}: the processor of --model does not reproduce the stored prompt ids; "
            "use the model the rollout was sampled with"
        )
    return inputs


def response_batch(batch: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Response ids/mask [B, T'] cut to the longest response of the batch (the rest is padding)."""
    mask = batch["response_mask"].bool()
    length = max(1, int(mask.sum(-1).max()) if len(mask) else 1)
    return batch["response_ids"][:, :length].to(device), mask[:, :length].to(device)


def token_column(values: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """Per-token values [B, T'] for `response_batch`'s tokens → float32 [B, width] on the CPU, 0 off the mask."""
    values = torch.where(mask, values, torch.zeros((), device=values.device))
    return right_pad(values.float().cpu(), width, 0.0)
