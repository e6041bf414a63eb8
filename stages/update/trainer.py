"""The optimisation loop of `update`, shared by every `--algo` (objectives.py says what is minimised).

Gradient averaging follows flow_grpo: one backward per (micro-batch, trained step), each loss divided
by (grad_accum × trained steps), so an optimizer step averages uniformly over both. Under torchrun,
each rank takes its own grad_accum micro-batches of every optimizer step and gradients are averaged
over ranks, so N ranks equal one process with N·grad_accum micro-batches. `samples_per_step` states
the step's size over all ranks instead, and grad_accum follows the world size (`accumulation`).

Mixed precision follows Accelerate and diffusers: the forward and loss run under autocast, the trained
parameters are fp32 (so AdamW steps in fp32) and `--dtype` is only the storage dtype of frozen weights.
The learning rate follows a warmup-then-decay schedule of the global optimizer step (transformers'
formulas), so it continues across updates.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from stages import knobs
from stages.dist import all_reduce_sum, data_parallel, world_and_rank
from stages.errors import NonFiniteError, UserInputError
from stages.knobs import PACKING
from stages.models.diffusion import FlowPolicy
from stages.models.kernels import Kernels, prepare
from stages.models.vlm import VLMPolicy
from stages.parallelism import ModelParallel
from stages.precision import autocast, launcher_mixed_precision, resolve_mixed_precision
from stages.update.checkpoint import load_state, resume_sharded, save_policy, trainer_state
from stages.update.checkpoint import save_state as save_state  # the state's writer, beside its reader
from stages.update.family_losses import AWM_WEIGHTINGS, NFT_DECAY_SCHEDULES, nft_old_decay
from stages.update.losses import get_algorithm
from stages.update.objectives import make_objective
from stages.update.parallel import STRATEGIES, Parallel, launcher_checkpointing, launcher_strategy
from stages.update.rows import trained_rows
from stages.update.token_losses import AGG_MODES, KL_KINDS

Policy = FlowPolicy | VLMPolicy
LR_SCHEDULERS = ("constant", "linear", "cosine")


@dataclass
class UpdateConfig:
    """Optimisation settings; defaults are flow_grpo's SD3 ones (diffusion-rl.md §1.2, §1.5)."""

    algo: str = "flow_grpo"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    adam_eps: float = 1e-8
    clip_range: float | None = None
    clip_range_high: float | None = None
    adv_clip: float | None = None
    beta: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch: int = 0
    grad_accum: int | None = None  # None: 1, or derived from samples_per_step (`accumulation`)
    samples_per_step: int = 0
    inner_epochs: int = 1
    timestep_fraction: float = 1.0
    shuffle: bool = True
    ema: bool = False
    ema_every: int = 8
    lora_rank: int = 32
    lora_alpha: int = 64
    full: bool = False
    seed: int = 0
    nft_beta: float = 1.0
    old_decay: str = "linear_to_0_5"
    awm_weighting: str = "uniform"
    awm_p: float = 0.25
    ema_beta: float = 0.0
    train_timesteps: int = 6
    dpo_beta: float = 5000.0
    loss_agg_mode: str | None = None
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    router_aux_loss_coef: float | None = None
    dual_clip: float | None = None
    train_vision: bool = False
    detach_uncond: bool = True
    mixed_precision: str = field(default_factory=launcher_mixed_precision)
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    lr_total_steps: int = 0
    strategy: str = "auto"
    gradient_checkpointing: bool = False
    packing: str = knobs.packing()
    balance_tokens: bool = knobs.balance_tokens()
    parallel: ModelParallel = field(default_factory=ModelParallel)
    kernels: Kernels = field(default_factory=Kernels)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> UpdateConfig:
        """The config of resolved command options (`update`'s flags, a preset's `update:` section).

        Every dataclass field is read from the option of the same name; other options (paths, output
        flags) are ignored, and a missing one keeps its default. Lists become tuples (YAML `betas`).
        An unset --mixed-precision (None) is the launcher's.
        """
        values = {f.name: options[f.name] for f in fields(cls) if f.name in options}
        if values.get("mixed_precision") is None:
            values.pop("mixed_precision", None)
        values["parallel"] = ModelParallel.from_options(options)
        values["kernels"] = Kernels.from_options(options)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

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
        return autocast(self.mixed_precision, device)

    def advantage_clip(self) -> float | None:
        """|A| bound: --adv-clip, else the --algo's (5 for the diffusion family, none for grpo/dapo/gspo);
        0 turns it off."""
        if self.adv_clip is None:
            return get_algorithm(self.algo).adv_clip
        return self.adv_clip or None

    def clip_bounds(self) -> tuple[float, float]:
        """(low, high) ratio clip: the --algo's defaults unless given; --clip-range alone is symmetric."""
        algo = get_algorithm(self.algo)
        low = algo.clip[0] if self.clip_range is None else self.clip_range
        if self.clip_range_high is not None:
            return low, self.clip_range_high
        return low, algo.clip[1] if self.clip_range is None else low

    def dual_clip_c(self) -> float | None:
        """Dual-clip constant: the --algo's unless given; 0 turns it off."""
        if self.dual_clip is None:
            return get_algorithm(self.algo).dual_clip
        return self.dual_clip or None

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
        launcher_strategy()
        resolve_mixed_precision(self.mixed_precision)

    def validate(self) -> None:
        """Raise a one-line UserInputError naming the first impossible setting."""
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
        if self.awm_weighting not in AWM_WEIGHTINGS:
            raise UserInputError(
                f"--awm-weighting {self.awm_weighting}: choose one of {', '.join(AWM_WEIGHTINGS)}"
            )
        if self.ema_beta > 0 and not self.ema:
            raise UserInputError("--ema-beta needs --ema (the EMA weights it pulls toward)")
        if self.strategy not in STRATEGIES:
            raise UserInputError(f"--strategy {self.strategy}: choose one of {', '.join(STRATEGIES)}")
        if self.train_timesteps < 1:
            raise UserInputError(f"--train-timesteps {self.train_timesteps}: must be at least 1")
        if self.packing not in PACKING:
            raise UserInputError(f"--packing {self.packing}: choose one of {', '.join(PACKING)}")
        if algo.family != "token" and (self.packing == "on" or self.balance_tokens):
            raise UserInputError(
                f"--packing on / --balance-tokens: VLM token objectives (grpo, dapo, gspo) only, not --algo "
                f"{algo.name}; drop it"
            )
        self.kernels.validate()


