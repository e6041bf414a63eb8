"""The VLM policy on the tiny Qwen2.5-VL: sampling, and replaying a response reproduces its rollout log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from stages.models.vlm import VLMPolicy


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stages.models.factory import init_model

    out = tmp_path_factory.mktemp("vlm") / "qwen2_5_vl-tiny"
    init_model("qwen2_5_vl", out, size="tiny", seed=0)
    return out


def _prompt(policy: VLMPolicy) -> dict[str, torch.Tensor]:
    red = Image.new("RGB", (56, 56), (220, 20, 20))
    wide = Image.new("RGB", (112, 56), (20, 20, 220))
    return policy.chat_inputs(["What colour is the square?", "Is the picture wide?"], [[red], [wide]])


def test_replay_reproduces_rollout_log_probs(tiny_vlm: Path) -> None:
    policy = VLMPolicy.load(tiny_vlm)
    prompt = _prompt(policy)
    assert "mm_token_type_ids" in prompt and (prompt["mm_token_type_ids"] == 1).any()
    roll = policy.generate(prompt, n=2, temperature=0.9, max_new_tokens=8, seed=3)
    assert roll.response_ids.shape[0] == 4 and roll.prompt_index == [0, 0, 1, 1] and len(roll.text) == 4
    assert roll.response_mask[:, 0].all()
    with torch.no_grad():
        replay = policy.response_log_probs(
            policy.expand(prompt, 2), roll.response_ids, roll.response_mask, 0.9
        )
    diff = (replay - roll.log_probs).abs()[roll.response_mask]
    assert float(diff.max()) < 1e-5
    again = policy.generate(prompt, n=2, temperature=0.9, max_new_tokens=8, seed=3)
    assert torch.equal(again.response_ids, roll.response_ids)  # seeded sampling is reproducible


def test_lora_trains_only_the_language_model(tiny_vlm: Path) -> None:
    policy = VLMPolicy.load(tiny_vlm)
    policy.add_lora(rank=4, alpha=8)
    params = policy.trainable_parameters()
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert params and all("lora_" in n and "visual" not in n for n in names)
    prompt = _prompt(policy)
    roll = policy.generate(prompt, n=1, max_new_tokens=4)
    logp = policy.response_log_probs(prompt, roll.response_ids, roll.response_mask)
    (-(logp * roll.response_mask).sum()).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
