"""Tiny Qwen2.5-VL: the folder loads offline through the Auto classes, the processor expands images like
Qwen's, `mm_token_type_ids` is what gives image tokens their 3-D rope positions, and builds are reproducible."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stages.errors import UserInputError
from stages.models.factory import init_model, read_model_card
from stages.models.qwen2_5_vl import CHAT_TEMPLATE, load_processor
from stages.models.tokenizers import QWEN2_SPECIAL_TOKENS, REASONING_TAGS, build_qwen2_tokenizer

QUESTIONS = ("How many apples are there?", "What is written on the sign in this picture?")
PATCH_ROW = 3 * 2 * 14 * 14  # channels x temporal patch x 14 x 14 pixels
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A tiny Qwen2.5-VL folder built once for this module (seed 0)."""
    out = tmp_path_factory.mktemp("models") / "qwen2_5_vl-tiny"
    return out, init_model("qwen2_5_vl", out, size="tiny", seed=0)


def load(folder: Path):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    return processor, model


def noise_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def user_turn(question: str, image: Image.Image | None = None) -> list[dict]:
    content: list[dict] = [{"type": "image"} if image is None else {"type": "image", "image": image}]
    return [{"role": "user", "content": [*content, {"type": "text", "text": question}]}]


def batch_of_two(processor) -> dict[str, torch.Tensor]:
    """Two prompts of different lengths with a 56x56 and a 56-high x 112-wide image, left-padded."""
    texts = [
        processor.apply_chat_template(user_turn(question), add_generation_prompt=True, tokenize=False)
        for question in QUESTIONS
    ]
    images = [noise_image(56, 56, 0), noise_image(56, 112, 1)]
    return processor(text=texts, images=images, return_tensors="pt", padding=True, padding_side="left")


def expected_positions(types: list[int], grid_hw: tuple[int, int]) -> list[list[int]]:
    """M-RoPE positions (t, h, w) of one unpadded row holding one image, by Qwen2-VL's rule: text counts
    up on all three axes; the image's merged h' x w' tokens (row-major) sit at temporal position s (the
    next text position), height s + row, width s + column; text after it resumes at s + max(h', w')."""
    merged_h, merged_w = grid_hw[0] // 2, grid_hw[1] // 2
    image_indices = [index for index, kind in enumerate(types) if kind == 1]
    assert len(image_indices) == merged_h * merged_w
    start = image_indices[0]
    positions, text_position = [], 0
    for index, kind in enumerate(types):
        if kind == 0:
            positions.append([text_position] * 3)
            text_position += 1
        else:
            row, column = divmod(index - start, merged_w)
            positions.append([start, start + row, start + column])
            text_position = start + max(merged_h, merged_w)
    return positions


