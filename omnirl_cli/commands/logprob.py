"""`omnirl logprob`: replay stored steps under given weights (old / reference log-probs)."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from stages.logprob.config import LogprobConfig
from stages.outputs import check_format, finalize, loaded, map_shards, open_inputs, policy_info, run_config

from ..console import emit_json, log, print_result, progress
from ..generate import config_command
from ..runtime import device, report_complete


def run(c: LogprobConfig, json_: bool) -> None:
    """Recompute the log-prob of every stored step under the given weights; writes old_log_probs.

    Uses the rollout's own sampler, CFG and batch size (from the samples manifest), so replaying with
    the sampling weights reproduces the rollout log-probs; reports |Δ logp| against them (mean, p99,
    max), and when the mean exceeds 1e-3 (the rollout engine computes other numbers than the trainer) one
    line on stderr suggesting `omnirl update --rollout-correction`. A rollout with no stored steps (the
    ODE sampler, for NFT/AWM) gets a shard set of its sample ids only, so recipes keep one shape for every
    algorithm; so does a rollout that --replay auto finds the replay cannot change (`"replayed": false` and the reason, in the manifest and --json).

    A diffusion replay loads no VAE, and no text encoder or tokenizer when the rollout stores its prompt
    conditioning (`sample` does): --json lists loaded_components; conditioning of another text encoder is
    refused (docs/real-checkpoints.md, "What each stage loads").

    A VLM rollout (text responses) gets every response token's log-prob (old_log_probs [T]) from one
    forward over prompt + response per sampling batch, and with --reference the base model's
    ref_log_probs [T]; that forward runs over packed sequences where the model can (--packing).

    A re-run skips shards that are complete and verified; over a finished --out it replays nothing, says
    so, and reports that output's |Δ logp| (`"skipped": true` with --json).

    With --sp-degree S (or --tp-degree) under a launcher, each group of S ranks replays the same shards
    together and its first rank writes them; shards are split over the ranks / S groups.

    Example: [bold]omnirl logprob --model models/sd3-tiny --adapter run/it0/policy --in run/it0/samples --out run/it0/logprobs[/]

    Health check: [bold]omnirl logprob --model models/sd3-tiny --in run/it0/samples --fraction 0.1 --out run/it0/replay-check[/]
    """
    from stages.errors import UserInputError
    from stages.logprob.decide import NATIVE, Numerics, replay_decision
    from stages.logprob.replay import pick_batches, replay_shard, replay_token_shard
    from stages.models.diffusion import FlowPolicy
    from stages.models.kernels import Kernels, prepare
    from stages.models.vlm import VLMPolicy
    from stages.parallelism import ModelParallel, layout
    from stages.precision import autocast, resolve_mixed_precision
    from stages.sample.engines import check_replayable
    from stages.sample.rollout import sample_config_of
    from stages.sample.vlm_stage import vlm_sample_config_of
    from stages.shards.manifest import SUBSET_KEY
    from stages.shards.reader import rollout_modality
    from stages.shards.writer import ShardSetWriter

    src = open_inputs(c.inputs)
    tokens = rollout_modality(src.manifests) == "text"
    parallel, kernels = ModelParallel.from_options(asdict(c)), Kernels.from_options(asdict(c))
    if tokens and (parallel.degree > 1 or kernels != Kernels()):
        raise UserInputError(
            "--sp-degree / --tp-degree / --attention-backend / --compile: diffusion transformers only; drop "
            "it for a text rollout"
        )
    if c.packing == "on" and not tokens:
        raise UserInputError("--packing on: text (VLM) rollouts only; drop it for a diffusion rollout")
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
        with progress() as bar:
            written = map_shards(src, writer, label, columns, replay_one, display=bar)
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
        return
    from stages.shards.manifest import read_manifest

    extra = read_manifest(c.out).extra
    result = {"out": str(c.out), "rows": src.num_rows, **extra, **loaded(policy)}
    if skipped:
        report_complete(c.out, json_, result)
    elif json_:
        emit_json({**result, "skipped": False})
    elif not extra["replayed"]:
        print_result(f"[green]no replay[/] → {c.out} (sample ids only): {extra['replay_reason']}")
    else:
        mean = extra.get("abs_delta_mean")
        print_result(
            f"[green]replayed[/] {extra['rows_replayed']} of {src.num_rows} samples → {c.out}"
            + (
                f"  rollout-vs-replay |Δlogp| mean {mean:.3g}, p99 {extra['abs_delta_p99']:.3g}, "
                f"max {extra['abs_delta_max']:.3g}"
                if mean is not None
                else ""
            )
        )
    if not skipped and extra.get("replayed"):
        from stages.update.rollout_correction import suggestion

        hint = suggestion(extra.get("abs_delta_mean"))
        if hint:
            log(hint)


def _delta_summary(mine: dict[int, Any]) -> dict[str, float | None]:
    """Rollout-vs-replay |Δlogp| statistics (`delta_summary`) over every rank's replayed shards (`mine`:
    this rank's flat |Δlogp| per shard index), joined in shard order as one process joins them, so a
    launch records the very floats of a single process."""
    import torch

    from stages.dist import gather
    from stages.logprob.replay import delta_summary

    per_shard = {s: deltas for part in gather(mine) for s, deltas in part.items()}
    return delta_summary(
        torch.cat([per_shard[s] for s in sorted(per_shard)]) if per_shard else torch.zeros(0)
    )


logprob = config_command(LogprobConfig, "logprob", run)
