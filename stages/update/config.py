"""`update`'s settings as one typed config, and the names its knobs take; torch-free.

`UpdateConfig` is the single declaration of every `omnirl update` option (help, choices, bounds, panel),
from which the CLI generates its options (`omnirl_cli.generate`); the trainer (`stages.update.trainer`)
and `omnirl online` run on an instance of it. The closed sets its knobs take, the built-in `--algo`
names and the check of a whole config (`validate`) are config_rules.py's.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages import knobs
from stages.advantage.config import NFT_ADV_MODES
from stages.errors import UserInputError
from stages.knobs import OPTIMISATION, knob
from stages.update.config_rules import (
    AGG_MODES,
    ALGORITHM_NAMES,
    AWM_WEIGHTINGS,
    GUARD_DANCE_SCALES,
    KL_KINDS,
    LR_SCHEDULERS,
    NFT_DECAY_SCHEDULES,
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTIONS,
    UpdateRules,
)

if TYPE_CHECKING:
    import torch

    from stages.models.kernels import Kernels
    from stages.parallelism import ModelParallel

# The knobs that name where `update` reads, writes and logs (and the stored dtype of the frozen model),
# not how it trains: the adapter's update_config (`UpdateConfig.settings`) records the others.
RUN_KNOBS = ("inputs", "out", "model", "adapter", "dtype", "report_to", "run_name", "overwrite")
LOSS = "Loss"


@dataclass
class UpdateConfig(UpdateRules):
    """Every setting of the `update` stage (`omnirl update`); defaults are flow_grpo's SD3 ones
    (diffusion-rl.md §1.2, §1.5)."""

    inputs: list[Path] | None = knobs.inputs()
    out: Path | None = knobs.out()
    model: str | None = knobs.model("Diffusers pipeline or transformers VLM")
    adapter: str | None = knobs.adapter(
        "Adapter to continue from",
        ". omnirl's also carry optimizer, EMA and step; another tool's LoRA starts a fresh optimizer at "
        "step 0 with its own rank and alpha.",
    )
    dtype: str = knobs.dtype()
    # None: the launcher's (resolved on construction, `__post_init__`)
    mixed_precision: str | None = knobs.mixed_precision(
        "the forward and loss (fp16 with a dynamic loss scale, torch.amp.GradScaler: an overflow skips the "
        "step and halves the scale, logged as actor/grad_scale; not with FSDP2)",
        OPTIMISATION,
        recorded="Recorded in the adapter's update_config.",
    )
    strategy: str = knobs.strategy()
    gradient_checkpointing: bool = knobs.gradient_checkpointing()
    sp_degree: int = knobs.sp_degree()
    sp_kind: str = knobs.sp_kind()
    tp_degree: int = knobs.tp_degree()
    attention_backend: str | None = knobs.attention_backend()
    compile: bool = knobs.compile()
    packing: str = knobs.packing()
    balance_tokens: bool = knobs.balance_tokens()
    micro_batch_tokens: int | None = knobs.micro_batch_tokens()
    algo: str = knob(
        "flow_grpo",
        "flow_grpo (first int(K·f) steps), dance_grpo (random steps per sample), mix_grpo (the stored "
        "window), grpo_guard (GRPO-Guard's RatioNorm ratio with the exact step std, as flow_grpo; on "
        "dance steps verl-omni scales by η·|Δσ| instead; needs `logprob --means`), flow_dppo (Flow-DPPO: "
        "unclipped ratio, a row dropped when its step's exact Gaussian KL to the rollout's passes "
        "--kl-mask-threshold and its ratio moves on in its advantage's direction; advantages unclipped, as "
        "verl-omni; rollout means from `logprob --means`, else replayed under the --adapter); on final "
        "latents: nft (DiffusionNFT), awm (advantage-weighted matching), dpo (best vs worst of each group), "
        "dgpo (DGPO group preference vs the base model, for ode rollouts: whole groups per micro-batch, "
        "--dgpo-beta, DSM ratio clip --clip-range 5e-2 vs an old policy moved by min(0.3, 0.001·step) "
        "after each step); VLM "
        "text rollouts: grpo (verl: clip 0.2, dual-clip 3, token-mean), dapo (clip-higher 0.28), gspo "
        "(verl: sequence ratio, clip 3e-4/4e-4, policy term always seq-mean-token-mean).",
        names=ALGORITHM_NAMES,
        panel=LOSS,
    )
    clip_range: float | None = knob(
        None,
        "PPO ratio clip ε (default per --algo: flow_grpo family 1e-4, grpo/dapo 0.2, gspo 3e-4, dgpo 5e-2 "
        "on its DSM ratio; flow_dppo uses none).",
        panel=LOSS,
    )
    clip_range_high: float | None = knob(
        None,
        "Upper clip if asymmetric (DAPO clip-higher 0.28; default: --algo's, or = --clip-range).",
        panel=LOSS,
    )
    dual_clip: float | None = knob(
        None,
        "Dual-clip c > 1 capping negative-advantage token losses (grpo/dapo 3; 0 turns it off).",
        panel=LOSS,
    )
    loss_agg_mode: str | None = knob(
        None,
        "VLM aggregation of the policy, KL and entropy terms (verl loss_agg_mode, default token-mean): "
        "token-mean, seq-mean-token-mean (original GRPO), seq-mean-token-sum, seq-mean-token-sum-norm "
        "(Dr.GRPO). gspo's policy term is always seq-mean-token-mean (verl); this sets its KL and entropy.",
        choices=AGG_MODES,
        panel=LOSS,
    )
    kl_type: str = knob(
        "low_var_kl",
        "VLM KL estimator for --beta: k1, abs, k2 (mse), k3 (low_var_kl, clamped), k1+, k3+.",
        choices=KL_KINDS,
        panel=LOSS,
    )
    entropy_coef: float = knob(0.0, "VLM: loss −= coef·entropy (verl 0).", panel=LOSS)
    router_aux_loss_coef: float | None = knob(
        None,
        "MoE VLM (Qwen3-Omni thinker): loss += coef·load-balancing loss of the routers, as "
        "transformers trains. Default: the config's router_aux_loss_coef when its "
        "output_router_logits is set, else 0. Router loads are reported either way (moe/*).",
        panel=LOSS,
    )
    adv_clip: float | None = knob(
        None,
        "Clip advantages to ±this; 0 turns it off. Default per --algo: 5 for the diffusion algorithms "
        "(flow_grpo, verl-omni adv_clip_max; nft/awm also scale advantages by it), none for grpo/dapo/gspo "
        "(verl never clips: one success in a group of 64 keeps A = 7.87).",
        panel=LOSS,
    )
    beta: float = knob(
        0.0,
        "KL-to-reference weight (flow_grpo: 0.04 OCR/GenEval; VLM kl_loss_coef, verl 0.01). Diffusion "
        "KL per step = mean (μ−μ_ref)²/(2d²): d = g on sde steps (flow_grpo, = exact KL·|Δσ|), d = the step "
        "std η·sqrt|Δσ| on dance steps (verl-omni dance_sde, the exact Gaussian KL), d = s on cps steps.",
        panel=LOSS,
    )
    timestep_fraction: float = knob(
        1.0, "Train the first int(K·f) stored steps (flow_grpo 0.99).", panel=LOSS
    )
    nft_beta: float = knob(1.0, "DiffusionNFT β (1.0; 0.1 for OCR / multi-reward).", panel=LOSS)
    old_decay: str = knob(
        "linear_to_0_5",
        "NFT old-policy schedule: copy, linear_to_0_5, delayed_linear_to_0_999.",
        choices=NFT_DECAY_SCHEDULES,
        panel=LOSS,
    )
    awm_weighting: str = knob(
        "uniform", "AWM pseudo log-prob: uniform or ghuber.", choices=AWM_WEIGHTINGS, panel=LOSS
    )
    awm_p: float = knob(0.25, "AWM generalised-Huber power.", panel=LOSS)
    ema_beta: float = knob(0.0, "AWM EMA-KL weight (needs --ema).", panel=LOSS)
    train_timesteps: int | None = knob(
        None,
        "Timesteps per sample (default per --algo): awm stratified (6); dgpo drawn per epoch from the "
        "first int(N·--timestep-fraction) sampling steps and shared by all rows (reference 4).",
        panel=LOSS,
    )
    dpo_beta: float = knob(5000.0, "Diffusion-DPO β (5000 for the reference's ε-MSE).", panel=LOSS)
    kl_mask_threshold: float = knob(
        1e-5,
        "flow_dppo: trust-region bound δ on each step's mean_dims (μ_θ − μ_old)²/(2s²) (verl-omni "
        "kl_mask_threshold 1e-5).",
        panel=LOSS,
    )
    dgpo_beta: float = knob(
        100.0,
        "DGPO β of the group preference σ(β/G·Σ A·(ℓ − ℓ_ref)) (reference beta_dpo 100; 10 for PickScore).",
        panel=LOSS,
    )
    lr: float = knob(
        3e-4,
        "AdamW learning rate (flow_grpo 3e-4). With --adapter, this run's --lr, --weight-decay, "
        "--adam-betas and --adam-eps replace the saved optimizer's; its moments carry over.",
        panel=OPTIMISATION,
    )
    weight_decay: float = knob(1e-4, "AdamW weight decay (flow_grpo 1e-4).", panel=OPTIMISATION)
    betas: tuple[float, float] = knob(
        (0.9, 0.999), "AdamW (β1, β2), each in [0, 1) (flow_grpo).", flag="--adam-betas", panel=OPTIMISATION
    )
    adam_eps: float = knob(1e-8, "AdamW ε > 0 (flow_grpo 1e-8).", panel=OPTIMISATION)
    lr_scheduler: str = knob(
        "constant",
        "LR schedule over the optimizer steps of the whole run, continued across updates from the "
        "--adapter's step (transformers/trl lr_scheduler_type, verl lr_scheduler_type): constant, linear "
        "(to 0 at --lr-total-steps) or cosine (half cosine to 0 at --lr-total-steps).",
        choices=LR_SCHEDULERS,
        panel=OPTIMISATION,
    )
    lr_warmup_steps: int = knob(
        0,
        "Linear warmup from 0 over this many optimizer steps (trl warmup_steps, verl lr_warmup_steps).",
        panel=OPTIMISATION,
    )
    lr_total_steps: int = knob(
        0,
        "Optimizer steps of the whole run (all updates) where linear/cosine reach 0 (trl max_steps, "
        "verl total_training_steps); needed by them.",
        panel=OPTIMISATION,
    )
    max_grad_norm: float = knob(1.0, "Gradient-norm clip (flow_grpo 1.0).", panel=OPTIMISATION)
    micro_batch: int = knobs.micro_batch()
    # None: 1, or derived from samples_per_step (`accumulation`)
    grad_accum: int | None = knob(
        None,
        "Micro-batches each rank takes per optimizer step (default 1): the step then grows with the "
        "launcher's ranks. Not with --samples-per-step.",
        low=1,
        panel=OPTIMISATION,
    )
    samples_per_step: int = knob(
        0,
        "Samples per optimizer step over all ranks (dpo: rows, two per pair); each rank's "
        "grad_accum is this ÷ (micro-batch × ranks), so 1 process and N ranks take the same steps. "
        "Refused when not a multiple of micro-batch × ranks, or with --grad-accum. 0: off (--grad-accum "
        "applies).",
        low=0,
        panel=OPTIMISATION,
    )
    inner_epochs: int = knob(1, "Passes over the data.", low=1, panel=OPTIMISATION)
    shuffle: bool = knob(True, "Shuffle trajectories each epoch.", negative=True, panel=OPTIMISATION)
    ema: bool = knob(False, "Keep an EMA of the weights (flow_grpo decay).", panel=OPTIMISATION)
    lora_rank: int = knobs.lora_rank()
    lora_alpha: int = knob(64, "LoRA alpha (flow_grpo 64).", panel=OPTIMISATION)
    full: bool = knobs.full()
    train_vision: bool = knob(
        False,
        "VLM with --full: train the encoder towers too (vision, and audio in omni models; "
        "frozen by default).",
        panel=OPTIMISATION,
    )
    detach_uncond: bool = knob(
        True,
        "Diffusion with CFG: the gradient stops at the unconditional branch (flow_grpo since "
        "July 2025); --no-detach-uncond lets it flow through both branches. Values are equal either way.",
        negative=True,
        panel=LOSS,
    )
    seed: int = knob(0, "Seeds LoRA init and shuffling.", panel=OPTIMISATION)
    guard_dance_scale: str = knob(
        "std",
        "--algo grpo_guard on dance steps: normalise the ratio by the exact step std η·sqrt|Δσ| (std, "
        "GRPO-Guard's RatioNorm) or by verl-omni's η·|Δσ| (eta_dsigma). Other samplers ignore it.",
        choices=GUARD_DANCE_SCALES,
        panel=LOSS,
    )
    rollout_correction: str = knob(
        "off",
        "Correct for a rollout engine whose log-probs differ from the trainer's (verl's decoupled rollout "
        "correction): weigh each step's (token's) policy term by ρ = π_old/π_rollout from old_log_probs "
        "(omnirl logprob) vs log_probs (omnirl sample). is: truncated weight min(ρ, --rollout-is-threshold); "
        "rs: 0 outside [--rollout-rs-threshold-lower, --rollout-rs-threshold]; is_rs: both.",
        choices=ROLLOUT_CORRECTIONS,
        panel=LOSS,
    )
    rollout_correction_level: str = knob(
        "token",
        "ρ per element (token: each stored denoising step, each response token) or per sequence (the "
        "product over a row's steps or tokens).",
        choices=ROLLOUT_CORRECTION_LEVELS,
        panel=LOSS,
    )
    rollout_is_threshold: float = knob(
        2.0,
        "Upper truncation of the importance weights (verl rollout_is_threshold, default 2.0).",
        panel=LOSS,
    )
    rollout_rs_threshold: float | None = knob(
        None, "Rejection: ρ above this is rejected (default: --rollout-is-threshold).", panel=LOSS
    )
    rollout_rs_threshold_lower: float | None = knob(
        None, "Rejection: ρ below this is rejected (default: 1 / --rollout-rs-threshold).", panel=LOSS
    )
    nft_adv_mode: str = knob(
        "continuous",
        "nft: how the clipped advantage a becomes the optimality r = m(a)/(2·adv-clip) + ½ (verl-omni "
        "adv_mode, default continuous: m(a) = a); positive_only: max(a, 0); negative_only: min(a, 0); "
        "one_only: 1 if a > 0 else 0; binary: sign(a).",
        choices=NFT_ADV_MODES,
        panel=LOSS,
    )
    old_decay_value: float | None = knob(
        None,
        "nft: a fixed λ in [0, 1] for θ_old ← λ·θ_old + (1−λ)·θ, replacing the --old-decay schedule "
        "(verl-omni old_policy_decay; default none: the schedule's λ; 0 copies).",
        low=0,
        high=1,
        panel=LOSS,
    )
    old_update_interval: int = knob(
        1,
        "nft: refresh the old policy at the end of an update that crosses a multiple of this many optimizer "
        "steps (verl-omni old_policy_update_interval, default 1: every update; its recipes 2).",
        low=1,
        panel=LOSS,
    )
    ref_reset_every: int = knob(
        0,
        "GARDO: before an update, reset the KL reference to the current policy when this many updates ran "
        "since the last reset (the reference's reset_freq 15 = every 16; default 0: never, the reference "
        "stays the base model). Kept in the adapter's trainer state; needs --beta > 0.",
        low=0,
        panel=LOSS,
    )
    ref_reset_kl: float | None = knob(
        None,
        "GARDO: also reset it before the next update when an optimizer step's actor/kl_loss exceeded this "
        "(the reference's kl_thres, e.g. 3e-4; default none).",
        low=0,
        panel=LOSS,
    )
    report_to: list[str] | None = knobs.report_to()
    run_name: str | None = knobs.run_name()
    overwrite: bool = knobs.overwrite()
    ema_every: int = 8  # optimizer steps between EMA updates (flow_grpo); not an option

    def __post_init__(self) -> None:
        """An unset mixed precision is the launcher's; the AdamW betas are a pair (a preset gives a list)."""
        if self.mixed_precision is None:
            from stages.precision import launcher_mixed_precision

            self.mixed_precision = launcher_mixed_precision()
        self.betas = tuple(self.betas)

    @property
    def parallel(self) -> ModelParallel:
        """The model parallelism of the trained transformer (--sp-degree, --sp-kind, --tp-degree)."""
        from stages.parallelism import ModelParallel

        return ModelParallel(self.sp_degree, self.sp_kind, self.tp_degree)

    @property
    def kernels(self) -> Kernels:
        """The trained transformer's attention backend and compilation (--attention-backend, --compile)."""
        from stages.models.kernels import Kernels

        return Kernels(self.attention_backend, self.compile)

    def settings(self) -> dict[str, Any]:
        """The training settings, as the adapter's update_config records them: every field but
        `RUN_KNOBS`."""
        return {k: v for k, v in asdict(self).items() if k not in RUN_KNOBS}

    def accumulation(self, micro: int, world: int) -> int:
        """Micro-batches each of `world` ranks takes per optimizer step, of `micro` samples each:
        --grad-accum (default 1), or --samples-per-step ÷ (micro × world), so that a preset's optimizer
        step holds the same samples at every world size. Not a whole number: a UserInputError."""
        if not self.samples_per_step:
            return self.grad_accum or 1
        per_pass = micro * world
        if self.samples_per_step % per_pass:
            of = (
                f"--micro-batch {micro}"
                if self.micro_batch
                else f"--micro-batch 0 (the rollout's batch size {micro})"
            )
            raise UserInputError(
                f"--samples-per-step {self.samples_per_step} is not a multiple of {of} × {world} rank(s) = "
                f"{per_pass}; give a multiple of {per_pass}, or another --micro-batch"
            )
        return self.samples_per_step // per_pass

    def optimizer_settings(self) -> dict[str, Any]:
        """AdamW's hyper-parameters of this run; they override those of a resumed optimizer state."""
        return {
            "lr": self.lr,
            "betas": tuple(self.betas),
            "weight_decay": self.weight_decay,
            "eps": self.adam_eps,
        }

    def lr_factor(self, step: int) -> float:
        """lr / --lr for the optimizer step taken after `step` earlier ones (counted over every update).

        transformers' schedules: a linear warmup from 0 over --lr-warmup-steps, then constant, linear
        decay to 0, or a half cosine to 0 at --lr-total-steps (and 0 after it).
        """
        warmup = self.lr_warmup_steps
        if step < warmup:
            return step / warmup
        if self.lr_scheduler == "constant":
            return 1.0
        progress = min((step - warmup) / (self.lr_total_steps - warmup), 1.0)
        if self.lr_scheduler == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def autocast(self, device: torch.device) -> AbstractContextManager[Any]:
        """The context the forward and loss run in: autocast to --mixed-precision on `device`'s type."""
        from stages.precision import autocast

        return autocast(self.mixed_precision, device)

    def advantage_clip(self) -> float | None:
        """|A| bound: --adv-clip, else the --algo's (5 for the diffusion family, none for grpo/dapo/gspo);
        0 turns it off."""
        from stages.update.losses import get_algorithm

        if self.adv_clip is None:
            return get_algorithm(self.algo).adv_clip
        return self.adv_clip or None

    def clip_bounds(self) -> tuple[float, float]:
        """(low, high) ratio clip: the --algo's defaults unless given; --clip-range alone is symmetric."""
        from stages.update.losses import get_algorithm

        algo = get_algorithm(self.algo)
        low = algo.clip[0] if self.clip_range is None else self.clip_range
        if self.clip_range_high is not None:
            return low, self.clip_range_high
        return low, algo.clip[1] if self.clip_range is None else low

    def timesteps(self) -> int:
        """Timesteps trained per sample: --train-timesteps, else the --algo's (awm 6, dgpo 4)."""
        from stages.update.losses import get_algorithm

        return get_algorithm(self.algo).timesteps if self.train_timesteps is None else self.train_timesteps

    def dual_clip_c(self) -> float | None:
        """Dual-clip constant: the --algo's unless given; 0 turns it off."""
        from stages.update.losses import get_algorithm

        if self.dual_clip is None:
            return get_algorithm(self.algo).dual_clip
        return self.dual_clip or None

    def rs_bounds(self) -> tuple[float, float]:
        """(lower, upper) band of the rollout ratio ρ that --rollout-correction rs keeps."""
        upper = self.rollout_is_threshold if self.rollout_rs_threshold is None else self.rollout_rs_threshold
        lower = 1.0 / upper if self.rollout_rs_threshold_lower is None else self.rollout_rs_threshold_lower
        return lower, upper

    def resets_reference(self) -> bool:
        """Whether GARDO's reference reset is on (--ref-reset-every or --ref-reset-kl)."""
        return self.ref_reset_every > 0 or self.ref_reset_kl is not None
