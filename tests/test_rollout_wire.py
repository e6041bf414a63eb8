"""Rollout protocol v1 on the wire: msgpack replies (``Accept: application/x-msgpack``) are the same reply
with raw bytes in place of base64, decoded to the same columns, a quarter smaller, while a JSON client
still gets JSON; a batch the server aborts is drawn again by the `remote` engine with the same request,
a bounded number of times."""

from __future__ import annotations

import base64
import io
import json
import threading
from typing import Any

import pytest
import torch
from PIL import Image

from stages.sample.rollout import SampleConfig
from stages.sample.rollout_protocol import (
    MAX_REDRAWS,
    ProtocolError,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from stages.sample.tensor_codec import CodecError, decode_tensor, encode_tensor
from stages.web import JsonClient, JsonServer, JsonService, pack_binary, unpack_binary


def _png(side: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (side, side, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _reply(
    batch: int, latent: tuple[int, ...], steps: int, latent_dtype: str = "fp32"
) -> tuple[dict[str, Any], dict[str, Any], dict]:
    """A request of `batch` samples storing all `steps` SDE steps, its reply and the columns it carries."""
    cfg = SampleConfig(steps=steps, resolution=32, latent_dtype=latent_dtype)
    stored = torch.bfloat16 if latent_dtype == "bf16" else torch.float32
    ids = [f"g000000-{i:03d}" for i in range(batch)]
    request = encode_request(
        "r1", cfg, ["p"] * batch, [""] * batch, list(range(batch)), [0] * batch, [0] * batch, ids, {}
    )
    g = torch.Generator().manual_seed(0)
    columns = {
        "final_latent": torch.randn(batch, *latent, generator=g).to(stored),
        "latents": torch.randn(batch, steps + 1, *latent, generator=g).to(stored),
        "log_probs": torch.randn(batch, steps, generator=g),
        "timesteps": torch.rand(batch, steps, generator=g) * 1000,
        "sigmas": torch.rand(batch, steps + 1, generator=g),
        "image": [_png(32, i) for i in range(batch)],
    }
    return request, encode_response("r1", 5, columns), columns


def test_a_msgpack_reply_round_trips_to_the_same_columns_and_is_smaller() -> None:
    # a video-sized trajectory: 2 samples × 11 latents of [16, 9, 30, 52] (Wan 2.1 at 480p, 33 frames)
    request, reply, columns = _reply(2, (16, 9, 30, 52), 10)
    packed, text = pack_binary(reply), json.dumps(reply).encode()
    version, decoded = decode_response(unpack_binary(packed), request)
    assert version == 5 and decoded["image"] == columns["image"]
    for key in ("final_latent", "latents", "log_probs", "timesteps", "sigmas"):
        assert torch.equal(decoded[key], columns[key]), key
    raw = sum(columns[k].numel() * 4 for k in ("final_latent", "latents", "log_probs", "timesteps", "sigmas"))
    raw += sum(len(b) for b in columns["image"])
    assert raw < len(packed) < raw * 1.001  # the bytes themselves plus a small envelope
    assert len(text) / len(packed) == pytest.approx(4 / 3, rel=0.01)  # base64's 4 characters per 3 bytes
    print(
        f"\nreply of {raw / 2**20:.1f} MiB: JSON+base64 {len(text) / 2**20:.2f} MiB, msgpack {len(packed) / 2**20:.2f} MiB"
    )


@pytest.mark.parametrize(("resolution", "wire"), [("240x416", [240, 416]), (512, 512), ("64x64", 64)])
def test_a_request_carries_height_and_width_and_a_square_as_one_side(resolution: Any, wire: Any) -> None:
    """A non-square size travels as [height, width]; a square as the one side v1 always sent, so a request
    of an older client (and to an older server) stays valid; decoding gives the same (height, width)."""
    cfg = SampleConfig(steps=3, resolution=resolution, frames=5)
    request = json.loads(json.dumps(encode_request("r", cfg, ["p"], [""], [1], [1], [0], ["s"], {})))
    assert request["sampling_params"]["resolution"] == wire
    decoded = decode_request(request, max_samples=4).cfg
    assert decoded == cfg and decoded.resolution == SampleConfig(resolution=wire).resolution
    assert "guidance_2" not in request["sampling_params"]  # unset: left out, so an older server answers
    cfg.guidance_2 = 2.0
    request = json.loads(json.dumps(encode_request("r", cfg, ["p"], [""], [1], [1], [0], ["s"], {})))
    assert decode_request(request, max_samples=4).cfg.guidance_2 == 2.0
    bad = {**request, "sampling_params": {**request["sampling_params"], "resolution": "wide"}}
    with pytest.raises(
        ProtocolError,
        match=r"sampling_params.resolution must be an integer or \[an integer, an integer\], not 'wide'",
    ):
        decode_request(bad, max_samples=4)


def test_bf16_latents_come_back_in_bf16() -> None:
    """The server's bf16 latents travel upcast (exact) and are stored in the dtype the request asked for."""
    request, reply, columns = _reply(2, (4, 2, 4, 4), 3, latent_dtype="bf16")
    _, decoded = decode_response(unpack_binary(pack_binary(reply)), request)
    for key in ("final_latent", "latents"):
        assert decoded[key].dtype == torch.bfloat16 and torch.equal(decoded[key], columns[key]), key
    assert decoded["log_probs"].dtype == torch.float32


def test_a_video_reply_carries_mp4s_and_frames_in_both_encodings() -> None:
    """A video family's reply: one MP4 per sample (and, with save_frames, its PNG frames) beside 5-D
    latents; msgpack and JSON decode to the same video/frames columns; formats are checked."""
    from test_shards import mp4_bytes

    cfg = SampleConfig(steps=2, resolution=8, frames=5, save_frames=True)
    request = encode_request("r1", cfg, ["p"] * 2, [""] * 2, [0, 1], [0, 0], [0, 0], ["a", "b"], {})
    columns = {
        "final_latent": torch.randn(2, 16, 2, 4, 4),
        "latents": torch.randn(2, 3, 16, 2, 4, 4),
        "log_probs": torch.randn(2, 2),
        "timesteps": torch.rand(2, 2),
        "sigmas": torch.rand(2, 3),
        "video": [mp4_bytes(0, frames=5), mp4_bytes(1, frames=5)],
        "frames": [[_png(8, 10 * i + j) for j in range(5)] for i in range(2)],
    }
    reply = encode_response("r1", 0, columns)
    assert [m["format"] for m in reply["media"]] == ["mp4", "mp4"] and "image" not in json.dumps(reply)
    for body in (json.loads(json.dumps(reply)), unpack_binary(pack_binary(reply))):
        _, back = decode_response(body, request)
        assert sorted(back) == sorted(columns)
        assert back["video"] == columns["video"] and back["frames"] == columns["frames"]
        assert torch.equal(back["latents"], columns["latents"])
    png = _png(8, 0)
    broken = [
        ({**reply, "media": [reply["media"][0], {"format": "png", **_b64(png)}]}, "mixes formats"),
        ({**reply, "media": [{"format": "mp4", **_b64(png)}] * 2}, "not a base64 PNG or MP4"),
        ({k: v for k, v in reply.items() if k != "frames"}, "frames must list 2"),
        ({**reply, "frames": [[{"format": "png", **_b64(columns["video"][0])}]] * 2}, r"frames\[0\]\[0\]"),
    ]
    for body, message in broken:
        with pytest.raises(ProtocolError, match=message):
            decode_response(body, request)
    plain = SampleConfig(steps=2, resolution=8, frames=5)  # no save_frames: the frames field is not read
    request = encode_request("r1", plain, ["p"] * 2, [""] * 2, [0, 1], [0, 0], [0, 0], ["a", "b"], {})
    _, back = decode_response({k: v for k, v in reply.items() if k != "frames"}, request)
    assert "frames" not in back and back["video"] == columns["video"]


def _b64(blob: bytes) -> dict[str, str]:
    return {"encoding": "base64", "data": base64.b64encode(blob).decode()}


def test_raw_tensors_are_checked_like_base64_ones() -> None:
    obj = unpack_binary(
        pack_binary({"t": encode_tensor(torch.arange(6, dtype=torch.float32).reshape(2, 3))})
    )["t"]
    assert obj["encoding"] == "raw" and isinstance(obj["data"], bytes)
    assert decode_tensor(obj, "t").tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(CodecError, match="t: 20 bytes"):
        decode_tensor({**obj, "data": obj["data"][:-4]}, "t")
    with pytest.raises(CodecError, match="not bytes"):
        decode_tensor({**obj, "data": base64.b64encode(obj["data"]).decode()}, "t")
    with pytest.raises(ValueError, match="msgpack"):
        unpack_binary(b"\xc1")  # a byte msgpack never uses


class _Echo(JsonService):
    def get(self, path: str) -> dict[str, Any]:
        return {"status": "ok", "t": encode_tensor(torch.ones(3))}


def test_the_server_answers_msgpack_only_to_a_client_that_asks() -> None:
    server = JsonServer(_Echo(token=None, max_request_bytes=1024))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        for binary, encoding in ((True, "raw"), (False, "base64")):
            client = JsonClient(server.url, token=None, timeout=10, retries=0, binary=binary)
            reply = client.call("/anything")
            assert reply["t"]["encoding"] == encoding
            assert decode_tensor(reply["t"], "t").tolist() == [1.0, 1.0, 1.0]
    finally:
        server.shutdown()
        server.server_close()


class _Aborting(JsonService):
    """A protocol v1 server that aborts its first `aborts` rollouts, then answers `columns`."""

    def __init__(self, aborts: int, columns: dict[str, Any]):
        super().__init__(token=None, max_request_bytes=1 << 20)
        self.aborts, self.columns, self.bodies = aborts, columns, []

    def post(self, path: str, raw: bytes) -> dict[str, Any]:
        body = json.loads(raw)
        self.bodies.append(body)
        if len(self.bodies) <= self.aborts:
            base = {k: body[k] for k in ("protocol", "version", "request_id")}
            return {**base, "weight_version": 0, "finish_reason": "abort"}
        return encode_response(body["request_id"], 2, self.columns)


@pytest.mark.parametrize("aborts", [2, MAX_REDRAWS + 1])
def test_the_remote_engine_draws_an_aborted_batch_again_a_bounded_number_of_times(aborts: int) -> None:
    from stages.errors import RuntimeFailure
    from stages.sample.remote_engine import RemoteEngine, RolloutClient

    _, _, columns = _reply(2, (4, 4, 4), 3)
    service = _Aborting(aborts, columns)
    server = JsonServer(service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = RolloutClient(server.url, token=None, timeout=10, retries=0)
        engine = RemoteEngine(client, {"family": "sd3"}, {"model_sha256": None})
        cfg = SampleConfig(steps=3, resolution=32)
        batch = (["p", "p"], ["", ""], [0, 1], [0, 0])
        if aborts > MAX_REDRAWS:
            with pytest.raises(RuntimeFailure, match=f"aborted {MAX_REDRAWS + 1} times"):
                engine.rollout(cfg, *batch, groups=[0, 0], sample_ids=["a", "b"])
        else:
            got = engine.rollout(cfg, *batch, groups=[0, 0], sample_ids=["a", "b"])
            assert torch.equal(got["latents"], columns["latents"]) and engine.server_weights["version"] == 2
        assert len(service.bodies) == min(aborts + 1, MAX_REDRAWS + 1)
        assert all(b == service.bodies[0] for b in service.bodies)  # the same request: ids and seeds
    finally:
        server.shutdown()
        server.server_close()


def test_forms_round_trip_and_refuse_what_a_form_route_cannot_take() -> None:
    """`encode_form` (the vLLM-Omni video client) and `parse_form` (`omnirl serve`'s /v1/videos/sync):
    multipart text fields survive exactly, urlencoded ones too; files, other content types and broken
    bodies are 400s."""
    from stages.web import HttpError, Payload, encode_form, parse_form

    fields = {"prompt": "héllo\r\nwörld -- 日本", "seed": 7, "guidance_scale": 4.5, "empty": ""}
    form = encode_form(fields)
    assert form.content_type.startswith("multipart/form-data; boundary=")
    assert parse_form(form.data, form.content_type) == {k: str(v) for k, v in fields.items()}
    assert parse_form(b"prompt=a+cat&seed=3", "application/x-www-form-urlencoded") == {
        "prompt": "a cat",
        "seed": "3",
    }
    boundary = "xyz"
    upload = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="input_reference"; filename="a.png"\r\n\r\n'
        f"PNG\r\n--{boundary}--\r\n"
    ).encode()
    refused = [
        (upload, f"multipart/form-data; boundary={boundary}", "files are not taken"),
        (b'{"prompt": "a"}', "application/json", "multipart/form-data"),
        (b"no parts here", "multipart/form-data; boundary=zzz", "well-formed"),
    ]
    for body, kind, message in refused:
        with pytest.raises(HttpError, match=message) as info:
            parse_form(body, kind)
        assert info.value.status == 400
    # limits checked before the MIME parser runs (its time grows faster than a crafted body)
    many = encode_form({f"a{i}": "v" for i in range(65)})
    name = "--b\r\nContent-Disposition: form-data; name*=utf-8''a%0Ab; filename=\"f\"\r\n\r\nx\r\n--b--\r\n"
    limits = [
        (encode_form({"prompt": "x" * 70_000}), 413, "more than 65536"),
        (many, 413, "more than 64 form fields"),
        (
            Payload("&".join(f"a{i}=v" for i in range(80)).encode(), "application/x-www-form-urlencoded"),
            413,
            "64",
        ),
        (Payload(name.encode(), "multipart/form-data; boundary=b"), 400, "'a b'|'a\\\\nb'"),
    ]
    for form, status, message in limits:
        with pytest.raises(HttpError, match=message) as info:
            parse_form(form.data, form.content_type)
        assert info.value.status == status and "\n" not in str(info.value)
    most = encode_form({f"a{i}": "v" for i in range(64)})
    assert len(parse_form(most.data, most.content_type)) == 64
