"""The OpenAI-API rollout engine against a real local HTTP server backed by the tiny Qwen2.5-VL.

The server (tests/openai_server.py) samples with `VLMPolicy.generate`, so the engine's rollout must be
exactly the policy's for the same prompt and seed: the HTTP round trip is only transport.
"""

from __future__ import annotations

import base64
import io
import json
import math
import shutil
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from openai_server import serve, serve_canned
from PIL import Image

from stages.errors import RuntimeFailure, UserInputError
from stages.models.vlm import Rollout, VLMPolicy
from stages.sample.openai_engine import NEUTRAL_SAMPLING, chat_request, generate_openai

MODEL = "tiny-vlm"
QUESTIONS = ["What colour is the square?", "Is the picture wide?", "Are both pictures the same colour?"]
N, MAX_NEW, TEMPERATURE, TOP_P = 3, 12, 0.9, 0.95


def _png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    image = Image.new("RGB", (width, height), colour)
    image.putpixel((3, 5), (255, 255, 255))
    image.save(buf, format="PNG")
    return buf.getvalue()


IMAGES = [
    [_png(56, 56, (220, 20, 20))],
    [_png(112, 56, (20, 20, 220))],
    [_png(56, 56, (20, 200, 20)), _png(56, 56, (220, 20, 20))],
]


def _decoded(images: list[list[bytes]]) -> list[list[Image.Image]]:
    return [[Image.open(io.BytesIO(b)).convert("RGB") for b in imgs] for imgs in images]


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> VLMPolicy:
    from stages.models.factory import init_model

    out = tmp_path_factory.mktemp("vlm") / "qwen2_5_vl-tiny"
    init_model("qwen2_5_vl", out, size="tiny", seed=0)
    return VLMPolicy.load(out)


@pytest.fixture(scope="module")
def server(policy: VLMPolicy) -> Iterator[str]:
    with serve(policy, MODEL) as url:
        yield url


def _policy_rollout(
    policy: VLMPolicy, questions: list[str], images: list[list[bytes]], seeds: list[int]
) -> Rollout:
    """What the engine should return: `policy.generate` per prompt with its seed, right-padded to MAX_NEW."""
    parts = []
    for q, imgs, seed in zip(questions, _decoded(images), seeds):
        prompt = policy.chat_inputs([q], [imgs])
        parts.append(
            policy.generate(
                prompt, n=N, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=MAX_NEW, seed=seed
            )
        )

    def pad(x: torch.Tensor, value: object) -> torch.Tensor:
        return torch.cat([x, torch.full((len(x), MAX_NEW - x.shape[1]), value, dtype=x.dtype)], dim=1)

    pad_id = policy.processor.tokenizer.pad_token_id
    return Rollout(
        [b for b in range(len(parts)) for _ in range(N)],
        torch.cat([pad(p.response_ids, pad_id) for p in parts]),
        torch.cat([pad(p.response_mask, False) for p in parts]),
        torch.cat([pad(p.log_probs, 0.0) for p in parts]),
        [t for p in parts for t in p.text],
    )


def _eos_seed(policy: VLMPolicy) -> int:
    """The first seed whose responses to prompt 0 include one ended by a stop token and one cut by the length."""
    stops = torch.tensor(policy.stop_ids)
    for seed in range(1000):
        roll = _policy_rollout(policy, QUESTIONS[:1], IMAGES[:1], [seed])
        ended = [
            bool(torch.isin(row[m], stops).any()) for row, m in zip(roll.response_ids, roll.response_mask)
        ]
        if any(ended) and not all(ended):
            return seed
    raise AssertionError("no seed in 0..999 samples a stop token: the tiny model changed")


def _sample(url: str, policy: VLMPolicy, seeds: list[int], **kw: object) -> Rollout:
    kw = {"questions": QUESTIONS, "images": IMAGES, **kw}
    return generate_openai(
        url,
        MODEL,
        kw.pop("questions"),
        kw.pop("images"),
        tokenizer=policy.processor.tokenizer,
        n=N,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        max_new_tokens=MAX_NEW,
        seeds=seeds,
        **kw,
    )


