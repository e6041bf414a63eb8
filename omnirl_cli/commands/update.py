"""`omnirl update`: train the policy on scored rollouts and write the next adapter."""

from __future__ import annotations

from typing import Annotated

import typer

from stages.knobs import WEIGHTS_METAVAR

from ..choices import (
    ALGORITHMS,
    AwmWeighting,
    KlType,
    LossAggMode,
    LrScheduler,
    OldDecay,
    complete,
)
from ..config import resolve
from ..console import emit_json, log, print_result, progress
from ..errors import handle_errors
from ..options import (
    ADAPTER_HELP,
    AttentionBackendOpt,
    BalanceTokensOpt,
    CompileOpt,
    ConfigOpt,
    DtypeOpt,
    FullOpt,
    GradientCheckpointingOpt,
    InOpt,
    JsonOpt,
    LoraRankOpt,
    MicroBatchOpt,
    OutOpt,
    OverwriteOpt,
    PackingOpt,
    ReportToOpt,
    RunNameOpt,
    SetOpt,
    SpDegreeOpt,
    SpKindOpt,
    StrategyOpt,
    TpDegreeOpt,
    mixed_precision_opt,
    model_opt,
)
from ..runtime import device, open_inputs, run_config

OPT = "Optimisation"
LOSS = "Loss"


