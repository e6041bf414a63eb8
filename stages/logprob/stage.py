"""The `logprob` stage over shard sets: replay a rollout's stored steps (or a VLM's response tokens)
under given weights into an output of old (and reference) log-probs, resumably, over a launcher's ranks.

The replay of one shard is `stages.logprob.replay`; whether a replay can change anything is
`stages.logprob.decide`.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import torch

from stages.dist import device, gather
from stages.errors import UserInputError
from stages.logprob.config import LogprobConfig
from stages.logprob.decide import NATIVE, Numerics, replay_decision
from stages.logprob.replay import delta_summary, pick_batches, replay_shard, replay_token_shard
from stages.models.diffusion import FlowPolicy
from stages.models.kernels import Kernels, prepare
from stages.models.vlm import VLMPolicy
from stages.outputs import check_format, finalize, loaded, map_shards, open_inputs, policy_info, run_config
from stages.parallelism import ModelParallel, layout
from stages.precision import autocast, resolve_mixed_precision
from stages.sample.engines import check_replayable
from stages.sample.rollout import sample_config_of
from stages.sample.vlm_stage import vlm_sample_config_of
from stages.shards.manifest import SUBSET_KEY, read_manifest
from stages.shards.reader import rollout_modality
from stages.shards.writer import ShardSetWriter


def run_logprob(c: LogprobConfig, display: Any) -> dict[str, Any] | None:
    """Replay `c.inputs` under `c.model` (+ `c.adapter`) into `c.out` (old_log_probs [N, T], and
    ref_log_probs / means where asked), advancing the progress `display` (`map_shards`); a finished
    `c.out` is left as it is. Returns the result this process reports (the output's manifest extra:
    replayed, replay_reason, rows_replayed, |Δlogp| statistics; what it loaded; skipped), or None on a
    rank of a launch that does not report."""
    src = open_inputs(c.inputs)
    tokens = rollout_modality(src.manifests) == "text"
    parallel, kernels = ModelParallel.from_options(asdict(c)), Kernels.from_options(asdict(c))
    if tokens and (parallel.degree > 1 or kernels != Kernels()):
        raise UserInputError(
            "--sp-degree / --tp-degree / --attention-backend / --compile: diffusion transformers only; drop "
            "it for a text rollout"
        )
    if (c.packing == "on" or c.micro_batch_tokens) and not tokens:
        raise UserInputError(
            "--packing on / --micro-batch-tokens: text (VLM) rollouts only; drop it for a diffusion rollout"
        )
    kernels.validate()
    layout(parallel)  # before the shards are split over the data-parallel ranks
    sample_cfg = vlm_sample_config_of(src.manifests) if tokens else sample_config_of(src.manifests)
    # the option, else the launcher's, else the rollout's: a plain replay reproduces the rollout's numerics
    c = replace(c, mixed_precision=resolve_mixed_precision(c.mixed_precision, sample_cfg.mixed_precision))
    check_replayable(src.manifests)
    if c.fraction < 1 and (c.replay == "auto" or tokens):
        raise UserInputError(
            f"--fraction {c.fraction}: "
            + (
                "a check replays whatever --replay auto would decide; drop --replay auto"
                if c.replay == "auto"
                else "diffusion rollouts only; replay a text rollout whole (drop --fraction)"
            )
        )
    identity = run_config(asdict(c))
    decision = replay_decision(
        src.manifests,
        Numerics(
            identity["model_sha256"],
            identity.get("adapter_sha256"),
            c.dtype,
            c.mixed_precision,
            device().type,
            identity.get("attention_backend") or NATIVE,
        ),
        computes=[flag for flag, asked in (("--reference", c.reference), ("--means", c.means)) if asked],
    )
    # an ODE rollout (NFT, AWM) stores no steps: nothing to replay
    stored = tokens or "latents" in src.columns
    replaying = stored and (c.replay == "yes" or decision.needed)
    subset = None
    if replaying and c.fraction < 1:
        shard_ids = [src.read_shard(s, ["sample_id"])["sample_id"] for s in range(src.num_shards)]
        seed = sample_cfg.seed if c.seed is None else c.seed
        subset = pick_batches(shard_ids, sample_cfg.batch_size, c.fraction, seed)
        subset = subset if len(subset) < src.num_rows else None  # every batch drawn: the full replay
    writer = ShardSetWriter(
        c.out,
        num_shards=src.num_shards,
        format=check_format(c.fmt),
        command="logprob",
        config=identity,
        parents=list(src.paths),
        policy=policy_info(c.model, c.adapter),
        overwrite=c.overwrite,
        kinds={"sample_id": "string"},  # a --fraction shard may hold no row
    )
    skipped = writer.complete
    if not skipped:
        policy: Any = None
        if replaying and tokens:
            policy = VLMPolicy.load(c.model, adapter=c.adapter, device=device(), dtype=c.dtype)
            policy.use_packing(c.packing)
        elif replaying:  # no VAE, and no text encoder when the rollout stores its conditioning
            policy = FlowPolicy.for_rollout(
                c.model,
                src,
                sample_cfg.max_sequence_length,
                adapter=c.adapter,
                device=device(),
                dtype=c.dtype,
            )
            prepare(policy.parts, parallel, kernels)
        found: list[Any] = []  # flat |Δlogp| of each shard replayed here, in order

        def replay_one(shard: dict, advance: Any) -> dict:
            if not replaying:
                advance(len(shard["sample_id"]))
                return {"sample_id": shard["sample_id"]}
            with autocast(c.mixed_precision, policy.device):
                cols, deltas = replay_stored(shard, advance)
            found.append(deltas)
            return cols

        def replay_stored(shard: dict, advance: Any) -> tuple[dict, Any]:
            if tokens:
                return replay_token_shard(
                    policy,
                    sample_cfg,
                    shard,
                    reference=c.reference,
                    where=str(src.paths[0]),
                    on_batch=advance,
                    budget=c.micro_batch_tokens,
                )
            return replay_shard(
                policy,
                sample_cfg,
                shard,
                reference=c.reference,
                means=c.means,
                where=str(src.paths[0]),
                on_batch=advance,
                subset=subset,
            )

        if tokens:
            columns = ["sample_id", "group_id", "prompt", "images", "prompt_ids", "prompt_mask"]
            columns += ["response_ids", "response_mask", "log_probs"]
            # absent in older rollouts
            columns += [name for name in ("messages", "videos", "audios") if name in src.columns]
        elif replaying:
            columns = ["sample_id", "group_id", "prompt", "negative_prompt", "latents", "sigmas", "log_probs"]
        else:
            columns = ["sample_id"]
        label = "replaying" if replaying else "listing"
        written = map_shards(src, writer, label, columns, replay_one, display=display)
        rows = len(subset) if subset is not None else src.num_rows if replaying else 0
        extra = {
            "replayed": replaying,
            "replay_reason": decision.reason,
            "rows_replayed": rows,
            **_delta_summary(dict(zip(written, found, strict=replaying))),
        }
        if subset is not None:
            option = f"--fraction {c.fraction}"
            extra[SUBSET_KEY] = {"rows": rows, "of": src.num_rows, "option": option}
    else:
        extra, policy = None, None
    if not finalize(writer, extra):
        return None
    extra = read_manifest(c.out).extra
    return {"out": str(c.out), "rows": src.num_rows, **extra, **loaded(policy), "skipped": skipped}


def _delta_summary(mine: dict[int, Any]) -> dict[str, float | None]:
    """Rollout-vs-replay |Δlogp| statistics (`delta_summary`) over every rank's replayed shards (`mine`:
    this rank's flat |Δlogp| per shard index), joined in shard order as one process joins them, so a
    launch records the very floats of a single process."""
    per_shard = {s: deltas for part in gather(mine) for s, deltas in part.items()}
    return delta_summary(
        torch.cat([per_shard[s] for s in sorted(per_shard)]) if per_shard else torch.zeros(0)
    )
