"""`omnirl logprob`: replay stored steps under given weights (old / reference log-probs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..choices import Dtype
from ..config import resolve
from ..console import emit_json, log
from ..errors import handle_errors
from ..options import (
    ADAPTER_HELP,
    ConfigOpt,
    FormatOpt,
    InOpt,
    JsonOpt,
    OutOpt,
    OverwriteOpt,
    SetOpt,
    mixed_precision_opt,
    model_opt,
)
from ..runtime import (
    check_format,
    device,
    finalize,
    loaded,
    map_shards,
    open_inputs,
    policy_info,
    run_config,
)


@handle_errors
def logprob(
    ctx: typer.Context,
    inputs: InOpt = None,
    out: OutOpt = None,
    model: model_opt("Diffusers pipeline or transformers VLM") = None,
    adapter: Annotated[
        Path | None,
        typer.Option("--adapter", help=f"Adapter to replay under: {ADAPTER_HELP} (default: base model)."),
    ] = None,
    dtype: Annotated[Dtype, typer.Option("--dtype", envvar="OMNIRL_DTYPE", help="Weights dtype.")] = "fp32",
    reference: Annotated[
        bool,
        typer.Option(
            "--reference",
            help="Also store the frozen base model's step means (ref_means; VLM: token ref_log_probs) for KL.",
        ),
    ] = False,
    means: Annotated[
        bool,
        typer.Option(
            "--means",
            help="Also store the step means under these weights (old_means, for --algo grpo_guard).",
        ),
    ] = False,
    mixed_precision: mixed_precision_opt(
        "the replayed forward, as `update --mixed-precision` (give both the same, so the old log-probs "
        "carry the trainer's numerics)",
        fallback="the rollout's `sample --mixed-precision` (so the replay reproduces the rollout log-probs)",
    ) = None,
    fmt: FormatOpt = "parquet",
    overwrite: OverwriteOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Recompute the log-prob of every stored step under the given weights; writes old_log_probs.

    Uses the rollout's own sampler, CFG and batch size (from the samples manifest), so replaying with
    the sampling weights reproduces the rollout log-probs; reports mean and max |Δ logp|. A rollout
    with no stored steps (the ODE sampler, for NFT/AWM) gets a shard set of its sample ids only, so
    recipes keep one shape for every algorithm.

    A diffusion replay loads no VAE, and no text encoder or tokenizer when the rollout stores its prompt
    conditioning (`sample` does): --json lists loaded_components; conditioning of another text encoder is
    refused (docs/real-checkpoints.md, "What each stage loads").

    A VLM rollout (text responses) gets every response token's log-prob (old_log_probs [T]) from one
    forward over prompt + response per sampling batch, and with --reference the base model's
    ref_log_probs [T].

    Example: [bold]omnirl logprob --model models/sd3-tiny --adapter run/it0/policy --in run/it0/samples --out run/it0/logprobs[/]
    """
    c = resolve(ctx, "logprob", required=("model", "out"))
    from stages.logprob.replay import replay_shard, replay_token_shard
    from stages.models.diffusion import FlowPolicy
    from stages.models.vlm import VLMPolicy
    from stages.precision import autocast, resolve_mixed_precision
    from stages.sample.engines import check_replayable
    from stages.sample.rollout import sample_config_of
    from stages.sample.vlm_stage import vlm_sample_config_of
    from stages.shards.reader import rollout_modality
    from stages.shards.writer import ShardSetWriter

    src = open_inputs(c["inputs"])
    tokens = rollout_modality(src.manifests) == "text"
    sample_cfg = vlm_sample_config_of(src.manifests) if tokens else sample_config_of(src.manifests)
    # the option, else the launcher's, else the rollout's: a plain replay reproduces the rollout's numerics
    c["mixed_precision"] = resolve_mixed_precision(c["mixed_precision"], sample_cfg.mixed_precision)
    check_replayable(src.manifests)
    # an ODE rollout (NFT, AWM) stores no steps: nothing to replay
    stored = tokens or "latents" in src.columns
    writer = ShardSetWriter(
        c["out"],
        num_shards=src.num_shards,
        format=check_format(c["fmt"]),
        command="logprob",
        config=run_config(c),
        parents=list(src.paths),
        policy=policy_info(c["model"], c["adapter"]),
        overwrite=c["overwrite"],
    )
    if not writer.complete:
        policy: Any = None
        if stored and tokens:
            policy = VLMPolicy.load(c["model"], adapter=c["adapter"], device=device(), dtype=c["dtype"])
        elif stored:  # no VAE, and no text encoder when the rollout stores its conditioning
            policy = FlowPolicy.for_rollout(
                c["model"],
                src,
                sample_cfg.max_sequence_length,
                adapter=c["adapter"],
                device=device(),
                dtype=c["dtype"],
            )
        found: list[dict] = []  # |Δlogp| stats of each shard replayed here, in order

        def replay(shard: dict, advance: Any) -> dict:
            if not stored:
                advance(len(shard["sample_id"]))
                return {"sample_id": shard["sample_id"]}
            with autocast(c["mixed_precision"], policy.device):
                cols, stats = replay_stored(shard, advance)
            found.append(stats)
            return cols

        def replay_stored(shard: dict, advance: Any) -> tuple[dict, dict]:
            if tokens:
                return replay_token_shard(
                    policy,
                    sample_cfg,
                    shard,
                    reference=c["reference"],
                    where=str(src.paths[0]),
                    on_batch=advance,
                )
            return replay_shard(
                policy,
                sample_cfg,
                shard,
                reference=c["reference"],
                means=c["means"],
                where=str(src.paths[0]),
                on_batch=advance,
            )

        if tokens:
            columns = ["sample_id", "group_id", "prompt", "images", "prompt_ids", "prompt_mask"]
            columns += ["response_ids", "response_mask", "log_probs"]
            # absent in older rollouts
            columns += [name for name in ("messages", "videos", "audios") if name in src.columns]
        elif stored:
            columns = ["sample_id", "prompt", "negative_prompt", "latents", "sigmas", "log_probs"]
        else:
            columns = ["sample_id"]
        written = map_shards(src, writer, "replaying", columns, replay, bar=not json_)
        extra = _delta_summary(dict(zip(written, found, strict=stored)))  # no stats where nothing is stored
    else:
        extra, policy = None, None
    if not finalize(writer, extra):
        return
    from stages.shards.manifest import read_manifest

    extra = read_manifest(c["out"]).extra
    result = {"out": str(c["out"]), "rows": src.num_rows, **extra, **loaded(policy)}
    if json_:
        emit_json(result)
    else:
        mean = extra.get("abs_delta_mean")
        log(
            f"[green]replayed[/] {src.num_rows} samples → {c['out']}"
            + (
                f"  rollout-vs-replay |Δlogp| mean {mean:.3g}, max {extra['abs_delta_max']:.3g}"
                if mean is not None
                else ""
            )
        )


def _delta_summary(mine: dict[int, dict]) -> dict[str, float | None]:
    """Rollout-vs-replay |Δlogp| mean and max over every rank's replayed shards (`mine`: this rank's
    per-shard stats by shard index), summed in shard order as one process sums them, so a launch
    records the very floats of a single process."""
    from stages.dist import gather

    per_shard = {s: stats for part in gather(mine) for s, stats in part.items()}
    total, largest, count = 0.0, 0.0, 0
    for s in sorted(per_shard):
        total += per_shard[s]["abs_delta_sum"]
        largest = max(largest, per_shard[s]["abs_delta_max"])
        count += per_shard[s]["count"]
    return {"abs_delta_mean": total / count if count else None, "abs_delta_max": largest if count else None}
