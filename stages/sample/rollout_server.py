"""The rollout server behind `omnirl serve`: a diffusion pipeline on its own device, over HTTP.

Routes (JSON in and out, never pickle; HTTP, token and size checks in `stages.web`):

- ``GET /health`` (no token): ``{"status": "ok", "protocols", "model", "family", "weights"}``, where
  ``weights`` is ``{"model_sha256", "adapter", "adapter_sha256", "version"}``;
- ``GET /v1/models``: the OpenAI list shape, one model whose ``id`` is the served model name;
- ``POST /omnirl/v1/rollout``: omnirl rollout protocol v1 (`stages.sample.rollout_protocol`): the
  trajectories of `rollout_batch`, which `omnirl logprob` replays exactly;
- ``POST /v1/images/generations``: vLLM-Omni's (OpenAI's) images API: ``prompt``, ``n`` (1–10),
  ``size`` ("WxH"), ``num_inference_steps`` (1–200), ``guidance_scale`` (0–20),
  ``negative_prompt``, ``seed`` (random when absent; image i draws from seed + i), ``model`` (400 when
  it is not the served name), ``response_format`` b64_json; deterministic (ode) sampling; the reply is
  ``{"created", "data": [{"b64_json", "url": null, "revised_prompt": null}], "output_format": "png",
  "size", "metrics"}``; other fields are ignored;
- ``GET /omnirl/v1/weights`` the weights held; ``POST /omnirl/v1/weights`` changes them without a
  restart and answers ``{"weights", "load": {"how", "seconds"}}``, either
  - a JSON body ``{"adapter": PATH | null, "version": int | null}``: an adapter folder on the server's
    file system (null: the base model); version defaults to the adapter's step; or
  - a pushed LoRA: ``?sha256=HEX&version=N`` with the bytes of a diffusers LoRA file as the body
    (`stages.models.lora_weights`, what `omnirl update` writes as pytorch_lora_weights.safetensors), at
    most --max-weights-mb; the body's SHA-256 must be HEX (400 otherwise); the weights record it as
    adapter "pushed" with that digest;
  a LoRA (pushed, or a folder in diffusers' layout) is swapped onto the pipeline in place
  (`FlowPolicy.set_lora`: copied into the LoRA layers of the same config, else unloaded and added);
  other adapters (PEFT folders, full fine-tunes) load as a second pipeline beside, then swap in;
- ``POST /omnirl/v1/latent_shape`` ``{"resolution": R or [H, W], "frames": F}`` (R a square's side, F
  default 1) → ``{"latent_shape": [...]}``.

Refusals: 400 a malformed request, 401 a missing token, 404 an unknown route, 409 a rollout that asks
for other weights than the server holds, 411/413 (`stages.web`), 413 a batch over --max-batch or
`max_pixels`, 422 an adapter that does not load (the weights held stay as they were). One request
runs the model at a time (a lock), so several clients may call the server; a LoRA swap holds that
lock while it copies, a pipeline loaded beside does not.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
import threading
import time
import urllib.parse
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
PUSHED = "pushed"  # the `adapter` of weights a client pushed as a LoRA file
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_PIXELS = 2**26  # pixels in one request (samples × frames × height × width)
MAX_SIDE = 8192  # pixels of one side
MAX_FRAMES = 4096  # frames of one sample
_SIZE_RE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
# vLLM-Omni 0.30.0 bounds of /v1/images/generations
MAX_IMAGES, MAX_IMAGE_STEPS, MAX_GUIDANCE = 10, 200, 20.0


def _int_field(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"{key} must be an integer in [{lo}, {hi}]")
    return value


def _resolution_field(body: dict[str, Any], key: str) -> tuple[int, int]:
    """(height, width) of a field holding one side (a square) or [height, width], each in [1, MAX_SIDE]."""
    value = body.get(key)
    sides = value if isinstance(value, list) and len(value) == 2 else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SIDE for v in sides):
        raise HttpError(
            HTTPStatus.BAD_REQUEST, f"{key} must be an integer or [height, width], each in [1, {MAX_SIDE}]"
        )
    height, width = sides * 2 if len(sides) == 1 else sides
    return height, width


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
        max_weights_bytes: int = 1024 * 2**20,
    ):
        from stages.models.diffusion import check_pipeline_folder
        from stages.models.factory import default_text_length
        from stages.shards.digest import content_digest

        super().__init__(token=token, max_request_bytes=max_request_bytes)
        self.model = check_pipeline_folder(model)  # before hashing what may be any folder
        self.device = device
        self.dtype = dtype
        self.served_name = served_name or self.model.name
        self.max_batch = max_batch
        self.max_pixels = max_pixels
        self.text_length = default_text_length(self.model)
        self.model_sha256 = content_digest(self.model, "--model")
        self.max_weights_bytes = max_weights_bytes
        self.lock = threading.Lock()  # the model runs one request at a time
        self.loading = threading.Lock()  # one adapter loads at a time
        self.weights = self._start(adapter)
        self.engine = self._open(adapter)

    # ---------------------------------------------------------------- weights
    def _open(self, adapter: str | Path | None) -> DiffusersEngine:
        from stages.models.diffusion import FlowPolicy

        return DiffusersEngine(
            FlowPolicy.load(self.model, adapter=adapter, device=self.device, dtype=self.dtype)
        )

    def _record(self, adapter: str | None, digest: str | None, version: int) -> dict[str, Any]:
        return {
            "model_sha256": self.model_sha256,
            "adapter": adapter,
            "adapter_sha256": digest,
            "version": version,
        }

    def _start(self, adapter: str | Path | None) -> dict[str, Any]:
        from stages.models.diffusion import read_adapter_config
        from stages.shards.digest import content_digest

        self.full = False  # whether the pipeline holds a full adapter (no LoRA swaps onto it in place)
        if adapter is None:
            return self._record(None, None, 0)
        config = read_adapter_config(adapter)
        self.full = config["kind"] == "full"
        return self._record(str(adapter), content_digest(adapter, "adapter"), int(config.get("step", 0)))

    def _swap(self, layers: Any, config: Any, record: dict[str, Any]) -> dict[str, Any]:
        """Swap a LoRA (None: the base model) onto the pipeline in place (`FlowPolicy.set_lora`); a
        pipeline holding a full adapter or text-encoder LoRA layers is reloaded beside instead."""
        if self.full or self.engine.policy.untrained_loras():
            engine = self._open(None)
            how = engine.policy.set_lora(layers, config)
            with self.lock:
                self.engine, self.weights, self.full = engine, record, False
            return {"how": f"reloaded, {how}"}
        with self.lock:  # no rollout sees half-copied weights
            how = self.engine.policy.set_lora(layers, config)
            self.weights = record
        return {"how": how}

    def _load_folder(self, adapter: str | None, version: int | None) -> dict[str, Any]:
        """``POST /omnirl/v1/weights`` with a folder path (module docstring)."""
        from stages.models.diffusion import LORA_WEIGHTS, read_adapter_config
        from stages.models.lora_weights import read_lora_file
        from stages.shards.digest import content_digest

        if adapter is None:
            return self._swap(None, None, self._record(None, None, 0 if version is None else version))
        config = read_adapter_config(adapter, "adapter")
        digest = content_digest(adapter, "adapter")
        step = int(config.get("step", 0)) if version is None else version
        file = Path(adapter) / LORA_WEIGHTS
        if config["kind"] == "lora" and file.is_file():
            try:
                layers, lora = read_lora_file(file.read_bytes(), self.engine.policy.family.trained_module)
            except ValueError:  # another trainer's file (text-encoder layers, no config): load it whole
                pass
            else:
                return self._swap(layers, lora, self._record(adapter, digest, step))
        engine = self._open(adapter)  # a PEFT folder or a full adapter: a pipeline beside, then swapped
        with self.lock:
            self.engine, self.full = engine, config["kind"] == "full"
            self.weights = self._record(adapter, digest, step)
        return {"how": "reloaded"}

    def _load_pushed(self, raw: bytes, query: dict[str, list[str]]) -> dict[str, Any]:
        """``POST /omnirl/v1/weights?sha256=HEX&version=N`` with a LoRA file's bytes (module docstring)."""
        from stages.models.lora_weights import read_lora_file

        digest = query["sha256"][-1].lower()
        if not _HEX64.match(digest):
            raise HttpError(HTTPStatus.BAD_REQUEST, "sha256 must be 64 hex digits (the body's SHA-256)")
        try:
            version = int(query.get("version", [""])[-1])
        except ValueError:
            raise HttpError(
                HTTPStatus.BAD_REQUEST, "a pushed adapter needs ?version=N (an integer)"
            ) from None
        actual = hashlib.sha256(raw).hexdigest()
        if actual != digest:
            raise HttpError(
                HTTPStatus.BAD_REQUEST,
                f"the body's sha256 is {actual[:12]}…, the request says {digest[:12]}…: the body was cut or "
                "changed on the way; send it again",
            )
        try:
            layers, lora = read_lora_file(raw, self.engine.policy.family.trained_module)
        except ValueError as exc:
            raise HttpError(HTTPStatus.UNPROCESSABLE_ENTITY, f"the pushed adapter: {exc}") from None
        return self._swap(layers, lora, self._record(PUSHED, digest, version))

    def load_weights(self, raw: bytes, query: dict[str, list[str]]) -> dict[str, Any]:
        """``POST /omnirl/v1/weights``: a pushed LoRA file (``?sha256=``) or a JSON body naming a folder;
        answers the weights now held and how they were loaded (``how``, ``seconds``)."""
        t0 = time.perf_counter()
        with self.loading:
            try:
                if "sha256" in query:
                    load = self._load_pushed(raw, query)
                else:
                    body = parse_json_object(raw)
                    adapter, version = body.get("adapter"), body.get("version")
                    if adapter is not None and not isinstance(adapter, str):
                        raise HttpError(
                            HTTPStatus.BAD_REQUEST, "adapter must be a folder path on the server or null"
                        )
                    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
                        raise HttpError(HTTPStatus.BAD_REQUEST, "version must be an integer or null")
                    load = self._load_folder(adapter, version)
            except UserInputError as exc:
                raise HttpError(HTTPStatus.UNPROCESSABLE_ENTITY, str(exc)) from None
        return {"weights": dict(self.weights), "load": {**load, "seconds": time.perf_counter() - t0}}

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

    def body_limit(self, path: str) -> tuple[int, str]:
        if path == WEIGHTS_ROUTE:
            return self.max_weights_bytes, "--max-weights-mb"
        return super().body_limit(path)

    def post(self, path: str, raw: bytes) -> dict[str, Any]:
        parts = urllib.parse.urlsplit(path)
        route = parts.path.rstrip("/")
        if route == WEIGHTS_ROUTE:
            return self.load_weights(raw, urllib.parse.parse_qs(parts.query))
        routes = {ROUTE: self.rollout, IMAGES_ROUTE: self.images, LATENT_ROUTE: self.latent_shape}
        if route not in routes:
            raise HttpError(
                HTTPStatus.NOT_FOUND, f"no route POST {path}; POST {', '.join([*routes, WEIGHTS_ROUTE])}"
            )
        try:
            return routes[route](raw)
        except ProtocolError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None

    def _check_pixels(self, samples: int, resolution: tuple[int, int], frames: int = 1) -> None:
        height, width = resolution
        if samples * frames * height * width > self.max_pixels:
            per = f"{frames} frames of {height}x{width}" if frames > 1 else f"{height}x{width}"
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
        if match is None or min(int(match.group(1)), int(match.group(2))) < 1:
            raise HttpError(
                HTTPStatus.BAD_REQUEST, f"size {size!r}: give 'WxH' (width first), e.g. '416x240'"
            )
        resolution = (int(match.group(2)), int(match.group(1)))  # (height, width)
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
        """``POST /omnirl/v1/latent_shape``: the stored latent of one sample of `resolution` (one side or
        [height, width]) and `frames` frames (default 1)."""
        body = parse_json_object(raw)
        resolution = _resolution_field(body, "resolution")
        frames = _int_field(body, "frames", 1, 1, MAX_FRAMES)
        try:
            return {"latent_shape": list(self.engine.latent_shape(resolution, frames))}
        except UserInputError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
