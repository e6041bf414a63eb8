"""A fake `vllm serve MODEL --omni` for tests: vLLM-Omni 0.30.0's images API, real HTTP, stdlib only.

``python tests/vllm_omni_server.py --served-model NAME [--port P] [--warmup S]`` prints one JSON line
``{"pid", "url"}`` once it listens on 127.0.0.1; stop it by its PID (SIGTERM). Routes:

- ``GET /health``: 503 ``{"detail"}`` for the first --warmup seconds, then 200 with an empty body
  (as vLLM answers it); ``GET /v1/models``: the OpenAI list with one model, NAME;
- ``POST /v1/images/generations`` with 0.30.0's field names and bounds: ``prompt`` (required), ``model``
  (400 when not NAME), ``n`` 1–10, ``size`` "WxH", ``num_inference_steps`` 1–200, ``guidance_scale``
  and ``true_cfg_scale`` 0–20, ``seed`` int64 (random when absent), ``response_format`` b64_json,
  ``output_format`` png, ``negative_prompt``, ``lora``, ``extra_args``; unknown fields ignored. Bound
  and type errors are FastAPI's 422 ``{"detail": [{"type", "loc", "msg", "input"}]}``, handler errors
  400 ``{"detail": str}``, engine errors 500 ``{"error": {message, type, code, request_id,
  error_stage_id}}``. Image i is `fake_image(prompt, seed + i, W, H)`: noise drawn from the prompt and
  seed, so a test can tell which seed a sample was drawn with;
- ``POST /v1/videos/sync``: a ``multipart/form-data`` form (FastAPI ``Form`` fields, as vLLM-Omni
  reads them): ``prompt`` (required), ``model`` (400 "Model mismatch" when not NAME), ``size`` "WxH" or
  ``width``/``height``, ``num_frames``, ``fps`` (default 24), ``num_inference_steps`` 1–200,
  ``guidance_scale`` 0–20, ``seed`` (random when absent), ``negative_prompt``, ``lora`` (JSON);
  unparsable or out-of-bound values are 422 ``{"detail": [...]}`` with ``loc`` ["body", KEY]. The reply
  is the MP4 itself (``video/mp4``, headers ``X-Request-Id``, ``X-Model``, ``X-Inference-Time-S``),
  of `fake_image(prompt, seed + f, W, H)` for frame f;
- ``POST /fake/faults`` ``{"faults": [KIND, ...]}`` queues faults, one per following image or video
  request: ``503``, ``500``, ``abort`` (200 with no image / an empty body), ``bad_png`` (also: a video
  reply that is not an MP4), ``wrong_size``, ``two_images``, ``wrong_frames`` (one frame too few);
- ``GET /fake/log``: the image request bodies and video form fields received (refused ones too), in
  order; ``POST /fake/reset`` clears both.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import re
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from PIL import Image

SIZE_RE = re.compile(r"^(\d+)x(\d+)$")
BOUNDS = {"n": (1, 10), "num_inference_steps": (1, 200), "guidance_scale": (0, 20), "true_cfg_scale": (0, 20)}
MAX_SEED = 2**63 - 1


def fake_image(prompt: str, seed: int, width: int, height: int) -> np.ndarray:
    """The uint8 [H, W, 3] image the fake draws for `prompt` with `seed`."""
    rng = np.random.default_rng([seed, zlib.crc32(prompt.encode())])
    return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


class Invalid(Exception):
    """A refused request: status and FastAPI-shaped detail."""

    def __init__(self, status: int, detail: Any):
        super().__init__(str(detail))
        self.status, self.detail = status, detail


def _bound_error(key: str, value: Any, lo: float, hi: float, integer: bool) -> dict[str, Any]:
    kind = "int" if integer else "float"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return {
            "type": f"{kind}_parsing",
            "loc": ["body", key],
            "msg": f"Input should be a valid {kind}",
            "input": value,
        }
    side, bound = ("greater_than_equal", lo) if value < lo else ("less_than_equal", hi)
    word = "greater than or equal to" if value < lo else "less than or equal to"
    return {"type": side, "loc": ["body", key], "msg": f"Input should be {word} {bound}", "input": value}


class FakeOmni:
    """The state of the fake: served name, warm-up end, queued faults and the request log."""

    def __init__(self, served: str, warmup: float):
        self.served = served
        self.ready_at = time.monotonic() + warmup
        self.faults: list[str] = []
        self.log: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def validate(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise Invalid(
                422, [{"type": "model_attributes_type", "loc": ["body"], "msg": "Input should be an object"}]
            )
        errors = []
        if not isinstance(body.get("prompt"), str):
            errors.append(
                {"type": "missing", "loc": ["body", "prompt"], "msg": "Field required", "input": body}
            )
        for key, (lo, hi) in BOUNDS.items():
            value = body.get(key)
            integer = key in ("n", "num_inference_steps")
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int if integer else (int, float))
                or not lo <= value <= hi
            ):
                errors.append(_bound_error(key, value, lo, hi, integer))
        seed = body.get("seed")
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
        ):
            errors.append(
                {
                    "type": "int_parsing",
                    "loc": ["body", "seed"],
                    "msg": "Input should be a valid int64",
                    "input": seed,
                }
            )
        if body.get("response_format", "b64_json") not in ("b64_json", "file"):
            errors.append(
                {
                    "type": "literal_error",
                    "loc": ["body", "response_format"],
                    "msg": "Input should be 'b64_json' or 'file'",
                }
            )
        if errors:
            raise Invalid(422, errors)
        if body.get("model") not in (None, self.served):
            raise Invalid(400, f"Model '{body['model']}' not found. Available: {self.served}")
        if not SIZE_RE.match(str(body.get("size", "1024x1024"))):
            raise Invalid(400, f"Invalid size format: {body.get('size')!r}. Expected 'WIDTHxHEIGHT'")
        if body.get("output_format", "png") != "png":
            raise Invalid(400, "this fake writes png only")
        return body

    def images(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            fault = self.faults.pop(0) if self.faults else None
        if fault == "503":
            return 503, {"detail": "Service Unavailable: the diffusion engine is busy"}
        if fault == "500":
            error = {"message": "generation failed: CUDA error", "type": "InternalServerError", "code": 500}
            return 500, {"error": {**error, "request_id": "req-1", "error_stage_id": 0}}
        width, height = (int(v) for v in SIZE_RE.match(body.get("size", "1024x1024")).groups())  # type: ignore[union-attr]
        seed = body.get("seed")
        seed = random.randrange(2**62) if seed is None else seed
        n = body.get("n", 1)
        data = [
            {
                "b64_json": base64.b64encode(
                    png(fake_image(body["prompt"], seed + i, width, height))
                ).decode(),
                "url": None,
                "revised_prompt": None,
            }
            for i in range(n)
        ]
        if fault == "abort":
            data = []
        elif fault == "bad_png":
            data[0]["b64_json"] = base64.b64encode(b"GIF89a not a png").decode()
        elif fault == "wrong_size":
            data[0]["b64_json"] = base64.b64encode(
                png(fake_image(body["prompt"], seed, width + 1, height))
            ).decode()
        elif fault == "two_images":
            data = data * 2
        reply = {
            "created": int(time.time()),
            "data": data,
            "output_format": "png",
            "size": f"{width}x{height}",
            "metrics": {"stage_durations": {"diffusion": 0.001}, "peak_memory_mb": 0.0},
        }
        return 200, reply


def parse_multipart(raw: bytes, content_type: str) -> dict[str, str]:
    """The fields of a multipart/form-data body (the stdlib e-mail parser; files are not expected)."""
    import email.parser
    import email.policy

    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + raw
    )
    if not message.is_multipart():
        raise Invalid(422, [{"type": "missing", "loc": ["body", "prompt"], "msg": "Field required"}])
    return {
        str(part.get_param("name", header="content-disposition")): part.get_payload(decode=True).decode()
        for part in message.iter_parts()
    }


VIDEO_INTS = {"width": (1, None), "height": (1, None), "num_frames": (1, None), "fps": (1, None),
              "num_inference_steps": (1, 200), "seed": (None, None)}  # fmt: skip


def validate_video(form: dict[str, str], served: str) -> dict[str, Any]:
    """The typed fields of a videos form, or `Invalid` as FastAPI and vLLM-Omni's handler refuse it."""
    errors: list[dict[str, Any]] = []
    fields: dict[str, Any] = dict(form)
    if "prompt" not in form:
        errors.append({"type": "missing", "loc": ["body", "prompt"], "msg": "Field required", "input": None})
    for key, (lo, hi) in VIDEO_INTS.items():
        if key not in form:
            continue
        try:
            fields[key] = int(form[key])
        except ValueError:
            errors.append(
                {"type": "int_parsing", "loc": ["body", key], "msg": "Input should be a valid integer"}
            )
            continue
        if (lo is not None and fields[key] < lo) or (hi is not None and fields[key] > hi):
            errors.append(_bound_error(key, fields[key], lo or 0, hi or MAX_SEED, True))
    if "guidance_scale" in form:
        try:
            fields["guidance_scale"] = float(form["guidance_scale"])
        except ValueError:
            errors.append(
                {
                    "type": "float_parsing",
                    "loc": ["body", "guidance_scale"],
                    "msg": "Input should be a valid number",
                }
            )
        else:
            if not 0 <= fields["guidance_scale"] <= 20:
                errors.append(_bound_error("guidance_scale", fields["guidance_scale"], 0, 20, False))
    if errors:
        raise Invalid(422, errors)
    if fields.get("model") not in (None, served):
        raise Invalid(
            400, f"Model mismatch: request specifies '{fields['model']}' but server is running '{served}'."
        )
    if "size" in fields:
        match = SIZE_RE.match(fields["size"])
        if not match:
            raise Invalid(
                422, [{"type": "string_pattern_mismatch", "loc": ["body", "size"], "msg": "bad size"}]
            )
        fields["width"], fields["height"] = (int(v) for v in match.groups())
    if "lora" in fields:
        fields["lora"] = json.loads(fields["lora"])
    return fields


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def fake(self) -> FakeOmni:
        return self.server.fake  # type: ignore[attr-defined]

    def _reply(self, status: int, payload: Any) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            if time.monotonic() < self.fake.ready_at:
                self._reply(503, {"detail": "engine is starting"})
            else:
                self._reply(200, None)
        elif self.path == "/v1/models":
            card = {"id": self.fake.served, "object": "model", "created": 0, "owned_by": "vllm-omni"}
            self._reply(200, {"object": "list", "data": [card]})
        elif self.path == "/fake/log":
            with self.fake.lock:
                self._reply(200, {"requests": list(self.fake.log)})
        else:
            self._reply(404, {"detail": "Not Found"})

    def _video(self, raw: bytes) -> None:
        """``POST /v1/videos/sync`` (module docstring)."""
        from stages.media.video import encode_mp4

        try:
            form = parse_multipart(raw, self.headers.get("Content-Type") or "")
            with self.fake.lock:
                self.fake.log.append(dict(form))
                fault = self.fake.faults.pop(0) if self.fake.faults else None
            fields = validate_video(form, self.fake.served)
        except Invalid as exc:
            self._reply(exc.status, {"detail": exc.detail})
            return
        if fault in ("503", "500"):
            self._reply(int(fault), {"detail": f"fault {fault}"})
            return
        seed = fields.get("seed", random.randrange(2**62))
        width, height = fields.get("width", 64), fields.get("height", 64)
        frames = fields.get("num_frames", 5) - (fault == "wrong_frames")
        pictures = [
            Image.fromarray(fake_image(fields["prompt"], seed + f, width, height)) for f in range(frames)
        ]
        data = encode_mp4(pictures, fields.get("fps", 24))
        if fault == "abort":
            data = b""
        elif fault == "bad_png":
            data = b"GIF89a not an mp4"
        self.send_response(200)
        self.send_header("Content-Type", "video/mp4")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Request-Id", "video_sync-1")
        self.send_header("X-Model", self.fake.served)
        self.send_header("X-Inference-Time-S", "0.001")
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path == "/v1/videos/sync":
            self._video(raw)
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._reply(
                422, {"detail": [{"type": "json_invalid", "loc": ["body", 0], "msg": "JSON decode error"}]}
            )
            return
        if self.path == "/fake/faults":
            with self.fake.lock:
                self.fake.faults.extend(str(f) for f in body["faults"])
            self._reply(200, {"queued": len(self.fake.faults)})
        elif self.path == "/fake/reset":
            with self.fake.lock:
                self.fake.faults.clear()
                self.fake.log.clear()
            self._reply(200, {})
        elif self.path == "/v1/images/generations":
            with self.fake.lock:
                self.fake.log.append(body)
            try:
                status, reply = self.fake.images(self.fake.validate(body))
            except Invalid as exc:
                status, reply = exc.status, {"detail": exc.detail}
            self._reply(status, reply)
        else:
            self._reply(404, {"detail": "Not Found"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--served-model", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--warmup", type=float, default=0.0)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.fake = FakeOmni(args.served_model, args.warmup)  # type: ignore[attr-defined]
    host, port = server.server_address[:2]
    print(json.dumps({"pid": os.getpid(), "url": f"http://{host}:{port}"}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
