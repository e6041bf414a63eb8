"""What `update`'s settings may be: the closed sets its knobs take, the built-in `--algo` names, and the
check of a whole config (`UpdateRules.validate`, which `UpdateConfig` in config.py inherits).

Each set is declared here once: `UpdateConfig`'s knobs offer them as choices and the modules that
implement them (losses.py, token_losses.py, family_losses.py) import them from here.
Torch-free, as config.py.
"""

from __future__ import annotations

import math

from stages import knobs
from stages.advantage.config import NFT_ADV_MODES
from stages.errors import UserInputError

# The built-in algorithms (`stages.update.losses.ALGORITHMS` implements each, in this order).
ALGORITHM_NAMES = (
    "flow_grpo",
    "dance_grpo",
    "mix_grpo",
    "grpo_guard",
    "flow_dppo",
    "nft",
    "awm",
    "dgpo",
    "dpo",
    "grpo",
    "dapo",
    "gspo",
)
LR_SCHEDULERS = ("constant", "linear", "cosine")  # `UpdateConfig.lr_factor`
# verl's loss_agg_mode and KL estimators (`stages.update.token_losses`)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+")
# DiffusionNFT's old-policy schedules and AWM's pseudo log-prob weightings (`stages.update.family_losses`)
NFT_DECAY_SCHEDULES = ("copy", "linear_to_0_5", "delayed_linear_to_0_999")
AWM_WEIGHTINGS = ("uniform", "ghuber")
# GRPO-Guard's ratio normaliser on dance steps: the exact step std s = η·sqrt|Δσ| (GRPO-Guard's RatioNorm),
# or verl-omni's s·sqrt|Δσ| = η·|Δσ| (`stages.update.family_losses`)
GUARD_DANCE_SCALES = ("std", "eta_dsigma")
# verl's decoupled rollout correction: its modes and the level a weight is taken at
# (`stages.update.rollout_correction`)
ROLLOUT_CORRECTIONS = ("off", "is", "rs", "is_rs")
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")


