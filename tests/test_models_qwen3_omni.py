"""Tiny Qwen3-Omni thinker: the folder loads offline through the Auto classes, the processor expands image and
audio placeholders to their feature counts (audio features independent of the batch), and the policy's
rollout log-probs replay to 1e-5 for text-only, image, audio and mixed prompts in one batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stages.errors import UserInputError
from stages.models.factory import read_model_card
from stages.models.qwen3_omni import repeat_prompts
from stages.models.vlm import VLMPolicy

RATE = 16_000


def clip(seconds: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 0.1).astype(np.float32)


def turn(kinds: list[str], question: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": k} for k in kinds), {"type": "text", "text": question}]}]


def audio_tokens(samples: int) -> int:
    """Audio tokens of a clip, from the tower's shape: 10 ms mel frames (the extractor drops the last
    STFT frame), then three stride-2 convolutions within 100-frame windows (13 tokens per full window)."""
    frames = samples // 160
    full, rest = divmod(frames, 100)
    for _ in range(3):
        rest = (rest - 1) // 2 + 1 if rest else 0
    return 13 * full + rest


def test_folder_loads_with_the_auto_classes(tiny_omni: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_omni)
    processor = AutoProcessor.from_pretrained(tiny_omni, local_files_only=True)
    text = model.config.text_config
    assert type(model).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    assert (text.num_experts, text.num_experts_per_tok) == (4, 2)
    assert text.rope_parameters["mrope_section"] == [4, 2, 2]
    assert model.config.vision_config.deepstack_visual_indexes == [0, 1]
    assert len(model.model.audio_tower.layers) == 2
    tok = processor.tokenizer
    assert model.config.audio_token_id == tok.audio_token_id == tok.convert_tokens_to_ids("<|audio_pad|>")
    assert model.config.image_token_id == tok.image_token_id
    assert model.config.text_config.vocab_size == len(tok)
    assert processor.feature_extractor.feature_size == model.config.audio_config.num_mel_bins
    card = read_model_card(tiny_omni)
    assert card["family"] == "qwen3_omni_thinker"
    assert set(card["parameters"]) == {"visual", "audio_tower", "language_model"}
    assert sum(card["parameters"].values()) == sum(p.numel() for p in model.parameters())


def test_processor_expands_placeholders_to_feature_counts(tiny_omni: Path) -> None:
    policy = VLMPolicy.for_prompts(tiny_omni)
    tok = policy.processor.tokenizer
    short, long = clip(0.5, 0), clip(1.37, 1)
    inputs = policy.chat_inputs(
        [turn(["image", "audio"], "What?"), turn(["audio"], "Hear?")],
        [[Image.new("RGB", (64, 128))], []],
        audios=[[short], [long]],
    )
    ids = inputs["input_ids"]
    assert int((ids == tok.image_token_id).sum()) == (64 * 128) // (32 * 32)  # 32 px per token
    assert (ids == tok.audio_token_id).sum(-1).tolist() == [audio_tokens(len(short)), audio_tokens(len(long))]
    assert audio_tokens(len(short)) == 7 and audio_tokens(len(long)) == 13 + 5
    # each clip's features are those of the clip alone, zero after its own frames
    alone = policy.processor.feature_extractor(
        [short], sampling_rate=RATE, padding="longest", return_tensors="pt"
    )
    frames = len(short) // 160
    assert inputs["feature_attention_mask"].sum(-1).tolist() == [frames, len(long) // 160]
    torch.testing.assert_close(
        inputs["input_features"][0, :, :frames], alone["input_features"][0, :, :frames]
    )
    assert not inputs["input_features"][0, :, frames:].any()
    with pytest.raises(UserInputError, match="prompt 0: 1 audio parts in its messages but 0 audios"):
        policy.chat_inputs([turn(["audio"], "Hear?")], [[]], audios=[[]])


def test_repeat_prompts_repeats_each_prompts_media_as_a_group(tiny_omni: Path) -> None:
    policy = VLMPolicy.for_prompts(tiny_omni)
    a0, a1, a2 = clip(0.3, 0), clip(0.6, 1), clip(0.9, 2)
    red, blue = Image.new("RGB", (64, 64), (255, 0, 0)), Image.new("RGB", (64, 128), (0, 0, 255))
    prompts = [turn(["audio", "audio", "image"], "A"), turn(["image", "audio"], "B")]
    inputs = policy.chat_inputs(prompts, [[red], [blue]], audios=[[a0, a1], [a2]])
    from transformers import AutoConfig

    out = repeat_prompts(inputs, 2, AutoConfig.from_pretrained(tiny_omni))
    expected = policy.chat_inputs(
        [p for p in prompts for _ in range(2)],
        [[red], [red], [blue], [blue]],
        audios=[[a0, a1]] * 2 + [[a2]] * 2,
    )
    assert set(out) <= set(expected)
    for key, value in out.items():
        assert torch.equal(value, expected[key]), key


def test_repeat_prompts_repeats_each_prompts_videos_as_a_group() -> None:
    """Videos (patches, grids, seconds per grid) follow their prompt like images: prompt 0 holds videos
    v0 (grid 2×2×2: 8 patches, 2 tokens) and v1 (1×2×2: 4 patches, 1 token), prompt 1 holds v2."""
    from types import SimpleNamespace

    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2), video_token_id=9)
    ids = torch.tensor([[9, 9, 9, 1], [0, 0, 9, 1]])
    grid = torch.tensor([[2, 2, 2], [1, 2, 2], [1, 2, 2]])
    patches = torch.arange(16.0)[:, None].expand(16, 3)  # v0: rows 0-7, v1: 8-11, v2: 12-15
    inputs = {
        "input_ids": ids,
        "attention_mask": ids > 0,
        "pixel_values_videos": patches,
        "video_grid_thw": grid,
        "video_second_per_grid": torch.tensor([0.5, 1.0, 2.0]),
    }
    out = repeat_prompts(inputs, 2, config)
    assert torch.equal(out["input_ids"], ids.repeat_interleave(2, dim=0))
    order = [0, 1, 0, 1, 2, 2]
    assert torch.equal(out["video_grid_thw"], grid[order])
    assert out["video_second_per_grid"].tolist() == [0.5, 1.0, 0.5, 1.0, 2.0, 2.0]
    rows = [*range(12), *range(12), *range(12, 16), *range(12, 16)]
    assert torch.equal(out["pixel_values_videos"], patches[rows])


@pytest.fixture(scope="module")
def mixed() -> tuple[list, list, list]:
    """Text-only, one image, two audio clips, and image + audio prompts."""
    prompts = [
        turn([], "What is two plus two?"),
        turn(["image"], "What colour is the square?"),
        turn(["audio", "audio"], "Which clip is longer?"),
        turn(["image", "audio"], "Describe both."),
    ]
    img = Image.new("RGB", (64, 96), (200, 30, 30))
    return prompts, [[], [img], [], [img]], [[], [], [clip(0.5, 0), clip(0.75, 1)], [clip(0.75, 1)]]


def test_replay_reproduces_rollout_log_probs_for_every_input_mode(tiny_omni: Path, mixed: tuple) -> None:
    prompts, images, audios = mixed
    policy = VLMPolicy.load(tiny_omni)
    roll = policy.generate(
        policy.chat_inputs(prompts, images, audios=audios), n=2, temperature=0.9, max_new_tokens=8, seed=3
    )
    assert roll.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3] and roll.response_mask[:, 0].all()
    assert not torch.isin(roll.response_ids[roll.response_mask], torch.tensor(policy.banned_ids)).any()
    rows = [k for k in range(4) for _ in range(2)]
    with torch.no_grad():
        replay = policy.response_log_probs(
            policy.chat_inputs(
                [prompts[k] for k in rows], [images[k] for k in rows], audios=[audios[k] for k in rows]
            ),
            roll.response_ids,
            roll.response_mask,
            0.9,
        )
        assert float((replay - roll.log_probs).abs()[roll.response_mask].max()) <= 1e-5
        for r, k in enumerate(rows):  # one row alone: other padding, no batch-mates
            alone = policy.response_log_probs(
                policy.chat_inputs([prompts[k]], [images[k]], audios=[audios[k]]),
                roll.response_ids[r : r + 1],
                roll.response_mask[r : r + 1],
                0.9,
            )
            mask = roll.response_mask[r : r + 1]
            assert float((alone - roll.log_probs[r : r + 1]).abs()[mask].max()) <= 1e-5
    again = policy.generate(
        policy.chat_inputs(prompts, images, audios=audios), n=2, temperature=0.9, max_new_tokens=8, seed=3
    )
    assert torch.equal(again.response_ids, roll.response_ids)


def test_lora_wraps_the_language_model_only(tiny_omni: Path, mixed: tuple) -> None:
    """omnirl's targets wrap q/k/v/o of the text layers (the experts are fused tensors); verl-omni's plain
    q_proj/k_proj/v_proj/o_proj list would also wrap the audio tower's attention."""
    from peft import LoraConfig, get_peft_model

    policy = VLMPolicy.load(tiny_omni)
    plain = get_peft_model(
        VLMPolicy.load(tiny_omni).model,
        LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    plain_wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in plain.named_parameters() if ".lora_A" in n}
    assert any(".audio_tower." in n for n in plain_wrapped)
    policy.add_lora(rank=4, alpha=8)
    params = policy.trainable_parameters()
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, p in policy.model.named_parameters() if ".lora_A" in n}
    layers = policy.module.config.text_config.num_hidden_layers
    assert len(wrapped) == 4 * layers and all(".language_model." in n for n in wrapped)
    assert wrapped == {n for n in plain_wrapped if ".language_model." in n}
    trained = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert len(params) == len(trained) == 8 * layers and all("lora_" in n for n in trained)
    prompts, images, audios = mixed
    inputs = policy.chat_inputs(prompts, images, audios=audios)
    roll = policy.generate(inputs, n=1, max_new_tokens=4)
    (-(policy.response_log_probs(inputs, roll.response_ids, roll.response_mask)).sum()).backward()
    assert all(p.grad is not None for p in params) and any(p.grad.abs().sum() > 0 for p in params)


def test_full_fine_tuning_freezes_both_towers(tiny_omni: Path) -> None:
    policy = VLMPolicy.load(tiny_omni)
    names = {n for n, _ in policy.model.named_parameters()}
    towers = {n for n in names if n.startswith(("model.visual.", "model.audio_tower."))}
    assert any("audio_tower" in n for n in towers) and any("visual" in n for n in towers)
    policy.trainable_parameters(full=True)
    assert {n for n, p in policy.model.named_parameters() if p.requires_grad} == names - towers