class EMA:
    """Exponential moving average of the trained weights; decay min((1+k)/(10+k), 0.9) (flow_grpo)."""

    def __init__(self, params: dict[str, torch.Tensor], updates: int = 0):
        self.shadow = {k: v.detach().clone().float() for k, v in params.items()}
        self.updates = updates

    def update(self, params: dict[str, torch.Tensor]) -> None:
        decay = min((1 + self.updates) / (10 + self.updates), 0.9)
        for k, v in params.items():
            self.shadow[k].mul_(decay).add_(v.detach().float(), alpha=1 - decay)
        self.updates += 1


def _named_trainable(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p for n, p in policy.module.named_parameters() if p.requires_grad}


def _check_finite(name: str, value: torch.Tensor, where: str) -> None:
    if not torch.isfinite(value).all():
        raise NonFiniteError(
            f"{name} is not finite {where}; lower --lr or check the inputs (no step was taken)"
        )


def _raise_if_any_rank_failed(failed: torch.Tensor, mine: str | None, where: str) -> None:
    """Raise NonFiniteError on every rank when some rank saw a non-finite loss.

    failed: [world] float, 1 at the ranks that did (already summed over ranks); mine: this rank's
    own message, if it is one of them. All ranks raise at the same point, so none waits in a collective.
    """
    ranks = [r for r, f in enumerate(failed.tolist()) if f > 0]
    if not ranks:
        return
    if mine is not None:
        raise NonFiniteError(f"{mine}; lower --lr or check the inputs (no step was taken)")
    raise NonFiniteError(
        f"loss is not finite on rank {', '.join(map(str, ranks))} {where} (that rank names the micro-batch); "
        "lower --lr or check the inputs (no step was taken)"
    )


Slot = tuple[list[int], bool]  # a micro-batch of this rank's step, and whether it counts (weight 0 if not)


