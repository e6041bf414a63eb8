"""`--engine sglang`: the OpenAI-compatible rollout engine in SGLang's dialect, against a fake SGLang
server (tests/openai_server.py --api sglang) run as its own process on 127.0.0.1 and stopped by its PID.

The fake samples with `VLMPolicy.generate` and, as SGLang does, takes the sampling fields a request
leaves out from the model's generation_config.json; so the engine's rollout must be exactly the
policy's for the same prompt and seed, whatever that config says."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import fails, run
from test_openai_engine import (
    IMAGES,
    MAX_NEW,
    MODEL,
    QUESTIONS,
    TEMPERATURE,
    TOP_P,
    N,
    _eos_seed,
    _policy_rollout,
)

from stages.errors import RuntimeFailure
from stages.models.vlm import VLMPolicy
from stages.sample.openai_engine import SGLANG, VLLM, chat_request, generate_openai
from stages.shards.reader import ShardSet


@pytest.fixture(scope="module")
def instruct(tiny_vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny VLM with Qwen2.5-VL-Instruct's sampling defaults in its generation_config.json (top_k 1,
    repetition_penalty 1.05, temperature 0.1, top_p 0.001), which SGLang applies to what a request omits."""
    out = tmp_path_factory.mktemp("sglang") / "qwen2_5_vl-instruct"
    shutil.copytree(tiny_vlm, out)
    path = out / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(do_sample=True, top_k=1, repetition_penalty=1.05, temperature=0.1, top_p=0.001)
    path.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def server(instruct: Path) -> Iterator[str]:
    """The fake SGLang server as its own process; stopped by its PID (SIGTERM)."""
    script = Path(__file__).with_name("openai_server.py")
    cmd = [sys.executable, str(script), "--model", str(instruct), "--served-model", MODEL, "--api", "sglang"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert ready["pid"] == proc.pid and ready["url"].startswith("http://127.0.0.1:")
        yield ready["url"]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) is not None


def _sample(url: str, policy: VLMPolicy, seeds: list[int], api: object = SGLANG) -> object:
    return generate_openai(
        url, MODEL, QUESTIONS, IMAGES, tokenizer=policy.processor.tokenizer, n=N, temperature=TEMPERATURE,
        top_p=TOP_P, max_new_tokens=MAX_NEW, seeds=seeds, api=api,
    )  # fmt: skip


def test_the_request_states_sglangs_sampling_fields_and_asks_for_token_ids() -> None:
    body = chat_request(MODEL, "q", [], n=2, temperature=0.7, top_p=0.9, max_new_tokens=5, seed=3, api=SGLANG)
    sampling = {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    assert sampling == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    assert (body["presence_penalty"], body["frequency_penalty"], body["min_tokens"]) == (0.0, 0.0, 0)
    assert body["ignore_eos"] is False and body["return_token_ids"] is True and body["seed"] == 3
    assert body["max_completion_tokens"] == 5 and body["logprobs"] is True and body["top_logprobs"] == 0
    # vLLM's own fields are not sent to SGLang
    assert "return_tokens_as_token_ids" not in body and "use_beam_search" not in body


def test_sglang_rollout_equals_policy_generate_whatever_the_generation_config(
    server: str, instruct: Path
) -> None:
    policy = VLMPolicy.load(instruct)
    # what a request that leaves the fields out gets: the config's top_k 1, one response repeated
    body = chat_request(MODEL, QUESTIONS[0], IMAGES[0], n=N, temperature=TEMPERATURE, top_p=TOP_P,
                        max_new_tokens=MAX_NEW, seed=5, api=SGLANG)  # fmt: skip
    bare = {k: v for k, v in body.items() if k not in SGLANG.neutral and k not in ("temperature", "top_p")}
    request = urllib.request.Request(
        f"{server}/chat/completions", json.dumps(bare).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as reply:
        choices = json.loads(reply.read())["choices"]
    assert len({tuple(c["token_ids"]) for c in choices}) == 1
    # the engine states every field: the policy's own distribution, stop tokens returned and kept
    seeds = [_eos_seed(policy), 2**62 + 17, 5]
    roll = _sample(server, policy, seeds)
    want = _policy_rollout(policy, QUESTIONS, IMAGES, seeds)
    assert torch.equal(roll.response_ids, want.response_ids) and torch.equal(
        roll.response_mask, want.response_mask
    )
    assert float((roll.log_probs - want.log_probs).abs().max()) < 1e-6 and roll.text == want.text
    lengths = roll.response_mask.sum(1)
    ended = [r for r in range(len(lengths)) if int(roll.response_ids[r, lengths[r] - 1]) in policy.stop_ids]
    assert ended and all(r in ended or lengths[r] == MAX_NEW for r in range(len(lengths)))
    # vLLM's dialect against SGLang: no "token_id:<int>" tokens come back, refused in one line
    with pytest.raises(RuntimeFailure, match="return_tokens_as_token_ids") as error:
        _sample(server, policy, seeds, api=VLLM)
    assert "\n" not in str(error.value)


def test_sample_engine_sglang_through_the_cli(server: str, instruct: Path, tmp_path: Path) -> None:
    from test_vlm_stages import fix_placeholders, verl_rows

    data = tmp_path / "dots.parquet"
    pq.write_table(pa.Table.from_pylist(fix_placeholders(verl_rows())), data)
    common = ["--model", str(instruct), "--prompts", str(data), "-n", "3", "--max-new-tokens", "6"]
    common += ["--max-prompt-length", "96", "--batch-size", "3", "--seed", "5"]
    fails(
        ["sample", *common, "--engine", "sglang", "--out", str(tmp_path / "x")],
        "--engine sglang",
        "--server-url",
    )
    run("sample", *common, "--out", str(tmp_path / "hf"))
    run("sample", *common, "--engine", "sglang", "--server-url", server, "--served-model", MODEL,
        "--out", str(tmp_path / "sglang"))  # fmt: skip
    hf, api = ShardSet(tmp_path / "hf").read_all(), ShardSet(tmp_path / "sglang").read_all()
    assert hf["response_text"] == api["response_text"]
    assert torch.equal(hf["response_ids"], api["response_ids"])
    assert torch.allclose(hf["log_probs"], api["log_probs"], atol=1e-6)
    assert ShardSet(tmp_path / "sglang").manifest.extra["vlm_sample_config"]["engine"] == "sglang"
