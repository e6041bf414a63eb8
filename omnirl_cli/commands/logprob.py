"""`omnirl logprob`: replay stored steps under given weights (old / reference log-probs)."""

from __future__ import annotations

from stages.logprob.config import LogprobConfig

from ..console import emit_json, log, print_result, progress
from ..generate import config_command
from ..runtime import report_complete


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
    from stages.logprob.stage import run_logprob

    with progress() as bar:
        result = run_logprob(c, bar)
    if result is None:
        return
    skipped = result.pop("skipped")
    if skipped:
        report_complete(c.out, json_, result)
    elif json_:
        emit_json({**result, "skipped": False})
    elif not result["replayed"]:
        print_result(f"[green]no replay[/] → {c.out} (sample ids only): {result['replay_reason']}")
    else:
        mean = result.get("abs_delta_mean")
        print_result(
            f"[green]replayed[/] {result['rows_replayed']} of {result['rows']} samples → {c.out}"
            + (
                f"  rollout-vs-replay |Δlogp| mean {mean:.3g}, p99 {result['abs_delta_p99']:.3g}, "
                f"max {result['abs_delta_max']:.3g}"
                if mean is not None
                else ""
            )
        )
    if not skipped and result.get("replayed"):
        from stages.update.rollout_correction import suggestion

        hint = suggestion(result.get("abs_delta_mean"))
        if hint:
            log(hint)


logprob = config_command(LogprobConfig, "logprob", run)