class UpdateRules:
    """The checks of `UpdateConfig` (config.py), whose fields and derived settings they read; each
    impossible setting is a one-line UserInputError."""

    def _validate_rollout_correction(self) -> None:
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise UserInputError(
                f"--rollout-correction {self.rollout_correction}: choose one of {', '.join(ROLLOUT_CORRECTIONS)}"
            )
        if self.rollout_correction_level not in ROLLOUT_CORRECTION_LEVELS:
            raise UserInputError(
                f"--rollout-correction-level {self.rollout_correction_level}: choose one of "
                f"{', '.join(ROLLOUT_CORRECTION_LEVELS)}"
            )
        if not 0 < self.rollout_is_threshold < math.inf:
            raise UserInputError(
                f"--rollout-is-threshold {self.rollout_is_threshold}: must be a finite number > 0"
            )
        lower, upper = self.rs_bounds()
        if not 0 <= lower <= upper < math.inf:
            raise UserInputError(
                f"--rollout-rs-threshold-lower {lower} / --rollout-rs-threshold {upper}: need 0 <= lower <= "
                "upper, both finite"
            )

    def _validate_optimizer(self) -> None:
        if not 0 <= self.lr < math.inf:
            raise UserInputError(f"--lr {self.lr}: the learning rate must be a finite number >= 0")
        if not 0 <= self.weight_decay < math.inf:
            raise UserInputError(f"--weight-decay {self.weight_decay}: must be a finite number >= 0")
        if not 0 < self.adam_eps < math.inf:
            raise UserInputError(f"--adam-eps {self.adam_eps}: must be a finite number > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UserInputError(
                f"--adam-betas {' '.join(map(str, self.betas))}: give two numbers in [0, 1), e.g. 0.9 0.999"
            )
        if not 0 < self.max_grad_norm < math.inf:
            raise UserInputError(f"--max-grad-norm {self.max_grad_norm}: must be a finite number > 0")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise UserInputError(
                f"--lr-scheduler {self.lr_scheduler}: choose one of {', '.join(LR_SCHEDULERS)}"
            )
        if self.lr_warmup_steps < 0:
            raise UserInputError(f"--lr-warmup-steps {self.lr_warmup_steps}: must be at least 0")
        if self.lr_scheduler != "constant" and self.lr_total_steps <= self.lr_warmup_steps:
            raise UserInputError(
                f"--lr-scheduler {self.lr_scheduler} decays to 0 at --lr-total-steps; give the optimizer "
                f"steps of the whole run, more than --lr-warmup-steps {self.lr_warmup_steps}"
            )

    def _validate_precision(self) -> None:
        from stages.precision import resolve_mixed_precision
        from stages.update.parallel import launcher_strategy

        launcher_strategy()
        resolve_mixed_precision(self.mixed_precision)

    def validate(self) -> None:
        """Raise a one-line UserInputError naming the first impossible setting."""
        from stages.update.losses import get_algorithm

        algo = get_algorithm(self.algo)
        self._validate_precision()
        self._validate_optimizer()
        if self.adv_clip is not None and not 0 <= self.adv_clip < math.inf:
            raise UserInputError(f"--adv-clip {self.adv_clip}: must be a finite number >= 0 (0 turns it off)")
        if algo.family == "forward" and self.advantage_clip() is None:
            raise UserInputError(
                f"--adv-clip 0: --algo {algo.name} scales advantages by it; give a positive bound (default 5)"
            )
        if not 0 < self.timestep_fraction <= 1:
            raise UserInputError(f"--timestep-fraction {self.timestep_fraction}: must lie in (0, 1]")
        if (self.grad_accum is not None and self.grad_accum < 1) or self.inner_epochs < 1:
            raise UserInputError("--grad-accum and --inner-epochs must be at least 1")
        if self.samples_per_step < 0:
            raise UserInputError(f"--samples-per-step {self.samples_per_step}: must be at least 1 (0: off)")
        if self.samples_per_step and self.grad_accum is not None:
            raise UserInputError(
                f"--samples-per-step {self.samples_per_step} and --grad-accum {self.grad_accum} both set the "
                "optimizer step's size; give one (--samples-per-step 0 drops a preset's)"
            )
        if min(self.clip_bounds()) <= 0:
            raise UserInputError(f"--clip-range {self.clip_bounds()}: must be positive")
        if self.dual_clip is not None and 0 < self.dual_clip <= 1:
            raise UserInputError(f"--dual-clip {self.dual_clip}: must be > 1 (or 0 to turn it off)")
        if self.loss_agg_mode is not None and self.loss_agg_mode not in AGG_MODES:
            raise UserInputError(
                f"--loss-agg-mode {self.loss_agg_mode}: choose one of {', '.join(AGG_MODES)}"
            )
        if self.kl_type not in KL_KINDS:
            raise UserInputError(f"--kl-type {self.kl_type}: choose one of {', '.join(KL_KINDS)}")
        if self.old_decay not in NFT_DECAY_SCHEDULES:
            raise UserInputError(
                f"--old-decay {self.old_decay}: choose one of {', '.join(NFT_DECAY_SCHEDULES)}"
            )
        if self.nft_adv_mode not in NFT_ADV_MODES:
            raise UserInputError(
                f"--nft-adv-mode {self.nft_adv_mode}: choose one of {', '.join(NFT_ADV_MODES)}"
            )
        if self.old_decay_value is not None and not 0 <= self.old_decay_value <= 1:
            raise UserInputError(
                f"--old-decay-value {self.old_decay_value}: must lie in [0, 1] (0 copies; omit it for --old-decay)"
            )
        if self.old_update_interval < 1:
            raise UserInputError(f"--old-update-interval {self.old_update_interval}: must be at least 1")
        if self.ref_reset_every < 0:
            raise UserInputError(f"--ref-reset-every {self.ref_reset_every}: must be at least 0 (0: never)")
        if self.ref_reset_kl is not None and not 0 <= self.ref_reset_kl < math.inf:
            raise UserInputError(f"--ref-reset-kl {self.ref_reset_kl}: must be a finite number >= 0")
        if self.resets_reference() and algo.family not in ("policy_gradient", "forward"):
            raise UserInputError(
                f"--ref-reset-every / --ref-reset-kl: diffusion policy-gradient and forward algorithms only, "
                f"not --algo {algo.name}"
            )
        if self.resets_reference() and self.beta <= 0:
            raise UserInputError(
                "--ref-reset-every / --ref-reset-kl reset the KL reference: give --beta > 0 (GARDO 0.04)"
            )
        if self.awm_weighting not in AWM_WEIGHTINGS:
            raise UserInputError(
                f"--awm-weighting {self.awm_weighting}: choose one of {', '.join(AWM_WEIGHTINGS)}"
            )
        if self.ema_beta > 0 and not self.ema:
            raise UserInputError("--ema-beta needs --ema (the EMA weights it pulls toward)")
        if self.strategy not in knobs.STRATEGIES:
            raise UserInputError(f"--strategy {self.strategy}: choose one of {', '.join(knobs.STRATEGIES)}")
        if self.timesteps() < 1:
            raise UserInputError(f"--train-timesteps {self.train_timesteps}: must be at least 1")
        if not 0 < self.kl_mask_threshold < math.inf:
            raise UserInputError(f"--kl-mask-threshold {self.kl_mask_threshold}: must be a finite number > 0")
        if not 0 < self.dgpo_beta < math.inf:
            raise UserInputError(f"--dgpo-beta {self.dgpo_beta}: must be a finite number > 0")
        if algo.family != "token" and (
            self.packing == "on" or self.balance_tokens or self.micro_batch_tokens
        ):
            raise UserInputError(
                "--packing on / --balance-tokens / --micro-batch-tokens: VLM token objectives (grpo, dapo, "
                f"gspo) only, not --algo {algo.name}; drop it"
            )
        self.kernels.validate()
        self._validate_rollout_correction()
        if self.guard_dance_scale not in GUARD_DANCE_SCALES:
            raise UserInputError(
                f"--guard-dance-scale {self.guard_dance_scale}: choose one of {', '.join(GUARD_DANCE_SCALES)}"
            )
        if self.rollout_correction != "off" and algo.family not in ("policy_gradient", "token"):
            raise UserInputError(
                f"--rollout-correction {self.rollout_correction}: --algo {algo.name} replays no rollout "
                "log-probs; use it with a policy-gradient --algo (flow_grpo, grpo_guard, grpo, ...) or drop it"
            )
