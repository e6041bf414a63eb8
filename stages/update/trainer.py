"""The optimisation loop of `update`: replay stored steps under the trained weights and step AdamW.

Gradient averaging follows flow_grpo: one backward per (micro-batch, trained step), each loss divided
by (grad_accum × trained steps), so an optimizer step averages uniformly over both.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from stages.errors import NonFiniteError, UserInputError
from stages.models.diffusion import FlowPolicy
from stages.sample.rollout import SampleConfig
from stages.sample.samplers import kl_to_reference, step
from stages.update.family_losses import grpo_guard_loss
from stages.update.losses import Algorithm, StepLoss, clipped_policy_loss, get_algorithm, step_plan

STATE_DIR = "trainer_state"
METRICS = "metrics.jsonl"


@dataclass
class UpdateConfig:
    """Optimisation settings; defaults are flow_grpo's SD3 ones (diffusion-rl.md §1.2, §1.5)."""

    algo: str = "flow_grpo"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    adam_eps: float = 1e-8
    clip_range: float = 1e-4
    clip_range_high: float | None = None
    adv_clip: float = 5.0
    beta: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch: int = 0
    grad_accum: int = 1
    inner_epochs: int = 1
    timestep_fraction: float = 1.0
    shuffle: bool = True
    ema: bool = False
    ema_every: int = 8
    lora_rank: int = 32
    lora_alpha: int = 64
    full: bool = False
    seed: int = 0

    def validate(self) -> None:
        if not 0 < self.timestep_fraction <= 1:
            raise UserInputError(f"--timestep-fraction {self.timestep_fraction}: must lie in (0, 1]")
        if self.grad_accum < 1 or self.inner_epochs < 1:
            raise UserInputError("--grad-accum and --inner-epochs must be at least 1")
        if self.clip_range <= 0:
            raise UserInputError(f"--clip-range {self.clip_range}: must be positive")
        get_algorithm(self.algo)


@dataclass
class TrainerState:
    """What the next `update` needs to continue exactly: step counter, optimizer and EMA."""

    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


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


def _named_trainable(policy: FlowPolicy) -> dict[str, torch.Tensor]:
    return {n: p for n, p in policy.transformer.named_parameters() if p.requires_grad}


def _check_finite(name: str, value: torch.Tensor, where: str) -> None:
    if not torch.isfinite(value).all():
        raise NonFiniteError(f"{name} is not finite {where}; lower --lr or check the inputs (no step was taken)")


METRIC_KEYS = (
    "actor/pg_loss", "actor/kl_loss", "actor/ratio_mean", "actor/ratio_std", "actor/pg_clipfrac", "actor/ppo_kl",
)


