"""verl/EasyR1 rows kept faithful: system and multi-turn messages survive, every <image> placeholder
becomes an image part at its position (verl's `_build_messages` rule), and the rollout's prompt ids,
the replay and the OpenAI request are built from those messages."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import fails, ins, run
from PIL import Image

from stages.errors import UserInputError
from stages.models.qwen2_5_vl import DEFAULT_SYSTEM_PROMPT, load_processor
from stages.sample.openai_engine import chat_messages
from stages.sample.sources import SourceRow
from stages.sample.vlm_data import build_messages, vlm_prompt
from stages.shards.reader import ShardSet

SYSTEM = "You are a careful geometry tutor."
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


# Image sizes differ, so each position's count of <|image_pad|> tokens tells which image sits there:
# Qwen2.5-VL cuts 14-px patches and merges 2×2 of them into one token.
SIZES = [(56, 56), (112, 56), (84, 84)]
PADS = [(w // 14) * (h // 14) // 4 for w, h in SIZES]  # 4, 8, 9

ROWS = [
    {  # a system prompt, images interleaved with the text, an earlier assistant turn, a trailing image
        "data_source": "geo",
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Compare <image> with <image>: which is wider?"},
            {"role": "assistant", "content": "The second."},
            {"role": "user", "content": "And this one?<image>"},
        ],
        "images": [{"bytes": _png(s, (40 * k, 90, 200)), "path": None} for k, s in enumerate(SIZES)],
        "reward_model": {"ground_truth": "no"},
        "extra_info": {"index": 0},
    },
    {  # text only: content stays a string, the model's default system prompt applies
        "data_source": "geo",
        "prompt": [{"role": "user", "content": "What is 2+2?"}],
        "images": [],
        "reward_model": {"ground_truth": "4"},
        "extra_info": {"index": 1},
    },
]
TEMPLATES = [
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    f"<|im_start|>user\nCompare {IMAGE} with {IMAGE}: which is wider?<|im_end|>\n"
    "<|im_start|>assistant\nThe second.<|im_end|>\n"
    f"<|im_start|>user\nAnd this one?{IMAGE}<|im_end|>\n"
    "<|im_start|>assistant\n",
    f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def _row(data: dict, index: int = 0) -> SourceRow:
    return SourceRow(index, data, f"rows.parquet: row {index}", Path("."), "rows.parquet")


def test_placeholders_become_typed_parts_at_their_positions() -> None:
    prompt = vlm_prompt(_row(ROWS[0]))
    assert prompt.messages == [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image"},
                {"type": "text", "text": " with "},
                {"type": "image"},
                {"type": "text", "text": ": which is wider?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "The second."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
    ]
    assert prompt.question == "Compare  with : which is wider?\nAnd this one?"
    assert prompt.images == [im["bytes"] for im in ROWS[0]["images"]]
    assert vlm_prompt(_row(ROWS[1])).messages == [{"role": "user", "content": "What is 2+2?"}]
    # EasyR1 rows are one user turn built by the same rule; no placeholder at all puts the images first
    easy = vlm_prompt(_row({"problem": "Sum?<image>", "answer": "3", "images": [b"x"]}), layout="easyr1")
    assert easy.messages == [
        {"role": "user", "content": [{"type": "text", "text": "Sum?"}, {"type": "image"}]}
    ]
    bare = build_messages("Which?", {"image": 2}, "r")
    assert bare == [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which?"}],
        }
    ]


@pytest.mark.parametrize(
    ("prompt", "images", "videos", "message"),
    [
        (
            "<image><image>Two?",
            1,
            0,
            "rows.parquet: row 3: 2 <image> placeholders but column 'images' holds 1 images",
        ),
        (
            "One?<image>",
            2,
            0,
            "rows.parquet: row 3: 1 <image> placeholders but column 'images' holds 2 images",
        ),
        (
            "Clip <video><video>",
            0,
            1,
            "rows.parquet: row 3: 2 <video> placeholders but column 'videos' holds 1 videos",
        ),
        (
            "<image> and <video>",
            1,
            0,
            "rows.parquet: row 3: 1 <video> placeholders but column 'videos' holds 0",
        ),
        (
            [{"role": "system", "content": "hi"}],
            0,
            0,
            "rows.parquet: row 3: the prompt's chat messages have no user",
        ),
        ([{"content": "no role"}], 0, 0, "rows.parquet: row 3: every chat message needs a 'role'"),
    ],
)
def test_a_row_that_does_not_add_up_is_a_one_line_error_naming_it(
    prompt: object, images: int, videos: int, message: str
) -> None:
    with pytest.raises(UserInputError, match="^" + message.replace("(", r"\(").replace("?", r"\?")):
        build_messages(prompt, {"image": images, "video": videos}, "rows.parquet: row 3")


def test_chat_template_output_is_exact(tiny_vlm: Path) -> None:
    processor = load_processor(tiny_vlm)
    for row, expected in zip(ROWS, TEMPLATES):
        messages = vlm_prompt(_row(row)).messages
        assert processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected


def test_openai_request_keeps_the_turns_and_image_positions() -> None:
    prompt = vlm_prompt(_row(ROWS[0]))
    messages = chat_messages(prompt.messages, prompt.images, "prompt 0")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    kinds = [[p["type"] for p in m["content"]] for m in messages]
    assert kinds[1] == ["text", "image_url", "text", "image_url", "text"] and kinds[3] == [
        "text",
        "image_url",
    ]
    urls = [p["image_url"]["url"] for m in messages for p in m["content"] if p["type"] == "image_url"]
    assert (
        len(urls) == 3 and len(set(urls)) == 3 and all(u.startswith("data:image/png;base64,") for u in urls)
    )


def test_sample_prompt_ids_keep_the_system_turns_and_image_positions(tiny_vlm: Path, tmp_path: Path) -> None:
    data = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), data)
    samples, logprobs = tmp_path / "samples", tmp_path / "logprobs"
    common = ["--model", str(tiny_vlm), "-n", "2", "--max-new-tokens", "3", "--max-prompt-length", "128"]
    run("sample", *common, "--prompts", str(data), "--batch-size", "4", "--out", str(samples))
    got = ShardSet(samples).read_all()
    tok = load_processor(tiny_vlm).tokenizer
    for i in range(4):
        k = i // 2
        ids = got["prompt_ids"][i][got["prompt_mask"][i]].tolist()
        expected = TEMPLATES[k]
        for pads in PADS if k == 0 else []:  # each image's pad tokens, expanded in placeholder order
            expected = expected.replace(IMAGE, "<|vision_start|>" + "<|IMG|>" * pads + "<|vision_end|>", 1)
        assert tok.decode(ids) == expected.replace("<|IMG|>", "<|image_pad|>")
        assert got["messages"][i] == vlm_prompt(_row(ROWS[k])).messages
    assert SYSTEM in tok.decode(got["prompt_ids"][0]) and DEFAULT_SYSTEM_PROMPT not in tok.decode(
        got["prompt_ids"][0]
    )
    # the replay rebuilds the very prompt ids from the stored messages (it refuses any difference)
    stats = run("logprob", "--model", str(tiny_vlm), *ins(samples), "--out", str(logprobs))
    assert stats["abs_delta_max"] < 1e-5


def test_a_placeholder_mismatch_in_a_table_names_the_row(tiny_vlm: Path, tmp_path: Path) -> None:
    rows = [dict(ROWS[1]), {**ROWS[1], "prompt": [{"role": "user", "content": "<image><image>Two?"}]}]
    rows[1]["images"] = [{"bytes": _png((56, 56), (0, 0, 0)), "path": None}]
    data = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    fails(
        ["sample", "--model", str(tiny_vlm), "--prompts", str(data), "--out", str(tmp_path / "out")],
        f"{data}: row 1: 2 <image> placeholders but column 'images' holds 1 images",
    )
    rows = [{**ROWS[1], "clips": None}, {**ROWS[1], "prompt": [{"role": "user", "content": "<video>?"}]}]
    rows[1]["clips"] = [[{"bytes": _png((56, 56), (0, 0, 0)), "path": None}]] * 2
    pq.write_table(pa.Table.from_pylist(rows), data)
    args = ["sample", "--model", str(tiny_vlm), "--prompts", str(data), "--video-key", "clips"]
    fails(
        [*args, "--out", str(tmp_path / "out")],
        f"{data}: row 1: 1 <video> placeholders but column 'clips' holds 2 videos",
    )
