"""The rollout server behind `omnirl serve`: a diffusion pipeline on its own device, over HTTP.

Routes (JSON in and out, never pickle; HTTP, token and size checks in `stages.web`):

- ``GET /health`` (no token): ``{"status": "ok", "protocols", "model", "family", "weights"}``, where
  ``weights`` is ``{"model_sha256", "adapter", "adapter_sha256", "version"}``;
- ``GET /v1/models``: the OpenAI list shape, one model whose ``id`` is the served model name;
- ``POST /omnirl/v1/rollout``: omnirl rollout protocol v1 (`stages.sample.rollout_protocol`): the
  trajectories of `rollout_batch`, which `omnirl logprob` replays exactly;
- ``POST /v1/images/generations``: vLLM-Omni's (OpenAI's) images API: ``prompt``, ``n`` (1–10),
  ``size`` ("WxH", square), ``num_inference_steps`` (1–200), ``guidance_scale`` (0–20),
  ``negative_prompt``, ``seed`` (random when absent; image i draws from seed + i), ``model`` (400 when
  it is not the served name), ``response_format`` b64_json; deterministic (ode) sampling; the reply is
  ``{"created", "data": [{"b64_json", "url": null, "revised_prompt": null}], "output_format": "png",
  "size", "metrics"}``; other fields are ignored;
- ``GET /omnirl/v1/weights`` the weights held; ``POST /omnirl/v1/weights`` ``{"adapter": PATH | null,
  "version": int | null}`` loads an adapter folder from the server's file system (null: the base
  model) without a restart and answers the new weights; version defaults to the adapter's step;
- ``POST /omnirl/v1/latent_shape`` ``{"resolution": R, "frames": F}`` (F default 1) → ``{"latent_shape": [...]}``.

Refusals: 400 a malformed request, 401 a missing token, 404 an unknown route, 409 a rollout that asks
for other weights than the server holds, 411/413 (`stages.web`), 413 a batch over --max-batch or
`max_pixels`, 422 an adapter that does not load. One request runs the model at a time (a lock), so
several clients may call the server; a new adapter loads beside the old one, which keeps serving.
"""

from __future__ import annotations

import base64
import re
import secrets
import threading
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.sample.engines import DiffusersEngine
from stages.sample.rollout import SampleConfig, stored_steps
from stages.sample.rollout_protocol import (
    PROTOCOL,
    ROUTE,
    VERSION,
    ProtocolError,
    check_weights,
    decode_request,
    encode_response,
    refuse_settings,
)
from stages.web import HttpError, JsonService, parse_json_object

IMAGES_ROUTE = "/v1/images/generations"
WEIGHTS_ROUTE = "/omnirl/v1/weights"
LATENT_ROUTE = "/omnirl/v1/latent_shape"
MAX_PIXELS = 2**26  # pixels in one request (samples × frames × resolution²)
MAX_FRAMES = 4096  # frames of one sample
_SIZE_RE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
# vLLM-Omni 0.30.0 bounds of /v1/images/generations
MAX_IMAGES, MAX_IMAGE_STEPS, MAX_GUIDANCE = 10, 200, 20.0


def _int_field(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"{key} must be an integer in [{lo}, {hi}]")
    return value


