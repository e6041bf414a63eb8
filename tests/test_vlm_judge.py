"""`vlm_judge`: a local tiny Qwen2.5-VL judge against an independent greedy decode, the OpenAI path
against a real local HTTP server with canned answers, and each preset's parse on hand-made answers."""

from __future__ import annotations

import base64
import io
import json
import logging
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from openai_server import _running
from PIL import Image

from stages.errors import RuntimeFailure, UserInputError
from stages.models.vlm import VLMPolicy
from stages.models.vlm_inputs import response_inputs
from stages.score.registry import get_reward, reward_files, reward_kind
from stages.score.remote import CHAT_PROTOCOLS
from stages.score.scoring import score_batch
from stages.score.vlm_judge import (
    PRESETS,
    VLMJudge,
    ocr_answer_reward,
    parse_yes_no,
)

MODEL = "judge"
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
PROMPTS = ['a sign that says "omnirl"', 'a cake reading "hello"', 'a cat next to the word "cat"']


def _image(colour: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> Image.Image:
    image = Image.new("RGB", size, colour)
    image.putpixel((size[0] - 1, size[1] - 1), (255, 255, 255))
    return image


IMAGES = [_image(COLOURS[0]), _image(COLOURS[1], (112, 56)), _image(COLOURS[2], (56, 84))]


# --- parsing on hand-made answers ----------------------------------------------------------------


def test_unifiedreward_presets_are_the_remote_protocols_rubrics() -> None:
    """One rubric per name: `vlm_judge preset=` and `remote: protocol=` ask the same question, resize
    alike and read an answer to the same number (flow_grpo's case-sensitive "Final Score:" pattern)."""
    answers = [
        "Final Score: 4",
        "**Final Score:** 5",
        "final score: 3",
        "Final Score: 5.5",
        "Alignment Score: 2\nCoherence Score: 4\nStyle Score: 3",
    ]
    for name in ("unifiedreward", "unifiedreward2"):
        preset, protocol = PRESETS[name], CHAT_PROTOCOLS[name]
        assert (preset.question, preset.image_size) == (protocol["question"], protocol["image_size"])
        assert [preset.parse(a, None) for a in answers] == [protocol["parse"](a) for a in answers]
    assert [PRESETS["unifiedreward"].parse(a, None) for a in answers] == [0.8, None, None, 1.1, None]
    assert PRESETS["unifiedreward2"].parse(answers[4], None) == pytest.approx(0.5)


def test_yes_no_parse() -> None:
    for answer, want in (
        ("Yes", 1.0),
        ("no.", 0.0),
        ("  YES, it does", 1.0),
        ("**No**", 0.0),
        ("yes/no", 1.0),
    ):
        assert parse_yes_no(answer) == want, answer
    for bad in ("Not really", "I think yes", "yesterday", "", "maybe"):
        assert parse_yes_no(bad) is None, bad


def test_ocr_answer_reward() -> None:
    # Flow-GRPO: spaces removed, lowercased; 0 when the target is inside; else 1 - min(lev, |t|)/|t|.
    assert ocr_answer_reward("The sign says: Omni RL", "omnirl") == 1.0
    assert ocr_answer_reward("helo", "hello") == pytest.approx(1 - 1 / 5)
    assert ocr_answer_reward("he\nl\tlo", "hello") == 1.0  # line breaks count as spaces
    assert ocr_answer_reward("dog", "cat") == 0.0  # distance 3, capped at |target| = 3
    assert ocr_answer_reward("", "cat") == 0.0  # the judge read nothing: a real 0, not a failure
    assert ocr_answer_reward("xxxxxxxxx", "ab") == 0.0  # distance 9 capped at 2
    with pytest.raises(ValueError):
        ocr_answer_reward("a", None)


def test_questions_and_templates() -> None:
    yes_no = VLMJudge(url="http://127.0.0.1:9/v1", preset="yes_no")
    assert yes_no.questions(["a red cube"]) == ["Does this image match: a red cube? Answer yes or no."]
    custom = VLMJudge(
        url="http://127.0.0.1:9/v1", preset="unifiedreward", template="Rate {prompt} / {prompt}"
    )
    assert custom.questions(["x{y}"]) == ["Rate x{y} / x{y}"]  # braces in a prompt are left alone
    assert (custom.max_tokens, custom.image_size) == (PRESETS["unifiedreward"].max_tokens, 512)
    ocr = VLMJudge(url="http://127.0.0.1:9/v1")
    assert ocr.preset_name == "ocr" and ocr.questions(PROMPTS[:1]) == [PRESETS["ocr"].question]
    assert (ocr.max_tokens, ocr.image_size) == (128, 0)
    assert (
        "{prompt}" in PRESETS["unifiedreward"].question
        and "Final Score:" in PRESETS["unifiedreward"].question
    )


def test_arguments(tmp_path: Path, tiny_vlm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert reward_kind("vlm_judge") == "image"
    url = "http://127.0.0.1:9/v1"
    judge = get_reward("vlm_judge", {"url": url, "max_tokens": "32", "batch_size": "3", "image_size": "0"})
    assert (judge.max_tokens, judge.batch_size, judge.image_size) == (32, 3, 0)
    assert reward_files("vlm_judge", {"url": url}) == {}
    assert VLMJudge(model=str(tiny_vlm)).weight_paths == {"model": tiny_vlm}
    cases = [
        ({}, "exactly one judge"),
        ({"url": url, "model": str(tiny_vlm)}, "exactly one judge"),
        ({"url": url, "preset": "bogus"}, "preset=bogus"),
        ({"url": url, "batch_size": 0}, "batch_size=0"),
        ({"url": url, "device": "cpu"}, "device and dtype"),
        ({"url": url, "token_env": "OMNIRL_TEST_NO_SUCH_VAR"}, "OMNIRL_TEST_NO_SUCH_VAR"),
        ({"url": url, "template": "  "}, "template is empty"),
        ({"model": str(tiny_vlm), "served_model": "m"}, "served_model and token_env"),
        ({"model": str(tiny_vlm), "dtype": "fp8"}, "dtype=fp8"),
        ({"model": str(tmp_path / "missing")}, "model="),
    ]
    not_vlm = tmp_path / "not_vlm"
    not_vlm.mkdir()
    (not_vlm / "config.json").write_text(json.dumps({"model_type": "clip"}))
    cases.append(({"model": str(not_vlm)}, "is not a .*qwen2_5_vl.* transformers folder"))
    monkeypatch.delenv("OMNIRL_TEST_NO_SUCH_VAR", raising=False)
    for kwargs, message in cases:
        with pytest.raises(UserInputError, match=message):
            VLMJudge(**kwargs)
    monkeypatch.setenv("OMNIRL_TEST_TOKEN", "secret")
    assert VLMJudge(url=url, token_env="OMNIRL_TEST_TOKEN")._api_key == "secret"


# --- local judge: the tiny Qwen2.5-VL ------------------------------------------------------------


@pytest.fixture(scope="module")
def judge_model(tiny_vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-VL with its matrices redrawn wider (std 3/√fan_in), saved as a folder: with the
    factory's small init every greedy answer is the same newline run, which could not show a question
    or an image reaching the wrong sample; these weights answer differently per input."""
    out = tmp_path_factory.mktemp("judge") / "qwen2_5_vl-judge"
    shutil.copytree(tiny_vlm, out)
    policy = VLMPolicy.load(out)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in policy.model.parameters():
            if weight.ndim == 2:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 3.0 / weight.shape[1] ** 0.5)
    policy.model.save_pretrained(out, safe_serialization=True)
    return out


def _greedy_answer(policy: VLMPolicy, question: str, image: Image.Image, max_tokens: int) -> str:
    """Greedy decoding written out: one full forward over prompt + answer so far per token (no KV
    cache, no `generate`), the argmax of the allowed logits, stopping after a stop token."""
    prompt = policy.chat_inputs([question], [[image]])
    answer = torch.zeros(1, 0, dtype=torch.int64)
    with torch.no_grad():
        for _ in range(max_tokens):
            inputs = response_inputs(prompt, answer, torch.ones_like(answer, dtype=torch.bool))
            token = policy.allowed(policy.model(**inputs).logits[:, -1]).argmax(-1, keepdim=True)
            answer = torch.cat([answer, token], dim=1)
            if int(token) in policy.stop_ids:
                break
    return policy.processor.tokenizer.decode(answer[0], skip_special_tokens=True)


def test_local_judge_answers_greedily(judge_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    policy = VLMPolicy.load(judge_model)
    judge = VLMJudge(model=str(judge_model), preset="yes_no", max_tokens=8, batch_size=2)
    prompts = ["a red square", "a green field", "a blue sky"]
    with caplog.at_level(logging.WARNING, logger="stages.score.vlm_judge"):
        scores = judge(IMAGES, prompts, [{}] * 3)
    questions = [f"Does this image match: {p}? Answer yes or no." for p in prompts]
    want = [_greedy_answer(policy, q, im, 8) for q, im in zip(questions, IMAGES)]
    # batch_size 2: a left-padded pair and a single; each answer equals its own greedy decode
    assert judge.last_answers == want
    assert len(set(want)) == 3 and all(want)  # the answers depend on the sample: nothing was mixed up
    assert scores == [parse_yes_no(a) for a in want]
    unparsed = [i for i, s in enumerate(scores) if s is None]
    assert unparsed and all(f"batch item {i} (prompt {prompts[i]!r})" in caplog.text for i in unparsed)


def test_local_ocr_with_template(judge_model: Path) -> None:
    policy = VLMPolicy.load(judge_model)
    judge = VLMJudge(model=str(judge_model), template="Read the sign for {prompt}", max_tokens=6)
    meta = [{}, {"ocr_text": "cake"}, {}]
    scores = judge(IMAGES, PROMPTS, meta)
    targets = ["omnirl", "cake", "cat"]  # the quoted text, unless the meta names one
    want = [_greedy_answer(policy, f"Read the sign for {p}", im, 6) for p, im in zip(PROMPTS, IMAGES)]
    assert judge.last_answers == want
    assert scores == [ocr_answer_reward(a, t) for a, t in zip(want, targets)]
    assert all(s is not None and 0.0 <= s <= 1.0 for s in scores)
    assert judge([], [], []) == []


# --- OpenAI-compatible judge: canned answers from a real local HTTP server -----------------------


class JudgeApp:
    """Lists `MODEL`; answers a chat completion with the canned text of its image's colour (pixel (0,0)),
    records every request body. `status` other than 200 answers every completion with an error."""

    def __init__(self, answers: dict[tuple[int, int, int], str | None], status: int = 200, reply: Any = None):
        self.answers, self.status, self.reply = answers, status, reply
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def get(self, path: str) -> tuple[int, bytes]:
        return 200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()

    def post(self, path: str, raw: bytes) -> tuple[int, bytes]:
        body = json.loads(raw)
        with self.lock:
            self.requests.append(body)
        if self.status != 200:
            return self.status, json.dumps(
                {"error": {"message": "judge is down", "code": self.status}}
            ).encode()
        if self.reply is not None:
            return 200, json.dumps(self.reply).encode()
        image = _decoded(body)
        content = self.answers[image.getpixel((0, 0))]
        message = {"role": "assistant", "content": content}
        return 200, json.dumps(
            {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        ).encode()


def _decoded(body: dict[str, Any]) -> Image.Image:
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


CANNED = {
    "ocr": (["The sign says: Omni RL", "helo", None], [1.0, pytest.approx(0.8), None]),
    "unifiedreward": (
        ["Final Score: 4", "Clear.\nFinal Score: 2.5", "I cannot rate this."],
        [0.8, 0.5, None],
    ),
    "unifiedreward2": (
        ["Alignment Score (1-5): 5\nCoherence Score (1-5): 5\nStyle Score (1-5): 5", "1, 2, 3", "No idea."],
        [1.0, 0.25, None],
    ),
    "yes_no": (["Yes.", "no", "Maybe"], [1.0, 0.0, None]),
}


@pytest.mark.parametrize("preset", sorted(CANNED))
def test_remote_presets(preset: str, caplog: pytest.LogCaptureFixture) -> None:
    answers, want = CANNED[preset]
    app = JudgeApp(dict(zip(COLOURS, answers)))
    with _running(app) as url, caplog.at_level(logging.WARNING, logger="stages.score.vlm_judge"):
        judge = VLMJudge(url=url, served_model=MODEL, preset=preset, batch_size=2, retries=0)
        scores = judge(IMAGES, PROMPTS, [{}, {"ocr_text": "hello"}, {}])
    assert scores == want
    assert judge.last_answers == answers
    assert "batch item 2" in caplog.text and "scored None" in caplog.text
    assert "batch item 0" not in caplog.text and "batch item 1" not in caplog.text
    assert len(app.requests) == 3
    by_colour = {_decoded(body).getpixel((0, 0)): body for body in app.requests}
    size = PRESETS[preset].image_size
    for k, (image, prompt) in enumerate(zip(IMAGES, PROMPTS)):
        body = by_colour[COLOURS[k]]
        assert body["model"] == MODEL and body["n"] == 1 and body["temperature"] == 0.0
        assert body["repetition_penalty"] == 1.0 and body["top_p"] == 1.0
        assert body["max_tokens"] == body["max_completion_tokens"] == PRESETS[preset].max_tokens
        assert body["messages"][0]["role"] == "user" and len(body["messages"]) == 1
        question = body["messages"][0]["content"][1]
        assert question == {"type": "text", "text": PRESETS[preset].question.replace("{prompt}", prompt)}
        sent = _decoded(body)
        expected = image.resize((size, size)) if size else image
        assert sent.size == expected.size and sent.tobytes() == expected.tobytes()


def test_remote_failure_is_recorded_not_zero() -> None:
    """Through `score_batch`: an unparseable answer fails the run, or with on_error=zero is flagged."""
    from stages.errors import NonFiniteError

    app = JudgeApp(dict(zip(COLOURS, ["Final Score: 5", "no score", "Final Score: 1"])))
    ids = ["s0", "s1", "s2"]
    with _running(app) as url:
        args = {"vlm_judge": {"url": url, "preset": "unifiedreward", "retries": "0"}}
        with pytest.raises(NonFiniteError, match="'s1'"):
            score_batch([("vlm_judge", 1.0)], IMAGES, PROMPTS, [{}] * 3, sample_ids=ids, reward_args=args)
        out = score_batch(
            [("vlm_judge", 2.0)], IMAGES, PROMPTS, [{}] * 3, sample_ids=ids, reward_args=args, on_error="zero"
        )
    assert out["reward.vlm_judge"].tolist() == [1.0, 0.0, pytest.approx(0.2)]
    assert out["reward_failed"].tolist() == [False, True, False]
    assert out["reward"].tolist() == [2.0, 0.0, pytest.approx(0.4)]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_errors() -> None:
    images, prompts = IMAGES[:1], PROMPTS[:1]
    app = JudgeApp({COLOURS[0]: "Yes"})
    with _running(app) as url:
        # served_model may be left out when the server lists one model
        assert VLMJudge(url=url, preset="yes_no")(images, prompts, [{}]) == [1.0]
        with pytest.raises(
            UserInputError, match=r"serves judge; pass one with --reward-arg vlm_judge.served_model"
        ):
            VLMJudge(url=url, served_model="other", preset="yes_no")(images, prompts, [{}])
        # the target is read before anything is asked
        with pytest.raises(UserInputError, match=r"reward 'vlm_judge': prompt 'no quotes'"):
            VLMJudge(url=url)(images, ["no quotes"], [{}])
        with pytest.raises(UserInputError, match="batch item 0 is a str"):
            VLMJudge(url=url, preset="yes_no")(["not an image"], prompts, [{}])
    assert len(app.requests) == 1
    down = JudgeApp({}, status=500)
    failed = r"reward 'vlm_judge': .*HTTP 500: judge is down"
    with _running(down) as url, pytest.raises(RuntimeFailure, match=failed):
        VLMJudge(url=url, preset="yes_no", retries=1)(images, prompts, [{}])
    assert len(down.requests) == 2  # one retry after a server failure
    with (
        _running(JudgeApp({}, reply={"choices": []})) as url,
        pytest.raises(RuntimeFailure, match="without choices"),
    ):
        VLMJudge(url=url, preset="yes_no", retries=0)(images, prompts, [{}])
    with pytest.raises(UserInputError, match=r"cannot connect.*--reward-arg vlm_judge.url"):
        VLMJudge(url=f"http://127.0.0.1:{_closed_port()}/v1", preset="yes_no")(images, prompts, [{}])


def test_edit_preset_shows_the_source_then_the_result() -> None:
    """preset=edit: each request holds the row's condition image, then the sample, then the rubric; the
    two axis scores become (mean − 1) / 4; a row without a source is a one-line error."""
    from stages.score.rubrics import EDIT_RUBRIC, edit_score

    assert edit_score("Instruction Score (1-5): 5\nConsistency Score (1-5): 2") == 0.625
    assert edit_score("Instruction Score (1-5): 4") is None  # both axes, or no score
    answers = [
        "Instruction Score (1-5): 5\nConsistency Score (1-5): 5",
        "Instruction Score (1-5): 1\nConsistency Score (1-5): 3",
        "It looks fine.",
    ]
    sources = [_image(colour, (28, 28)) for colour in COLOURS]  # keyed by the first image the judge sees
    results = [_image((90, 90, 90)), _image((120, 120, 120)), _image((150, 150, 150))]
    app = JudgeApp(dict(zip(COLOURS, answers)))
    meta = [{"condition_images": [source]} for source in sources]
    with _running(app) as url:
        judge = VLMJudge(url=url, served_model=MODEL, preset="edit", retries=0)
        assert judge(results, PROMPTS, meta) == [1.0, 0.25, None]
        with pytest.raises(UserInputError, match=r"batch item 1 .* has 0 condition images"):
            judge(results[:2], PROMPTS[:2], [meta[0], {}])
    for body in app.requests:
        content = body["messages"][0]["content"]
        assert [part["type"] for part in content] == ["image_url", "image_url", "text"]
        k = COLOURS.index(_decoded(body).getpixel((0, 0)))
        second = content[1]["image_url"]["url"].split(",", 1)[1]
        assert (
            Image.open(io.BytesIO(base64.b64decode(second))).convert("RGB").tobytes() == results[k].tobytes()
        )
        assert content[2]["text"] == EDIT_RUBRIC.question.replace("{prompt}", PROMPTS[k])
