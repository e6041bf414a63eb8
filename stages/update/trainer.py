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
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from stages.dist import all_reduce_sum, data_parallel, world_and_rank
from stages.errors import NonFiniteError, UserInputError
from stages.models.diffusion import FlowPolicy
from stages.models.kernels import Kernels, prepare
from stages.models.vlm import VLMPolicy
from stages.update import rollout_correction
from stages.update.checkpoint import load_state, resume_sharded, save_policy, trainer_state
from stages.update.checkpoint import save_state as save_state  # the state's writer, beside its reader
from stages.update.config import UpdateConfig
from stages.update.ema import EMA
from stages.update.family_losses import dgpo_old_decay, nft_old_refresh, old_policy_metrics
from stages.update.losses import get_algorithm
from stages.update.objectives import make_objective
from stages.update.parallel import Parallel, launcher_checkpointing
from stages.update.rows import trained_rows

Policy = FlowPolicy | VLMPolicy
PERSISTENT_OLD = ("nft", "dgpo")  # algorithms whose old policy is trainer state, saved with the adapter


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
    """Every optimizer step of the run: (epoch, index of this rank's first chunk in the epoch, the
    step's chunks over all ranks, this rank's slots).

    The order is drawn from `seed` (a shuffle per epoch, then the objective's own draws in `epoch`),
    so two passes with one seed give the same steps. Each rank takes its own chunks of a step (the
    objective's `steps`: grad_accum each, `UpdateConfig.accumulation`, or as many as a token budget
    needs); a rank short of chunks replays the step's first one with weight 0, so every rank runs as
    many slots as the busiest and the collectives of DDP and FSDP2 stay in step.
    """
    rng = random.Random(seed)
    world, rank = data_parallel()  # the ranks of a model-parallel group take the same slots
    accum = cfg.accumulation(micro, world)
    for epoch in range(cfg.inner_epochs):
        order = rows[:]
        if cfg.shuffle:
            rng.shuffle(order)
        first = 0
        for ranks in objective.steps(objective.epoch(order, micro, rng), accum, world):
            step_chunks = [idx for chunks in ranks for idx in chunks]
            mine = ranks[rank]
            padded = [(idx, True) for idx in mine]
            padded += [(step_chunks[0], False)] * (max(map(len, ranks)) - len(mine))
            yield epoch, first + sum(map(len, ranks[:rank])), step_chunks, padded
            first += len(step_chunks)


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
        self.par = Parallel.setup(policy.module, cfg.strategy, swaps_weights=self._swaps_weights())
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
        # DiffusionNFT's and DGPO's old policy persists across steps and updates (None: the first step's weights)
        saved = state.get("old_weights") if self.algo.name in PERSISTENT_OLD else None
        self.old_weights = self.par.shard_like(saved, self.named) if saved else None
        # GARDO's KL reference: None is the base model (`policy.reference()`) until the first reset
        reference = state.get("reference") or {}
        ref = reference.get("weights") if cfg.resets_reference() else None
        self.ref_weights = self.par.shard_like(ref, self.named) if ref else None
        self.ref_age = int(reference.get("age", 0))
        self.ref_pending = bool(reference.get("pending", False))

    @classmethod
    def resume(cls, policy: Policy, cfg: UpdateConfig, adapter: Path | None) -> Trainer:
        """The trainer of `policy`, continuing the update that wrote `adapter` (None: a first one)."""
        state, step = load_state(adapter)
        return cls(policy, cfg, state, step)

    def _swaps_weights(self) -> bool:
        """Whether the objective runs old weights through the module (`Parallel.setup`)."""
        return self.algo.family in ("forward", "group") or self.algo.kl_mask

    def _old_policy(self, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """The "old" weights of an objective that runs them: NFT's and DGPO's persistent ones; AWM's, and
        flow_dppo's when --in has no old_means, the weights this step starts from. Other objectives need no
        copy (for a fully fine-tuned VLM it would be a second model)."""
        replays_old = self.algo.kl_mask and "old_means" not in data
        if self.algo.family not in ("forward", "group") and not replays_old:
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

        Every rank runs as many micro-batch slots per optimizer step as the busiest (`_steps`), so the
        collectives of DDP and FSDP2 stay in step; a non-finite loss is reported by every rank at the
        step's end, before any weight moves.
        """
        cfg = self.cfg if seed is None else replace(self.cfg, seed=seed)
        algo, par, optimizer, scaler, params = self.algo, self.par, self.optimizer, self.scaler, self.params
        micro = cfg.micro_batch or sample_cfg.batch_size
        world, rank = world_and_rank()
        cfg.accumulation(micro, data_parallel()[0])  # a --samples-per-step it does not divide: refused
        missing = [c for c in algo.needs if c not in data]
        if missing:
            hint = " (omnirl logprob --means)" if missing[0] == "old_means" else ""
            raise UserInputError(f"--algo {algo.name} needs the column '{missing[0]}' in --in{hint}")
        rows = trained_rows(data)
        data, corrections = rollout_correction.attach(data, cfg, rows, tokens=algo.family == "token")
        old_weights = self._old_policy(data)
        if algo.name == "dgpo":
            self.old_weights = old_weights  # moved toward the trained weights after every optimizer step
        reset = self._reset_reference()
        objective = make_objective(
            self.policy,
            data,
            sample_cfg,
            cfg,
            algo,
            old_weights=old_weights,
            ema_weights=self.ema.shadow if self.ema is not None else None,
            ref_weights=self.ref_weights,
        )
        rows = trained_rows(data)
        start = self.global_step
        seed = cfg.seed + start
        if load_rows is not None:
            load_rows(_planned_rows(objective, rows, micro, cfg, seed))
        on = params[0].device
        keys = objective.metric_keys
        metrics: list[dict[str, Any]] = []
        attribute = "transformer" if isinstance(self.policy, FlowPolicy) else "model"
        with par.forwarding(self.policy, attribute):
            for epoch, first, step_chunks, mine in _steps(objective, rows, micro, cfg, seed):
                t0 = time.perf_counter()
                # metric sums, the count of losses, then one non-finite flag per rank: one all_reduce
                sums = torch.zeros(len(keys) + 1 + world, dtype=torch.float64)
                failure = None
                for c, (idx, real) in enumerate(mine):
                    # × the ranks DDP / FSDP2 average over (`Parallel.averaged`): all of them under sp, whose
                    # group's gradients add up to its replica's, the dp replicas under tp
                    weight = (
                        par.averaged
                        * objective.share(idx, step_chunks, len(step_chunks))
                        / objective.per_chunk
                    )
                    where = f"at epoch {epoch}, micro-batch {first + c}"
                    losses = objective.losses(idx)
                    for t in range(objective.per_chunk):
                        with par.sync(c == len(mine) - 1 and t == objective.per_chunk - 1):
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
                if algo.name == "dgpo":  # θ_old ← λ·θ_old + (1−λ)·θ, λ of the steps before this one
                    decay = dgpo_old_decay(self.global_step - 1)
                    with torch.no_grad():
                        for k, v in self.named.items():
                            old_weights[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
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
                        # verl-omni's perf names: images (rows) per second per device, the step's seconds
                        "perf/throughput": seen / elapsed / world if elapsed > 0 else math.nan,
                        "perf/time_per_step": elapsed,
                        "perf/sample_steps_per_s": seen * objective.per_chunk / elapsed
                        if elapsed > 0
                        else math.nan,
                        **corrections,
                        **par.memory(params, optimizer),
                        **({"actor/grad_scale": scaler.get_scale()} if scaler.is_enabled() else {}),
                        **({"old_policy/decay": decay} if algo.name == "dgpo" else {}),
                    }
                )
                metrics.append(record)
                if on_step:
                    on_step(record)
        if algo.name == "nft":  # θ_old ← λ·θ_old + (1−λ)·θ after the update, every interval (DiffusionNFT)
            decay = nft_old_refresh(
                start,
                self.global_step,
                cfg.old_decay,
                fixed=cfg.old_decay_value,
                interval=cfg.old_update_interval,
            )
            self.old_weights = old_weights
            if decay is not None:
                self.old_weights = {
                    k: decay * old_weights[k] + (1 - decay) * v.detach() for k, v in self.named.items()
                }
            if metrics:
                metrics[-1].update(old_policy_metrics(decay))
        if cfg.resets_reference():
            self.ref_age += 1
            bound = cfg.ref_reset_kl
            self.ref_pending = bound is not None and any(m["actor/kl_loss"] > bound for m in metrics)
            if metrics:
                metrics[-1].update({"ref/reset": float(reset), "ref/age": float(self.ref_age)})
        return metrics

    def _reset_reference(self) -> bool:
        """GARDO's adaptive reference: before this update, θ_ref ← θ when --ref-reset-every updates ran
        since the last reset (or since the first update), or when the last update's KL passed --ref-reset-kl
        at some optimizer step. Returns whether it reset."""
        cfg = self.cfg
        due = cfg.ref_reset_every > 0 and self.ref_age >= cfg.ref_reset_every
        if not cfg.resets_reference() or not (due or self.ref_pending):
            return False
        self.ref_weights = {k: v.detach().clone() for k, v in self.named.items()}
        self.ref_age, self.ref_pending = 0, False
        return True

    def state(self) -> dict[str, Any]:
        """What the next update resumes from (`trainer_state`; a collective under FSDP2)."""
        reference = {"weights": self.ref_weights, "age": self.ref_age, "pending": self.ref_pending}
        return trainer_state(self.par, self.optimizer, self.ema, self.old_weights, self.scaler, reference)

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