@handle_errors
def update(
    ctx: typer.Context,
    inputs: InOpt = None,
    out: OutOpt = None,
    model: model_opt("Diffusers pipeline or transformers VLM") = None,
    adapter: Annotated[
        str | None,
        typer.Option(
            "--adapter",
            metavar=WEIGHTS_METAVAR,
            help=f"Adapter to continue from: {ADAPTER_HELP}. omnirl's also carry optimizer, EMA and step; "
            "another tool's LoRA starts a fresh optimizer at step 0 with its own rank and alpha.",
        ),
    ] = None,
    dtype: DtypeOpt = "fp32",
    mixed_precision: mixed_precision_opt(
        "the forward and loss (fp16 with a dynamic loss scale, torch.amp.GradScaler: an overflow skips the "
        "step and halves the scale, logged as actor/grad_scale; not with FSDP2)",
        OPT,
        recorded="Recorded in the adapter's update_config.",
    ) = None,
    strategy: StrategyOpt = "auto",
    gradient_checkpointing: GradientCheckpointingOpt = False,
    sp_degree: SpDegreeOpt = 1,
    sp_kind: SpKindOpt = "ulysses",
    tp_degree: TpDegreeOpt = 1,
    attention_backend: AttentionBackendOpt = None,
    compile: CompileOpt = False,
    algo: Annotated[
        str,
        typer.Option(
            "--algo",
            autocompletion=complete(ALGORITHMS),
            help="flow_grpo (first int(K·f) steps), dance_grpo (random steps per sample), mix_grpo (the stored "
            "window), grpo_guard (GRPO-Guard's RatioNorm ratio with the exact step std, as flow_grpo; on "
            "dance steps verl-omni scales by η·|Δσ| instead; needs `logprob --means`); on final latents: nft "
            "(DiffusionNFT), awm (advantage-weighted matching), dpo (best vs worst of each group); VLM "
            "text rollouts: grpo (verl: clip 0.2, dual-clip 3, token-mean), dapo (clip-higher 0.28), gspo "
            "(verl: sequence ratio, clip 3e-4/4e-4, policy term always seq-mean-token-mean).",
            rich_help_panel=LOSS,
        ),
    ] = "flow_grpo",
    clip_range: Annotated[
        float | None,
        typer.Option(
            "--clip-range",
            help="PPO ratio clip ε (default per --algo: flow_grpo family 1e-4, grpo/dapo 0.2, gspo 3e-4).",
            rich_help_panel=LOSS,
        ),
    ] = None,
    clip_range_high: Annotated[
        float | None,
        typer.Option(
            "--clip-range-high",
            help="Upper clip if asymmetric (DAPO clip-higher 0.28; default: --algo's, or = --clip-range).",
            rich_help_panel=LOSS,
        ),
    ] = None,
    dual_clip: Annotated[
        float | None,
        typer.Option(
            "--dual-clip",
            help="Dual-clip c > 1 capping negative-advantage token losses (grpo/dapo 3; 0 turns it off).",
            rich_help_panel=LOSS,
        ),
    ] = None,
    loss_agg_mode: Annotated[
        LossAggMode | None,
        typer.Option(
            "--loss-agg-mode",
            help="VLM aggregation of the policy, KL and entropy terms (verl loss_agg_mode, default token-mean): "
            "token-mean, seq-mean-token-mean (original GRPO), seq-mean-token-sum, seq-mean-token-sum-norm "
            "(Dr.GRPO). gspo's policy term is always seq-mean-token-mean (verl); this sets its KL and entropy.",
            rich_help_panel=LOSS,
        ),
    ] = None,
    kl_type: Annotated[
        KlType,
        typer.Option(
            "--kl-type",
            help="VLM KL estimator for --beta: k1, abs, k2 (mse), k3 (low_var_kl, clamped), k1+, k3+.",
            rich_help_panel=LOSS,
        ),
    ] = "low_var_kl",
    entropy_coef: Annotated[
        float,
        typer.Option("--entropy-coef", help="VLM: loss −= coef·entropy (verl 0).", rich_help_panel=LOSS),
    ] = 0.0,
    router_aux_loss_coef: Annotated[
        float | None,
        typer.Option(
            "--router-aux-loss-coef",
            help="MoE VLM (Qwen3-Omni thinker): loss += coef·load-balancing loss of the routers, as "
            "transformers trains. Default: the config's router_aux_loss_coef when its "
            "output_router_logits is set, else 0. Router loads are reported either way (moe/*).",
            rich_help_panel=LOSS,
        ),
    ] = None,
    adv_clip: Annotated[
        float | None,
        typer.Option(
            "--adv-clip",
            help="Clip advantages to ±this; 0 turns it off. Default per --algo: 5 for the diffusion algorithms "
            "(flow_grpo, verl-omni adv_clip_max; nft/awm also scale advantages by it), none for grpo/dapo/gspo "
            "(verl never clips: one success in a group of 64 keeps A = 7.87).",
            rich_help_panel=LOSS,
        ),
    ] = None,
    beta: Annotated[
        float,
        typer.Option(
            "--beta",
            help="KL-to-reference weight (flow_grpo: 0.04 OCR/GenEval; VLM kl_loss_coef, verl 0.01). Diffusion "
            "KL per step = mean (μ−μ_ref)²/(2d²): d = g on sde steps (flow_grpo, = exact KL·|Δσ|), d = the step "
            "std η·sqrt|Δσ| on dance steps (verl-omni dance_sde, the exact Gaussian KL), d = s on cps steps.",
            rich_help_panel=LOSS,
        ),
    ] = 0.0,
    timestep_fraction: Annotated[
        float,
        typer.Option(
            "--timestep-fraction",
            help="Train the first int(K·f) stored steps (flow_grpo 0.99).",
            rich_help_panel=LOSS,
        ),
    ] = 1.0,
    nft_beta: Annotated[
        float,
        typer.Option(
            "--nft-beta", help="DiffusionNFT β (1.0; 0.1 for OCR / multi-reward).", rich_help_panel=LOSS
        ),
    ] = 1.0,
    old_decay: Annotated[
        OldDecay,
        typer.Option(
            "--old-decay",
            help="NFT old-policy schedule: copy, linear_to_0_5, delayed_linear_to_0_999.",
            rich_help_panel=LOSS,
        ),
    ] = "linear_to_0_5",
    awm_weighting: Annotated[
        AwmWeighting,
        typer.Option("--awm-weighting", help="AWM pseudo log-prob: uniform or ghuber.", rich_help_panel=LOSS),
    ] = "uniform",
    awm_p: Annotated[
        float, typer.Option("--awm-p", help="AWM generalised-Huber power.", rich_help_panel=LOSS)
    ] = 0.25,
    ema_beta: Annotated[
        float, typer.Option("--ema-beta", help="AWM EMA-KL weight (needs --ema).", rich_help_panel=LOSS)
    ] = 0.0,
    train_timesteps: Annotated[
        int,
        typer.Option(
            "--train-timesteps", help="AWM: stratified timesteps per sample (6).", rich_help_panel=LOSS
        ),
    ] = 6,
    dpo_beta: Annotated[
        float,
        typer.Option(
            "--dpo-beta", help="Diffusion-DPO β (5000 for the reference's ε-MSE).", rich_help_panel=LOSS
        ),
    ] = 5000.0,
    lr: Annotated[
        float,
        typer.Option(
            "--lr",
            help="AdamW learning rate (flow_grpo 3e-4). With --adapter, this run's --lr, --weight-decay, "
            "--adam-betas and --adam-eps replace the saved optimizer's; its moments carry over.",
            rich_help_panel=OPT,
        ),
    ] = 3e-4,
    weight_decay: Annotated[
        float,
        typer.Option("--weight-decay", help="AdamW weight decay (flow_grpo 1e-4).", rich_help_panel=OPT),
    ] = 1e-4,
    betas: Annotated[
        tuple[float, float],
        typer.Option("--adam-betas", help="AdamW (β1, β2), each in [0, 1) (flow_grpo).", rich_help_panel=OPT),
    ] = (0.9, 0.999),
    adam_eps: Annotated[
        float, typer.Option("--adam-eps", help="AdamW ε > 0 (flow_grpo 1e-8).", rich_help_panel=OPT)
    ] = 1e-8,
    lr_scheduler: Annotated[
        LrScheduler,
        typer.Option(
            "--lr-scheduler",
            help="LR schedule over the optimizer steps of the whole run, continued across updates from the "
            "--adapter's step (transformers/trl lr_scheduler_type, verl lr_scheduler_type): constant, linear "
            "(to 0 at --lr-total-steps) or cosine (half cosine to 0 at --lr-total-steps).",
            rich_help_panel=OPT,
        ),
    ] = "constant",
    lr_warmup_steps: Annotated[
        int,
        typer.Option(
            "--lr-warmup-steps",
            help="Linear warmup from 0 over this many optimizer steps (trl warmup_steps, verl lr_warmup_steps).",
            rich_help_panel=OPT,
        ),
    ] = 0,
    lr_total_steps: Annotated[
        int,
        typer.Option(
            "--lr-total-steps",
            help="Optimizer steps of the whole run (all updates) where linear/cosine reach 0 (trl max_steps, "
            "verl total_training_steps); needed by them.",
            rich_help_panel=OPT,
        ),
    ] = 0,
    max_grad_norm: Annotated[
        float,
        typer.Option("--max-grad-norm", help="Gradient-norm clip (flow_grpo 1.0).", rich_help_panel=OPT),
    ] = 1.0,
    micro_batch: MicroBatchOpt = 0,
    grad_accum: Annotated[
        int | None,
        typer.Option(
            "--grad-accum",
            min=1,
            help="Micro-batches each rank takes per optimizer step (default 1): the step then grows with the "
            "launcher's ranks. Not with --samples-per-step.",
            rich_help_panel=OPT,
        ),
    ] = None,
    samples_per_step: Annotated[
        int,
        typer.Option(
            "--samples-per-step",
            min=0,
            help="Samples per optimizer step over all ranks (dpo: rows, two per pair); each rank's "
            "grad_accum is this ÷ (micro-batch × ranks), so 1 process and N ranks take the same steps. "
            "Refused when not a multiple of micro-batch × ranks, or with --grad-accum. 0: off (--grad-accum "
            "applies).",
            rich_help_panel=OPT,
        ),
    ] = 0,
    inner_epochs: Annotated[
        int, typer.Option("--inner-epochs", min=1, help="Passes over the data.", rich_help_panel=OPT)
    ] = 1,
    shuffle: Annotated[
        bool,
        typer.Option("--shuffle/--no-shuffle", help="Shuffle trajectories each epoch.", rich_help_panel=OPT),
    ] = True,
    ema: Annotated[
        bool, typer.Option("--ema", help="Keep an EMA of the weights (flow_grpo decay).", rich_help_panel=OPT)
    ] = False,
    lora_rank: LoraRankOpt = 32,
    lora_alpha: Annotated[
        int, typer.Option("--lora-alpha", help="LoRA alpha (flow_grpo 64).", rich_help_panel=OPT)
    ] = 64,
    full: FullOpt = False,
    train_vision: Annotated[
        bool,
        typer.Option(
            "--train-vision",
            help="VLM with --full: train the encoder towers too (vision, and audio in omni models; "
            "frozen by default).",
            rich_help_panel=OPT,
        ),
    ] = False,
    detach_uncond: Annotated[
        bool,
        typer.Option(
            "--detach-uncond/--no-detach-uncond",
            help="Diffusion with CFG: the gradient stops at the unconditional branch (flow_grpo since "
            "July 2025); --no-detach-uncond lets it flow through both branches. Values are equal either way.",
            rich_help_panel=LOSS,
        ),
    ] = True,
    seed: Annotated[
        int, typer.Option("--seed", help="Seeds LoRA init and shuffling.", rich_help_panel=OPT)
    ] = 0,
    report_to: ReportToOpt = None,
    run_name: RunNameOpt = None,
    overwrite: OverwriteOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
    packing: PackingOpt = "auto",
    balance_tokens: BalanceTokensOpt = False,
) -> None:
    """Train the policy with --algo on rollouts (or offline pairs / latents) and write the next adapter.

    Policy-gradient algorithms replay the stored SDE steps under the trained weights; nft and awm
    train on the final latents with fresh noise; dpo on the best and worst sample of each group.
    For a VLM (--model a Qwen2.5-VL folder), grpo/dapo/gspo replay the response tokens: LoRA on the
    language model (vision tower frozen), writes a PEFT adapter (or the full model with --full).

    Writes an inference-ready adapter (diffusers `pipe.load_lora_weights(OUT)`), the optimizer/EMA
    state the next update resumes from, and metrics.jsonl per optimizer step: actor/pg_loss, kl_loss,
    pg_clipfrac, grad_norm, the effective lr, samples/s, and under verl-omni's names (verl's for VLMs)
    ratio_mean and ppo_kl = mean(−log r); diffusion steps add ratio_std (Bessel, as verl-omni) and
    flow_grpo's approx_kl = ½·mean((log r)²); memory/param_bytes and optimizer_bytes (this rank's share).

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

    Example: [bold]omnirl update --model models/sd3-tiny --in run/it0/samples --in run/it0/advantages \\
    --algo flow_grpo --out run/it1/policy[/]

    VLM: [bold]omnirl update --model models/vlm --in run/it0/samples --in run/it0/advantages --algo dapo \\
    --lr 1e-6 --beta 0 --out run/it1/policy[/]
    """
    c = resolve(ctx, "update", required=("model", "out"))
    from stages.dist import world_and_rank
    from stages.parallelism import layout
    from stages.tracking import open_tracking
    from stages.update.stage import run_update
    from stages.update.trainer import UpdateConfig

    tracking = open_tracking(c["report_to"], c["out"], c["run_name"])
    cfg = UpdateConfig.from_options(c)
    cfg.validate()
    layout(cfg.parallel)  # a world the degrees do not fit is refused before anything loads
    c["mixed_precision"] = cfg.mixed_precision  # the launcher's setting enters the run's identity
    src = open_inputs(c["inputs"])
    with tracking, progress() as bar:
        task = bar.add_task("updating", total=None, rate="")

        def on_step(record: dict) -> None:
            bar.update(task, advance=1, rate=f"loss {record.get('actor/pg_loss', 0):+.3e}")
            tracking.log_update([record])

        result = run_update(
            c["model"],
            c["adapter"],
            src,
            c["out"],
            cfg,
            dtype=c["dtype"],
            device=device(),
            run_config=run_config(c),
            overwrite=c["overwrite"],
            on_step=on_step,
        )
    if world_and_rank()[1] != 0:  # one report per launch, from rank 0 (the rank that wrote the adapter)
        return
    if json_:
        emit_json(result)
    elif result.get("skipped"):
        log(f"{c['out']} already holds this update; nothing to do")
    else:
        means = result["step_means"]
        shown = (
            ("pg_loss", "pg_loss", "+.4e"),
            ("ratio_mean", "ratio", ".6f"),
            ("clipfrac", "clipfrac", ".3f"),
        )
        print_result(
            f"[green]updated[/] → {c['out']}  step {result['step']}  mean of {result['optimizer_steps']} "
            f"optimizer step{'' if result['optimizer_steps'] == 1 else 's'} (as `omnirl report`): "
            + "  ".join(f"{label} {means[key]:{spec}}" for key, label, spec in shown if key in means)
            + f"  {result['reward_failed']} rows with a failed reward skipped"
        )
