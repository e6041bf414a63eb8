"""The clipped-ratio objective over the stored SDE steps of a rollout (flow_grpo, dance_grpo, mix_grpo,
grpo_guard, flow_dppo): `PolicyGradient` replays each trained step under the trained weights
(`samplers.step` with the stored x') and applies the --algo loss (losses.py, family_losses.py) + β·KL.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch

from stages.errors import UserInputError
from stages.models.diffusion import FlowPolicy
from stages.sample.rollout import SampleConfig
from stages.sample.samplers import kl_to_reference, step
from stages.update.chunks import (
    Chunk,
    LossItem,
    chunk_rows,
    condition,
    fixed_steps,
    gated_kl,
    kl_reference,
    sample_share,
    split_chunks,
)
from stages.update.family_losses import flow_dppo_loss, grpo_guard_loss
from stages.update.losses import Algorithm, clipped_policy_loss, kl_std, ratio_metrics, step_plan
from stages.update.rollout_correction import WEIGHTS

# Flow-DPPO's trust-region metrics, verl-omni's names (`family_losses.flow_dppo_loss`)
DPPO_KEYS = (
    "actor/kl_new_old_mean",
    "actor/kl_new_old_max",
    "actor/kl_mask_fraction",
    "actor/pos_rm_fraction",
    "actor/neg_rm_fraction",
    "actor/masked_fraction",
    "actor/unmasked_fraction",
)


class PolicyGradient:
    """Clipped-ratio objectives over the stored steps of a rollout.

    flow_dppo's rollout means are the `old_means` column when given, else replayed under `old_weights`
    (the weights the update starts from)."""

    share = staticmethod(sample_share)
    steps = staticmethod(fixed_steps)
    rows_of = staticmethod(chunk_rows)

    def __init__(
        self,
        policy: FlowPolicy,
        data: dict[str, Any],
        sample_cfg: SampleConfig,
        cfg: Any,
        algo: Algorithm,
        ref_weights: dict[str, torch.Tensor] | None = None,
        *,
        old_weights: dict[str, torch.Tensor] | None = None,
    ):
        self.policy, self.data, self.sample_cfg, self.cfg, self.algo = policy, data, sample_cfg, cfg, algo
        self.ref_weights = ref_weights
        self.old_weights = old_weights
        self.metric_keys = (
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/ratio_mean",
            "actor/ratio_std",
            "actor/pg_clipfrac",
            "actor/pg_clipfrac_higher",
            "actor/pg_clipfrac_lower",
            "actor/ppo_kl",
            "actor/approx_kl",
            *(DPPO_KEYS if algo.kl_mask else ()),
        )
        self.old = data.get("old_log_probs", data.get("log_probs"))
        if self.old is None:
            raise UserInputError(
                "--in: neither old_log_probs (omnirl logprob) nor log_probs (omnirl sample) is present"
            )
        self.sigma_safe = policy.sigmas(sample_cfg.steps, sample_cfg.resolution)[1]
        self.plan = torch.zeros(0, 0, dtype=torch.int64)

    def epoch(self, rows: list[int], micro: int, rng: random.Random) -> list[Chunk]:
        num_steps = self.data["latents"].shape[1] - 1
        chunks = split_chunks(rows, micro)
        self.plan = step_plan(
            self.algo, self.data["latents"].shape[0], num_steps, self.cfg.timestep_fraction, rng
        )
        return chunks

    @property
    def per_chunk(self) -> int:
        return self.plan.shape[1]

    def losses(self, idx: Chunk) -> Iterator[LossItem]:
        cond = condition(self.policy, self.data, idx, self.sample_cfg)
        low, high = self.cfg.clip_bounds()
        for t in range(self.per_chunk):
            res, log_ratio = self._step(idx, self.plan[idx, t], cond)
            m = ratio_metrics(res.ratio, log_ratio)
            m.update(
                {
                    "actor/pg_loss": res.policy_loss.item(),
                    "actor/kl_loss": res.kl.item(),
                    "actor/pg_clipfrac": res.clipped.mean().item(),
                    **res.extra,
                    # verl-omni's split of the clipped ratios: above 1 + ε_high, below 1 − ε
                    "actor/pg_clipfrac_higher": (res.ratio > 1.0 + high).float().mean().item(),
                    "actor/pg_clipfrac_lower": (res.ratio < 1.0 - low).float().mean().item(),
                }
            )
            yield res.loss, [m[k] for k in self.metric_keys]

    def _step(self, idx: Chunk, j: torch.Tensor, cond: Any) -> tuple[Any, torch.Tensor]:
        """Loss of stored step j[b] for row idx[b]: replay under the trained weights, then the --algo loss.

        Also returns the plain log-ratio log π_θ − log π_old [B] of the step (GRPO-Guard clips another
        ratio; its ppo_kl is still this one's, as in verl-omni).
        """
        policy, data, scfg, cfg = self.policy, self.data, self.sample_cfg, self.cfg
        index = torch.tensor(idx)
        x = data["latents"][index, j].to(policy.device).float()
        x_next = data["latents"][index, j + 1].to(policy.device).float()
        s, s_next = data["sigmas"][index, j], data["sigmas"][index, j + 1]

        def replay(v: torch.Tensor) -> Any:
            return step(
                scfg.sampler,
                v,
                x,
                s,
                s_next,
                noise_level=scfg.noise_level,
                sigma_max_safe=self.sigma_safe,
                prev_sample=x_next,
            )

        out = replay(policy.velocity(x, s, cond, scfg.guidance, scfg.guidance_2))
        kl = None
        if cfg.beta > 0:
            if "ref_means" in data and self.ref_weights is None:  # stored means are the base model's
                ref_mean = data["ref_means"][index, j].to(policy.device)
            else:
                with torch.no_grad(), kl_reference(policy, self.ref_weights):
                    ref_mean = replay(policy.velocity(x, s, cond, scfg.guidance, scfg.guidance_2)).mean
            kl = kl_to_reference(out.mean, ref_mean, kl_std(scfg.sampler, out.diffusion, out.std))
            kl = gated_kl(kl, data, index)
        adv = data["advantages"][index, j].to(policy.device).float()
        old = self.old[index, j].to(policy.device).float()
        common = {
            "clip_range": cfg.clip_bounds()[0],
            "clip_range_high": cfg.clip_bounds()[1],
            "adv_clip": cfg.advantage_clip(),
            "kl": kl,
            "beta": cfg.beta,
        }
        if WEIGHTS in data:  # --rollout-correction's multiplier of each row's term
            common["weights"] = data[WEIGHTS][index, j].to(policy.device)
        log_ratio = out.log_prob.detach() - old
        if self.algo.guard:
            old_mean = data["old_means"][index, j].to(policy.device).float()
            if scfg.sampler == "dance" and cfg.guard_dance_scale == "eta_dsigma":  # verl-omni's η·|Δσ|
                common["scale"] = out.std * (s - s_next).abs().sqrt().to(out.std)
            return grpo_guard_loss(out.mean, old_mean, x_next, out.std, s_next - s, adv, **common), log_ratio
        if self.algo.kl_mask:
            if "old_means" in data:
                old_mean = data["old_means"][index, j].to(policy.device).float()
            else:
                with torch.no_grad(), policy.weights(self.old_weights):
                    old_mean = replay(policy.velocity(x, s, cond, scfg.guidance, scfg.guidance_2)).mean
            loss = flow_dppo_loss(
                out.mean,
                old_mean,
                out.std,
                out.log_prob,
                old,
                adv,
                kl_threshold=cfg.kl_mask_threshold,
                adv_clip=common["adv_clip"],
                kl=kl,
                beta=cfg.beta,
                weights=common.get("weights"),
            )
            return loss, log_ratio
        return clipped_policy_loss(out.log_prob, old, adv, **common), log_ratio