def test_folder_loads_offline_through_the_auto_classes(tiny_vlm: tuple[Path, dict], offline: None) -> None:
    folder, summary = tiny_vlm
    assert {path.name for path in folder.iterdir()} == {
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "omnirl_model.json",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    processor, model = load(folder)
    assert type(processor).__name__ == "Qwen2_5_VLImageTextProcessor"
    assert type(processor.image_processor).__name__.startswith("Qwen2VLImageProcessor")
    assert type(processor.tokenizer).__name__ == "Qwen2Tokenizer"
    assert type(load_processor(folder)) is type(processor)

    card = read_model_card(folder)
    assert card is not None and (card["family"], card["size"], card["seed"]) == ("qwen2_5_vl", "tiny", 0)
    assert card["pipeline_class"] == "Qwen2_5_VLForConditionalGeneration"
    assert {key: summary[key] for key in card} == card
    assert summary["parameters"] == {
        "visual": sum(p.numel() for p in model.model.visual.parameters()),
        "language_model": sum(p.numel() for p in model.model.language_model.parameters()),
    }
    assert sum(summary["parameters"].values()) == sum(p.numel() for p in model.parameters())
    assert summary["bytes"] < 4 * 2**20

    tokenizer, config = processor.tokenizer, model.config
    assert config.text_config.vocab_size == len(tokenizer) == summary["details"]["vocab_size"]
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    token_ids = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    for attribute, token in token_ids.items():
        assert getattr(config, attribute) == tokenizer.convert_tokens_to_ids(token)
    assert processor.image_token_id == config.image_token_id
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(
        ["<|im_end|>", "<|endoftext|>"]
    )
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size
    head_dim = config.text_config.hidden_size // config.text_config.num_attention_heads
    assert sum(config.text_config.rope_parameters["mrope_section"]) == head_dim // 2
    window = config.vision_config.window_size
    assert window % (config.vision_config.patch_size * config.vision_config.spatial_merge_size) == 0
    assert all(
        0 <= block < config.vision_config.depth for block in config.vision_config.fullatt_block_indexes
    )


def test_chat_template_renders_chatml_with_an_image_placeholder(
    tiny_vlm: tuple[Path, dict], offline: None
) -> None:
    processor, _ = load(tiny_vlm[0])
    rendered = processor.apply_chat_template(
        user_turn("How many?"), add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    conversation = [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>add</think><answer>4</answer>"},
    ]
    expected = (
        "<|im_start|>system\nThink first.<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>add</think><answer>4</answer><|im_end|>\n"
    )
    assert processor.apply_chat_template(conversation, tokenize=False) == expected
    assert processor.tokenizer.apply_chat_template(conversation, tokenize=False) == expected
    assert processor.tokenizer.chat_template == processor.chat_template == CHAT_TEMPLATE


def test_processor_resizes_to_28px_multiples_within_the_pixel_budget(
    tiny_vlm: tuple[Path, dict], offline: None
) -> None:
    processor, _ = load(tiny_vlm[0])
    # (height, width) -> (grid h, grid w) in 14-px patches, from Qwen's resize rule with min 56², max 112²:
    # 56x56 stays; 56x112 stays; 40x24 is below 3136 px: scale by sqrt(3136/960) and ceil to 28 -> 84x56;
    # 280x200 is above 12544 px: scale by sqrt(12544/56000) and floor to 28 -> 112x84.
    cases = {(56, 56): (4, 4), (56, 112): (4, 8), (40, 24): (6, 4), (280, 200): (8, 6)}
    for (height, width), (grid_h, grid_w) in cases.items():
        image = Image.new("RGB", (width, height), (255, 0, 128))
        inputs = processor(
            text=[processor.apply_chat_template(user_turn("What?"), tokenize=False)],
            images=[image],
            return_tensors="pt",
        )
        assert inputs["image_grid_thw"].tolist() == [[1, grid_h, grid_w]]
        assert inputs["pixel_values"].shape == (grid_h * grid_w, PATCH_ROW)
        image_tokens = int((inputs["input_ids"] == processor.image_token_id).sum())
        assert image_tokens == grid_h * grid_w // 4 == int(inputs["mm_token_type_ids"].sum())
        assert 56 * 56 <= grid_h * grid_w * 14 * 14 <= 112 * 112
        channels = inputs["pixel_values"].reshape(-1, 3, PATCH_ROW // 3).double()
        for channel, value in enumerate((1.0, 0.0, 128 / 255)):
            expected = (value - CLIP_MEAN[channel]) / CLIP_STD[channel]
            np.testing.assert_allclose(channels[:, channel].numpy(), expected, atol=1e-5)


def test_chat_message_with_an_image_generates(tiny_vlm: tuple[Path, dict], offline: None) -> None:
    processor, model = load(tiny_vlm[0])
    image = noise_image(56, 56, 0)
    inputs = processor.apply_chat_template(
        user_turn(QUESTIONS[0], image),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    text = processor.apply_chat_template(user_turn(QUESTIONS[0]), add_generation_prompt=True, tokenize=False)
    direct = processor(text=[text], images=[image], return_tensors="pt")
    assert set(inputs) == {
        "input_ids",
        "attention_mask",
        "mm_token_type_ids",
        "pixel_values",
        "image_grid_thw",
    }
    for key in inputs:
        assert torch.equal(inputs[key], direct[key]), key
    prompt = processor.decode(inputs["input_ids"][0])
    assert prompt == text.replace("<|image_pad|>", "<|image_pad|>" * 4)

    torch.manual_seed(0)
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=True)
    prompt_length = inputs["input_ids"].shape[1]
    assert generated.shape == (1, prompt_length + 6)
    assert torch.equal(generated[:, :prompt_length], inputs["input_ids"])
    completion = processor.batch_decode(generated[:, prompt_length:], skip_special_tokens=False)[0]
    assert isinstance(completion, str) and completion
    assert processor.decode(generated[0]) == prompt + completion


def test_mm_token_type_ids_give_image_tokens_3d_rope_positions(
    tiny_vlm: tuple[Path, dict], offline: None
) -> None:
    processor, model = load(tiny_vlm[0])
    inputs = batch_of_two(processor)
    ids, mask, types = inputs["input_ids"], inputs["attention_mask"], inputs["mm_token_type_ids"]
    # 1 at image pads, 2 at video pads, 0 elsewhere
    image_pads, video_pads = ids == model.config.image_token_id, ids == model.config.video_token_id
    assert torch.equal(types, image_pads.long() + 2 * video_pads.long())
    assert mask[0].sum() < mask[1].sum() == ids.shape[1]
    assert not mask[0, 0] and mask[0, -1]

    positions, deltas = model.model.get_rope_index(
        ids, types, image_grid_thw=inputs["image_grid_thw"], attention_mask=mask
    )
    golden = torch.zeros_like(positions)
    for row, grid in enumerate(inputs["image_grid_thw"].tolist()):
        keep = mask[row].bool()
        golden[:, row, keep] = torch.tensor(
            expected_positions(types[row, keep].tolist(), (grid[1], grid[2]))
        ).T
        assert torch.equal(positions[:, row, keep], golden[:, row, keep])
        merged_h, merged_w = grid[1] // 2, grid[2] // 2
        assert deltas[row].item() == max(merged_h, merged_w) - merged_h * merged_w
    assert deltas.tolist() == [[-2], [-4]]

    common = {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": inputs["pixel_values"],
        "image_grid_thw": inputs["image_grid_thw"],
    }
    with torch.no_grad():
        with_types = model(**common, mm_token_type_ids=types).logits
        with_golden = model(**common, position_ids=golden).logits
        without_types = model(**common).logits
        flat = torch.arange(ids.shape[1]).expand(3, 2, -1)
        with_flat = model(**common, position_ids=flat).logits
    real = mask.bool()
    torch.testing.assert_close(with_types[real], with_golden[real], rtol=0, atol=1e-6)
    torch.testing.assert_close(without_types[real], with_flat[real], rtol=0, atol=1e-6)
    assert (with_types[real] - without_types[real]).abs().max() > 1e-4


def test_rollout_logits_are_recomputed_only_with_mm_token_type_ids(
    tiny_vlm: tuple[Path, dict], offline: None
) -> None:
    processor, model = load(tiny_vlm[0])
    inputs = batch_of_two(processor)
    torch.manual_seed(0)
    with torch.no_grad():
        rollout = model.generate(
            **inputs,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    prompt_length = inputs["input_ids"].shape[1]
    sequences = rollout.sequences
    sampled_logits = torch.stack(rollout.logits, dim=1)
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(sequences[:, prompt_length:])], dim=1)
    # the prompt's types from the processor, completion tokens text (0), as VLMPolicy builds them
    types = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(sequences[:, prompt_length:])], dim=1)
    common = {
        "input_ids": sequences,
        "attention_mask": mask,
        "pixel_values": inputs["pixel_values"],
        "image_grid_thw": inputs["image_grid_thw"],
    }
    with torch.no_grad():
        recomputed = model(**common, mm_token_type_ids=types).logits[:, prompt_length - 1 : -1]
        forgotten = model(**common).logits[:, prompt_length - 1 : -1]
    torch.testing.assert_close(recomputed, sampled_logits, rtol=0, atol=1e-5)
    assert (forgotten - sampled_logits).abs().max() > 1e-4

    completion_ids = sequences[:, prompt_length:, None]
    rollout_logprobs = sampled_logits.log_softmax(-1).gather(-1, completion_ids)
    wrong_logprobs = forgotten.log_softmax(-1).gather(-1, completion_ids)
    assert not torch.allclose(rollout_logprobs, wrong_logprobs, rtol=0, atol=1e-5)


