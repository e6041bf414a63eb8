"""The token objective of text/VLM responses (grpo, dapo, gspo): `TokenPolicyGradient` replays the
response tokens' log-probs under the trained weights and applies verl's clipped token objective + KL +
entropy (token_losses.py), with the load-balancing loss of a mixture-of-experts model.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch

from stages.errors import UserInputError
from stages.models.vlm import VLMPolicy
from stages.update.chunks import Chunk, LossItem, chunk_rows, fixed_steps, split_chunks
from stages.update.losses import Algorithm
from stages.update.rollout_correction import WEIGHTS
from stages.update.token_losses import grpo_loss


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
        self.plan: list[list[list[Chunk]]] = []  # the last epoch's steps (`steps`)
        if cfg.micro_batch_tokens:
            from stages.update.balance import row_tokens, warn_over_budget

            warn_over_budget(row_tokens(data), cfg.micro_batch_tokens)
        self.router = policy.moe
        if self.router:  # MoE: expert loads in the metrics, the configured load-balancing loss
            from stages.models import moe

            config = policy.module.config
            text = config.get_text_config()
            self.aux_coef = moe.aux_loss_coef(config, getattr(cfg, "router_aux_loss_coef", None))
            self.experts = (int(text.num_experts), int(text.num_experts_per_tok))
            self.metric_keys = (*type(self).metric_keys, *moe.metric_keys(moe.sparse_layers(text)))

    def epoch(self, rows: list[int], micro: int, rng: random.Random) -> list[Chunk]:
        """The micro-batches of one pass, `micro` rows each, grad_accum per rank and optimizer step; with
        --balance-tokens each step's rows are re-dealt by token count to the ranks, then over each
        rank's micro-batches (`balance.deal`); with --micro-batch-tokens each rank's rows of a step are
        regrouped into as many micro-batches as the token budget needs, the same number on every rank
        (`balance.equal_counts`). Records the steps (`steps`) and each chunk's share of its step's token
        and sequence counts, so the loss normalisation is the same however the rows are dealt."""
        from stages.dist import data_parallel

        chunks = split_chunks(rows, micro)
        dp = data_parallel()[0]
        accum = self.cfg.accumulation(micro, dp)
        per_step = accum * dp
        self.plan = []
        for first in range(0, len(chunks), per_step):
            step = chunks[first : first + per_step]
            if self.cfg.balance_tokens:
                step = self._deal(step, dp if len(step) == per_step else 1)
            (ranks,) = fixed_steps(step, accum, dp)
            self.plan.append(self._budget(ranks) if self.cfg.micro_batch_tokens else ranks)
        mask = self.data["response_mask"].bool()
        for ranks in self.plan:
            step = [c for chunks in ranks for c in chunks]
            step_rows = torch.tensor([i for c in step for i in c])
            tokens = float(mask[step_rows].sum())
            seqs = float((mask[step_rows].sum(-1) > 0).sum())
            for c in step:
                self.counts[c[0]] = (tokens / len(step), seqs / len(step))
        return [c for ranks in self.plan for chunks in ranks for c in chunks]

    def steps(self, chunks: list[Chunk], accum: int, ranks: int) -> list[list[list[Chunk]]]:
        """The optimizer steps `epoch` laid `chunks` out as, each as its ranks' micro-batches."""
        return self.plan

    def _deal(self, step: list[Chunk], ranks: int) -> list[Chunk]:
        """One optimizer step's rows dealt over `ranks` shares of as many micro-batches as it has, by token
        count; a short last step (fewer micro-batches than the ranks' slots) as one share."""
        from stages.update.balance import deal, row_tokens

        rows = [i for c in step for i in c]
        return [
            [rows[k] for k in group] for group in deal(row_tokens(self.data, rows), ranks, len(step) // ranks)
        ]

    def _budget(self, ranks: list[list[Chunk]]) -> list[list[Chunk]]:
        """Each rank's rows of a step regrouped into micro-batches of at most --micro-batch-tokens tokens,
        as many on every rank as its rows allow (`balance.equal_counts`)."""
        from stages.update.balance import equal_counts, row_tokens

        shares = [[i for c in chunks for i in c] for chunks in ranks]
        groups = equal_counts([row_tokens(self.data, rows) for rows in shares], self.cfg.micro_batch_tokens)
        return [[[rows[k] for k in g] for g in gs] for rows, gs in zip(shares, groups, strict=True)]

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
