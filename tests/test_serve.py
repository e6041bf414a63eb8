"""`omnirl serve` started for real on 127.0.0.1 and `omnirl sample --engine remote`.

Remote samples equal in-process samples byte for byte and replay with |Δlogp| = 0; a server killed
mid-run and restarted loses and duplicates nothing (the client retries, or a re-run resumes the
shards); an adapter loaded without a restart changes the next samples and the reported version;
malformed and oversized requests get 4xx while the server keeps serving; vLLM-Omni's images route
returns the PNGs asked for.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import PROMPTS, fails, run, runner, sample_args
from PIL import Image

from omnirl_cli.app import app
from stages.models.conditioning import from_bytes, to_bytes
from stages.sample.rollout import SampleConfig
from stages.sample.rollout_protocol import (
    ProtocolError,
    conditioning_item,
    decode_conditioning,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from stages.sample.tensor_codec import encode_tensor

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
WINDOW = ("--sde-window", "2", "--sde-window-range", "0", "4", "--num-shards", "3", "--batch-size", "2")


class Server:
    """`python -m omnirl_cli serve ARGS --json` in a subprocess; `url` from its ready line."""

    def __init__(self, model: Path, *args: str, port: int = 0, env: dict[str, str] | None = None):
        cmd = [sys.executable, "-m", "omnirl_cli", "serve", "--model", str(model), *args]
        cmd += ["--port", str(port), "--json"]
        env = {**ENV, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, self.proc.stderr.read()  # type: ignore[union-attr]
        self.ready = json.loads(line)
        assert self.ready["pid"] == self.proc.pid
        self.url: str = self.ready["url"]
        self.port = int(urllib.parse.urlsplit(self.url).port or 0)

    def stop(self) -> tuple[int, str]:
        """SIGTERM (by PID); the exit status and stderr."""
        os.kill(self.proc.pid, signal.SIGTERM)
        _, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=30)


def _request(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """A raw request; (status, decoded JSON reply)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
        conn.request(method, path, body=data, headers=headers)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


@contextlib.contextmanager
def _serving(service: Any) -> Iterator[str]:
    """`service` (a `RolloutService` built here) behind a `JsonServer` in a thread; its URL."""
    from stages.web import JsonServer

    srv = JsonServer(service)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv.url
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "prompts.txt"
    path.write_text("\n".join([*PROMPTS, "a green cube", "two cats", "a red house"]) + "\n")
    return path


@pytest.fixture(scope="module")
def server(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of the tiny SD3 at most 6 samples, 1 MiB and 1 megapixel-step (10^6 pixel-steps) a request,
    loading adapter folders under the tests' temporary folder."""
    limits = ("--max-batch", "6", "--max-request-mb", "1", "--max-request-cost", "1")
    srv = Server(tiny_sd3, *limits, "--weights-root", str(tmp_path_factory.getbasetemp()))
    yield srv
    code, err = srv.stop()
    assert code == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def reference(tiny_sd3: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The in-process (diffusers engine) samples: 6 prompts × 2, SDE window 2 in [0, 4), 3 shards."""
    out = tmp_path_factory.mktemp("serve") / "local"
    result = run(*sample_args(tiny_sd3, prompts, out, *WINDOW))
    assert result["rows"] == 12 and result["complete"]
    return out


@pytest.fixture(scope="module")
def adapter(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter (rank 4, random B so that it changes the samples) at optimizer step 7."""
    out = tmp_path_factory.mktemp("serve") / "adapter"
    _random_lora(tiny_sd3, 1, out, step=7)
    return out


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("train-*"))}


def _remote(model: Path, prompts: Path, out: Path, url: str, *extra: str) -> list[str]:
    return sample_args(model, prompts, out, *WINDOW, "--engine", "remote", "--server-url", url, *extra)


# ---- equality with the in-process engine, replay ---------------------------------------------------