def test_same_seed_same_bytes_in_a_fresh_process_other_seed_other_weights(
    tiny_vlm: tuple[Path, dict], tmp_path: Path
) -> None:
    folder, _ = tiny_vlm

    def file_hashes(path: Path) -> dict[str, str]:
        return {
            file.name: hashlib.sha256(file.read_bytes()).hexdigest()
            for file in sorted(path.iterdir())
            if file.name != "omnirl_model.json"
        }

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONHASHSEED": "12345", "HF_HUB_OFFLINE": "1"}
    command = "from omnirl_cli.app import main; main()"
    cli = [sys.executable, "-c", command, "init-model", "--family", "qwen2_5_vl", "--size", "tiny", "--json"]
    result = subprocess.run(
        [*cli, str(tmp_path / "same")], capture_output=True, text=True, env=env, cwd=root, check=True
    )
    assert json.loads(result.stdout)["family"] == "qwen2_5_vl"
    init_model("qwen2_5_vl", tmp_path / "other", size="tiny", seed=1)
    reference = file_hashes(folder)
    assert file_hashes(tmp_path / "same") == reference
    other = file_hashes(tmp_path / "other")
    assert other["model.safetensors"] != reference["model.safetensors"]
    assert {name: digest for name, digest in other.items() if name != "model.safetensors"} == {
        name: digest for name, digest in reference.items() if name != "model.safetensors"
    }


