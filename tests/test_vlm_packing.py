"""Packed sequences in the VLM forward (`vlm_inputs.pack_inputs`): every row's real tokens back to back, no
padding, its M-RoPE positions those of the padded batch. On a batch mixing a text-only prompt, an
image and a video with responses of different lengths, packed equals padded within 1e-5 for the
response log-probs, the entropies, the GRPO loss and the LoRA gradients, for Qwen2.5-VL and Qwen3-VL
(dense and MoE, whose router loads and load-balancing loss match too);
auto packs only with a variable-length (flash) attention kernel; the Qwen3-Omni thinker cannot pack
and is refused in one line when packing is asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stages.errors import UserInputError
from stages.models.vlm import VLMPolicy
from stages.update.token_losses import grpo_loss


def picture(seed: int, size: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def mixed_batch(policy: VLMPolicy) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Prompts: text only, one image, a 3-frame video; responses of 7, 3 and 5 tokens (right-padded)."""
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    video = [{"role": "user", "content": [{"type": "video", "fps": 2.0}, {"type": "text", "text": "Why?"}]}]
    frames = [picture(10 + k) for k in range(3)]
    prompt = policy.chat_inputs(
        ["Say something long about colours.", image, video],
        [[], [picture(1, 84)], []],
        videos=[[], [], [frames]],
    )
    lengths = torch.tensor([7, 3, 5])
    mask = torch.arange(7)[None] < lengths[:, None]
    ids = torch.randint(10, 200, (3, 7), generator=torch.Generator().manual_seed(0))
    return prompt, ids.masked_fill(~mask, policy.pad_id), mask


@pytest.mark.parametrize("family", ["tiny_vlm", "tiny_qwen3_vl", "tiny_qwen3_vl_moe"])
def test_packed_equals_padded_log_probs_loss_and_gradients(
    family: str, request: pytest.FixtureRequest
) -> None:
    policy = VLMPolicy.load(request.getfixturevalue(family))
    policy.add_lora(rank=4, seed=0)
    params = policy.trainable_parameters()
    with torch.no_grad():  # a non-zero LoRA B, so the adapter shapes the outputs and has A gradients
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(name) % 2**31))
    prompt, ids, mask = mixed_batch(policy)
    results = {}
    for mode in ("off", "on"):
        policy.use_packing(mode)
        out = policy.response_forward(prompt, ids, mask, 0.8, entropy=True)
        old = out.log_probs.detach() + 0.05 * torch.arange(7)[None].float() / 7
        loss, _ = grpo_loss(
            out.log_probs, old, torch.tensor([1.0, -0.5, 0.3]), mask, entropy=out.entropy, entropy_coef=0.01
        )
        grads = torch.autograd.grad(loss, params)
        results[mode] = (out.log_probs.detach(), out.entropy.detach(), loss.detach(), grads)
    padded, packed = results["off"], results["on"]
    assert float(padded[0][mask].abs().min()) > 0.1  # real log-probs, not zeros
    torch.testing.assert_close(packed[0][mask], padded[0][mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[1][mask], padded[1][mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[2], padded[2], rtol=0, atol=1e-5)
    assert max(float(g.abs().max()) for g in padded[3]) > 1e-3
    for a, b in zip(packed[3], padded[3]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_packed_moe_routes_as_padded(tiny_qwen3_vl_moe: Path) -> None:
    """The MoE variant's router logits over the packed tokens give the padded forward's expert loads
    and load-balancing loss."""
    from stages.models import moe

    policy = VLMPolicy.load(tiny_qwen3_vl_moe)
    prompt, ids, mask = mixed_batch(policy)
    text = policy.module.config.get_text_config()
    assert policy.moe and (text.num_experts, text.num_experts_per_tok) == (4, 2)
    results = {}
    for mode in ("off", "on"):
        policy.use_packing(mode)
        out = policy.response_forward(prompt, ids, mask, router=True)
        aux = moe.aux_loss(out.router_logits, out.attention_mask, 4, 2)
        results[mode] = (moe.expert_load(out.router_logits, out.attention_mask, 2), float(aux))
    assert results["on"][0].shape == (2, 4) and float(results["on"][0].min()) > 0
    torch.testing.assert_close(results["on"][0], results["off"][0], rtol=0, atol=1e-6)
    assert results["on"][1] == pytest.approx(results["off"][1], rel=1e-6) and results["on"][1] > 1


def test_auto_packs_where_the_model_can_and_attends_with_a_variable_length_kernel(
    tiny_vlm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = VLMPolicy.load(tiny_vlm)
    assert policy.can_pack and not policy.varlen_attention and not policy.packed  # sdpa: a dense mask
    policy.use_packing("on")
    assert policy.packed
    monkeypatch.setattr(policy.module.config, "_attn_implementation", "flash_attention_2")
    policy.use_packing("auto")
    assert policy.varlen_attention and policy.packed
    policy.use_packing("off")
    assert not policy.packed


def test_packing_is_refused_in_one_line_for_a_model_that_cannot(tiny_omni: Path) -> None:
    policy = VLMPolicy.load(tiny_omni)
    assert not policy.can_pack and not policy.packed
    policy.use_packing("auto")
    assert not policy.packed
    with pytest.raises(
        UserInputError,
        match=r"^--packing on: --model .+ \(qwen3_omni_moe_thinker\) does not take packed sequences .+; use --packing auto or off$",
    ):
        policy.use_packing("on")


def test_update_refuses_packing_and_balancing_for_a_diffusion_objective(tmp_path: Path) -> None:
    from helpers import fails

    paths = ["--model", str(tmp_path), "--in", str(tmp_path), "--out", str(tmp_path / "out")]
    for flags in (["--packing", "on"], ["--balance-tokens"], ["--micro-batch-tokens", "4096"]):
        line = fails(
            ["update", *paths, "--algo", "flow_grpo", *flags],
            "--packing on / --balance-tokens / --micro-batch-tokens",
            "--algo flow_grpo",
        )
        assert line.endswith("drop it")


def test_logprob_refuses_a_token_budget_for_a_diffusion_rollout(tmp_path: Path) -> None:
    from helpers import fails

    from stages.shards.writer import ShardSetWriter

    writer = ShardSetWriter(tmp_path / "samples", num_shards=1, command="sample", config={})
    writer.write_shard(0, {"sample_id": ["g0-0"], "latents": torch.zeros(1, 2, 4)})
    writer.finalize({"modality": "image"})
    args = [
        "logprob",
        "--model",
        str(tmp_path),
        "--in",
        str(tmp_path / "samples"),
        "--out",
        str(tmp_path / "o"),
    ]
    line = fails([*args, "--micro-batch-tokens", "4096"], "--micro-batch-tokens", "diffusion rollout")
    assert line.endswith("drop it for a diffusion rollout")