def test_remote_samples_equal_in_process_ones_and_replay_exactly(
    server: Server, reference: Path, tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "remote"
    result = run(*_remote(tiny_sd3, prompts, out, server.url))
    assert result["rows"] == 12 and result["complete"]
    assert _shards(out) == _shards(reference)  # same ids, seeds, latents, log-probs, PNGs: same bytes
    manifest = json.loads((out / "_manifest.json").read_text())
    local = json.loads((reference / "_manifest.json").read_text())
    assert manifest["config_hash"] == local["config_hash"]
    assert manifest["extra"]["engine"]["name"] == "remote"
    assert manifest["extra"]["engine"]["server_url"] == server.url
    assert manifest["extra"]["engine"]["server_weights"]["version"] == 0
    assert local["extra"]["engine"] == {"name": "diffusers", "device": "cpu"}
    # the server returned the prompt conditioning it sampled with: stored as the in-process engine stores
    # its own, the same tensors, so the replay loads no text encoder, tokenizer or VAE
    record, ours = manifest["extra"]["conditioning"], local["extra"]["conditioning"]
    assert record["identity"] == ours["identity"] and len(record["files"]) == 3
    for a, b in zip(record["files"], ours["files"]):
        remote_entries = from_bytes((out / a["file"]).read_bytes())
        local_entries = from_bytes((reference / b["file"]).read_bytes())
        assert remote_entries.keys() == local_entries.keys() and len(remote_entries) == 2  # 2 prompts a shard
        for key, branches in local_entries.items():
            for theirs, mine in zip(remote_entries[key], branches):
                assert theirs.keys() == mine.keys() and all(torch.equal(theirs[n], mine[n]) for n in mine)
    replay = run("logprob", "--model", str(tiny_sd3), "--in", str(out), "--out", str(tmp_path / "lp"))
    assert replay["abs_delta_max"] == 0.0
    assert replay["conditioning"] == "stored" and replay["loaded_components"] == ["scheduler", "transformer"]
    run("logprob", "--model", str(tiny_sd3), "--in", str(reference), "--out", str(tmp_path / "lp0"))
    assert _shards(tmp_path / "lp") == _shards(tmp_path / "lp0")


def test_a_server_of_another_dtype_is_not_asked_for_conditioning(server: Server, tiny_sd3: Path) -> None:
    """Its conditioning would be another dtype's than the run's: the rollout stores none (encoded
    downstream, as before), and a batch asks for none."""
    from stages.sample.engines import EngineOptions
    from stages.sample.remote_engine import RemoteEngine

    options = dict(model=tiny_sd3, server_url=server.url, startup_timeout=30)
    same = RemoteEngine.open(EngineOptions(**options), "cpu")
    other = RemoteEngine.open(EngineOptions(**options, dtype="bf16"), "cpu")
    assert same.returns_conditioning and not other.returns_conditioning
    cfg = SampleConfig(steps=2, guidance=1.0, resolution=32, sampler="ode")
    args = (cfg, ["a cat"], [""], [1], [1])
    other.rollout(*args, groups=[0], sample_ids=["s0"])
    assert other.conditioning([("a cat", "", cfg.max_sequence_length, "")]) is None and not other.received
    same.rollout(*args, groups=[0], sample_ids=["s0"])
    (entries,) = same.conditioning([("a cat", "", cfg.max_sequence_length, "")]).values()
    assert entries[0] and all(torch.isfinite(t).all() for t in entries[0].values() if t.is_floating_point())


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Wan 2.1 (a video family: 5 frames of 32² are 2 latent frames of 4×4)."""
    out = tmp_path_factory.mktemp("serve-wan") / "wan2_1"
    run("init-model", "--family", "wan2_1", "--size", "tiny", str(out))
    return out


def test_a_video_family_samples_through_serve_as_in_process(wan: Path, tmp_path: Path) -> None:
    """Wan through `omnirl serve`: the MP4 video column, the lossless frames and the 5-D window latents
    come back, so the shards are the in-process ones byte for byte and `logprob` replays them exactly."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red ball\na blue cube\n")
    video = ("--frames", "5", "--fps", "8", "--save-frames", "--sde-window", "2", "--batch-size", "2")
    local = tmp_path / "local"
    run(*sample_args(wan, prompts, local, *video))
    srv = Server(wan)
    try:
        out = tmp_path / "remote"
        result = run(*sample_args(wan, prompts, out, *video, "--engine", "remote", "--server-url", srv.url))
        _check_videos_sync(srv.url, wan)
    finally:
        code, err = srv.stop()
    assert code == 0 and "Traceback" not in err, err
    assert result["rows"] == 4 and _shards(out) == _shards(local)
    manifest = json.loads((out / "_manifest.json").read_text())
    columns = {c["name"]: c for c in manifest["columns"]}
    assert "image" not in columns and columns["video"]["kind"] == "video" and "frames" in columns
    assert columns["latents"]["shape"] == [3, 16, 2, 4, 4]  # [K+1, C, F', h, w]
    replay = run("logprob", "--model", str(wan), "--in", str(out), "--out", str(tmp_path / "lp"))
    assert replay["abs_delta_max"] == 0.0 and replay["rows"] == 4


def _check_videos_sync(url: str, wan: Path) -> None:
    """vLLM-Omni's /v1/videos/sync on a Wan server: a multipart form in, the MP4 out, equal to the
    in-process ODE sample of that seed; refusals are one-line 400s."""
    from stages.media.video import probe_mp4
    from stages.models.diffusion import FlowPolicy
    from stages.models.factory import default_text_length
    from stages.sample.rollout import rollout_batch
    from stages.web import encode_form

    fields = {"model": "wan2_1", "prompt": "a red ball", "size": "32x32", "num_frames": 5, "fps": 8}
    form = encode_form({**fields, "num_inference_steps": 3, "guidance_scale": 2.0, "seed": 11})
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.request("POST", "/v1/videos/sync", body=form.data, headers={"Content-Type": form.content_type})
        reply = conn.getresponse()
        mp4 = reply.read()
        assert reply.status == 200 and reply.getheader("Content-Type") == "video/mp4"
        assert reply.getheader("X-Model") == "wan2_1" and float(reply.getheader("X-Inference-Time-S")) > 0
    finally:
        conn.close()
    info = probe_mp4(mp4)
    assert (info.frames, info.width, info.height, info.fps) == (5, 32, 32, 8.0)
    policy = FlowPolicy.load(wan)
    cfg = SampleConfig(
        steps=3, guidance=2.0, resolution=32, frames=5, fps=8.0, sampler="ode",
        max_sequence_length=default_text_length(wan),
    )  # fmt: skip
    local = rollout_batch(policy, cfg, ["a red ball"], [""], [11], [11], groups=[0], sample_ids=["v"])
    assert local["video"][0] == mp4
    form = encode_form({**fields, "size": "32x16", "num_inference_steps": 1, "seed": 3})  # W×H, not square
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.request("POST", "/v1/videos/sync", body=form.data, headers={"Content-Type": form.content_type})
        reply = conn.getresponse()
        wide = reply.read()
        assert reply.status == 200, wide
    finally:
        conn.close()
    assert (probe_mp4(wide).width, probe_mp4(wide).height) == (32, 16)
    refused = [
        ({**fields, "size": "32x20"}, "--resolution 20x32"),
        ({**fields, "size": "32 by 32"}, "give 'WxH'"),
        ({k: v for k, v in fields.items() if k != "num_frames"}, "num_frames"),
        ({**fields, "num_inference_steps": "many"}, "num_inference_steps must be an integer"),
        ({**fields, "model": "other"}, "not served here"),
        ({**fields, "num_frames": 4}, "--frames 4"),
    ]
    for body, message in refused:
        form = encode_form(body)
        status, error = _request(
            url, "POST", "/v1/videos/sync", raw=form.data, headers={"Content-Type": form.content_type}
        )
        assert status == 400 and message in error["error"]["message"], (body, error)
    status, error = _request(url, "POST", "/v1/videos/sync", fields)  # JSON is not a form
    assert status == 400 and "multipart/form-data" in error["error"]["message"]
    status, error = _request(url, "POST", "/v1/images/generations", {"prompt": "a red ball"})
    assert status == 400 and "/v1/videos/sync" in error["error"]["message"]


