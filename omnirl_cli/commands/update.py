"""`omnirl update`: train the policy on scored rollouts and write the next adapter."""

from __future__ import annotations

from stages.knobs import knobs
from stages.outputs import open_inputs, run_config
from stages.update.config import UpdateConfig

from ..console import emit_json, log, print_result, progress
from ..generate import config_command
from ..runtime import device


def run(c: UpdateConfig, json_: bool) -> None:
    """Train the policy with --algo on rollouts (or offline pairs / latents) and write the next adapter.

    Policy-gradient algorithms replay the stored SDE steps under the trained weights; nft and awm
    train on the final latents with fresh noise; dpo on the best and worst sample of each group; dgpo
    on whole groups of final latents (docs/algorithms.md has each one's formula and reference).
    For a VLM (--model a Qwen2.5-VL folder), grpo/dapo/gspo replay the response tokens: LoRA on the
    language model (vision tower frozen), writes a PEFT adapter (or the full model with --full).

    Writes an inference-ready adapter (diffusers `pipe.load_lora_weights(OUT)`), the optimizer/EMA
    state the next update resumes from, and metrics.jsonl per optimizer step: actor/pg_loss, kl_loss,
    pg_clipfrac, grad_norm, the effective lr, and under verl-omni's names (verl's for VLMs) ratio_mean,
    pg_clipfrac_higher / _lower, ppo_kl = mean(−log r), perf/throughput (images per second per device)
    and perf/time_per_step; diffusion steps add ratio_std (Bessel, as verl-omni) and flow_grpo's
    approx_kl = ½·mean((log r)²); memory/param_bytes and optimizer_bytes (this rank's share);
    rollout_corr/* with --rollout-correction (docs/algorithms.md). docs/tracking.md maps renamed metrics.
    flow_dppo adds verl-omni's kl_new_old_mean/max, kl_mask_fraction, pos/neg_rm_fraction and
    masked/unmasked_fraction; dgpo reports fm_loss, group_weight_mean and old_policy/decay.

    Under torchrun or `accelerate launch` each rank takes its grad_accum micro-batches of every step:
    N ranks equal one process with N·grad_accum (DDP, or FSDP2 with --strategy fsdp2 or an fsdp_version 2
    accelerate config; recipes/accelerate/ has configs). --samples-per-step fixes the step's size at any
    world size instead (grad_accum = it ÷ (micro-batch × ranks)), as the presets do. Rank 0 writes the adapter and prints the report.
    Under FSDP2 with fsdp_state_dict_type SHARDED_STATE_DICT (FSDP_STATE_DICT_TYPE) each rank writes its shards of
    the trainer state (torch.distributed.checkpoint, trainer_state/sharded); the adapter stays one loadable folder.
    With --sp-degree S the launch's ranks form dp × S: each group of S ranks trains on the same
    micro-batches with 1/S of every sequence, so N ranks equal one process with N/S·grad_accum
    (docs/scaling.md, "Sequence and tensor parallelism"). An FSDP2 rank keeps its shards only: it loads
    the checkpoint without a private copy and saves by gathering the whole weights, then the optimizer
    state, one after the other (docs/real-checkpoints.md, "FSDP2 memory").

    --report-to logs every metrics.jsonl record as it is made, at its global optimizer step.

    A diffusion update loads no VAE, and no text encoder or tokenizer when the rollout stores its prompt
    conditioning (`sample` does); --json lists loaded_components (docs/real-checkpoints.md, "What each
    stage loads").

    Rows whose reward failed (flagged in reward_failed by `score --on-error zero` and passed on by
    `advantage`, or a NaN reward) are skipped whatever --algo reads (advantage or reward): they give no
    gradient; their count is reward_failed (--json, omnirl_adapter.json).

    GARDO: when --in carries kl_gate (`advantage --gate-reward`), the diffusion KL term (--beta) of a
    micro-batch averages over its gated rows only (none gated: no KL term).

    Example: [bold]omnirl update --model models/sd3-tiny --in run/it0/samples --in run/it0/advantages \\
    --algo flow_grpo --out run/it1/policy[/]

    VLM: [bold]omnirl update --model models/vlm --in run/it0/samples --in run/it0/advantages --algo dapo \\
    --lr 1e-6 --beta 0 --out run/it1/policy[/]
    """
    from stages.dist import world_and_rank
    from stages.parallelism import layout
    from stages.tracking import open_tracking
    from stages.update.stage import run_update

    tracking = open_tracking(c.report_to, c.out, c.run_name)
    c.validate()
    layout(c.parallel)  # a world the degrees do not fit is refused before anything loads
    src = open_inputs(c.inputs)
    options = {f.name: getattr(c, f.name) for f, _ in knobs(UpdateConfig)}  # the output's identity
    with tracking, progress() as bar:
        task = bar.add_task("updating", total=None, rate="")

        def on_step(record: dict) -> None:
            bar.update(task, advance=1, rate=f"loss {record.get('actor/pg_loss', 0):+.3e}")
            tracking.log_update([record])

        result = run_update(
            c.model,
            c.adapter,
            src,
            c.out,
            c,
            dtype=c.dtype,
            device=device(),
            run_config=run_config(options),
            overwrite=c.overwrite,
            on_step=on_step,
        )
    if world_and_rank()[1] != 0:  # one report per launch, from rank 0 (the rank that wrote the adapter)
        return
    if json_:
        emit_json(result)
    elif result.get("skipped"):
        log(f"{c.out} already holds this update; nothing to do")
    else:
        means = result["step_means"]
        shown = (
            ("pg_loss", "pg_loss", "+.4e"),
            ("ratio_mean", "ratio", ".6f"),
            ("clipfrac", "clipfrac", ".3f"),
        )
        print_result(
            f"[green]updated[/] → {c.out}  step {result['step']}  mean of {result['optimizer_steps']} "
            f"optimizer step{'' if result['optimizer_steps'] == 1 else 's'} (as `omnirl report`): "
            + "  ".join(f"{label} {means[key]:{spec}}" for key, label, spec in shown if key in means)
            + f"  {result['reward_failed']} rows with a failed reward skipped"
        )


update = config_command(UpdateConfig, "update", run)
