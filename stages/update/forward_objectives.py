"""The objectives on x_t built from the final latent x0 with fresh noise, x_t = (1−t)·x0 + t·ε.

- `ForwardProcess` (nft, awm): schedule timesteps per sample; DiffusionNFT's implicit-policy loss or
  Advantage-Weighted Matching (family_losses.py).
- `Preference` (dpo): best and worst sample of each group as a pair, sharing t and ε; Diffusion-DPO
  against the frozen reference.
- `GroupPreference` (dgpo): whole groups per micro-batch, one ε per group and timestep; DGPO's group
  preference against the frozen reference (family_losses.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch

from stages.advantage.estimators import best_worst_pairs, nft_optimality
from stages.errors import UserInputError
from stages.models.diffusion import FlowPolicy
from stages.sample.rollout import SampleConfig
from stages.update.chunks import (
    Chunk,
    LossItem,
    chunk_rows,
    condition,
    fixed_steps,
    gardo_gate,
    kl_reference,
    sample_share,
    split_chunks,
)
from stages.update.family_losses import awm_loss, dgpo_loss, diffusion_dpo_loss, fm_error, nft_loss
from stages.update.losses import Algorithm
from stages.update.rows import trained_rows


def _stratified(lo: int, hi: int, strata: int, rng: random.Random) -> list[int]:
    """One index drawn uniformly inside each of `strata` equal slices of [lo, hi] (AWM's timesteps)."""
    width = (hi + 1 - lo) / strata
    return [min(hi, int(lo + (k + rng.random()) * width)) for k in range(strata)]


def _interpolate(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x0 + t·ε for latents of any rank [B, ...], t [B]."""
    t = t.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0 + t * eps


def _noise(seed: int, rows: Chunk, column: int, shape: tuple[int, ...]) -> torch.Tensor:
    """ε for (row, trained timestep): seeded per row, so batching and ranks never change it."""
    gens = [torch.Generator("cpu").manual_seed(seed * 1_000_003 + r * 101 + column) for r in rows]
    return torch.stack([torch.randn(shape, generator=g) for g in gens])


class ForwardProcess:
    """DiffusionNFT and AWM: losses on x_t built from the final latent with fresh noise."""

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
        *,
        old_weights: dict[str, torch.Tensor] | None,
        ema_weights: dict[str, torch.Tensor] | None,
        ref_weights: dict[str, torch.Tensor] | None = None,
    ):
        self.policy, self.data, self.sample_cfg, self.cfg, self.algo = policy, data, sample_cfg, cfg, algo
        self.ref_weights = ref_weights
        self.schedule = policy.sigmas(sample_cfg.steps, sample_cfg.resolution)[
            :-1
        ].float()  # σ of each sampling step, [N]
        self.old_weights = old_weights
        self.ema_weights = ema_weights
        self.plan = torch.zeros(0, 0)
        self.seed = 0
        self.metric_keys = (
            (
                "actor/pg_loss",
                "actor/kl_loss",
                "actor/positive_loss",
                "actor/negative_loss",
                "actor/old_deviate",
                "actor/reward_prob_mean",
                "actor/policy_loss",
                "actor/ref_kl_loss",
                "actor/total_loss",
            )
            if algo.name == "nft"
            else (
                "actor/pg_loss",
                "actor/kl_loss",
                "actor/ema_kl_loss",
                "actor/fm_loss",
                "actor/ratio_mean",
                "actor/ratio_std",
                "actor/pg_clipfrac",
                "actor/ppo_kl",
                "actor/approx_kl",
            )
        )

    def epoch(self, rows: list[int], micro: int, rng: random.Random) -> list[Chunk]:
        n, count = self.data["final_latent"].shape[0], len(self.schedule)
        self.seed = rng.randrange(2**31)
        if self.algo.name == "nft":  # a random permutation of the schedule per sample, first int(N·f) kept
            keep = max(1, int(count * self.cfg.timestep_fraction))
            self.plan = torch.tensor([rng.sample(range(count), keep) for _ in range(n)], dtype=torch.int64)
        else:  # AWM: `train_timesteps` stratified over schedule indices [1, ⌊0.9·N⌋]
            lo = min(1, count - 1)
            hi = max(lo, int(0.9 * count))
            strata = self.cfg.timesteps()
            self.plan = torch.tensor([_stratified(lo, hi, strata, rng) for _ in range(n)], dtype=torch.int64)
        return split_chunks(rows, micro)

    @property
    def per_chunk(self) -> int:
        return self.plan.shape[1]

    def losses(self, idx: Chunk) -> Iterator[LossItem]:
        policy, cfg, scfg = self.policy, self.cfg, self.sample_cfg
        cond = condition(policy, self.data, idx, scfg)
        index = torch.tensor(idx)
        x0 = self.data["final_latent"][index].to(policy.device).float()
        adv = self.data["advantages"][index, 0].to(policy.device).float()
        gate = gardo_gate(self.data, index, policy.device)  # GARDO's rows of the NFT KL (AWM: all)
        scale = cfg.advantage_clip()  # DiffusionNFT and AWM normalise advantages by their clip
        for col in range(self.per_chunk):
            t = self.schedule[self.plan[index, col]].to(policy.device)
            eps = _noise(self.seed, idx, col, tuple(x0.shape[1:])).to(policy.device)
            x_t = _interpolate(x0, eps, t)
            v = policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2)
            v_ref = None
            if cfg.beta > 0:
                with torch.no_grad(), kl_reference(policy, self.ref_weights):
                    v_ref = policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2)
            if self.algo.name == "nft":
                with torch.no_grad(), policy.weights(self.old_weights):
                    v_old = policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2)
                loss, m = nft_loss(
                    v,
                    v_old,
                    v_ref,
                    x0,
                    x_t,
                    t,
                    nft_optimality(adv, scale, cfg.nft_adv_mode),
                    beta=cfg.nft_beta,
                    kl_beta=cfg.beta,
                    adv_clip=scale,
                    kl_rows=gate if gate is not None and bool(gate.any()) else None,  # none gated: all
                )
            else:
                with torch.no_grad(), policy.weights(self.old_weights):
                    v_old = policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2)
                v_ema = None
                if cfg.ema_beta > 0:
                    with torch.no_grad(), policy.weights(self.ema_weights):
                        v_ema = policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2)
                loss, m = awm_loss(
                    v,
                    v_old,
                    eps,
                    x0,
                    t,
                    adv,
                    weighting=cfg.awm_weighting,
                    p=cfg.awm_p,
                    clip_range=cfg.clip_bounds()[0],
                    adv_clip=scale,
                    ref_v=v_ref,
                    beta=cfg.beta,
                    ema_v=v_ema,
                    ema_beta=cfg.ema_beta,
                )
            yield loss, [float(m.get(k, 0.0)) for k in self.metric_keys]


class Preference:
    """Online Diffusion-DPO: the best and worst sample of each group, one shared (t, ε) per pair."""

    metric_keys = (
        "actor/dpo_loss",
        "actor/implicit_acc",
        "actor/rewards/chosen",
        "actor/rewards/rejected",
        "actor/rewards/margins",
    )
    per_chunk = 1
    share = staticmethod(sample_share)
    steps = staticmethod(fixed_steps)

    def __init__(self, policy: FlowPolicy, data: dict[str, Any], sample_cfg: SampleConfig, cfg: Any):
        self.policy, self.data, self.sample_cfg, self.cfg = policy, data, sample_cfg, cfg
        rows = trained_rows(data)  # pairs of trained rows only: never a failed reward
        score = data["advantages"][:, 0] if "advantages" in data else data["reward"]
        groups = list(data["group_id"])
        self.pairs = [
            (rows[best], rows[worst])
            for best, worst in best_worst_pairs(score[rows], [groups[i] for i in rows])
        ]
        if not self.pairs:
            raise UserInputError(
                "--algo dpo: every group has equal rewards, so there is no preference pair to train on"
            )
        self.schedule = policy.sigmas(sample_cfg.steps, sample_cfg.resolution)[:-1].float()
        self.t = torch.zeros(0, dtype=torch.int64)
        self.seed = 0

    def epoch(self, rows: list[int], micro: int, rng: random.Random) -> list[Chunk]:
        order = list(range(len(self.pairs)))  # the pairs are of trained rows (`trained_rows`) already
        if self.cfg.shuffle:
            rng.shuffle(order)
        self.t = torch.tensor([rng.randrange(len(self.schedule)) for _ in self.pairs], dtype=torch.int64)
        self.seed = rng.randrange(2**31)
        return split_chunks(order, max(1, micro // 2))

    def rows_of(self, pair_idx: Chunk) -> Chunk:
        """The rows of a chunk of pairs: w0, l0, w1, l1, ..."""
        return [i for p in pair_idx for i in self.pairs[p]]

    def losses(self, pair_idx: Chunk) -> Iterator[LossItem]:
        policy, scfg = self.policy, self.sample_cfg
        rows = self.rows_of(pair_idx)
        cond = condition(policy, self.data, rows, scfg)
        x0 = self.data["final_latent"][torch.tensor(rows)].to(policy.device).float()
        t = self.schedule[self.t[torch.tensor(pair_idx)]].repeat_interleave(2).to(policy.device)
        eps = (
            _noise(self.seed, pair_idx, 0, tuple(x0.shape[1:])).repeat_interleave(2, dim=0).to(policy.device)
        )
        x_t = _interpolate(x0, eps, t)
        err = fm_error(policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2), eps, x0)
        with torch.no_grad(), policy.reference():
            ref = fm_error(policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2), eps, x0)
        loss, m = diffusion_dpo_loss(err[0::2], err[1::2], ref[0::2], ref[1::2], beta=self.cfg.dpo_beta)
        yield loss, [float(m.get(k, 0.0)) for k in self.metric_keys]


class GroupPreference:
    """DGPO: each micro-batch holds whole groups (packed up to --micro-batch rows, at least one group), so
    a group's preference weight needs no other micro-batch or rank. Per epoch, `--train-timesteps`
    schedule indices are drawn without replacement from the first int(N·--timestep-fraction) (all rows
    share them, as the reference); at each, the rows of a group share one ε."""

    metric_keys = (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/fm_loss",
        "actor/pg_clipfrac",
        "actor/group_weight_mean",
    )
    share = staticmethod(sample_share)
    steps = staticmethod(fixed_steps)
    rows_of = staticmethod(chunk_rows)

    def __init__(
        self,
        policy: FlowPolicy,
        data: dict[str, Any],
        sample_cfg: SampleConfig,
        cfg: Any,
        *,
        old_weights: dict[str, torch.Tensor] | None,
    ):
        self.policy, self.data, self.sample_cfg, self.cfg = policy, data, sample_cfg, cfg
        if "group_id" not in data:
            raise UserInputError(
                "--algo dgpo needs the column 'group_id' in --in (the samples of `omnirl sample`)"
            )
        numbers: dict[str, int] = {}
        self.group = [numbers.setdefault(g, len(numbers)) for g in data["group_id"]]  # row → group number
        self.schedule = policy.sigmas(sample_cfg.steps, sample_cfg.resolution)[:-1].float()
        self.old_weights = old_weights
        self.plan: list[int] = []
        self.seed = 0

    def epoch(self, rows: list[int], micro: int, rng: random.Random) -> list[Chunk]:
        members: dict[int, list[int]] = {}
        for r in rows:  # groups in the order of their first row
            members.setdefault(self.group[r], []).append(r)
        chunks: list[Chunk] = []
        for block in members.values():
            if chunks and len(chunks[-1]) + len(block) <= micro:
                chunks[-1].extend(block)
            else:
                chunks.append(list(block))
        pool = max(1, int(len(self.schedule) * self.cfg.timestep_fraction))
        self.plan = rng.sample(range(pool), min(self.cfg.timesteps(), pool))
        self.seed = rng.randrange(2**31)
        return chunks

    @property
    def per_chunk(self) -> int:
        return len(self.plan)

    def losses(self, idx: Chunk) -> Iterator[LossItem]:
        policy, cfg, scfg = self.policy, self.cfg, self.sample_cfg
        cond = condition(policy, self.data, idx, scfg)
        index = torch.tensor(idx)
        x0 = self.data["final_latent"][index].to(policy.device).float()
        adv = self.data["advantages"][index, 0].to(policy.device).float()
        groups = [self.group[i] for i in idx]
        for col, j in enumerate(self.plan):
            t = self.schedule[j].expand(len(idx)).to(policy.device)
            eps = _noise(self.seed, groups, col, tuple(x0.shape[1:])).to(policy.device)
            x_t = _interpolate(x0, eps, t)
            v = policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2)
            with torch.no_grad():
                with policy.reference():
                    v_ref = policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2)
                with policy.weights(self.old_weights):
                    v_old = policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2)
            loss, m = dgpo_loss(
                v,
                v_ref,
                v_old,
                eps,
                x0,
                adv,
                torch.tensor(groups, device=policy.device),
                beta=cfg.dgpo_beta,
                clip_range=cfg.clip_bounds()[0],
                adv_clip=cfg.advantage_clip(),
                kl_beta=cfg.beta,
            )
            yield loss, [m[k] for k in self.metric_keys]