@pytest.fixture(scope="module")
def sampled(server: str, policy: VLMPolicy) -> tuple[Rollout, list[int]]:
    seeds = [_eos_seed(policy), 2**62 + 17, 5]
    return _sample(server, policy, seeds), seeds


def test_rollout_equals_policy_generate(policy: VLMPolicy, sampled: tuple[Rollout, list[int]]) -> None:
    roll, seeds = sampled
    want = _policy_rollout(policy, QUESTIONS, IMAGES, seeds)
    assert roll.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert roll.response_ids.dtype == torch.int64 and roll.response_ids.shape == (9, MAX_NEW)
    assert roll.response_mask.dtype == torch.bool and roll.log_probs.dtype == torch.float32
    assert torch.equal(roll.response_ids, want.response_ids)
    assert torch.equal(roll.response_mask, want.response_mask)
    assert float((roll.log_probs - want.log_probs).abs().max()) < 1e-6
    assert roll.text == want.text
    assert (roll.log_probs[~roll.response_mask] == 0).all()
    # The stop token comes back from the server with its log-prob and closes the mask, as in HF generate.
    lengths = roll.response_mask.sum(1)
    ended = [r for r in range(9) if int(roll.response_ids[r, lengths[r] - 1]) in policy.stop_ids]
    assert ended and all(lengths[r] == MAX_NEW or r in ended for r in range(9))
    assert all(float(roll.log_probs[r, lengths[r] - 1]) < 0 for r in ended)
    assert all(
        int(roll.response_ids[r, lengths[r]]) == policy.processor.tokenizer.pad_token_id
        for r in ended
        if lengths[r] < MAX_NEW
    )


def test_replay_reproduces_server_log_probs(policy: VLMPolicy, sampled: tuple[Rollout, list[int]]) -> None:
    roll, _ = sampled
    rows = [q for q in QUESTIONS for _ in range(N)], [im for im in _decoded(IMAGES) for _ in range(N)]
    with torch.no_grad():
        replay = policy.response_log_probs(
            policy.chat_inputs(*rows), roll.response_ids, roll.response_mask, TEMPERATURE
        )
    diff = (replay - roll.log_probs).abs()[roll.response_mask]
    assert diff.numel() > 9 and float(diff.max()) < 1e-5


def test_order_follows_prompts_and_seeds(server: str, policy: VLMPolicy) -> None:
    questions, images = [QUESTIONS[0], QUESTIONS[1], QUESTIONS[0]], [IMAGES[0], IMAGES[1], IMAGES[0]]
    a = _sample(server, policy, [7, 8, 7], questions=questions, images=images, concurrency=3)
    b = _sample(server, policy, [8, 7], questions=QUESTIONS[1::-1], images=IMAGES[1::-1], concurrency=2)
    assert a.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2] and b.prompt_index == [0, 0, 0, 1, 1, 1]
    assert torch.equal(a.response_ids[:N], a.response_ids[2 * N :])  # same prompt, same seed
    assert torch.equal(b.response_ids, torch.cat([a.response_ids[N : 2 * N], a.response_ids[:N]]))
    assert b.text == a.text[N : 2 * N] + a.text[:N]
    assert not torch.equal(a.response_ids[:N], a.response_ids[N : 2 * N])
    # The n responses of one request differ from one another (n samples, not one repeated).
    assert len({tuple(r.tolist()) for r in a.response_ids[:N]}) == N