def _steps(
    objective: Any, rows: list[int], micro: int, cfg: UpdateConfig, seed: int
) -> Iterator[tuple[int, int, list[list[int]], list[Slot]]]:
    """Every optimizer step of the run: (epoch, index of its first chunk, the step's chunks over all
    ranks, this rank's grad_accum slots).

    The order is drawn from `seed` (a shuffle per epoch, then the objective's own draws in `epoch`),
    so two passes with one seed give the same steps. Each rank takes its own grad_accum chunks of a
    step (`UpdateConfig.accumulation`); a rank short of chunks replays the step's first one with
    weight 0, so every rank runs grad_accum slots and the collectives of DDP and FSDP2 stay in step.
    """
    rng = random.Random(seed)
    world, rank = data_parallel()  # the ranks of a model-parallel group take the same slots
    accum = cfg.accumulation(micro, world)
    slots = accum * world
    for epoch in range(cfg.inner_epochs):
        order = rows[:]
        if cfg.shuffle:
            rng.shuffle(order)
        chunks = objective.epoch(order, micro, rng)
        for first in range(0, len(chunks), slots):
            step_chunks = chunks[first : first + slots]
            mine = step_chunks[rank * accum : (rank + 1) * accum]
            padded = [(idx, True) for idx in mine]
            padded += [(step_chunks[0], False)] * (accum - len(mine))
            yield epoch, first, step_chunks, padded


def _planned_rows(objective: Any, rows: list[int], micro: int, cfg: UpdateConfig, seed: int) -> list[int]:
    """The data rows this rank's slots will read over the whole run (a dry pass of `_steps`)."""
    needed: set[int] = set()
    for _, _, _, mine in _steps(objective, rows, micro, cfg, seed):
        for idx, _ in mine:
            needed.update(objective.rows_of(idx))
    return sorted(needed)