def world_and_rank() -> tuple[int, int]:
    """(world size, rank) of an initialised torch.distributed group, else (1, 0)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def _average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """All-reduce the gradients of the trained parameters to their mean over ranks (DDP's rule)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        torch.distributed.all_reduce(p.grad)
        p.grad.div_(world)


def _step_loss(
    policy: FlowPolicy, data: dict[str, Any], idx: list[int], j: torch.Tensor, old: torch.Tensor,
    sample_cfg: SampleConfig, cfg: UpdateConfig, algo: Algorithm, sigma_safe: torch.Tensor | None,
) -> StepLoss:
    """Loss of stored step j[b] for each row idx[b]: replay under the trained weights, then the --algo loss."""
    index = torch.tensor(idx)
    prompts = [data["prompt"][i] for i in idx]
    negatives = [data["negative_prompt"][i] for i in idx] if "negative_prompt" in data else None
    cond = policy.encode(prompts, negatives, sample_cfg.guidance > 1.0, sample_cfg.max_sequence_length)
    latents, sigmas = data["latents"], data["sigmas"]
    x = latents[index, j].to(policy.device).float()
    x_next = latents[index, j + 1].to(policy.device).float()
    s, s_next = sigmas[index, j], sigmas[index, j + 1]

    def replay(v: torch.Tensor) -> Any:
        return step(sample_cfg.sampler, v, x, s, s_next, noise_level=sample_cfg.noise_level,
                    sigma_max_safe=sigma_safe, prev_sample=x_next)

    out = replay(policy.velocity(x, s, cond, sample_cfg.guidance))
    kl = None
    if cfg.beta > 0 and "ref_means" in data:
        kl = kl_to_reference(out.mean, data["ref_means"][index, j].to(policy.device), out.diffusion)
    elif cfg.beta > 0:
        with torch.no_grad(), policy.reference():
            ref = replay(policy.velocity(x, s, cond, sample_cfg.guidance))
        kl = kl_to_reference(out.mean, ref.mean, out.diffusion)
    adv = data["advantages"][index, j].to(policy.device).float()
    common = {"clip_range": cfg.clip_range, "clip_range_high": cfg.clip_range_high, "adv_clip": cfg.adv_clip,
              "kl": kl, "beta": cfg.beta}
    if algo.guard:
        old_mean = data["old_means"][index, j].to(policy.device).float()
        return grpo_guard_loss(out.mean, old_mean, x_next, out.std, s_next - s, adv, **common)
    return clipped_policy_loss(out.log_prob, old[index, j].to(policy.device).float(), adv, **common)


def train(
    policy: FlowPolicy,
    data: dict[str, Any],
    sample_cfg: SampleConfig,
    cfg: UpdateConfig,
    *,
    optimizer_state: dict[str, Any] | None,
    ema_state: dict[str, torch.Tensor] | None,
    start_step: int,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[torch.optim.Optimizer, EMA | None, list[dict[str, Any]]]:
    """Run `inner_epochs` passes over `data` (columns of samples ⋈ logprobs ⋈ advantages).

    data: prompt, negative_prompt (lists), latents [N, K+1, C, h, w], sigmas [N, K+1],
    log_probs / old_log_probs [N, K], advantages [N, K], optional train_mask [N], and optional
    ref_means [N, K, C, h, w] (from `logprob --reference`), which spares the reference forward pass.
    """
    cfg.validate()
    algo = get_algorithm(cfg.algo)
    missing = [c for c in algo.needs if c not in data]
    if missing:
        raise UserInputError(f"--algo {algo.name} needs the column '{missing[0]}' in --in (omnirl logprob --means)")
    params = policy.trainable_parameters(full=cfg.full)
    named = _named_trainable(policy)
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.adam_eps
    )
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    ema = EMA(named) if cfg.ema else None
    if ema is not None and ema_state is not None:
        ema.shadow = {k: v.clone() for k, v in ema_state["shadow"].items()}
        ema.updates = int(ema_state["updates"])

    old = data.get("old_log_probs", data.get("log_probs"))
    if old is None:
        raise UserInputError("update: inputs carry neither old_log_probs (omnirl logprob) nor log_probs (omnirl sample)")
    latents = data["latents"]
    rows = list(range(latents.shape[0]))
    if "train_mask" in data:
        rows = [i for i in rows if bool(data["train_mask"][i])]
    num_steps = latents.shape[1] - 1
    micro = cfg.micro_batch or sample_cfg.batch_size
    sigma_safe = policy.sigmas(sample_cfg.steps)[1] if sample_cfg.steps > 1 else None
    rng = random.Random(cfg.seed + start_step)
    world, rank = world_and_rank()
    metrics: list[dict[str, Any]] = []
    global_step = start_step
    for epoch in range(cfg.inner_epochs):
        order = rows[:]
        if cfg.shuffle:
            rng.shuffle(order)
        chunks = [order[i : i + micro] for i in range(0, len(order), micro)]
        plan = step_plan(algo, latents.shape[0], num_steps, cfg.timestep_fraction, rng)
        trained = plan.shape[1]
        # One optimizer step takes grad_accum micro-batches per rank; rank r takes its own run of them,
        # so N ranks × grad_accum equals one process with N·grad_accum micro-batches.
        per_step = cfg.grad_accum * world
        for first in range(0, len(chunks), per_step):
            t0 = time.perf_counter()
            mine = chunks[first + rank * cfg.grad_accum : first + (rank + 1) * cfg.grad_accum]
            sums = torch.zeros(len(METRIC_KEYS) + 1, dtype=torch.float64)
            for c, idx in enumerate(mine):
                where = f"at epoch {epoch}, micro-batch {first + rank * cfg.grad_accum + c}"
                for t in range(trained):
                    res = _step_loss(policy, data, idx, plan[idx, t], old, sample_cfg, cfg, algo, sigma_safe)
                    _check_finite("loss", res.loss, f"{where}, trained step {t}")
                    (res.loss / (cfg.grad_accum * trained)).backward()
                    sums[:-1] += torch.tensor([
                        res.policy_loss.item(), res.kl.item(), res.ratio.mean().item(),
                        res.ratio.std(unbiased=False).item(), res.clipped.mean().item(),
                        (0.5 * res.log_ratio.pow(2)).mean().item(),
                    ], dtype=torch.float64)
                    sums[-1] += 1
            seen = sum(len(idx) for idx in chunks[first : first + per_step])
            if world > 1:
                _average_gradients(params, world)
                torch.distributed.all_reduce(sums)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            _check_finite("grad norm", grad_norm, f"at epoch {epoch}, optimizer step {global_step + 1}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if ema is not None and global_step % cfg.ema_every == 0:
                ema.update(named)
            elapsed = time.perf_counter() - t0
            record: dict[str, Any] = {k: float(v / max(sums[-1], 1)) for k, v in zip(METRIC_KEYS, sums[:-1])}
            record.update(
                {
                    "step": global_step,
                    "epoch": epoch,
                    "actor/grad_norm": float(grad_norm),
                    "actor/lr": cfg.lr,
                    "perf/samples_per_s": seen / elapsed if elapsed > 0 else math.nan,
                    "perf/sample_steps_per_s": seen * trained / elapsed if elapsed > 0 else math.nan,
                }
            )
            metrics.append(record)
            if on_step:
                on_step(record)
    return optimizer, ema, metrics


def save_state(out: Path, optimizer: torch.optim.Optimizer, ema: EMA | None, step: int, cfg: UpdateConfig) -> None:
    """Optimizer (torch format, read back with weights_only=True), EMA (safetensors) and counters."""
    from safetensors.torch import save_file

    state = out / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    torch.save(optimizer.state_dict(), state / "optimizer.pt")
    if ema is not None:
        save_file({k: v.contiguous() for k, v in ema.shadow.items()}, state / "ema.safetensors")
    info = {"step": step, "ema_updates": ema.updates if ema else 0, "update_config": asdict(cfg)}
    (state / "state.json").write_text(json.dumps(info, indent=2, sort_keys=True))


def load_state(adapter: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None, int]:
    """(optimizer state, EMA state, step) saved next to an adapter; (None, None, 0) when absent."""
    state = adapter / STATE_DIR
    if not (state / "state.json").is_file():
        return None, None, 0
    info = json.loads((state / "state.json").read_text())
    opt = torch.load(state / "optimizer.pt", weights_only=True) if (state / "optimizer.pt").is_file() else None
    ema = None
    if (state / "ema.safetensors").is_file():
        from safetensors.torch import load_file

        ema = {"shadow": load_file(state / "ema.safetensors"), "updates": info.get("ema_updates", 0)}
    return opt, ema, int(info.get("step", 0))
