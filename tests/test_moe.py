"""MoE routing on the tiny Qwen3-Omni thinker: expert-load statistics and the load-balancing loss against
hand computations, the loss weight as the config defines it, and the replay routing every token to the
experts the rollout chose."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3OmniMoeThinkerConfig

from stages.models import moe
from stages.models.vlm import VLMPolicy
from stages.models.vlm_inputs import response_inputs


def test_expert_load_and_its_statistics_by_hand() -> None:
    # top-2 of 4: token 0 -> {0, 1}, token 1 -> {1, 2}, token 2 -> {3, 0}; token 3 is padding
    logits = torch.tensor([[4.0, 3, 0, 0], [0, 5, 4, 0], [1, 0, 0, 9], [9, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    load = moe.expert_load((logits, logits.flip(-1)), mask, top_k=2)
    assert load.tolist()[0] == pytest.approx([2 / 6, 2 / 6, 1 / 6, 1 / 6])
    assert load.tolist()[1] == pytest.approx([1 / 6, 1 / 6, 2 / 6, 2 / 6])
    metrics = moe.load_metrics(load)
    entropy = -(2 * (1 / 3) * math.log(1 / 3) + 2 * (1 / 6) * math.log(1 / 6)) / math.log(4)
    assert metrics["moe/load_entropy"] == pytest.approx(entropy)
    assert metrics["moe/load_entropy/layer1"] == pytest.approx(entropy)
    assert metrics["moe/max_load"] == pytest.approx(1 / 3)
    assert set(metrics) | {"moe/aux_loss"} == set(moe.metric_keys(2))
    balanced = moe.load_metrics(torch.full((1, 4), 0.25))
    assert balanced["moe/load_entropy"] == pytest.approx(1.0) and balanced["moe/max_load"] == 0.25


def test_aux_loss_is_the_switch_transformer_loss_over_valid_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    layers = tuple(torch.randn(2 * 5, 4, generator=gen) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])
    valid = mask.reshape(-1).bool().numpy()
    counts, probs = np.zeros(4), np.zeros(4)
    for logits in layers:
        x = logits.numpy()[valid]
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        for row in np.argsort(-p, axis=-1)[:, :2]:
            counts[row] += 1
        probs += p.sum(0)
    tokens = len(layers) * valid.sum()
    expected = 4 * float(np.sum(counts / tokens * probs / tokens))
    assert float(moe.aux_loss(layers, mask, 4, 2)) == pytest.approx(expected, rel=1e-5)


def test_aux_loss_weight_follows_the_config_unless_given() -> None:
    off = Qwen3OmniMoeThinkerConfig(text_config={"router_aux_loss_coef": 0.02})
    on = Qwen3OmniMoeThinkerConfig(text_config={"router_aux_loss_coef": 0.02, "output_router_logits": True})
    assert moe.aux_loss_coef(off, None) == 0.0
    assert moe.aux_loss_coef(on, None) == 0.02
    assert moe.aux_loss_coef(off, 0.5) == 0.5 and moe.aux_loss_coef(on, 0.0) == 0.0
    assert moe.sparse_layers(off.text_config) == off.text_config.num_hidden_layers
    sparse = Qwen3OmniMoeThinkerConfig(
        text_config={"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    assert moe.sparse_layers(sparse.text_config) == 2  # layers 1 and 5 (3 is dense)


def _turns() -> list[list[dict]]:
    return [
        [{"role": "user", "content": "What is two plus two?"}],
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What do you hear?"}]}],
    ]


def test_replay_routes_every_token_to_the_rollouts_experts(tiny_omni: Path) -> None:
    """The routers' top-k choices while sampling (prefill, then one token per step with a KV cache) are
    the choices of the replay's single forward, for every prompt and response token."""
    policy = VLMPolicy.load(tiny_omni)
    clip = (np.random.default_rng(0).standard_normal(8000) * 0.1).astype(np.float32)
    prompt = policy.chat_inputs(_turns(), [[], []], audios=[[], [clip]])
    top_k = policy.module.config.text_config.num_experts_per_tok
    routers = [m for name, m in policy.module.named_modules() if name.endswith("mlp.gate")]
    assert len(routers) == policy.module.config.text_config.num_hidden_layers
    calls: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [
        router.register_forward_hook(lambda _m, _a, out, k=k: calls[k].append(out[2].sort(-1).values))
        for k, router in enumerate(routers)
    ]
    try:
        roll = policy.generate(prompt, n=2, max_new_tokens=6, seed=1)
    finally:
        for hook in hooks:
            hook.remove()
    rows, length = roll.response_ids.shape[0], prompt["input_ids"].shape[1]
    replay_prompt = policy.chat_inputs(
        [t for t in _turns() for _ in range(2)], [[]] * 4, audios=[[], [], [clip], [clip]]
    )
    with torch.no_grad():
        out = policy.response_forward(replay_prompt, roll.response_ids, roll.response_mask, router=True)
    assert float((out.log_probs - roll.log_probs).abs()[roll.response_mask].max()) <= 1e-5
    valid = torch.cat([replay_prompt["attention_mask"].bool(), roll.response_mask], dim=1)
    for k, logits in enumerate(out.router_logits):
        replayed = logits.topk(top_k, dim=-1).indices.sort(-1).values.reshape(rows, -1, top_k)
        # sampling: the prefill routes the prompt tokens, step t the response token t-1
        sampled = torch.cat(
            [calls[k][0].reshape(rows, length, top_k), *(c.reshape(rows, 1, top_k) for c in calls[k][1:])],
            dim=1,
        )
        width = sampled.shape[1]  # the last response token is never fed back
        check = valid[:, :width]
        assert torch.equal(sampled[check], replayed[:, :width][check])
    load = moe.expert_load(out.router_logits, out.attention_mask, top_k)
    assert torch.allclose(load.sum(-1), torch.ones(len(routers)))
    with torch.no_grad():
        own = policy.model(
            **response_inputs(replay_prompt, roll.response_ids, roll.response_mask),
            output_router_logits=True,
        ).aux_loss
    e = policy.module.config.text_config.num_experts
    assert float(moe.aux_loss(out.router_logits, out.attention_mask, e, top_k)) == pytest.approx(float(own))