class RolloutService(JsonService):
    """What `omnirl serve` does with a request, apart from HTTP (module docstring)."""

    def __init__(
        self,
        model: str | Path,
        adapter: str | Path | None = None,
        *,
        device: Any = "cpu",
        dtype: str = "fp32",
        served_name: str | None = None,
        token: str | None = None,
        max_request_bytes: int = 64 * 2**20,
        max_batch: int = 64,
        max_pixels: int = MAX_PIXELS,
    ):
        from stages.models.factory import default_text_length
        from stages.shards.digest import content_digest

        super().__init__(token=token, max_request_bytes=max_request_bytes)
        self.model = Path(model)
        if not (self.model / "model_index.json").is_file():  # before hashing what may be any folder
            raise UserInputError(f"--model {model}: not a diffusers pipeline folder (no model_index.json)")
        self.device = device
        self.dtype = dtype
        self.served_name = served_name or self.model.name
        self.max_batch = max_batch
        self.max_pixels = max_pixels
        self.text_length = default_text_length(self.model)
        self.model_sha256 = content_digest(self.model, "--model")
        self.lock = threading.Lock()  # the model runs one request at a time
        self.loading = threading.Lock()  # one adapter loads at a time
        self.engine, self.weights = self._load(adapter, None)

    # ---------------------------------------------------------------- weights
    def _load(
        self, adapter: str | Path | None, version: int | None
    ) -> tuple[DiffusersEngine, dict[str, Any]]:
        """A new engine holding `adapter` (None: the base model) and its weights record."""
        from stages.models.diffusion import FlowPolicy, read_adapter_config
        from stages.shards.digest import content_digest

        if adapter is not None:
            step = int(read_adapter_config(adapter).get("step", 0))
        policy = FlowPolicy.load(self.model, adapter=adapter, device=self.device, dtype=self.dtype)
        weights = {
            "model_sha256": self.model_sha256,
            "adapter": None if adapter is None else str(adapter),
            "adapter_sha256": None if adapter is None else content_digest(adapter, "adapter"),
            "version": (0 if adapter is None else step) if version is None else version,
        }
        return DiffusersEngine(policy), weights

    def load_weights(self, raw: bytes) -> dict[str, Any]:
        """``POST /omnirl/v1/weights``: load the adapter beside the current weights, then swap them in."""
        body = parse_json_object(raw)
        adapter, version = body.get("adapter"), body.get("version")
        if adapter is not None and not isinstance(adapter, str):
            raise HttpError(HTTPStatus.BAD_REQUEST, "adapter must be a folder path on the server or null")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise HttpError(HTTPStatus.BAD_REQUEST, "version must be an integer or null")
        with self.loading:
            try:
                engine, weights = self._load(adapter, version)
            except UserInputError as exc:
                raise HttpError(HTTPStatus.UNPROCESSABLE_ENTITY, str(exc)) from None
            with self.lock:
                self.engine, self.weights = engine, weights
        return {"weights": dict(weights)}

    # ---------------------------------------------------------------- routes
    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "protocols": [f"{PROTOCOL}/{VERSION}"],
            "model": self.served_name,
            "family": self.engine.family,
            "weights": dict(self.weights),
        }

    def get(self, path: str) -> dict[str, Any]:
        if path == "/health":
            return self.health()
        if path == "/v1/models":
            card = {"id": self.served_name, "object": "model", "created": 0, "owned_by": "omnirl"}
            return {"object": "list", "data": [card]}
        if path == WEIGHTS_ROUTE:
            return {"weights": dict(self.weights)}
        raise HttpError(
            HTTPStatus.NOT_FOUND, f"no route GET {path}; GET /health, /v1/models or {WEIGHTS_ROUTE}"
        )

    def post(self, path: str, raw: bytes) -> dict[str, Any]:
        routes = {
            ROUTE: self.rollout,
            IMAGES_ROUTE: self.images,
            WEIGHTS_ROUTE: self.load_weights,
            LATENT_ROUTE: self.latent_shape,
        }
        if path.rstrip("/") not in routes:
            raise HttpError(HTTPStatus.NOT_FOUND, f"no route POST {path}; POST {', '.join(routes)}")
        try:
            return routes[path.rstrip("/")](raw)
        except ProtocolError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None

    def _check_pixels(self, samples: int, resolution: int, frames: int = 1) -> None:
        if samples * frames * resolution * resolution > self.max_pixels:
            per = f"{frames} frames of {resolution}²" if frames > 1 else f"{resolution}²"
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"{samples} samples of {per} pixels, more than the server's {self.max_pixels}; "
                "send fewer samples per request",
            )

    def rollout(self, raw: bytes) -> dict[str, Any]:
        """``POST /omnirl/v1/rollout``: one batch of protocol v1."""
        body = parse_json_object(raw)
        samples = body.get("samples")
        if isinstance(samples, list) and len(samples) > self.max_batch:
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"{len(samples)} samples in one request, more than --max-batch {self.max_batch}; "
                "lower the client's --batch-size",
            )
        request = decode_request(body, max_samples=self.max_batch)
        refuse_settings(request.cfg)
        self._check_pixels(len(request.prompts), request.cfg.resolution, request.cfg.frames)
        windows = {len(stored_steps(request.cfg, g)) for g in request.groups}
        if len(windows) > 1:
            raise ProtocolError("the samples' groups place windows of different lengths; batch them apart")
        with self.lock:
            conflict = check_weights(request.weights, self.weights)
            if conflict:
                raise HttpError(
                    HTTPStatus.CONFLICT,
                    f"{conflict}; load those weights (POST {WEIGHTS_ROUTE}) or restart with that --adapter",
                )
            columns = self.engine.rollout(
                request.cfg,
                request.prompts,
                request.negatives,
                request.seeds,
                request.init_seeds,
                groups=request.groups,
                sample_ids=request.sample_ids,
            )
            version = self.weights["version"]
        return encode_response(request.request_id, version, columns)

    def images(self, raw: bytes) -> dict[str, Any]:
        """``POST /v1/images/generations`` as vLLM-Omni answers it (module docstring)."""
        body = parse_json_object(raw)
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise HttpError(HTTPStatus.BAD_REQUEST, "prompt is required (a non-empty string)")
        model = body.get("model")
        if model is not None and model != self.served_name:
            raise HttpError(
                HTTPStatus.BAD_REQUEST,
                f"model {model!r} is not served here; this serves {self.served_name!r}",
            )
        if body.get("response_format", "b64_json") != "b64_json":
            raise HttpError(HTTPStatus.BAD_REQUEST, "response_format: only b64_json is served")
        negative = body.get("negative_prompt") or ""
        if not isinstance(negative, str):
            raise HttpError(HTTPStatus.BAD_REQUEST, "negative_prompt must be a string")
        n = _int_field(body, "n", 1, 1, MAX_IMAGES)
        steps = _int_field(body, "num_inference_steps", SampleConfig.steps, 1, MAX_IMAGE_STEPS)
        seed = _int_field(body, "seed", secrets.randbelow(2**62), 0, 2**63 - 1 - MAX_IMAGES)
        guidance = body.get("guidance_scale", SampleConfig.guidance)
        if (
            not isinstance(guidance, (int, float))
            or isinstance(guidance, bool)
            or not 0 <= guidance <= MAX_GUIDANCE
        ):
            raise HttpError(
                HTTPStatus.BAD_REQUEST, f"guidance_scale must be a number in [0, {MAX_GUIDANCE:g}]"
            )
        size = body.get("size", "512x512")
        match = _SIZE_RE.match(size) if isinstance(size, str) else None
        if match is None or match.group(1) != match.group(2) or int(match.group(1)) < 1:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"size {size!r}: give a square 'WxH', e.g. '512x512'")
        resolution = int(match.group(1))
        self._check_pixels(n, resolution)
        cfg = SampleConfig(
            steps=steps,
            guidance=float(guidance),
            resolution=resolution,
            sampler="ode",
            max_sequence_length=self.text_length,
        )
        seeds = [seed + i for i in range(n)]
        t0 = time.perf_counter()
        with self.lock:
            try:
                columns = self.engine.rollout(
                    cfg,
                    [prompt] * n,
                    [negative] * n,
                    seeds,
                    seeds,
                    groups=[0] * n,
                    sample_ids=[f"image-{i}" for i in range(n)],
                )
            except UserInputError as exc:
                raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        data = [
            {"b64_json": base64.b64encode(png).decode("ascii"), "url": None, "revised_prompt": None}
            for png in columns["image"]
        ]
        return {
            "created": int(time.time()),
            "data": data,
            "output_format": "png",
            "size": size,
            "metrics": {"seconds": time.perf_counter() - t0},
        }

    def latent_shape(self, raw: bytes) -> dict[str, Any]:
        """``POST /omnirl/v1/latent_shape``: the stored latent of one resolution² sample (of `frames`
        frames, default 1)."""
        body = parse_json_object(raw)
        resolution = _int_field(body, "resolution", 0, 1, 8192)
        frames = _int_field(body, "frames", 1, 1, MAX_FRAMES)
        try:
            return {"latent_shape": list(self.engine.latent_shape(resolution, frames))}
        except UserInputError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