def test_chat_request_body() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format="JPEG")
    jpeg = buf.getvalue()
    body = chat_request(
        MODEL, "q?", [IMAGES[0][0], jpeg], n=2, temperature=0.7, top_p=0.9, max_new_tokens=5, seed=3
    )
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"] and parts[2]["text"] == "q?"
    urls = [p["image_url"]["url"] for p in parts[:2]]
    assert urls[0].startswith("data:image/png;base64,") and urls[1].startswith("data:image/jpeg;base64,")
    assert base64.b64decode(urls[1].split(",", 1)[1]) == jpeg
    assert body["max_completion_tokens"] == body["max_tokens"] == 5 and body["seed"] == 3
    # every knob vLLM would otherwise take from the model's generation_config.json, at its neutral value
    sampling = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty")
    assert [body[k] for k in sampling] == [0.7, 0.9, -1, 0.0, 1.0, 0.0]
    assert body["frequency_penalty"] == 0.0 and body["min_tokens"] == 0 and body["use_beam_search"] is False
    assert "logit_bias" not in body
    banned = chat_request(
        MODEL, "q?", [], n=1, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=0, banned_ids=[7, 9]
    )
    assert banned["logit_bias"] == {"7": -100, "9": -100}
    assert body["logprobs"] is True and body["top_logprobs"] == 0 and body["return_tokens_as_token_ids"]
    with pytest.raises(UserInputError, match="prompt, image 0"):
        chat_request(MODEL, "q", [b"not an image"], n=1, temperature=1, top_p=1, max_new_tokens=1, seed=0)


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_answers_errors_as_openai_json(server: str) -> None:
    status, body = _post(f"{server}/chat/completions", json.dumps({"model": MODEL}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = _post(
        f"{server}/chat/completions", json.dumps({"model": "other", "messages": []}).encode()
    )
    assert status == 404 and body["error"]["type"] == "NotFoundError"
    status, body = _post(f"{server}/nowhere", b"{}")
    assert status == 404 and "error" in body


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def _assert_one_line(error: pytest.ExceptionInfo, url: str) -> None:
    message = str(error.value)
    assert url in message and "\n" not in message


def test_unreachable_server_is_a_user_error(policy: VLMPolicy) -> None:
    url = _closed_port_url()
    with pytest.raises(UserInputError, match="vllm serve") as e:
        _sample(url, policy, [0, 1, 2])
    _assert_one_line(e, url)


def test_unknown_model_and_wrong_path_are_user_errors(server: str, policy: VLMPolicy) -> None:
    with pytest.raises(UserInputError, match=f"serves {MODEL}; pass one") as e:
        generate_openai(
            server,
            "no-such-model",
            QUESTIONS[:1],
            IMAGES[:1],
            tokenizer=policy.processor.tokenizer,
            n=1,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=2,
            seeds=[0],
        )
    _assert_one_line(e, server)
    root = server.removesuffix("/v1")
    with pytest.raises(UserInputError, match="HTTP 404") as e:
        _sample(root, policy, [0, 1, 2])
    _assert_one_line(e, root)


def _reply(choices: list[dict]) -> bytes:
    return json.dumps({"object": "chat.completion", "model": MODEL, "choices": choices}).encode()


def _choice(index: int, tokens: list[object], logprobs: list[object], finish: str = "length") -> dict:
    content = [{"token": t, "logprob": lp, "top_logprobs": []} for t, lp in zip(tokens, logprobs)]
    return {
        "index": index,
        "message": {"role": "assistant", "content": ""},
        "logprobs": {"content": content},
        "finish_reason": finish,
    }


GOOD = [_choice(j, ["token_id:5", "token_id:6"], [-1.0, -2.0]) for j in range(N)]


@pytest.mark.parametrize(
    ("status", "body", "match"),
    [
        (500, b'{"error": {"message": "CUDA out of memory"}}', "HTTP 500: CUDA out of memory"),
        (200, b'{"choices": [', "not JSON"),
        (200, _reply(GOOD[:2]), f"asked for {N} choices, the reply has 2"),
        (200, _reply([*GOOD[:2], _choice(2, ["token_id:5"], [math.nan])]), "not a finite"),
        (200, _reply([*GOOD[:2], _choice(2, ["token_id:5"], [None])]), "not a finite"),
        (200, _reply([*GOOD[:2], _choice(2, ["token_id:5"], [-9999.0])]), "not a finite"),
        (200, _reply([*GOOD[:2], _choice(2, ["hello"], [-1.0])]), "return_tokens_as_token_ids"),
        (200, _reply([*GOOD[:2], {**GOOD[2], "logprobs": None}]), "no token log-probs"),
        (200, _reply([*GOOD[:2], _choice(2, ["token_id:5"], [-1.0], "stop")]), "without returning its stop"),
        (
            200,
            _reply([*GOOD[:2], _choice(2, ["token_id:5"] * (MAX_NEW + 1), [-1.0] * (MAX_NEW + 1))]),
            "more than",
        ),
    ],
)
def test_server_failures_are_runtime_failures(
    policy: VLMPolicy, status: int, body: bytes, match: str
) -> None:
    with serve_canned(MODEL, status, body) as url, pytest.raises(RuntimeFailure, match=match) as e:
        _sample(url, policy, [0, 1, 2])
    _assert_one_line(e, f"{url}/chat/completions")


def test_canned_good_reply_and_timeout(policy: VLMPolicy) -> None:
    eos = policy.processor.tokenizer.eos_token_id
    stop = [_choice(j, ["token_id:5", f"token_id:{eos}"], [-1.5, -0.25], "stop") for j in range(N)]
    with serve_canned(MODEL, 200, _reply(stop)) as url:
        roll = _sample(url, policy, [0], questions=QUESTIONS[:1], images=IMAGES[:1])
    assert (
        roll.response_ids[:, :2].tolist() == [[5, eos]] * N and roll.response_mask.sum(1).tolist() == [2] * N
    )
    assert roll.log_probs[:, :3].tolist() == [[-1.5, -0.25, 0.0]] * N
    with (
        serve_canned(MODEL, 200, _reply(GOOD), delay=0.6) as url,
        pytest.raises(RuntimeFailure, match=r"no answer within 0\.2 s") as e,
    ):
        _sample(url, policy, [0], questions=QUESTIONS[:1], images=IMAGES[:1], timeout=0.2)
    _assert_one_line(e, url)


@pytest.fixture(scope="module")
def instruct_policy(policy: VLMPolicy, tmp_path_factory: pytest.TempPathFactory) -> VLMPolicy:
    """The tiny VLM whose generation_config.json carries Qwen2.5-VL-Instruct's sampling defaults (top_k 1,
    repetition_penalty 1.05, temperature 0.1, top_p 0.001), which `vllm serve` applies to what a request omits."""
    out = tmp_path_factory.mktemp("vlm-instruct") / "qwen2_5_vl-tiny"
    shutil.copytree(policy.model_path, out)
    path = out / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(do_sample=True, top_k=1, repetition_penalty=1.05, temperature=0.1, top_p=0.001)
    path.write_text(json.dumps(config))
    return VLMPolicy.load(out)


def test_the_model_generation_config_does_not_change_the_distribution(instruct_policy: VLMPolicy) -> None:
    seeds = [5, 6, 7]
    with serve(instruct_policy, MODEL) as url:
        # The server does what vLLM does: a request that leaves the knobs out samples greedily (top_k 1),
        # so the n responses of a group are one response repeated.
        body = chat_request(
            MODEL,
            QUESTIONS[0],
            IMAGES[0],
            n=N,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            max_new_tokens=MAX_NEW,
            seed=5,
        )
        status, reply = _post(
            f"{url}/chat/completions",
            json.dumps({k: v for k, v in body.items() if k not in NEUTRAL_SAMPLING}).encode(),
        )
        assert status == 200
        tokens = [[t["token"] for t in c["logprobs"]["content"]] for c in reply["choices"]]
        assert len(tokens) == N and all(t == tokens[0] for t in tokens)
        roll = _sample(url, instruct_policy, seeds)
    # The engine states every knob: the groups are sampled (they differ) exactly as the hf engine samples them.
    for p in range(len(QUESTIONS)):
        assert len({tuple(r.tolist()) for r in roll.response_ids[p * N : (p + 1) * N]}) == N
    want = _policy_rollout(instruct_policy, QUESTIONS, IMAGES, seeds)
    assert torch.equal(roll.response_ids, want.response_ids) and roll.text == want.text
    assert float((roll.log_probs - want.log_probs).abs().max()) < 1e-6