def test_qwen2_tokenizer_layout_and_round_trip() -> None:
    tokenizer = build_qwen2_tokenizer()
    assert 2000 < len(tokenizer) < 5000
    special_ids = tokenizer.convert_tokens_to_ids(list(QWEN2_SPECIAL_TOKENS))
    first = len(tokenizer) - len(QWEN2_SPECIAL_TOKENS) - len(REASONING_TAGS)
    assert special_ids == list(range(first, first + len(QWEN2_SPECIAL_TOKENS)))
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        None,
    )

    text = "<think>3 + 4 = 7, so x is 7.</think><answer>\\boxed{7}</answer>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert [token for token in tokens if token in REASONING_TAGS] == list(REASONING_TAGS)
    assert tokens[1:6] == ["3", "Ġ+", "Ġ", "4", "Ġ="]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = "<|im_start|>user\nHow many apples?<|im_end|>"
    chat_tokens = tokenizer.convert_ids_to_tokens(tokenizer(chat)["input_ids"])
    assert chat_tokens == ["<|im_start|>", "user", "Ċ", "How", "Ġmany", "Ġapples", "?", "<|im_end|>"]
    assert (
        tokenizer.decode(tokenizer(chat)["input_ids"], skip_special_tokens=True) == "user\nHow many apples?"
    )
    anything = "Ünïcödé 漢字 🙂 tab\there\r\n" + "".join(chr(code) for code in range(32, 127))
    assert tokenizer.decode(tokenizer(anything)["input_ids"]) == anything


def test_unknown_size_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match=r"unknown size 'huge' for model family 'qwen2_5_vl'.*tiny"):
        init_model("qwen2_5_vl", tmp_path / "x", size="huge")
    assert not (tmp_path / "x").exists()
