"""What `update` minimises, per `--algo`: one objective object per family, one shared optimizer loop.

An objective splits the data into micro-batches ("chunks") each epoch and yields, for a chunk, the
losses whose mean is its contribution (e.g. one per trained step), each with fixed metric values.
`share(idx, step, slots)` says what a chunk's mean loss weighs in its optimizer step (`step`: the step's
chunks over all ranks, `slots`: grad_accum × world): its share of the step's samples, so a short last
step or a short chunk is weighed exactly (for the token objective, 1/slots: its loss is already
normalised by the step's token or sequence count, verl's global token-mean).

- `PolicyGradient` (flow_grpo, dance_grpo, mix_grpo, grpo_guard, flow_dppo): replays stored SDE steps
  under the trained weights (`samplers.step` with the stored x'), clipped ratio objective (flow_dppo: its
  KL trust region) + β·KL (losses.py, family_losses.py).
- `ForwardProcess` (nft, awm): fresh noise on the final latent x0, x_t = (1−t)·x0 + t·ε at schedule
  timesteps; DiffusionNFT's implicit-policy loss or Advantage-Weighted Matching (family_losses.py).
- `Preference` (dpo): best and worst sample of each group as a pair, sharing t and ε; Diffusion-DPO
  against the frozen reference.
- `GroupPreference` (dgpo): whole groups per micro-batch, one ε per group and timestep; DGPO's group
  preference against the frozen reference (family_losses.py).
- `TokenPolicyGradient` (grpo, dapo, gspo): text/VLM responses, token log-probs replayed under the
  trained weights, verl's clipped token objective + KL + entropy (token_losses.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch

from stages.advantage.estimators import best_worst_pairs, nft_optimality
from stages.advantage.gardo import GATE_COLUMN
from stages.errors import UserInputError
from stages.models.diffusion import FlowPolicy
from stages.models.vlm import VLMPolicy
from stages.sample.rollout import SampleConfig
from stages.sample.samplers import kl_to_reference, step
from stages.update.family_losses import (
    awm_loss,
    dgpo_loss,
    diffusion_dpo_loss,
    flow_dppo_loss,
    fm_error,
    grpo_guard_loss,
    nft_loss,
)
from stages.update.losses import Algorithm, clipped_policy_loss, kl_std, ratio_metrics, step_plan
from stages.update.rollout_correction import WEIGHTS
from stages.update.rows import trained_rows
from stages.update.token_losses import grpo_loss

Chunk = list[int]
LossItem = tuple[torch.Tensor, list[float]]
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


def _condition(policy: FlowPolicy, data: dict[str, Any], idx: Chunk, sample_cfg: SampleConfig) -> Any:
    prompts = [data["prompt"][i] for i in idx]
    negatives = [data["negative_prompt"][i] for i in idx] if "negative_prompt" in data else None
    images = policy.images_of([data["group_id"][i] for i in idx]) if "group_id" in data else None
    return policy.encode(
        prompts, negatives, policy.needs_negative(sample_cfg.guidance), sample_cfg.max_sequence_length, images
    )


def sample_share(idx: Chunk, step: list[Chunk], slots: int) -> float:
    """The chunk's share of the samples of its optimizer step (its loss is a mean over its samples)."""
    return len(idx) / sum(len(c) for c in step)


def chunk_rows(idx: Chunk) -> Chunk:
    """The data rows a chunk reads: the chunk itself, for objectives whose chunks are row numbers."""
    return idx


def _chunks(order: list[int], size: int) -> list[Chunk]:
    return [order[i : i + size] for i in range(0, len(order), size)]


def _reference(policy: FlowPolicy, weights: dict[str, torch.Tensor] | None) -> Any:
    """The context the KL reference runs in: GARDO's reset weights when set, else the base model."""
    return policy.weights(weights) if weights is not None else policy.reference()


