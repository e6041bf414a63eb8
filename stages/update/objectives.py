"""What `update` minimises, per `--algo`: one objective object per family, one shared optimizer loop.

An objective splits the data into micro-batches ("chunks") each epoch and yields, for a chunk, the
losses whose mean is its contribution (e.g. one per trained step), each with fixed metric values.
`steps(chunks, accum, ranks)` lays an epoch's chunks out as optimizer steps, each as its ranks' lists of
chunks (`fixed_steps`: grad_accum each; the token objective's `--micro-batch-tokens`: as many as the
tokens need). `share(idx, step, slots)` says what a chunk's mean loss weighs in its optimizer step
(`step`: the step's chunks over all ranks, `slots`: their number): its share of the step's samples, so
a short last step or a short chunk is weighed exactly (for the token objective, 1/slots: its loss is
already normalised by the step's token or sequence count, verl's global token-mean).

The chunks and their weighing are chunks.py's; each family is its own module:

- `PolicyGradient` (policy_gradient.py; flow_grpo, dance_grpo, mix_grpo, grpo_guard, flow_dppo): replays
  stored SDE steps under the trained weights (`samplers.step` with the stored x'), clipped ratio
  objective (flow_dppo: its KL trust region) + β·KL (losses.py, family_losses.py).
- `ForwardProcess` (forward_objectives.py, as the next two; nft, awm): fresh noise on the final latent
  x0, x_t = (1−t)·x0 + t·ε at schedule timesteps; DiffusionNFT's implicit-policy loss or
  Advantage-Weighted Matching (family_losses.py).
- `Preference` (dpo): best and worst sample of each group as a pair, sharing t and ε; Diffusion-DPO
  against the frozen reference.
- `GroupPreference` (dgpo): whole groups per micro-batch, one ε per group and timestep; DGPO's group
  preference against the frozen reference (family_losses.py).
- `TokenPolicyGradient` (token_objective.py; grpo, dapo, gspo): text/VLM responses, token log-probs
  replayed under the trained weights, verl's clipped token objective + KL + entropy (token_losses.py).
"""

from __future__ import annotations

from typing import Any

import torch

from stages.models.diffusion import FlowPolicy
from stages.models.vlm import VLMPolicy
from stages.sample.rollout import SampleConfig
from stages.update.forward_objectives import ForwardProcess, GroupPreference, Preference
from stages.update.losses import Algorithm
from stages.update.policy_gradient import PolicyGradient
from stages.update.token_objective import TokenPolicyGradient


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
