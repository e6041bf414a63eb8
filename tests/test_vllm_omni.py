"""`omnirl sample --engine vllm-omni` against a fake `vllm serve --omni` (tests/vllm_omni_server.py), run
for real on 127.0.0.1 and stopped by its PID.

Images mode sends one request per sample with the sample's seed and vLLM-Omni's field names, keeps the
PNGs it gets back (each the image the fake draws for that seed), records that no trajectory exists,
and feeds `score` and `encode`, while `logprob` refuses it in one line. Faults: a 4xx is not retried
(exit 2, one line, one request), a 503 is retried with the same seed, an aborted sample (no image) is
drawn again with the same seed a bounded number of times, and a malformed reply stops the run in one
line without writing a shard.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import signal
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import fails, run, runner, sample_args
from PIL import Image

from omnirl_cli.app import app
from stages.sample.rollout_protocol import MAX_REDRAWS
from stages.shards.reader import ShardSet

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from vllm_omni_server import fake_image  # noqa: E402

SERVED = "tiny-sd3"


class FakeServer:
    """tests/vllm_omni_server.py in a subprocess; `url` from its ready line, stopped by PID."""

    def __init__(self, *args: str):
        cmd = [sys.executable, str(HERE / "vllm_omni_server.py"), "--served-model", SERVED, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]
        assert ready["pid"] == self.proc.pid
        self.url: str = ready["url"]

    def call(self, method: str, path: str, body: Any = None) -> Any:
        parts = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            assert reply.status == 200
            return json.loads(reply.read())
        finally:
            conn.close()

    def faults(self, *kinds: str) -> None:
        self.call("POST", "/fake/reset", {})
        self.call("POST", "/fake/faults", {"faults": list(kinds)})

    def log(self) -> list[dict[str, Any]]:
        return self.call("GET", "/fake/log")["requests"]

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    """The fake, answering /health with 503 for its first second (the client polls until 200)."""
    server = FakeServer("--warmup", "1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm_omni") / "prompts.txt"
    path.write_text("a red apple\nnot a cat\n")
    return path


def _args(model: Path, prompts: Path, out: Path, url: str, *extra: str) -> list[str]:
    """2 prompts × 2 at 32 px, ODE, batches of 2, through the fake."""
    args = sample_args(model, prompts, out, "--engine", "vllm-omni", "--server-url", url, "--sampler", "ode")
    return [*args, "--batch-size", "2", "--server-retries", "3", *extra]


def _exit_1(args: list[str], *names: str) -> str:
    """Run `omnirl ARGS`: exit 1, one stderr line naming every one of `names`; that line."""
    result = runner.invoke(app, args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(name in lines[0] for name in names), lines[0]
    return lines[0]


def test_images_mode_samples_one_request_per_sample_with_its_seed_then_scores_and_encodes(
    fake: FakeServer, tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    fake.faults()
    out = tmp_path / "samples"
    result = run(*_args(tiny_sd3, prompts, out, fake.url))
    assert result["rows"] == 4 and result["complete"]
    rows = ShardSet(out).read_all()
    assert "latents" not in rows and "final_latent" not in rows
    sent = fake.log()
    assert len(sent) == 4  # one request per sample, none retried
    by_seed = {body["seed"]: body for body in sent}
    seeds = rows["seed"].tolist()
    assert sorted(by_seed) == sorted(seeds) and len(set(seeds)) == 4
    for prompt, seed, blob in zip(rows["prompt"], seeds, rows["image"]):
        body = by_seed[seed]
        assert body["prompt"] == prompt and "negative_prompt" not in body  # none in a .txt prompt file
        assert (body["model"], body["n"], body["size"], body["num_inference_steps"]) == (
            SERVED,
            1,
            "32x32",
            4,
        )
        assert body["guidance_scale"] == 1.0 and body["response_format"] == "b64_json"
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(blob))), fake_image(prompt, seed, 32, 32))
    engine = json.loads((out / "_manifest.json").read_text())["extra"]["engine"]
    assert engine["name"] == "vllm-omni" and engine["mode"] == "images" and engine["trajectory"] == "absent"
    assert engine["served_model"] == SERVED and engine["server_url"] == fake.url

    # its samples are not the diffusers engine's: the output is not resumed by another engine
    fails(
        sample_args(tiny_sd3, prompts, out, "--sampler", "ode", "--batch-size", "2"), str(out), "--overwrite"
    )

    rewards = run("score", "--in", str(out), "--reward", "jpeg_compressibility", "--out", str(tmp_path / "r"))
    assert rewards["rows"] == 4
    scored = ShardSet(tmp_path / "r").read_all()["reward"].tolist()
    from stages.score.image_rewards import jpeg_compressibility

    images = [Image.open(io.BytesIO(b)) for b in rows["image"]]
    assert scored == pytest.approx(jpeg_compressibility(images, [], []), rel=1e-6)

    replay = ["logprob", "--model", str(tiny_sd3), "--in", str(out), "--out", str(tmp_path / "lp")]
    fails(replay, "--in", "images only", "encode")
    encoded = run(
        "encode",
        "--model",
        str(tiny_sd3),
        "--in",
        str(out),
        "--resolution",
        "32",
        "--out",
        str(tmp_path / "e"),
    )
    assert encoded["rows"] == 4
    latents = ShardSet(tmp_path / "e").read_all()["final_latent"]
    from stages.models.diffusion import FlowPolicy

    assert tuple(latents.shape) == (4, *FlowPolicy.load(tiny_sd3).latent_shape(32))


def test_a_4xx_is_not_retried_a_503_is_and_a_500_once(
    fake: FakeServer, tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    fake.faults()
    fails(
        _args(tiny_sd3, prompts, tmp_path / "a", fake.url, "--guidance", "25"),
        "HTTP 422",
        "guidance_scale",
        "20",
    )
    assert len(fake.log()) in (1, 2)  # the batch's two samples go at once; neither is sent twice
    assert len({b["seed"] for b in fake.log()}) == len(fake.log())
    assert not (tmp_path / "a" / "_manifest.json").exists()

    fake.faults("503", "503")
    result = run(*_args(tiny_sd3, prompts, tmp_path / "b", fake.url))
    assert result["rows"] == 4 and result["complete"]
    sent = [b["seed"] for b in fake.log()]
    assert len(sent) == 6 and len(set(sent)) == 4  # two requests retried, with their own seeds

    # vLLM-Omni's engine error shape {"error": {"message", ...}}: a 500 is retried once, not more
    fake.faults("500", "500")
    _exit_1(
        _args(tiny_sd3, prompts, tmp_path / "e", fake.url, "--batch-size", "1"),
        "HTTP 500",
        "generation failed",
    )
    assert len(fake.log()) == 2

    dead = _args(tiny_sd3, prompts, tmp_path / "x", "http://127.0.0.1:9", "--server-startup-timeout", "1")
    fails(dead, "127.0.0.1:9", "no healthy vLLM-Omni server within 1 s")
    fails(
        _args(tiny_sd3, prompts, tmp_path / "c", fake.url, "--served-model", "other"),
        "--served-model",
        SERVED,
    )
    fails(_args(tiny_sd3, prompts, tmp_path / "d", fake.url, "--sampler", "sde"), "--sampler sde", "ode")


def test_aborted_samples_are_redrawn_with_their_seed_a_bounded_number_of_times(
    fake: FakeServer, tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    fake.faults("abort", "abort")
    result = run(*_args(tiny_sd3, prompts, tmp_path / "a", fake.url, "--batch-size", "1"))
    assert result["rows"] == 4
    sent = [b["seed"] for b in fake.log()]
    assert len(sent) == 6 and sent[0] == sent[1] == sent[2]  # the first sample, drawn three times
    reference = ShardSet(tmp_path / "a").read_all()["image"]
    fake.faults()
    run(*_args(tiny_sd3, prompts, tmp_path / "b", fake.url))
    assert ShardSet(tmp_path / "b").read_all()["image"] == reference  # aborts change no sample

    fake.faults(*["abort"] * (MAX_REDRAWS + 1))
    _exit_1(
        _args(tiny_sd3, prompts, tmp_path / "c", fake.url, "--batch-size", "1"),
        "aborted",
        str(MAX_REDRAWS + 1),
    )
    assert len(fake.log()) == MAX_REDRAWS + 1
    assert not any((tmp_path / "c").glob("train-*"))  # the group is not written short


@pytest.mark.parametrize("fault", ["bad_png", "wrong_size", "two_images"])
def test_a_malformed_reply_stops_the_run_in_one_line(
    fault: str, fake: FakeServer, tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    fake.faults(fault)
    _exit_1(_args(tiny_sd3, prompts, tmp_path / "a", fake.url, "--batch-size", "1"), "malformed", fake.url)
    assert not any((tmp_path / "a").glob("train-*"))


# ---- RL mode: the custom pipeline's output, converted back to protocol v1 ----------------------------


def test_the_custom_pipeline_output_converts_to_protocol_v1_and_equals_the_diffusers_samples(
    tiny_sd3: Path,
) -> None:
    """`pipeline_fields` (what the custom pipeline returns) in a duck-typed `OmniRequestOutput`, through
    `outputs_to_reply` and `decode_response`, gives the diffusers engine's columns bit for bit; an
    aborted output is redrawn, a foreign one refused."""
    from types import SimpleNamespace

    import torch

    from stages.models.diffusion import FlowPolicy
    from stages.sample.engines import DiffusersEngine
    from stages.sample.rollout import SampleConfig
    from stages.sample.rollout_protocol import Aborted, ProtocolError, decode_response, encode_request
    from stages.sample.vllm_omni_engine import EXTRA_KEY, outputs_to_reply, pipeline_fields

    policy = FlowPolicy.load(tiny_sd3)
    cfg = SampleConfig(steps=4, guidance=1.0, resolution=32, window=2, window_range=(0, 4), batch_size=2)
    batch = (["a red apple", "a cat"], ["", ""], [11, 12], [21, 22])
    ids = ["g000000-000", "g000000-001"]
    body = encode_request("req-1", cfg, *batch, [0, 0], ids, {})
    fields = pipeline_fields(policy, body, weight_version=3)
    assert fields["trajectory_latents"].dtype == torch.float32
    assert tuple(fields["trajectory_latents"].shape) == (2, 3, *policy.latent_shape(32))
    # OmniRequestOutput.from_diffusion: images ← output, the trajectory fields and custom_output as they are
    out = SimpleNamespace(
        request_id="0",
        images=fields["output"],
        error=None,
        latents=None,
        **{
            k: fields[k]
            for k in ("trajectory_latents", "trajectory_log_probs", "trajectory_timesteps", "custom_output")
        },
    )
    version, columns = decode_response(outputs_to_reply([out], body), body)
    expected = DiffusersEngine(policy).rollout(cfg, *batch, groups=[0, 0], sample_ids=ids)
    assert version == 3 and columns["image"] == expected["image"]
    for key in ("final_latent", "latents", "log_probs", "timesteps", "sigmas"):
        assert torch.equal(columns[key], expected[key]), key

    aborted = SimpleNamespace(request_id="0", images=[], error="Request aborted", custom_output={})
    with pytest.raises(Aborted):
        decode_response(outputs_to_reply([aborted], body), body)
    foreign = SimpleNamespace(**{**vars(out), "custom_output": {EXTRA_KEY: {"request_id": "other"}}})
    with pytest.raises(ProtocolError, match="custom pipeline"):
        outputs_to_reply([foreign], body)
    failed = SimpleNamespace(**{**vars(out), "error": "CUDA out of memory"})
    with pytest.raises(ProtocolError, match="out of memory"):
        outputs_to_reply([failed], body)


def test_rl_mode_without_vllm_omni_installed_is_one_line(
    tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm_omni") is not None:
        pytest.skip("vllm-omni is installed")
    args = sample_args(tiny_sd3, prompts, tmp_path / "s", "--engine", "vllm-omni")
    fails(args, "--engine vllm-omni", "omnirl[vllm-omni]", "--server-url")


# ---- video families: /v1/videos/sync -----------------------------------------------------------------


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vllm_omni_wan") / "wan2_1"
    run("init-model", "--family", "wan2_1", "--size", "tiny", str(out))
    return out


def test_images_mode_samples_a_video_family_through_videos_sync(
    fake: FakeServer, wan: Path, prompts: Path, tmp_path: Path
) -> None:
    """A video family: one multipart /v1/videos/sync form per sample with its seed; the MP4 that comes
    back is stored as the video column byte for byte; an aborted reply (empty body) and a 503 are drawn
    again with the same seed; an MP4 of other frames stops the run in one line."""
    from stages.media.video import encode_mp4

    fake.faults("abort", "503")
    out = tmp_path / "videos"
    result = run(*_args(wan, prompts, out, fake.url, "--frames", "5", "--fps", "8"))
    assert result["rows"] == 4 and result["complete"]
    rows = ShardSet(out).read_all()
    assert "image" not in rows and "final_latent" not in rows
    sent = fake.log()
    assert len(sent) == 6  # 4 samples, one drawn again after the abort, one retried after the 503
    by_seed = {int(form["seed"]): form for form in sent}
    assert sorted(by_seed) == sorted(rows["seed"].tolist())
    for prompt, seed, mp4 in zip(rows["prompt"], rows["seed"].tolist(), rows["video"]):
        assert by_seed[seed] == {
            "model": SERVED,
            "prompt": prompt,
            "size": "32x32",
            "num_frames": "5",
            "fps": "8",
            "num_inference_steps": "4",
            "guidance_scale": "1.0",
            "seed": str(seed),
        }
        frames = [Image.fromarray(fake_image(prompt, seed + f, 32, 32)) for f in range(5)]
        assert mp4 == encode_mp4(frames, 8)  # the fake's MP4 of that seed, as it sent it
    column = ShardSet(out).columns["video"]
    assert (column.kind, column.shape, column.fps) == ("video", (5, 32, 32), 8.0)

    fake.faults(*["wrong_frames"] * 4)
    _exit_1(_args(wan, prompts, tmp_path / "bad", fake.url, "--frames", "5"), "/v1/videos/sync", "4 frames")
    assert not list((tmp_path / "bad").glob("train-*"))
    fake.faults()
    fails(
        _args(wan, prompts, tmp_path / "sf", fake.url, "--frames", "5", "--save-frames"),
        "--save-frames",
        "MP4",
    )
    fails(_args(wan, prompts, tmp_path / "fps", fake.url, "--frames", "5", "--fps", "7.5"), "--fps 7.5")


def test_the_custom_pipeline_returns_a_video_family_s_mp4s_and_frames(wan: Path) -> None:
    """RL mode for a video family: the custom pipeline's record carries the MP4s (and saved frames), so
    the duck-typed output converts to the diffusers engine's video columns and 5-D latents bit for bit."""
    from types import SimpleNamespace

    import torch

    from stages.models.diffusion import FlowPolicy
    from stages.sample.engines import DiffusersEngine
    from stages.sample.rollout import SampleConfig
    from stages.sample.rollout_protocol import decode_response, encode_request
    from stages.sample.vllm_omni_engine import outputs_to_reply, pipeline_fields

    policy = FlowPolicy.load(wan)
    cfg = SampleConfig(steps=3, guidance=1.0, resolution=32, frames=5, window=1, save_frames=True)
    cfg.max_sequence_length = 64
    batch = (["a red apple"], [""], [11], [21])
    body = encode_request("req-v", cfg, *batch, [0], ["v0"], {})
    fields = pipeline_fields(policy, body, weight_version=0)
    assert fields["output"] == []  # no images: the media travel encoded in the record
    out = SimpleNamespace(
        images=fields["output"],
        error=None,
        **{
            k: fields[k]
            for k in ("trajectory_latents", "trajectory_log_probs", "trajectory_timesteps", "custom_output")
        },
    )
    _, columns = decode_response(outputs_to_reply([out], body), body)
    expected = DiffusersEngine(policy).rollout(cfg, *batch, groups=[0], sample_ids=["v0"])
    assert columns["video"] == expected["video"] and columns["frames"] == expected["frames"]
    assert "image" not in columns and columns["latents"].shape == (1, 2, 16, 2, 4, 4)
    for key in ("final_latent", "latents", "log_probs"):
        assert torch.equal(columns[key], expected[key]), key


def test_the_engine_names_the_wan_variant_of_the_folder(wan: Path, tmp_path: Path) -> None:
    """The family a vLLM-Omni rollout records is the folder's own variant (`variant_name`), as the
    diffusers engine's, not the first name of the adapter class every Wan folder shares."""
    from stages.models.wan import WanAdapter
    from stages.sample.vllm_omni_engine import model_family

    run("init-model", "--family", "wan2_2_5b", "--size", "tiny", str(tmp_path / "ti2v"))
    assert model_family(wan) == (WanAdapter, "wan2_1")
    assert model_family(tmp_path / "ti2v") == (WanAdapter, "wan2_2_5b")