def _gate(data: dict[str, Any], index: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """GARDO's `kl_gate` of the micro-batch's rows, bool [B]; None when the advantages carry no gate."""
    if GATE_COLUMN not in data:
        return None
    return torch.as_tensor(data[GATE_COLUMN])[index].to(device).bool()


def _gated(kl: torch.Tensor, data: dict[str, Any], index: torch.Tensor) -> torch.Tensor | None:
    """The KL rows to penalise: the gated ones when the advantages carry GARDO's gate (None when it marks
    none of this micro-batch: no KL term, as the reference's Flow-GRPO), else all [B]."""
    gate = _gate(data, index, kl.device)
    if gate is None:
        return kl
    return kl[gate] if bool(gate.any()) else None


class PolicyGradient:
    """Clipped-ratio objectives over the stored steps of a rollout.

    flow_dppo's rollout means are the `old_means` column when given, else replayed under `old_weights`
    (the weights the update starts from)."""

    share = staticmethod(sample_share)
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
        chunks = _chunks(rows, micro)
        self.plan = step_plan(
            self.algo, self.data["latents"].shape[0], num_steps, self.cfg.timestep_fraction, rng
        )
        return chunks

    @property
    def per_chunk(self) -> int:
        return self.plan.shape[1]

    def losses(self, idx: Chunk) -> Iterator[LossItem]:
        cond = _condition(self.policy, self.data, idx, self.sample_cfg)
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
                with torch.no_grad(), _reference(policy, self.ref_weights):
                    ref_mean = replay(policy.velocity(x, s, cond, scfg.guidance, scfg.guidance_2)).mean
            kl = kl_to_reference(out.mean, ref_mean, kl_std(scfg.sampler, out.diffusion, out.std))
            kl = _gated(kl, data, index)
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
        return _chunks(rows, micro)

    @property
    def per_chunk(self) -> int:
        return self.plan.shape[1]

    def losses(self, idx: Chunk) -> Iterator[LossItem]:
        policy, cfg, scfg = self.policy, self.cfg, self.sample_cfg
        cond = _condition(policy, self.data, idx, scfg)
        index = torch.tensor(idx)
        x0 = self.data["final_latent"][index].to(policy.device).float()
        adv = self.data["advantages"][index, 0].to(policy.device).float()
        gate = _gate(self.data, index, policy.device)  # GARDO's rows of the NFT KL (AWM: all)
        scale = cfg.advantage_clip()  # DiffusionNFT and AWM normalise advantages by their clip
        for col in range(self.per_chunk):
            t = self.schedule[self.plan[index, col]].to(policy.device)
            eps = _noise(self.seed, idx, col, tuple(x0.shape[1:])).to(policy.device)
            x_t = _interpolate(x0, eps, t)
            v = policy.velocity(x_t, t, cond, scfg.guidance, scfg.guidance_2)
            v_ref = None
            if cfg.beta > 0:
                with torch.no_grad(), _reference(policy, self.ref_weights):
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
        return _chunks(order, max(1, micro // 2))

    def rows_of(self, pair_idx: Chunk) -> Chunk:
        """The rows of a chunk of pairs: w0, l0, w1, l1, ..."""
        return [i for p in pair_idx for i in self.pairs[p]]

    def losses(self, pair_idx: Chunk) -> Iterator[LossItem]:
        policy, scfg = self.policy, self.sample_cfg
        rows = self.rows_of(pair_idx)
        cond = _condition(policy, self.data, rows, scfg)
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
        cond = _condition(policy, self.data, idx, scfg)
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


class TokenPolicyGradient:
    """GRPO / DAPO / GSPO on text responses: the response tokens replayed under the trained weights.

    One loss per micro-batch (`token_losses.grpo_loss`). The aggregation counts tokens (or
    sequences) over the whole optimizer step, all ranks included, so a step's loss is the
    aggregate of its mini-batch however it is split into micro-batches (verl's global token-mean).
    """

    metric_keys = (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/ratio_mean",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_dual",
        "actor/ppo_kl",
    )
    per_chunk = 1
    rows_of = staticmethod(chunk_rows)

    @staticmethod
    def share(idx: Chunk, step: list[Chunk], slots: int) -> float:
        """1/slots: the loss is normalised by the step's counts per slot (see `epoch`)."""
        return 1.0 / slots

    def __init__(self, policy: VLMPolicy, data: dict[str, Any], sample_cfg: Any, cfg: Any, algo: Algorithm):
        from stages.sample.vlm_stage import row_media, row_prompts

        self.policy, self.data, self.sample_cfg, self.cfg, self.algo = policy, data, sample_cfg, cfg, algo
        self.old = data.get("old_log_probs", data.get("log_probs"))
        if self.old is None:
            raise UserInputError(
                "--in: neither old_log_probs (omnirl logprob) nor log_probs (omnirl sample) is present"
            )
        self.media = row_media(data, "--in")
        self.prompts = row_prompts(data)
        self.low, self.high = cfg.clip_bounds()
        self.mode = cfg.loss_agg_mode or "token-mean"
        self.counts: dict[int, tuple[float, float]] = {}
        self.router = policy.moe
        if self.router:  # MoE: expert loads in the metrics, the configured load-balancing loss
            from stages.models import moe

            config = policy.module.config
            text = config.get_text_config()
            self.aux_coef = moe.aux_loss_coef(config, getattr(cfg, "router_aux_loss_coef", None))
            self.experts = (int(text.num_experts), int(text.num_experts_per_tok))
            self.metric_keys = (*type(self).metric_keys, *moe.metric_keys(moe.sparse_layers(text)))

    def epoch(self, rows: list[int], micro: int, rng: random.Random) -> list[Chunk]:
        """The micro-batches of one pass, `micro` rows each; with --balance-tokens each optimizer step's
        rows are re-dealt by token count to the ranks, then over each rank's micro-batches
        (`balance.deal`). Also records each chunk's share of its step's token and sequence
        counts, so the loss normalisation is the same however the rows are dealt."""
        from stages.dist import data_parallel

        chunks = _chunks(rows, micro)
        dp = data_parallel()[0]
        per_step = self.cfg.accumulation(micro, dp) * dp
        mask = self.data["response_mask"].bool()
        if self.cfg.balance_tokens:
            chunks = [
                c
                for first in range(0, len(chunks), per_step)
                for c in self._deal(
                    chunks[first : first + per_step], dp if len(chunks) - first >= per_step else 1
                )
            ]
        for first in range(0, len(chunks), per_step):
            step_rows = torch.tensor([i for c in chunks[first : first + per_step] for i in c])
            tokens = float(mask[step_rows].sum())
            seqs = float((mask[step_rows].sum(-1) > 0).sum())
            for c in chunks[first : first + per_step]:
                self.counts[c[0]] = (tokens / per_step, seqs / per_step)
        return chunks

    def _deal(self, step: list[Chunk], ranks: int) -> list[Chunk]:
        """One optimizer step's rows dealt over `ranks` shares of as many micro-batches as it has, by token
        count (prompt + response tokens: what a forward computes); a short last step (fewer micro-batches
        than the ranks' slots) as one share."""
        from stages.update.balance import deal

        rows = [i for c in step for i in c]
        index = torch.tensor(rows)
        tokens = (
            self.data["prompt_mask"][index].sum(-1) + self.data["response_mask"][index].sum(-1)
        ).tolist()
        return [[rows[k] for k in group] for group in deal(tokens, ranks, len(step) // ranks)]

    def losses(self, idx: Chunk) -> Iterator[LossItem]:
        from stages.sample.vlm_stage import prompt_inputs, response_batch

        policy, data, cfg = self.policy, self.data, self.cfg
        index = torch.tensor(idx)
        inputs = prompt_inputs(
            policy,
            [self.prompts[i] for i in idx],
            [self.media[i] for i in idx],
            data["prompt_ids"][index],
            data["prompt_mask"][index],
            "--in",
        )
        tokens, mask = response_batch(
            {"response_ids": data["response_ids"][index], "response_mask": data["response_mask"][index]},
            policy.device,
        )
        width = tokens.shape[1]
        temperature = self.sample_cfg.temperature
        bonus = cfg.entropy_coef != 0
        forward = policy.response_forward(
            inputs, tokens, mask, temperature, entropy=True, entropy_grad=bonus, router=self.router
        )
        logp, entropy = forward.log_probs, forward.entropy
        ref = None
        if cfg.beta != 0 and "ref_log_probs" in data:
            ref = data["ref_log_probs"][index, :width].to(policy.device)
        elif cfg.beta != 0:
            with torch.no_grad(), policy.reference():
                ref = policy.response_log_probs(inputs, tokens, mask, temperature)
        adv = data["advantages"][index].reshape(len(idx), -1)[:, 0].to(policy.device).float()
        bound = cfg.advantage_clip()
        if bound is not None:
            adv = adv.clamp(-bound, bound)
        num_tokens, num_seqs = self.counts[idx[0]]
        weights = data[WEIGHTS][index, :width].to(policy.device) if WEIGHTS in data else None
        loss, m = grpo_loss(
            logp,
            self.old[index, :width].to(policy.device).float(),
            adv,
            mask,
            ref_logp=ref,
            entropy=entropy,
            kl_coef=cfg.beta,
            kl_kind=cfg.kl_type,
            entropy_coef=cfg.entropy_coef,
            clip_low=self.low,
            clip_high=self.high,
            dual_clip_c=cfg.dual_clip_c(),
            ratio_type=self.algo.ratio,
            agg_mode=self.mode,
            norm_len=data["response_ids"].shape[1],
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            weights=weights,
        )
        keys = ("pg_loss", "kl_loss", "entropy", "ratio_mean", "pg_clipfrac", "pg_clipfrac_dual", "ppo_kl")
        values = [float(m.get(k, 0.0)) for k in keys]
        if self.router:
            loss, extra = self._router_terms(loss, forward)
            values += [extra[k] for k in self.metric_keys[len(values) :]]
        yield loss, values

    def _router_terms(self, loss: torch.Tensor, forward: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss plus `aux_coef`·load-balancing loss, and the `moe/*` metrics of this micro-batch."""
        from stages.models import moe

        logits, mask = forward.router_logits, forward.attention_mask
        aux = moe.aux_loss(logits, mask, *self.experts)
        metrics = {
            **moe.load_metrics(moe.expert_load(logits, mask, self.experts[1])),
            "moe/aux_loss": float(aux.detach()),
        }
        return (loss + self.aux_coef * aux if self.aux_coef else loss), metrics


def make_objective(
    policy: FlowPolicy | VLMPolicy,
    data: dict[str, Any],
    sample_cfg: SampleConfig,
    cfg: Any,
    algo: Algorithm,
    *,
    old_weights: dict[str, torch.Tensor] | None = None,
    ema_weights: dict[str, torch.Tensor] | None = None,
    ref_weights: dict[str, torch.Tensor] | None = None,
) -> Any:
    """The objective of `algo` over `data`; `ref_weights` (GARDO's reset reference) replaces the base
    model as the KL reference of the diffusion policy-gradient and forward-process families."""
    if algo.family == "token":
        return TokenPolicyGradient(policy, data, sample_cfg, cfg, algo)
    if algo.family == "policy_gradient":
        return PolicyGradient(policy, data, sample_cfg, cfg, algo, ref_weights, old_weights=old_weights)
    if algo.family == "forward":
        return ForwardProcess(
            policy,
            data,
            sample_cfg,
            cfg,
            algo,
            old_weights=old_weights,
            ema_weights=ema_weights,
            ref_weights=ref_weights,
        )
    if algo.family == "group":
        return GroupPreference(policy, data, sample_cfg, cfg, old_weights=old_weights)
    return Preference(policy, data, sample_cfg, cfg)