# ---- faults: the server dies mid-run ----------------------------------------------------------------


def _client(model: Path, prompts: Path, out: Path, url: str, *extra: str) -> subprocess.Popen:
    args = _remote(model, prompts, out, url, *extra)[1:]
    cmd = [sys.executable, "-m", "omnirl_cli", "sample", *args, "--json", "-q"]  # -q: no progress lines
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _pause_after_first_shard(client: subprocess.Popen, out: Path) -> None:
    """Wait until shard 0 of 3 is written, then stop the client (SIGSTOP) before it finishes the run."""
    deadline = time.monotonic() + 120
    while not (out / ".train-00000-of-00003.parquet.done.json").exists():
        assert client.poll() is None and time.monotonic() < deadline, client.communicate()
        time.sleep(0.005)
    os.kill(client.pid, signal.SIGSTOP)
    assert not (out / ".train-00002-of-00003.parquet.done.json").exists()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_server_killed_mid_run_and_restarted_loses_and_duplicates_nothing(
    server: Server, reference: Path, tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    """The client waits for a server that is starting; when the server dies after shard 0, the client
    retries until a new one answers on the port and completes; a client whose retries run out stops in
    one line (exit 1), and its re-run, on any server of the same weights, resumes after the shards."""
    port = _free_port()
    out = tmp_path / "retried"
    client = _client(tiny_sd3, prompts, out, f"http://127.0.0.1:{port}", "--server-retries", "12")
    time.sleep(0.5)  # the client polls /health meanwhile
    first = Server(tiny_sd3, port=port)
    _pause_after_first_shard(client, out)
    first.kill()
    os.kill(client.pid, signal.SIGCONT)  # its next request meets a dead server: retried with backoff
    time.sleep(1.0)
    second = Server(tiny_sd3, port=port)
    try:
        stdout, stderr = client.communicate(timeout=300)
        assert client.returncode == 0 and "Traceback" not in stderr, stderr
        result = json.loads(stdout)
        assert result["rows"] == 12 and result["rows_written"] == 12 and result["complete"]
        assert _shards(out) == _shards(reference)

        out = tmp_path / "resumed"
        client = _client(tiny_sd3, prompts, out, second.url, "--server-retries", "1")
        _pause_after_first_shard(client, out)
    finally:
        second.kill()
    os.kill(client.pid, signal.SIGCONT)
    _, stderr = client.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert client.returncode == 1, stderr
    assert len(lines) == 1 and second.url in lines[0] and "Traceback" not in stderr, stderr
    assert not (out / "_manifest.json").exists()
    result = run(*_remote(tiny_sd3, prompts, out, server.url))  # the URL is not part of the run
    assert result["shards_resumed"] >= 1 and result["rows_written"] == 12 - 4 * result["shards_resumed"]
    assert _shards(out) == _shards(reference)


def test_no_server_within_the_startup_budget_is_exit_2_naming_the_url_with_progress_meanwhile(
    tiny_sd3: Path, prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    import stages.web.client

    url = f"http://127.0.0.1:{_free_port()}"
    args = _remote(tiny_sd3, prompts, tmp_path / "o", url, "--server-startup-timeout", "1")
    fails(args, url, "no healthy rollout server within 1 s", "Connection refused", "--server-startup-timeout")
    assert not (tmp_path / "o").exists()
    # a person waiting sees what for: a line after HEALTH_FIRST_NOTICE_S, then every HEALTH_NOTICE_S
    monkeypatch.setattr(stages.web.client, "HEALTH_FIRST_NOTICE_S", 0.3)
    monkeypatch.setattr(stages.web.client, "HEALTH_NOTICE_S", 0.5)
    args = _remote(tiny_sd3, prompts, tmp_path / "o", url, "--server-startup-timeout", "1.6")
    with caplog.at_level("WARNING", logger="stages.web"):
        assert runner.invoke(app, args).exit_code == 2
    notices = [
        r.getMessage() for r in caplog.records if "waiting for a healthy rollout server" in r.getMessage()
    ]
    assert len(notices) == 3, notices  # at 0.3, 0.8 and 1.3 s
    assert all(
        url in n and "of --server-startup-timeout 1.6" in n and "Connection refused" in n for n in notices
    )


def test_user_errors_of_the_remote_engine_are_one_line_exit_2(
    server: Server, tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    out = str(tmp_path / "o")
    fails(sample_args(tiny_sd3, prompts, Path(out), "--engine", "remote"), "--engine remote", "--server-url")
    fails(
        sample_args(tiny_sd3, prompts, Path(out), "--engine", "nope"), "--engine nope", "diffusers", "remote"
    )
    fails(_remote(tiny_sd3, prompts, Path(out), "ftp://127.0.0.1:1"), "--server-url", "ftp://127.0.0.1:1")
    fails(_remote(tiny_sd3, prompts, Path(out), server.url + "/v1"), server.url + "/v1", "omnirl serve")
    other = tmp_path / "sd3-other"
    from stages.models.factory import init_model

    init_model("sd3", other, size="tiny", seed=1)
    fails(_remote(other, prompts, Path(out), server.url), server.url, str(other))


# ---- weights loaded without a restart ---------------------------------------------------------------


def test_an_adapter_loaded_without_restart_changes_the_next_samples_and_the_version(
    server: Server, reference: Path, adapter: Path, tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    run(*sample_args(tiny_sd3, prompts, local, *WINDOW, "--adapter", str(adapter)))
    # the server still holds the base model: a run naming the adapter is refused, nothing written
    fails(
        _remote(tiny_sd3, prompts, tmp_path / "x", server.url, "--adapter", str(adapter)),
        "holds the base model",
    )
    status, reply = _request(server.url, "POST", "/omnirl/v1/weights", {"adapter": str(adapter)})
    try:
        assert status == 200, reply
        assert reply["weights"]["version"] == 7 and reply["weights"]["adapter"] == str(adapter)
        assert _request(server.url, "GET", "/health")[1]["weights"]["version"] == 7
        out = tmp_path / "remote"
        run(*_remote(tiny_sd3, prompts, out, server.url, "--adapter", str(adapter)))
        assert _shards(out) == _shards(local)
        manifest = json.loads((out / "_manifest.json").read_text())
        assert manifest["extra"]["engine"]["server_weights"]["version"] == 7
        # a run of the base model now meets the adapter: refused in one line naming it
        fails(_remote(tiny_sd3, prompts, tmp_path / "y", server.url), str(adapter))
        # a pushed version number is reported as given
        status, reply = _request(
            server.url, "POST", "/omnirl/v1/weights", {"adapter": str(adapter), "version": 12}
        )
        assert status == 200 and reply["weights"]["version"] == 12
    finally:
        status, reply = _request(server.url, "POST", "/omnirl/v1/weights", {"adapter": None})
    assert status == 200 and reply["weights"]["version"] == 0 and reply["weights"]["adapter"] is None
    from stages.shards.reader import open_inputs

    images = [open_inputs([p]).read_shard(0, columns=["image"])["image"] for p in (out, reference)]
    assert images[0] != images[1]  # the adapter changed the samples


# ---- refusals ---------------------------------------------------------------------------------------


def _rollout_body(n: int = 2, **params: Any) -> dict[str, Any]:
    cfg = SampleConfig(steps=2, guidance=1.0, resolution=32, max_sequence_length=32)
    for key, value in params.items():
        setattr(cfg, key, value)
    return encode_request(
        "r1", cfg, ["a cat"] * n, [""] * n, list(range(n)), list(range(n)), [0] * n,
        [f"s{i}" for i in range(n)], {},
    )  # fmt: skip


def _random_lora(model: Path, seed: int, out: Path, step: int = 0) -> bytes:
    """A rank-4 LoRA with random B (so it changes the samples) saved at `out`; its LoRA file's bytes."""
    from stages.models.diffusion import FlowPolicy

    policy = FlowPolicy.load(model)
    policy.add_lora(rank=4, alpha=8)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    policy.save_adapter(out, kind="lora", extra={"step": step})
    return policy.lora_file()


def test_named_weights_let_two_trainers_share_a_server_and_a_request_pin_a_version(
    tiny_sd3: Path, tmp_path: Path
) -> None:
    """Two clients push their own LoRA under their own name and interleave batches: each gets the samples
    of its LoRA (equal to in-process ones), unnamed requests still get the server's own weights, a
    request pins a version the server holds, and one it no longer holds is a one-line 409."""
    from stages.errors import UserInputError
    from stages.models.diffusion import FlowPolicy
    from stages.sample.engines import DiffusersEngine, EngineOptions
    from stages.sample.remote_engine import RemoteEngine

    files = {name: _random_lora(tiny_sd3, seed, tmp_path / name) for name, seed in (("a", 1), ("b", 2))}
    cfg = SampleConfig(steps=3, guidance=1.0, resolution=32, window=2, max_sequence_length=32)
    batch = (["a red ball", "two cats"], ["", ""], [5, 6], [7, 8])
    kw = {"groups": [0, 1], "sample_ids": ["s0", "s1"]}

    def local(adapter: Path | None) -> dict[str, Any]:
        return DiffusersEngine(FlowPolicy.load(tiny_sd3, adapter=adapter)).rollout(cfg, *batch, **kw)

    def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
        return got["image"] == want["image"] and all(
            torch.equal(got[k], want[k]) for k in ("final_latent", "latents", "log_probs")
        )

    want = {"a": local(tmp_path / "a"), "b": local(tmp_path / "b"), None: local(None)}
    srv = Server(tiny_sd3, "--max-named-weights", "2")
    try:
        trainers = {
            name: RemoteEngine.open(
                EngineOptions(model=tiny_sd3, server_url=srv.url, pushed_weights=True, weights_name=name),
                "cpu",
            )
            for name in ("a", "b")
        }
        for name, engine in trainers.items():
            assert engine.push_weights(files[name], 1)["load"]["how"] == "stored"
        plain = RemoteEngine.open(EngineOptions(model=tiny_sd3, server_url=srv.url), "cpu")
        for name in ("a", "b", None, "b", "a"):
            engine = plain if name is None else trainers[name]
            got = engine.rollout(cfg, *batch, **kw)
            assert same(got, want[name]), name
            if name is not None:
                assert got["policy_version"].tolist() == [1, 1]
        a = trainers["a"]
        a.push_weights(files["b"], 2)  # "a" now holds versions 1 and 2
        a.pin_weights(1)
        assert same(a.rollout(cfg, *batch, **kw), want["a"])
        a.pin_weights(None)  # the latest
        got = a.rollout(cfg, *batch, **kw)
        assert same(got, want["b"]) and got["policy_version"].tolist() == [2, 2]
        a.push_weights(files["a"], 3)  # keeps the latest two: 2 and 3
        a.pin_weights(1)
        with pytest.raises(UserInputError, match=r"HTTP 409.*'a' version 1 was asked.*versions \[2, 3\]"):
            a.rollout(cfg, *batch, **kw)
        status, health = _request(srv.url, "GET", "/health")
        assert (
            health["named_weights"]["a"]["versions"] == [2, 3]
            and health["named_weights"]["b"]["version"] == 1
        )
        assert health["weights"]["adapter"] is None  # the unnamed weights are untouched
        a.pin_weights(3)
        assert same(a.rollout(cfg, *batch, **kw), want["a"])  # ("a", 3) is on the pipeline now
        a.push_weights(files["b"], 3)  # that version again, other bytes: the next batch swaps them in
        assert same(a.rollout(cfg, *batch, **kw), want["b"])
        b = trainers["b"]
        b.push_weights(files["a"], 0)  # a new run under the same name starts again at 0: the latest pushed
        got = b.rollout(cfg, *batch, **kw)
        assert same(got, want["a"]) and got["policy_version"].tolist() == [0, 0]
        body = _rollout_body()
        body["weights"] = {"name": "nobody"}
        status, reply = _request(srv.url, "POST", "/omnirl/v1/rollout", body)
        assert status == 409 and "no weights named 'nobody'" in reply["error"]["message"]
        # two names held, the --max-named-weights: a third is refused until one is forgotten
        status, reply = _request(srv.url, "POST", "/omnirl/v1/weights?" + urllib.parse.urlencode(
            {"name": "c", "sha256": hashlib.sha256(files["a"]).hexdigest(), "version": 0}), raw=files["a"])  # fmt: skip
        assert status == 409 and "holds 2 named weights, its --max-named-weights" in reply["error"]["message"]
        status, reply = _request(srv.url, "DELETE", "/omnirl/v1/weights?name=a&version=2")
        assert status == 200 and reply["deleted"] == {"name": "a", "versions": [2]}
        assert reply["named_weights"]["a"]["versions"] == [3]
        a.pin_weights(2)
        with pytest.raises(UserInputError, match=r"HTTP 409.*'a' version 2 was asked.*versions \[3\]"):
            a.rollout(cfg, *batch, **kw)
        a.close()  # forgets "a" (every version) on the server
        status, health = _request(srv.url, "GET", "/health")
        assert set(health["named_weights"]) == {"b"}
        for query, code, words in [
            ("name=a", 404, "no weights named 'a'"),
            ("name=b&version=7", 404, "'b' version 7 is not held (versions [0, 1])"),
            ("name=b&version=x", 400, "version 'x' is not a non-negative integer"),
            ("", 400, "name the weights to forget"),
        ]:
            status, reply = _request(srv.url, "DELETE", "/omnirl/v1/weights?" + query)
            assert status == code and words in reply["error"]["message"], (query, reply)
        status, reply = _request(srv.url, "DELETE", "/omnirl/v1/weights?name=b", raw=b"{}")
        assert status == 400 and "DELETE takes no body" in reply["error"]["message"]
        srv_health = _request(srv.url, "GET", "/health")[1]
        assert set(srv_health["named_weights"]) == {"b"}  # the refused DELETE forgot nothing
        status, reply = _request(srv.url, "DELETE", "/health")
        assert status == 404 and "no route DELETE /health" in reply["error"]["message"]
        assert trainers["b"].push_weights(files["b"], 1)["load"]["how"] == "stored"
        c = RemoteEngine.open(
            EngineOptions(model=tiny_sd3, server_url=srv.url, pushed_weights=True, weights_name="c"), "cpu"
        )
        assert c.push_weights(files["a"], 0)["load"]["how"] == "stored"  # room again
        assert same(c.rollout(cfg, *batch, **kw), want["a"])
    finally:
        code, err = srv.stop()
    assert code == 0 and "Traceback" not in err, err


def test_the_names_of_killed_trainers_run_out_so_a_17th_run_gets_a_place(
    tiny_sd3: Path, tmp_path: Path
) -> None:
    """15 trainers push named weights and are killed (never renew, never DELETE); one more keeps running:
    the server then holds 16 names, its --max-named-weights, and a 17th run is 409. Once the killed
    ones' leases (--named-weights-ttl 2) run out they are forgotten, the running trainer's (renewed by
    its engine's heartbeat) is kept, and the 17th run gets its place."""
    from stages.sample.engines import EngineOptions
    from stages.sample.remote_engine import RemoteEngine

    raw = _random_lora(tiny_sd3, 1, tmp_path / "lora")
    digest = hashlib.sha256(raw).hexdigest()

    def push(url: str, name: str) -> tuple[int, Any]:
        query = urllib.parse.urlencode({"name": name, "sha256": digest, "version": 0})
        return _request(url, "POST", f"/omnirl/v1/weights?{query}", raw=raw)

    srv = Server(tiny_sd3, "--named-weights-ttl", "2")
    try:
        alive = RemoteEngine.open(
            EngineOptions(model=tiny_sd3, server_url=srv.url, pushed_weights=True, weights_name="alive"),
            "cpu",
        )
        assert alive.push_weights(raw, 0)["weights"]["lease_s"] == 2
        t0 = time.monotonic()
        for i in range(15):
            assert push(srv.url, f"killed-{i}")[0] == 200
        held = _request(srv.url, "GET", "/omnirl/v1/weights")[1]["named_weights"]
        assert len(held) == 16 and 0 < held["killed-0"]["lease_left_s"] <= 2
        status, reply = push(srv.url, "run-17")
        assert (
            status == 409 and "holds 16 named weights, its --max-named-weights" in reply["error"]["message"]
        )
        time.sleep(max(0.0, t0 + 2.5 - time.monotonic()))  # the killed ones' leases run out
        status, reply = push(srv.url, "run-17")
        assert status == 200 and reply["weights"]["name"] == "run-17", reply
        assert set(_request(srv.url, "GET", "/omnirl/v1/weights")[1]["named_weights"]) == {"alive", "run-17"}
        status, reply = _request(srv.url, "POST", "/omnirl/v1/weights/lease", {"name": "killed-0"})
        assert status == 404 and "its lease ran out" in reply["error"]["message"]
        status, reply = _request(srv.url, "POST", "/omnirl/v1/weights/lease", {"name": "run-17"})
        assert status == 200 and reply == {"name": "run-17", "versions": [0], "lease_s": 2}
        alive.close()  # stops the heartbeat, forgets "alive"
        assert set(_request(srv.url, "GET", "/omnirl/v1/weights")[1]["named_weights"]) == {"run-17"}
    finally:
        code, err = srv.stop()
    assert code == 0 and "Traceback" not in err, err


def test_malformed_and_oversized_requests_get_4xx_and_the_server_keeps_serving(server: Server) -> None:
    good = _rollout_body()
    bad_seed = _rollout_body()
    bad_seed["samples"][0]["seed"] = -1
    cases = [
        (400, "POST", "/omnirl/v1/rollout", None, b"{not json"),
        (400, "POST", "/omnirl/v1/rollout", [1, 2], None),
        (400, "POST", "/omnirl/v1/rollout", {**good, "version": 2}, None),
        (400, "POST", "/omnirl/v1/rollout", _rollout_body(sampler="euler"), None),
        (400, "POST", "/omnirl/v1/rollout", {**good, "sampling_params": {"steps": 2, "bogus": 1}}, None),
        (400, "POST", "/omnirl/v1/rollout", bad_seed, None),
        (400, "POST", "/omnirl/v1/rollout", {**good, "samples": []}, None),
        (413, "POST", "/omnirl/v1/rollout", _rollout_body(n=7), None),
        (413, "POST", "/omnirl/v1/rollout", None, b" " * (2 * 2**20)),
        (413, "POST", "/omnirl/v1/rollout", _rollout_body(resolution=8192), None),
        (409, "POST", "/omnirl/v1/rollout", {**good, "weights": {"model_sha256": "0" * 64}}, None),
        (404, "POST", "/omnirl/v1/nothing", {}, None),
        (404, "GET", "/nothing", None, None),
        (403, "POST", "/omnirl/v1/weights", {"adapter": "/no/such/adapter"}, None),  # outside --weights-root
        (422, "POST", "/omnirl/v1/weights", {"adapter": "."}, None),  # the root: not an adapter folder
        (400, "POST", "/v1/images/generations", {"prompt": "x", "n": 11}, None),
        (400, "POST", "/v1/images/generations", {"prompt": "x", "size": "32x36"}, None),
        (400, "POST", "/omnirl/v1/latent_shape", {"resolution": [32, 0]}, None),
        (400, "POST", "/omnirl/v1/latent_shape", {"resolution": [32, 36]}, None),
        (400, "POST", "/v1/images/generations", {"prompt": "x", "model": "other"}, None),
        (400, "POST", "/v1/images/generations", {"n": 1}, None),
        (400, "POST", "/v1/images/generations", {"prompt": "x", "guidance_scale": 21}, None),
    ]
    for status, method, path, body, raw in cases:
        got, reply = _request(server.url, method, path, body, raw)
        assert got == status, (path, body if raw is None else raw[:20], reply)
        assert isinstance(reply["error"]["message"], str) and reply["error"]["code"] == status
    status, reply = _request(server.url, "POST", "/omnirl/v1/rollout", good)
    assert status == 200 and reply["request_id"] == "r1" and len(reply["media"]) == 2
    version, columns = decode_response(reply, good)
    assert version == 0 and columns["latents"].shape[:2] == (2, 3) and columns["log_probs"].shape == (2, 2)
    assert _request(server.url, "GET", "/health")[0] == 200


def test_a_sampling_param_of_another_type_or_not_finite_is_400_naming_it(server: Server) -> None:
    """Every ``sampling_params`` field is checked against its type (`SampleConfig`'s) before anything
    runs: a string for a number, a non-finite number, a number for a flag is a 400 naming the field."""
    cases = {
        "steps": ("abc", "must be an integer, not 'abc'"),
        "guidance": ("x", "must be a finite number, not 'x'"),
        "noise_level": (float("nan"), "must be a finite number, not nan"),
        "fps": (float("inf"), "must be a finite number, not inf"),
        "roll_back": (1, "must be true or false, not 1"),
        "window_range": ([0, "4"], "must be [an integer, an integer] or null, not [0, '4']"),
        "resolution": ("big", "must be an integer or [an integer, an integer], not 'big'"),
    }
    for key, (value, words) in cases.items():
        body = _rollout_body()
        body["sampling_params"][key] = value
        raw = json.dumps(body).encode()  # NaN and Infinity as Python's json writes (and reads) them
        status, reply = _request(server.url, "POST", "/omnirl/v1/rollout", raw=raw)
        assert status == 400, (key, reply)
        assert reply["error"]["message"] == f"sampling_params.{key} {words}", reply
    assert _request(server.url, "POST", "/omnirl/v1/rollout", _rollout_body())[0] == 200


def test_a_request_over_the_cost_limit_is_413_naming_the_limit_and_its_cost(server: Server) -> None:
    """--max-request-cost 1 (megapixel-step): each route that samples refuses a request over it before
    running it, naming the limit and what the request costs; one under it is served."""
    images = {"prompt": "x", "n": 2, "size": "64x32", "num_inference_steps": 200}  # 0.8192 Mpx-steps
    assert _request(server.url, "POST", "/v1/images/generations", images)[0] == 200
    for path, body, cost in [
        ("/omnirl/v1/rollout", _rollout_body(steps=500), "1.024 megapixel-steps (2 samples of 32x32 pixels × 500 steps)"),
        ("/v1/images/generations", {**images, "n": 3}, "1.2288 megapixel-steps (3 samples of 32x64 pixels × 200 steps)"),
    ]:  # fmt: skip
        status, reply = _request(server.url, "POST", path, body)
        assert status == 413, reply
        assert reply["error"]["message"] == (
            f"the request costs {cost}, more than the server's --max-request-cost 1; "
            "send fewer samples or steps per request"
        )


def test_an_abandoned_batch_stops_at_the_next_step_and_frees_the_model(
    tiny_sd3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends a 1000-step batch and hangs up after 3 steps: the server stops that batch
    at its next denoising step (the transformer runs a step or two more, not 997), replies nothing, and
    the next client's 2-step batch takes about its time alone."""
    from stages.sample.rollout_server import RolloutService

    service = RolloutService(tiny_sd3)
    policy = service.engine.policy
    forwards: list[int] = []
    velocity = policy.velocity
    monkeypatch.setattr(policy, "velocity", lambda *a, **k: forwards.append(1) or velocity(*a, **k))
    with _serving(service) as url:
        short = _rollout_body(steps=2, resolution=64)
        t0 = time.perf_counter()
        assert _request(url, "POST", "/omnirl/v1/rollout", short)[0] == 200  # also warms up
        alone = time.perf_counter() - t0
        forwards.clear()
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        body = json.dumps(_rollout_body(steps=1000, resolution=64)).encode()
        conn.request("POST", "/omnirl/v1/rollout", body, {"Content-Type": "application/json"})
        deadline = time.monotonic() + 60
        while len(forwards) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        at_hang_up = len(forwards)
        conn.close()  # the client gives up
        t0 = time.perf_counter()
        status, reply = _request(url, "POST", "/omnirl/v1/rollout", short)
        after = time.perf_counter() - t0
        assert status == 200 and len(reply["media"]) == 2
        abandoned = len(forwards) - 2  # the 2-step batch ran 2
        print(
            f"\nabandoned after {at_hang_up} steps, ran {abandoned}; next batch {after:.2f} s, alone {alone:.2f} s"
        )
        assert 3 <= at_hang_up <= abandoned <= at_hang_up + 2
        assert after < 3 * alone + 1.0


def test_a_token_guards_everything_but_health(tiny_sd3: Path) -> None:
    from stages.sample.rollout_server import RolloutService

    with _serving(RolloutService(tiny_sd3, token="s3cret")) as url:
        assert _request(url, "GET", "/health")[0] == 200
        assert _request(url, "GET", "/v1/models")[0] == 401
        assert _request(url, "POST", "/omnirl/v1/rollout", _rollout_body())[0] == 401
        assert _request(url, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})[0] == 200


def test_a_folder_loads_by_path_only_under_the_weights_root_or_with_a_token(
    tiny_sd3: Path, tmp_path: Path
) -> None:
    """A path in POST /omnirl/v1/weights makes the server read with its own rights: under --weights-root
    it loads (a relative path is taken there), outside it (a symlink resolved first) it is 403 with the
    same reply whether the folder exists or not; without a root a server loads a folder by path only
    when it has a token. A pushed LoRA file reads nothing of the server's and needs neither."""
    from stages.sample.rollout_server import RolloutService

    root, outside = tmp_path / "root", tmp_path / "outside"
    raw = _random_lora(tiny_sd3, 1, root / "run" / "it3", step=3)
    _random_lora(tiny_sd3, 1, outside, step=4)
    (root / "escape").symlink_to(outside)
    weights = "/omnirl/v1/weights"
    with _serving(RolloutService(tiny_sd3)) as url:  # no root, no token: no folder by path
        for path in (str(outside), str(tmp_path / "missing")):
            status, reply = _request(url, "POST", weights, {"adapter": path})
            assert status == 403 and "start it with --weights-root DIR" in reply["error"]["message"]
        query = urllib.parse.urlencode({"sha256": hashlib.sha256(raw).hexdigest(), "version": 6})
        status, reply = _request(url, "POST", f"{weights}?{query}", raw=raw)
        assert status == 200 and reply["weights"]["version"] == 6  # a pushed file still loads
        assert _request(url, "POST", weights, {"adapter": None})[0] == 200  # and the base model
    with _serving(RolloutService(tiny_sd3, weights_root=root)) as url:
        status, reply = _request(url, "POST", weights, {"adapter": "run/it3"})
        assert status == 200 and reply["weights"]["adapter"] == str((root / "run" / "it3").resolve())
        assert reply["weights"]["version"] == 3
        assert _request(url, "POST", weights, {"adapter": str(root / "run" / "it3"), "version": 5})[0] == 200
        refusals = [
            _request(url, "POST", weights, {"adapter": path})
            for path in (str(outside), "escape", "../outside", str(root / "missing"))
        ]
        shutil.rmtree(outside)
        refusals.append(_request(url, "POST", weights, {"adapter": str(outside)}))  # gone now
        assert all(r == refusals[0] for r in refusals), refusals
        status, reply = refusals[0]
        assert status == 403 and reply["error"]["message"].startswith(
            "adapter: no such folder under this server's --weights-root;"
        )
        assert _request(url, "GET", weights)[1]["weights"]["version"] == 5  # the refusals changed nothing
    _random_lora(tiny_sd3, 1, outside, step=4)
    bearer = {"Authorization": "Bearer s3cret"}
    with _serving(RolloutService(tiny_sd3, token="s3cret")) as url:  # a token holder names any folder
        status, reply = _request(url, "POST", weights, {"adapter": str(outside)}, headers=bearer)
        assert status == 200 and reply["weights"]["version"] == 4


# ---- vLLM-Omni's images API -------------------------------------------------------------------------


def test_images_generations_returns_the_requested_pngs(server: Server) -> None:
    status, models = _request(server.url, "GET", "/v1/models")
    assert status == 200 and models["object"] == "list" and models["data"][0]["id"] == "sd3-tiny"
    body = {
        "prompt": "a red apple",
        "n": 3,
        "size": "32x32",
        "seed": 5,
        "num_inference_steps": 3,
        "guidance_scale": 1.0,
    }
    status, reply = _request(server.url, "POST", "/v1/images/generations", {**body, "model": "sd3-tiny"})
    assert status == 200, reply
    assert reply["output_format"] == "png" and reply["size"] == "32x32" and len(reply["data"]) == 3
    images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in reply["data"]]
    assert all(im.format == "PNG" and im.size == (32, 32) for im in images)
    assert all(d["url"] is None and d["revised_prompt"] is None for d in reply["data"])
    again = _request(server.url, "POST", "/v1/images/generations", {**body, "n": 1, "seed": 6})[1]
    assert again["data"][0]["b64_json"] == reply["data"][1]["b64_json"]  # image i draws from seed + i
    assert len({d["b64_json"] for d in reply["data"]}) == 3
    # "WxH" is width first: 64 wide, 32 high
    status, wide = _request(server.url, "POST", "/v1/images/generations", {**body, "n": 1, "size": "64x32"})
    assert status == 200 and wide["size"] == "64x32", wide
    assert Image.open(io.BytesIO(base64.b64decode(wide["data"][0]["b64_json"]))).size == (64, 32)


def test_latent_shape_takes_a_side_or_height_and_width(server: Server, tiny_sd3: Path) -> None:
    from stages.models.diffusion import FlowPolicy
    from stages.sample.remote_engine import RemoteEngine, RolloutClient

    policy = FlowPolicy.load(tiny_sd3)
    for resolution, size in ((32, (32, 32)), ([32, 64], (32, 64))):
        status, reply = _request(server.url, "POST", "/omnirl/v1/latent_shape", {"resolution": resolution})
        assert status == 200 and reply["latent_shape"] == list(policy.latent_shape(size)), reply
    engine = RemoteEngine(RolloutClient(server.url, token=None, timeout=30, retries=0), {}, {})
    assert engine.latent_shape((32, 64)) == policy.latent_shape((32, 64))


# ---- the protocol's checks of a reply ---------------------------------------------------------------


def test_a_reply_is_checked_for_id_count_shapes_and_finiteness() -> None:
    request = _rollout_body(n=2)
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    columns = {
        "image": [png.getvalue()] * 2,
        "final_latent": torch.zeros(2, 4, 2, 2),
        "latents": torch.zeros(2, 3, 4, 2, 2),
        "sigmas": torch.ones(2, 3),
        "timesteps": torch.ones(2, 2),
        "log_probs": torch.zeros(2, 2),
    }
    reply = encode_response("r1", 3, columns)
    version, back = decode_response(json.loads(json.dumps(reply)), request)
    assert version == 3 and all(torch.equal(back[k], columns[k]) for k in columns if k != "image")
    assert back["image"] == columns["image"]
    broken = [
        ({**reply, "request_id": "r2"}, "reply to request"),
        ({**reply, "media": reply["media"][:1]}, "media must list 2"),
        ({**reply, "finish_reason": "abort"}, "finish_reason"),
        ({**reply, "final_latent": encode_tensor(torch.zeros(3, 4, 2, 2))}, "final_latent has shape"),
        (
            {**reply, "trajectory": {**reply["trajectory"], "log_probs": encode_tensor(torch.zeros(2, 3))}},
            "log_probs",
        ),
        (
            {
                **reply,
                "trajectory": {
                    **reply["trajectory"],
                    "latents": encode_tensor(torch.full((2, 3, 4, 2, 2), float("nan"))),
                },
            },
            "NaN",
        ),
        ({**reply, "trajectory": None}, "2 stored steps"),
        ({**reply, "media": [{"format": "png", "data": "AAAA"}] * 2}, "not a base64 PNG"),
    ]
    for body, message in broken:
        with pytest.raises(ProtocolError, match=message):
            decode_response(body, request)


def test_the_conditioning_asked_for_travels_bit_for_bit_and_a_forged_one_is_refused() -> None:
    from stages.web import pack_binary, unpack_binary

    request = _rollout_body(n=2)
    assert "return_conditioning" not in request  # not asked: the body an older server reads
    request = {**request, "return_conditioning": True}
    assert decode_request(request, max_samples=2).conditioning_keys() == [("a cat", "", 32, "")]
    with pytest.raises(ProtocolError, match="return_conditioning must be true or false"):
        decode_request({**request, "return_conditioning": "yes"}, max_samples=2)
    g = torch.Generator().manual_seed(0)
    pos = {"prompt_embeds": torch.randn(5, 8, generator=g), "mask": torch.ones(5, dtype=torch.bool)}
    entries = {("a cat", "", 32, ""): (pos, {"prompt_embeds": torch.randn(5, 8, generator=g)})}
    reply = encode_response("r1", 0, {"image": [b""] * 2, "final_latent": torch.zeros(2, 4, 2, 2)}, entries)
    for body in (json.loads(json.dumps(reply)), unpack_binary(pack_binary(reply))):
        back = decode_conditioning(body, request)
        assert back is not None and back.keys() == entries.keys()
        for theirs, mine in zip(back[("a cat", "", 32, "")], entries[("a cat", "", 32, "")]):
            assert all(torch.equal(theirs[n], mine[n]) and theirs[n].dtype == mine[n].dtype for n in mine)
    assert decode_conditioning({k: v for k, v in reply.items() if k != "conditioning"}, request) is None
    nan = {
        key: ({**p, "prompt_embeds": torch.full((5, 8), float("nan"))}, n) for key, (p, n) in entries.items()
    }
    forged = [
        (
            conditioning_item({("a dog", "", 32, ""): entries[("a cat", "", 32, "")]}),
            "holds 1 prompts, not the batch",
        ),
        (conditioning_item({}), "holds 0 prompts"),
        (conditioning_item(nan), "prompt_embeds is not finite"),
        ({"format": "safetensors", "encoding": "base64", "data": "AAAA"}, "not a base64 safetensors"),
        ({"format": "pickle", "encoding": "base64", "data": reply["conditioning"]["data"]}, "safetensors"),
        ({**reply["conditioning"], "data": base64.b64encode(to_bytes(entries)[:-3]).decode()}, "safetensors"),
    ]
    for item, message in forged:
        with pytest.raises(ProtocolError, match=message):
            decode_conditioning({**reply, "conditioning": item}, request)
