"""Remote rewards: `omnirl serve-reward` started for real on 127.0.0.1 and the `remote:URL` client.

Rewards through the server equal the in-process rewards bit for bit; a server killed mid-batch and
restarted loses nothing; malformed, oversized and unauthorised requests get 4xx while the server keeps
serving; a server that stays down stops `score` in one line (or is recorded and flagged). The chat
adapters (flow_grpo's UnifiedReward over sglang, verl-omni's UnifiedReward-2.0) run against a small
OpenAI-compatible server in a thread that answers canned text and records what it was sent.
"""

from __future__ import annotations

import base64
import http.client
import importlib.util
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import fails, run
from PIL import Image

from stages.errors import NonFiniteError, UserInputError
from stages.score.registry import check_reward_args, get_reward, reward_column, reward_kind
from stages.score.rubrics import final_score, three_axis_score
from stages.score.scoring import score_batch

TASK = Path(__file__).resolve().parents[1] / "recipes" / "tasks" / "shapes.py"
TOKEN_ENV = "OMNIRL_TEST_REWARD_TOKEN"
TOKEN = "s3cret-token"
ARGS = {"token_env": TOKEN_ENV, "batch_size": "3", "concurrency": "2"}
# `omnirl score` lists file plugins as lineage inputs through `stages.plugins.spec_file`, which reads the
# '//' of a URL as a path; the CLI tests run once it leaves `remote:` names alone.


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m omnirl_cli serve-reward ARGS --json` in a subprocess; `url` from its ready line."""

    def __init__(self, *args: str, port: int = 0):
        env = {**os.environ, "OMP_NUM_THREADS": "1", TOKEN_ENV: TOKEN}
        cmd = [sys.executable, "-m", "omnirl_cli", "serve-reward", *args, "--port", str(port), "--json"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, self.proc.stderr.read()  # type: ignore[union-attr]
        self.ready = json.loads(line)
        self.url: str = self.ready["url"]
        self.port = int(urllib.parse.urlsplit(self.url).port or 0)
        assert self.ready["pid"] == self.proc.pid

    def stop(self) -> tuple[int, str]:
        """SIGTERM (by PID); the exit status and stderr."""
        os.kill(self.proc.pid, signal.SIGTERM)
        _, err = self.proc.communicate(timeout=20)
        return self.proc.returncode, err

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=20)


def _task() -> Any:
    spec = importlib.util.spec_from_file_location("omnirl_test_remote_shapes_task", TASK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def world() -> tuple[list[Image.Image], list[str], list[dict]]:
    """8 shape images with their GenEval prompts and metadata; odd rows drawn from the next row's
    metadata (partial credit), one row without include clauses (None), and noise in some for JPEG."""
    task = _task()
    rows = task.make_prompts(8, seed=3)
    rng = np.random.default_rng(0)
    images, prompts, meta = [], [], []
    for i, row in enumerate(rows):
        drawn = task.render(rows[(i + 1) % 8] if i % 2 else row, 64, seed=i)
        if i % 3 == 0:
            pixels = np.asarray(drawn, dtype=np.int16) + rng.integers(-6, 7, (64, 64, 3))
            drawn = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        images.append(drawn)
        prompts.append(row["prompt"])
        meta.append({k: v for k, v in row.items() if k != "prompt"})
    meta[5] = {"tag": "single_object"}
    return images, prompts, meta


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A token-protected server of jpeg_compressibility and geneval_shapes (weight 0.5), 1 MiB / 8 images."""
    srv = Server(
        "--reward", "jpeg_compressibility", "--reward", "geneval_shapes=0.5",
        "--token-env", TOKEN_ENV, "--max-request-mb", "1", "--max-batch", "8",
    )  # fmt: skip
    yield srv
    code, err = srv.stop()
    assert code == 0 and "Traceback" not in err, err


def _b64png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _post(url: str, body: bytes | None, headers: dict[str, str], path: str = "/score") -> tuple[int, Any]:
    """A raw POST; (status, decoded JSON reply)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


# ---- the omnirl protocol against the real server -------------------------------------------------


def test_health_lists_the_served_rewards_and_weights(server: Server) -> None:
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as reply:
        assert json.loads(reply.read()) == {
            "status": "ok",
            "rewards": {"jpeg_compressibility": 1.0, "geneval_shapes": 0.5},
        }
    assert server.ready["rewards"] == {"jpeg_compressibility": 1.0, "geneval_shapes": 0.5}
    assert server.url.startswith("http://127.0.0.1:")  # loopback by default


def test_rewards_through_the_server_equal_in_process_bit_for_bit(server: Server, world) -> None:
    images, prompts, meta = world
    for name in ("jpeg_compressibility", "geneval_shapes"):
        remote = get_reward(f"remote:{server.url}/{name}", ARGS)
        local = get_reward(name)(images, prompts, meta)
        got = remote(images, prompts, meta)
        assert got == local  # exact float equality, None where in-process is None
        assert [type(v) for v in got] == [type(v) for v in local]
    assert local[5] is None and len(set(local) - {None}) > 1  # partial credit, not all ones

    # the server's weighted total (/score) equals score_batch's in-process sum, in float32 as stored
    keep = [i for i in range(8) if i != 5]
    picked = [images[i] for i in keep], [prompts[i] for i in keep], [meta[i] for i in keep]
    ids = [f"s{i}" for i in keep]
    in_process = score_batch(
        [("jpeg_compressibility", 1.0), ("geneval_shapes", 0.5)], *picked, sample_ids=ids
    )
    total = f"remote:{server.url}/score"
    through = score_batch([(total, 1.0)], *picked, sample_ids=ids, reward_args={total: ARGS})
    assert torch.equal(through["reward"], in_process["reward"])
    assert torch.equal(through[reward_column(total)], in_process["reward"].double().float())
    expected = [
        1.0 * j + 0.5 * g
        for j, g in zip(
            get_reward("jpeg_compressibility")(*picked), get_reward("geneval_shapes")(*picked), strict=True
        )
    ]
    assert get_reward(total, ARGS)(*picked) == expected


def test_malformed_oversized_and_unauthorised_requests_get_4xx_and_the_server_keeps_serving(
    server: Server, world, monkeypatch: pytest.MonkeyPatch
) -> None:
    images, prompts, meta = world
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    good = json.dumps({"images": [_b64png(images[0])], "prompts": prompts[:1], "meta": meta[:1]}).encode()
    expected = get_reward("jpeg_compressibility")(images[:1], prompts[:1], meta[:1])

    def still_serving() -> None:
        status, reply = _post(server.url, good, auth, "/jpeg_compressibility")
        assert status == 200 and reply["rewards"]["jpeg_compressibility"] == expected

    gif = io.BytesIO()
    images[0].save(gif, format="GIF")
    bad_bodies = {
        b"{not json": "not JSON",
        b"[1, 2]": "not a JSON object",
        json.dumps({"images": ["@@@"], "prompts": ["p"]}).encode(): "not valid base64",
        json.dumps(
            {"images": [base64.b64encode(b"hello").decode()], "prompts": ["p"]}
        ).encode(): "not a readable",
        json.dumps({"images": [base64.b64encode(gif.getvalue()).decode()], "prompts": ["p"]}).encode(): "GIF",
        json.dumps({"images": [_b64png(images[0])], "prompts": ["a", "b"]}).encode(): "one length",
        json.dumps({"images": [_b64png(images[0])], "prompts": [3]}).encode(): "strings",
        b"[" * 100_000 + b"]" * 100_000: "JSON nested too deep",  # was a 500 (RecursionError)
    }
    for body, message in bad_bodies.items():
        status, reply = _post(server.url, body, auth)
        assert status == 400 and message in reply["error"]["message"], (body[:40], reply)
        still_serving()

    for headers in ({"Content-Type": "application/json"}, {**auth, "Authorization": "Bearer wrong"}):
        status, reply = _post(server.url, good, headers)
        assert status == 401 and reply["error"]["code"] == 401
        still_serving()

    oversized = json.dumps({"images": ["A" * (3 * 2**19)], "prompts": ["p"]}).encode()  # 1.5 MiB > 1 MiB
    status, reply = _post(server.url, oversized, auth)
    assert status == 413 and "--max-request-mb" in reply["error"]["message"]
    still_serving()
    nine = json.dumps({"images": [_b64png(images[0])] * 9, "prompts": ["p"] * 9}).encode()
    status, reply = _post(server.url, nine, auth)
    assert status == 413 and "--max-batch 8" in reply["error"]["message"]
    still_serving()

    # a declared body far over the limit is refused unread and the connection closed
    head = f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b"Content-Length: 900000000\r\n\r\n")
        reply_bytes = b""
        while chunk := sock.recv(65536):
            reply_bytes += chunk
    assert reply_bytes.startswith(b"HTTP/1.1 413") and b"Connection: close" in reply_bytes
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 411")
    still_serving()

    status, reply = _post(server.url, good, auth, "/pickscore")
    assert status == 404 and "jpeg_compressibility, geneval_shapes" in reply["error"]["message"]
    dog = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
    body = json.dumps({"images": [_b64png(images[0])], "prompts": ["a dog"], "meta": [dog]}).encode()
    status, reply = _post(server.url, body, auth, "/geneval_shapes")
    assert status == 422 and "'dog' is not a shape" in reply["error"]["message"]
    still_serving()

    # the client turns the refusals a retry cannot fix into one-line user errors
    monkeypatch.setenv(TOKEN_ENV, "wrong")  # read when the reward is built (a new one: retries differ)
    with pytest.raises(UserInputError, match=r"HTTP 401 .*token in \$" + TOKEN_ENV):
        get_reward(f"remote:{server.url}/jpeg_compressibility", {**ARGS, "retries": "7"})(
            images, prompts, meta
        )
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(UserInputError, match=r"HTTP 401 .*token_env=VAR"):
        get_reward(f"remote:{server.url}/jpeg_compressibility")(images, prompts, meta)
    with pytest.raises(UserInputError, match=r"HTTP 413 .*batch_size"):
        get_reward(f"remote:{server.url}/jpeg_compressibility", {**ARGS, "batch_size": "9"})(
            images + images[:1], prompts + prompts[:1], meta + meta[:1]
        )
    with pytest.raises(UserInputError, match=r"HTTP 422 .*'dog' is not a shape"):
        get_reward(f"remote:{server.url}/geneval_shapes", ARGS)(images[:1], ["a dog"], [dog])


SLOW_PLUGIN = '''
import time
from pathlib import Path

from stages.score.image_rewards import jpeg_compressibility


def slow(images, prompts, meta):
    """jpeg_compressibility, 0.15 s per call, each call logged to calls.log beside this file."""
    time.sleep(0.15)
    with open(Path(__file__).with_name("calls.log"), "a") as log:
        log.write(f"{len(images)}\\n")
    return jpeg_compressibility(images, prompts, meta)
'''


def test_killed_mid_batch_and_restarted_the_client_retries_and_loses_nothing(world, tmp_path, caplog) -> None:
    images, prompts, meta = world
    images, prompts, meta = images * 2, prompts * 2, meta * 2  # 16 samples, one request each
    plugin = tmp_path / "slow.py"
    plugin.write_text(SLOW_PLUGIN)
    calls = tmp_path / "calls.log"
    first = Server("--reward", f"{plugin}:slow")
    remote = get_reward(
        f"remote:{first.url}/score",
        {"batch_size": "1", "concurrency": "1", "retries": "12", "backoff": "0.1"},
    )
    out: dict[str, Any] = {}

    def client() -> None:
        try:
            out["values"] = remote(images, prompts, meta)
        except BaseException as exc:  # reported by the assertion below
            out["error"] = exc

    thread = threading.Thread(target=client)
    with caplog.at_level(logging.INFO, logger="stages.score.remote"):
        thread.start()
        deadline = time.monotonic() + 30
        while (not calls.exists() or len(calls.read_text().split()) < 4) and time.monotonic() < deadline:
            time.sleep(0.02)
        first.kill()  # SIGKILL by PID, in the middle of the 16 requests
        served_before = len(calls.read_text().split())
        assert 4 <= served_before < 16
        second = Server("--reward", f"{plugin}:slow", port=first.port)
        try:
            thread.join(timeout=60)
        finally:  # a failed check below leaves no server running
            code, err = second.stop()
    assert not thread.is_alive() and "error" not in out, out.get("error")
    assert out["values"] == get_reward("jpeg_compressibility")(images, prompts, meta)
    assert any("retry 1 of 12" in r.getMessage() for r in caplog.records)
    assert len(calls.read_text().split()) >= 16  # every sample scored by one of the two servers
    assert code == 0 and "Traceback" not in err, err


# ---- a server that stays down --------------------------------------------------------------------


def test_a_down_server_fails_the_batch_naming_url_sample_and_prompt_or_is_flagged(world) -> None:
    images, prompts, meta = world
    port = _free_port()
    name = f"remote:http://127.0.0.1:{port}/jpeg_compressibility"
    args = {"retries": "2", "backoff": "0.01"}
    ids = [f"s{i}" for i in range(8)]
    with pytest.raises(NonFiniteError) as info:
        score_batch([(name, 1.0)], images, prompts, meta, sample_ids=ids, reward_args={name: args})
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    for part in (f"127.0.0.1:{port}", "no answer after 3 tries", repr(prompts[0]), "'s0'", "on_error=zero"):
        assert part in message, message
    flagged = score_batch(
        [(name, 1.0), ("jpeg_compressibility", 0.0)],
        images,
        prompts,
        meta,
        sample_ids=ids,
        on_error="zero",
        reward_args={name: args},
    )
    assert flagged["reward_failed"].all() and flagged[reward_column(name)].eq(0).all()


@pytest.fixture(scope="module")
def image_set(world, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The world's rows with include clauses as a 2-shard image rollout, as `omnirl sample` writes one."""
    from stages.shards.writer import ShardSetWriter

    images, prompts, meta = world
    keep = [i for i in range(8) if i != 5]
    out = tmp_path_factory.mktemp("remote_set") / "samples"
    writer = ShardSetWriter(
        out, num_shards=2, command="sample", config={}, kinds={"image": "image", "prompt_meta": "json"}
    )
    for s, rows in enumerate((keep[:4], keep[4:])):
        blobs = []
        for r in rows:
            buffer = io.BytesIO()
            images[r].save(buffer, format="PNG")
            blobs.append(buffer.getvalue())
        writer.write_shard(
            s,
            {
                "sample_id": [f"s{r}" for r in rows],
                "prompt": [prompts[r] for r in rows],
                "prompt_meta": [meta[r] for r in rows],
                "image": blobs,
            },
        )
    writer.finalize(extra={"modality": "image"})
    return out


def test_omnirl_score_through_the_server_writes_the_in_process_columns(server, image_set, tmp_path) -> None:
    from stages.shards.reader import ShardSet

    run("score", "--in", str(image_set), "--reward", "jpeg_compressibility", "--reward", "geneval_shapes=0.5",
        "--out", str(tmp_path / "local"))  # fmt: skip
    jpeg, geneval = f"remote:{server.url}/jpeg_compressibility", f"remote:{server.url}/geneval_shapes"
    run("score", "--in", str(image_set), "--reward", jpeg, "--reward", f"{geneval}=0.5",
        "--reward-arg", f"{jpeg}.token_env={TOKEN_ENV}", "--reward-arg", f"{geneval}.token_env={TOKEN_ENV}",
        "--out", str(tmp_path / "remote"))  # fmt: skip
    local, remote = ShardSet(tmp_path / "local").read_all(), ShardSet(tmp_path / "remote").read_all()
    assert remote["sample_id"] == local["sample_id"]
    assert torch.equal(remote["reward"], local["reward"])
    assert torch.equal(remote[reward_column(jpeg)], local["reward.jpeg_compressibility"])
    assert torch.equal(remote[reward_column(geneval)], local["reward.geneval_shapes"])
    config = ShardSet(tmp_path / "remote").manifest.config
    assert TOKEN not in json.dumps(config)  # the token's variable is recorded, never the token


def test_omnirl_score_with_a_down_server_is_one_line_exit_2(image_set, tmp_path) -> None:
    port = _free_port()
    name = f"remote:http://127.0.0.1:{port}/jpeg_compressibility"
    flags = ["score", "--in", str(image_set), "--reward", name, "--reward-arg", f"{name}.retries=1"]
    flags += ["--reward-arg", f"{name}.backoff=0"]
    fails([*flags, "--out", str(tmp_path / "r")], f"127.0.0.1:{port}", "'s0'", "no answer after 2 tries")
    assert not (tmp_path / "r" / "_manifest.json").exists()


def test_serve_reward_refuses_bad_setups_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from omnirl_cli.app import app

    result = CliRunner().invoke(app, ["serve-reward", "--help"])
    assert result.exit_code == 0 and "Example" in result.output and "omnirl serve-reward" in result.output
    fails(["serve-reward", "--reward", "bleu"], "--reward bleu", "scores texts")
    fails(["serve-reward"], "--reward")
    monkeypatch.delenv("OMNIRL_TEST_UNSET_VAR", raising=False)
    args = ["serve-reward", "--reward", "jpeg_compressibility", "--token-env", "OMNIRL_TEST_UNSET_VAR"]
    fails(args, "$OMNIRL_TEST_UNSET_VAR is not set")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        fails(
            ["serve-reward", "--reward", "jpeg_compressibility", "--port", port],
            f"--port {port}",
            "cannot bind",
        )


# ---- names, arguments, columns -------------------------------------------------------------------


def test_remote_names_arguments_and_columns() -> None:
    name = "remote:http://127.0.0.1:18090/jpeg_compressibility"
    assert reward_kind(name) == "image"
    assert reward_column(name) == "reward.remote:127.0.0.1:18090:jpeg_compressibility"
    assert reward_column("remote:https://h.example/api/v1") == "reward.remote:h.example:api:v1"
    assert check_reward_args([name], {name: {"timeout": "5", "retries": "0"}}) == {
        name: {"timeout": 5.0, "retries": 0}
    }
    assert get_reward(name, {"batch_size": "4"}) is get_reward(name, {"batch_size": 4})
    cases = {
        (name, "timeout", "soon"): "not of type float",
        (name, "colour", "red"): "no argument 'colour'",
        (name, "token_env", "OMNIRL_TEST_UNSET_VAR"): r"\$OMNIRL_TEST_UNSET_VAR is not set",
        (name, "protocol", "grpc"): "not one of omnirl, unifiedreward, unifiedreward2",
        (name, "protocol", "flow_grpo_geneval"): "exchanges pickles.*omnirl serve-reward",
        (name, "model", "m"): "chat protocols only",
        (name, "retries", "-1"): "retries=-1 must be at least 0",
        ("remote:ftp://h/x", "timeout", "1"): "not an http",
        ("remote:http://h:port/x", "timeout", "1"): "port that is not a number",
        ("remote:http://h:1/x?a", "timeout", "1"): "without query",
    }
    for (reward, key, value), message in cases.items():
        with pytest.raises(UserInputError, match=message):
            check_reward_args([reward], {reward: {key: value}})


# ---- third-party protocols: OpenAI-compatible chat judges ----------------------------------------


class ChatApp:
    """What a local OpenAI-compatible server answers: `answers[prompt]` for a question that contains
    the prompt; the first `fail_first` requests get `fail_status`. Records every request body."""

    def __init__(self, answers: dict[str, str], fail_first: int = 0, fail_status: int = 503):
        self.answers, self.fail_first, self.fail_status = answers, fail_first, fail_status
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def post(self, path: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        with self.lock:
            body = json.loads(raw)
            self.requests.append({"path": path, **body})
            if len(self.requests) <= self.fail_first:
                return self.fail_status, {"error": {"message": "busy", "code": self.fail_status}}
        question = next(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text")
        answer = next(text for prompt, text in self.answers.items() if prompt in question)
        return 200, {"object": "chat.completion", "choices": [{"index": 0, "message": {"content": answer}}]}


class _ChatHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        status, reply = self.server.app.post(self.path, raw)  # type: ignore[attr-defined]
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def chat() -> Iterator[Any]:
    """start(app) → the /v1 URL of `app` served on 127.0.0.1 in a thread."""
    servers = []

    def start(app: ChatApp) -> str:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _ChatHandler)
        srv.app = app  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/v1"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _image(content: dict[str, Any]) -> Image.Image:
    url = next(p["image_url"]["url"] for p in content if p["type"] == "image_url")
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


def test_unifiedreward_speaks_flow_grpos_sglang_request_and_parse(chat, world, caplog) -> None:
    images, _, _ = world
    prompts = ["a red circle", "two squares", "a tree", "a cat", "a dog"]
    answers = {
        "a red circle": "Looks right.\nFinal Score: 4",
        "two squares": "Final Score: 3.5 overall",
        "a tree": "I would say it is good.",  # no score: None, never 0
        "a cat": "Final Score: 7",  # outside 1-5: flow_grpo's pattern does not match
        "a dog": "Final Score:2",
    }
    app = ChatApp(answers, fail_first=2)  # two 503s first: retried
    url = chat(app)
    name = f"remote:{url}"
    reward = get_reward(name, {"protocol": "unifiedreward", "backoff": "0.01", "concurrency": "1"})
    with caplog.at_level(logging.INFO, logger="stages.score.remote"):
        assert reward(images[:5], prompts, [{}] * 5) == [0.8, 0.7, None, None, 0.4]
    assert sum("no score in the answer" in r.getMessage() for r in caplog.records) == 2
    assert sum("HTTP 503" in r.getMessage() for r in caplog.records) == 2
    sent = app.requests[2:]
    assert len(sent) == 5 and all(r["path"] == "/v1/chat/completions" for r in sent)
    for body, image, prompt in zip(sent, images[:5], prompts, strict=True):
        assert body["model"] == "UnifiedReward-7b-v1.5" and body["temperature"] == 0.0
        assert len(body["messages"]) == 1 and body["messages"][0]["role"] == "user"
        content = body["messages"][0]["content"]
        assert [p["type"] for p in content] == ["image_url", "text"]
        assert f"[{prompt}]" in content[1]["text"] and "Final Score:" in content[1]["text"]
        sent_image = _image(content)
        assert sent_image.size == (512, 512)
        assert np.array_equal(np.asarray(sent_image), np.asarray(image.resize((512, 512))))

    custom = ChatApp({"a red circle": "Final Score: 5"})
    reward = get_reward(
        f"remote:{chat(custom)}/chat/completions",
        {"protocol": "unifiedreward", "model": "ur", "template": "Caption <{prompt}>"},
    )
    assert reward(images[:1], ["a red circle"], [{}]) == [1.0]
    assert custom.requests[0]["path"] == "/v1/chat/completions" and custom.requests[0]["model"] == "ur"
    assert custom.requests[0]["messages"][0]["content"][1]["text"] == "Caption <a red circle>"


def test_unifiedreward2_speaks_verl_omnis_three_axis_rubric(chat, world) -> None:
    images, _, _ = world
    prompts = ["p-axes", "p-case", "p-fallback", "p-clip", "p-none"]
    answers = {
        "p-axes": "Alignment Score (1-5): 4\nCoherence Score (1-5): 3\nStyle Score (1-5): 5",
        "p-case": "alignment score: 2\nstyle score: 3.5",  # two axes, no "(1-5)"
        "p-fallback": "I give 4, then 2, then 3.",
        "p-clip": "Alignment Score: 9\nCoherence Score: 8\nStyle Score: 7",
        "p-none": "fine",
    }
    app = ChatApp(answers)
    reward = get_reward(f"remote:{chat(app)}", {"protocol": "unifiedreward2"})
    got = reward(images[:5], prompts, [{}] * 5)
    assert got == [(4 - 1) / 4, ((2 + 3.5) / 2 - 1) / 4, (3 - 1) / 4, 1.0, None]
    assert len(app.requests) == 5  # sent concurrently: matched to samples by the prompt in the question
    for prompt, image in zip(prompts, images[:5], strict=True):
        (body,) = [r for r in app.requests if f"[{prompt}]" in r["messages"][0]["content"][1]["text"]]
        assert body["model"] == "CodeGoat24/UnifiedReward-2.0-qwen3vl-2b"
        assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.0, 1.0, 512)
        assert np.array_equal(np.asarray(_image(body["messages"][0]["content"])), np.asarray(image))


def test_answer_parsers_on_canned_strings() -> None:
    assert final_score("Final Score: 4.25") == 0.85
    assert final_score("final score: 4") is None  # flow_grpo's pattern is case-sensitive
    assert final_score("Final Score: 0") is None
    assert three_axis_score("Alignment Score (1-5): 1\nCoherence Score (1-5): 1\nStyle Score (1-5): 1") == 0.0
    assert three_axis_score("Style Score: 2\nStyle Score: 4") == 0.75  # the later line for an axis wins
    assert three_axis_score("only 1 and 2") is None


def test_chat_errors_a_retry_cannot_fix_are_not_retried(chat, world) -> None:
    images, _, _ = world
    app = ChatApp({"p": "Final Score: 3"}, fail_first=5, fail_status=400)
    reward = get_reward(f"remote:{chat(app)}", {"protocol": "unifiedreward", "retries": "4", "backoff": "0"})
    with pytest.raises(UserInputError, match=r"HTTP 400 \(busy\)"):
        reward(images[:1], ["p"], [{}])
    assert len(app.requests) == 1


def test_a_remote_reward_url_with_credentials_is_refused_without_showing_them() -> None:
    # the URL becomes the reward's column name and is recorded: a password there would be stored
    from stages.score.remote import remote_reward_class

    with pytest.raises(UserInputError, match=r"carries credentials") as info:
        remote_reward_class("http://alice:s3cret@127.0.0.1:18090/jpeg_compressibility")
    assert "s3cret" not in str(info.value) and "alice:***@" in str(info.value)
    with pytest.raises(UserInputError, match=r"not an http") as info:
        remote_reward_class("ftp://alice:s3cret@host/x")
    assert "s3cret" not in str(info.value)
