"""The VLM policy on the tiny Qwen2.5-VL: sampling, and replaying a response reproduces its rollout log-probs."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from stages.models.vlm import VLMPolicy


def _prompt(policy: VLMPolicy, n: int = 1) -> dict[str, torch.Tensor]:
    """Two prompts, each repeated n times in place (one row per response, as the stages replay them)."""
    red = Image.new("RGB", (56, 56), (220, 20, 20))
    wide = Image.new("RGB", (112, 56), (20, 20, 220))
    questions, images = ["What colour is the square?", "Is the picture wide?"], [[red], [wide]]
    return policy.chat_inputs(
        [q for q in questions for _ in range(n)], [im for im in images for _ in range(n)]
    )


def test_replay_reproduces_rollout_log_probs(tiny_vlm: Path) -> None:
    policy = VLMPolicy.load(tiny_vlm)
    prompt = _prompt(policy)
    assert "mm_token_type_ids" in prompt and (prompt["mm_token_type_ids"] == 1).any()
    roll = policy.generate(prompt, n=2, temperature=0.9, max_new_tokens=8, seed=3)
    assert roll.response_ids.shape[0] == 4 and roll.prompt_index == [0, 0, 1, 1] and len(roll.text) == 4
    assert roll.response_mask[:, 0].all()
    with torch.no_grad():
        replay = policy.response_log_probs(_prompt(policy, 2), roll.response_ids, roll.response_mask, 0.9)
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


def test_full_fine_tuning_freezes_the_vision_tower_unless_asked(tiny_vlm: Path) -> None:
    policy = VLMPolicy.load(tiny_vlm)
    names = {n for n, _ in policy.model.named_parameters()}
    visual = {n for n in names if n.startswith("model.visual.")}
    assert visual and len(visual) < len(names)
    policy.trainable_parameters(full=True)
    trained = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trained == names - visual
    policy.trainable_parameters(full=True, train_vision=True)
    assert {n for n, p in policy.model.named_parameters() if p.requires_grad} == names
    prompt = _prompt(policy)
    roll = policy.generate(prompt, n=1, max_new_tokens=3)
    policy.response_log_probs(prompt, roll.response_ids, roll.response_mask).sum().backward()
    grads = {n: p.grad for n, p in policy.model.named_parameters()}
    assert any(grads[n] is not None and grads[n].abs().sum() > 0 for n in visual)  # images feed the loss


def test_a_response_ends_at_any_generation_stop_token(tiny_vlm: Path) -> None:
    """Qwen stops on <|im_end|> and <|endoftext|>; the mask must end at whichever comes first."""
    policy = VLMPolicy.load(tiny_vlm)
    assert policy.stop_ids == sorted(policy.model.generation_config.eos_token_id)
    prompt = _prompt(policy)
    with torch.no_grad():
        first = policy.model(**prompt).logits[:, -1].argmax(-1)  # the likeliest first token per prompt
    extra = sorted(set(first.tolist()) - set(policy.stop_ids))
    policy.model.generation_config.eos_token_id = [*policy.stop_ids, *extra]
    roll = policy.generate(prompt, n=3, temperature=0.05, max_new_tokens=6, seed=0)
    stops = torch.isin(roll.response_ids, torch.tensor(policy.stop_ids))
    for row, mask in zip(roll.response_ids, roll.response_mask):
        hit = torch.isin(row, torch.tensor(policy.stop_ids)).nonzero()
        length = int(hit[0]) + 1 if len(hit) else len(row)
        assert mask[:length].all() and not mask[length:].any()
    assert stops[:, 0].all()  # near-greedy sampling stopped every response at its first token
    assert roll.response_mask.sum() == len(roll.response_mask)


def test_vision_markers_are_never_sampled_and_carry_no_probability(tiny_vlm: Path) -> None:
    """A policy that strongly prefers <|image_pad|> (trl #3847's failure) still answers in text, and
    the rollout and replay log-probs describe the same distribution without the markers."""
    policy = VLMPolicy.load(tiny_vlm)
    pad = policy.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert pad in policy.banned_ids and len(policy.banned_ids) == 4

    def prefer_image_pad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[..., pad] += 20.0
        return output

    policy.model.lm_head.register_forward_hook(prefer_image_pad)
    prompt = _prompt(policy)
    with torch.no_grad():
        raw = policy.model(**prompt).logits[:, -1].softmax(-1)[:, pad]
    assert (raw > 0.99).all()  # unguarded, nearly every token would be an image pad
    roll = policy.generate(prompt, n=4, max_new_tokens=8, seed=1)
    assert not torch.isin(roll.response_ids[roll.response_mask], torch.tensor(policy.banned_ids)).any()
    with torch.no_grad():
        replay, entropy = policy.response_stats(
            _prompt(policy, 4), roll.response_ids, roll.response_mask, entropy=True
        )
    assert float((replay - roll.log_probs).abs()[roll.response_mask].max()) < 1e-5
    assert torch.isfinite(entropy).all() and (entropy > 0).all()
    logits = policy.allowed(torch.zeros(1, 1, policy.model.config.text_config.vocab_size))
    assert float(logits.softmax(-1)[0, 0, policy.banned_ids].sum()) == 0.0