class Trainer:
    """The optimisation state of one policy, built once and stepped over any number of data sets.

    setup (the constructor): the trained parameters marked, the parallel wrapper (DDP / FSDP2), AdamW,
    the fp16 loss scaler, the EMA and DiffusionNFT's old policy, resumed from `state` (`load_state`).
    `step` runs `inner_epochs` passes over one data set; `save` writes the policy directory. `update`
    steps once; `online` steps once per iteration, so its moments, scheduler position and wrapper carry
    across iterations as a staged run's do through its saved state.
    """

    def __init__(self, policy: Policy, cfg: UpdateConfig, state: dict[str, Any], step: int = 0):
        cfg.validate()
        self.policy, self.cfg, self.global_step = policy, cfg, step
        self.algo = get_algorithm(cfg.algo)
        if isinstance(policy, FlowPolicy):
            policy.family.detach_uncond = cfg.detach_uncond
        vision = {"train_vision": cfg.train_vision} if isinstance(policy, VLMPolicy) else {}
        policy.trainable_parameters(full=cfg.full, **vision)
        if isinstance(policy, VLMPolicy):
            policy.use_packing(cfg.packing)
        if cfg.gradient_checkpointing or launcher_checkpointing():
            policy.gradient_checkpointing()
        if isinstance(policy, VLMPolicy) and (cfg.parallel.degree > 1 or cfg.kernels != Kernels()):
            raise UserInputError(
                "--sp-degree / --tp-degree / --attention-backend / --compile: diffusion transformers only; "
                "drop it for a VLM"
            )
        if isinstance(policy, FlowPolicy):  # after the LoRA is on, before DDP / FSDP2 wrap the module
            prepare(policy.parts, cfg.parallel, cfg.kernels)
        self.par = Parallel.setup(policy.module, cfg.strategy, swaps_weights=self.algo.family == "forward")
        self.named = _named_trainable(policy)
        self.params = list(self.named.values())
        settings = cfg.optimizer_settings()
        self.optimizer = torch.optim.AdamW(self.params, **settings)
        if state.get("sharded") is not None:  # each rank reads its shards; the optimizer's in place
            state = resume_sharded(state, self.par, self.optimizer, self.named)
        if state.get("optimizer") is not None:
            self.par.load_optimizer_state(self.optimizer, state["optimizer"])
        # The moments carry over; the hyper-parameters are this run's (a new --lr takes effect).
        for group in self.optimizer.param_groups:
            group.update(settings)
        if cfg.mixed_precision == "fp16" and self.par.kind == "fsdp2":
            raise UserInputError(
                "--mixed-precision fp16 with FSDP2: the loss scale is not sharded yet; use bf16 (or --strategy ddp)"
            )
        # fp16: the loss is scaled before each backward and the gradients unscaled before clipping
        # (torch.amp.GradScaler); disabled, every call passes through.
        self.scaler = torch.amp.GradScaler(self.params[0].device.type, enabled=cfg.mixed_precision == "fp16")
        if state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        self.ema = EMA(self.named) if cfg.ema else None
        if self.ema is not None and state.get("ema") is not None:
            self.ema.shadow = self.par.shard_like(
                {k: v.float() for k, v in state["ema"]["shadow"].items()}, self.named
            )
            self.ema.updates = int(state["ema"]["updates"])
        # DiffusionNFT's old policy persists across steps and updates (None: the first step's weights)
        saved = state.get("old_weights") if self.algo.name == "nft" else None
        self.old_weights = self.par.shard_like(saved, self.named) if saved else None

    @classmethod
    def resume(cls, policy: Policy, cfg: UpdateConfig, adapter: Path | None) -> Trainer:
        """The trainer of `policy`, continuing the update that wrote `adapter` (None: a first one)."""
        state, step = load_state(adapter)
        return cls(policy, cfg, state, step)

    def _old_policy(self) -> dict[str, torch.Tensor] | None:
        """The "old" weights of a forward-family objective: NFT's persistent ones, AWM's the weights this
        step starts from. Other families need no copy (for a fully fine-tuned VLM it would be a second model)."""
        if self.algo.family != "forward":
            return None
        if self.old_weights is not None:
            return self.old_weights
        return {k: v.detach().clone() for k, v in self.named.items()}

    def step(
        self,
        data: dict[str, Any],
        sample_cfg: Any,
        *,
        seed: int | None = None,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        load_rows: Callable[[list[int]], Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Run `inner_epochs` passes of the `--algo` objective over `data` (zipped input columns); one
        metrics record per optimizer step.

        seed: the shuffle's (default --seed), offset by the optimizer steps taken so far. `load_rows`,
        when given, is called once with the rows this rank's micro-batches will read, before the first
        step: `data`'s heavy columns are `rows.HeldRows` that it fills (`rows.held_columns`).

        Every rank runs grad_accum micro-batch slots per optimizer step (`_steps`), so the collectives of
        DDP and FSDP2 stay in step; a non-finite loss is reported by every rank at the step's end, before
        any weight moves.
        """
        cfg = self.cfg if seed is None else replace(self.cfg, seed=seed)
        algo, par, optimizer, scaler, params = self.algo, self.par, self.optimizer, self.scaler, self.params
        micro = cfg.micro_batch or sample_cfg.batch_size
        world, rank = world_and_rank()
        accum = cfg.accumulation(
            micro, data_parallel()[0]
        )  # a --samples-per-step it does not divide: refused
        missing = [c for c in algo.needs if c not in data]
        if missing:
            hint = " (omnirl logprob --means)" if missing[0] == "old_means" else ""
            raise UserInputError(f"--algo {algo.name} needs the column '{missing[0]}' in --in{hint}")
        old_weights = self._old_policy()
        objective = make_objective(
            self.policy,
            data,
            sample_cfg,
            cfg,
            algo,
            old_weights=old_weights,
            ema_weights=self.ema.shadow if self.ema is not None else None,
        )
        rows = trained_rows(data)
        seed = cfg.seed + self.global_step
        if load_rows is not None:
            load_rows(_planned_rows(objective, rows, micro, cfg, seed))
        on = params[0].device
        keys = objective.metric_keys
        metrics: list[dict[str, Any]] = []
        attribute = "transformer" if isinstance(self.policy, FlowPolicy) else "model"
        dp, dp_rank = data_parallel()  # the ranks of a model-parallel group take the same slots
        slots = accum * dp
        with par.forwarding(self.policy, attribute):
            for epoch, first, step_chunks, mine in _steps(objective, rows, micro, cfg, seed):
                t0 = time.perf_counter()
                # metric sums, the count of losses, then one non-finite flag per rank: one all_reduce
                sums = torch.zeros(len(keys) + 1 + world, dtype=torch.float64)
                failure = None
                for c, (idx, real) in enumerate(mine):
                    # × every rank, not dp: DDP / FSDP2 average over all of them, and a model-parallel
                    # group's gradients add up to its replica's (`stages.parallelism`)
                    weight = world * objective.share(idx, step_chunks, slots) / objective.per_chunk
                    where = f"at epoch {epoch}, micro-batch {first + dp_rank * accum + c}"
                    losses = objective.losses(idx)
                    for t in range(objective.per_chunk):
                        with par.sync(c == accum - 1 and t == objective.per_chunk - 1):
                            with cfg.autocast(on):
                                loss, values = next(losses)
                            scaler.scale(loss * (weight if real else 0.0)).backward()
                        if not real:
                            continue
                        if failure is None and not bool(torch.isfinite(loss).all()):
                            failure = f"loss is not finite {where}, trained step {t}" + (
                                f" (rank {rank})" if world > 1 else ""
                            )
                        sums[: len(keys)] += torch.tensor(values, dtype=torch.float64)
                        sums[len(keys)] += 1
                sums[len(keys) + 1 + rank] = float(failure is not None)
                if world > 1:
                    sums = all_reduce_sum(sums, on)
                where = f"at epoch {epoch}, optimizer step {self.global_step + 1}"
                _raise_if_any_rank_failed(sums[len(keys) + 1 :], failure, where)
                scaler.unscale_(optimizer)
                grad_norm = par.clip_grad_norm(params, cfg.max_grad_norm)
                if not scaler.is_enabled():  # under fp16 an overflow skips the step and lowers the scale
                    _check_finite("grad norm", grad_norm, where)
                for group in optimizer.param_groups:
                    group["lr"] = cfg.lr * cfg.lr_factor(self.global_step)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                self.global_step += 1
                if self.ema is not None and self.global_step % cfg.ema_every == 0:
                    self.ema.update(self.named)
                elapsed = time.perf_counter() - t0
                seen = sum(len(idx) for idx in step_chunks)
                count = max(float(sums[len(keys)]), 1.0)
                record: dict[str, Any] = {k: float(v / count) for k, v in zip(keys, sums[: len(keys)])}
                record.update(
                    {
                        "step": self.global_step,
                        "epoch": epoch,
                        "actor/grad_norm": float(grad_norm),
                        "actor/lr": optimizer.param_groups[0]["lr"],
                        "perf/samples_per_s": seen / elapsed if elapsed > 0 else math.nan,
                        "perf/sample_steps_per_s": seen * objective.per_chunk / elapsed
                        if elapsed > 0
                        else math.nan,
                        **par.memory(params, optimizer),
                        **({"actor/grad_scale": scaler.get_scale()} if scaler.is_enabled() else {}),
                    }
                )
                metrics.append(record)
                if on_step:
                    on_step(record)
        if algo.name == "nft":  # θ_old ← λ·θ_old + (1−λ)·θ after the epoch (DiffusionNFT)
            decay = nft_old_decay(self.global_step, cfg.old_decay)
            self.old_weights = {
                k: decay * old_weights[k] + (1 - decay) * v.detach() for k, v in self.named.items()
            }
            if metrics:
                metrics[-1]["old_policy/decay"] = decay
        return metrics

    def state(self) -> dict[str, Any]:
        """What the next update resumes from (`trainer_state`; a collective under FSDP2)."""
        return trainer_state(self.par, self.optimizer, self.ema, self.old_weights, self.scaler)

    def save(self, out: Path, metrics: list[dict[str, Any]], *, extra: dict[str, Any]) -> None:
        """Write the policy directory `out` atomically (`save_policy`; every rank calls it): the trained
        weights, gathered whole when sharded, `metrics`, and this trainer's state at its current step."""
        save_policy(
            self.policy,
            out,
            self.state,
            metrics,
            self.global_step,
            self.cfg,
            weights=lambda: self.par.module_state(trained_only=not self.cfg.full),
            extra=extra,
        )


def train(
    policy: Policy,
    data: dict[str, Any],
    sample_cfg: Any,
    cfg: UpdateConfig,
    *,
    state: dict[str, Any],
    start_step: int,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    load_rows: Callable[[list[int]], Any] | None = None,
) -> tuple[
    torch.optim.Optimizer,
    EMA | None,
    dict[str, torch.Tensor] | None,
    list[dict[str, Any]],
    Parallel,
    torch.amp.GradScaler,
]:
    """One `Trainer` step from `state` (`load_state`), for one-shot callers (benchmarks): the optimizer,
    the EMA, the new old-policy weights (NFT), the metrics, the `Parallel` and the fp16 loss scaler, the
    arguments of `trainer_state`."""
    trainer = Trainer(policy, cfg, state, start_step)
    metrics = trainer.step(data, sample_cfg, on_step=on_step, load_rows=load_rows)
    return trainer.optimizer, trainer.ema, trainer.old_weights, metrics, trainer.par, trainer.scaler
