"""The rollout server behind `omnirl serve`: a diffusion pipeline on its own device, over HTTP.

Routes (JSON in and out, never pickle; HTTP, token and size checks in `stages.web`):

- ``GET /health`` (no token): ``{"status": "ok", "protocols", "model", "family", "dtype", "weights"}``,
  where ``dtype`` is the weights dtype (--dtype) and ``weights`` is ``{"model_sha256", "adapter",
  "adapter_sha256", "version"}``;
- ``GET /v1/models``: the OpenAI list shape, one model whose ``id`` is the served model name;
- ``POST /omnirl/v1/rollout``: omnirl rollout protocol v1 (`stages.sample.rollout_protocol`): the trajectories
  of `rollout_batch`, which `omnirl logprob` replays exactly, and when asked the prompt conditioning they were
  sampled with (which `omnirl sample` stores and `online`'s trainer trains on);
- ``POST /v1/images/generations``: vLLM-Omni's (OpenAI's) images API: ``prompt``, ``n`` (1–10),
  ``size`` ("WxH"), ``num_inference_steps`` (1–200), ``guidance_scale`` (0–20),
  ``negative_prompt``, ``seed`` (random when absent; image i draws from seed + i), ``model`` (400 when
  it is not the served name), ``response_format`` b64_json; deterministic (ode) sampling; the reply is
  ``{"created", "data": [{"b64_json", "url": null, "revised_prompt": null}], "output_format": "png",
  "size", "metrics"}``; other fields are ignored;
- ``POST /v1/videos/sync`` (a video family): vLLM-Omni's synchronous videos API, a form
  (``multipart/form-data`` or urlencoded, as its FastAPI ``Form`` fields): ``prompt``, ``model``, ``size``
  "WxH" or ``width``/``height``, ``num_frames`` (or ``seconds`` × ``fps``), ``fps`` (default 24),
  ``num_inference_steps`` (1–200), ``guidance_scale`` (0–20), ``guidance_scale_2`` (the low-noise expert's,
  two-expert families), ``negative_prompt``, ``seed`` (random when absent); deterministic (ode) sampling; the
  reply is the MP4 itself (``video/mp4``) with headers ``X-Request-Id``, ``X-Model``, ``X-Inference-Time-S``,
  ``X-Stage-Durations``, ``X-Peak-Memory-MB``; other fields are ignored;
- ``GET /omnirl/v1/weights`` the weights held; ``POST /omnirl/v1/weights`` changes them without a
  restart and answers ``{"weights", "load": {"how", "seconds"}}``, either
  - a JSON body ``{"adapter": PATH | null, "version": int | null}``: an adapter folder on the server's
    file system (null: the base model); version defaults to the adapter's step. A path makes the server
    read with its own rights, so it loads only under --weights-root (a relative PATH is taken there;
    symlinks are resolved first) and, without one, only for a server with a token (its holders may
    name any folder); any other path is 403 with one reply, whether it exists or not
    (`ServedWeights._adapter_folder`); or
  - a pushed LoRA: ``?sha256=HEX&version=N`` with the bytes of a diffusers LoRA file as the body
    (`stages.models.lora_weights`, what `omnirl update` writes as pytorch_lora_weights.safetensors), at
    most --max-weights-mb; the body's SHA-256 must be HEX (400 otherwise); the weights record it as
    adapter "pushed" with that digest;
  a LoRA (pushed, or a folder in diffusers' layout) is swapped onto the pipeline in place
  (`FlowPolicy.set_lora`: copied into the LoRA layers of the same config, else unloaded and added); other
  adapters (PEFT folders, full fine-tunes) load as a second pipeline beside, then swap in; with a ``name``
  (``?name=NAME``, or ``"name"`` in the JSON body) the LoRA is kept as version N of the named weights NAME
  instead (the latest `served_weights.KEEP_VERSIONS` pushed of each name), leaving the unnamed weights as they
  are: several trainers share the server, each rollout request naming its weights (``weights.name``,
  optionally pinning ``weights.version``; 409 for a name or version not held) and the pipeline swapping them
  in before the batch when another batch used other weights; a push of a new name when the server holds
  --max-named-weights names is 409 (delete one first). Each name is held on a lease of --named-weights-ttl
  seconds (``lease_s`` in the push's reply), renewed by every push, rollout request and ``POST
  /omnirl/v1/weights/lease`` naming it: a name not renewed for that long (its trainer was killed) is
  forgotten, before any use of the table (so before the cap is checked);
- ``POST /omnirl/v1/weights/lease`` ``{"name": NAME}`` renews the lease of named weights NAME (a trainer's
  heartbeat while it trains), answering ``{"name", "versions", "lease_s"}``; 404 when not held (never pushed,
  deleted, or expired);
- ``DELETE /omnirl/v1/weights?name=NAME[&version=N]`` forgets named weights NAME (every version, or
  version N), answering ``{"deleted": {"name", "versions"}, "named_weights"}``; 404 when not held
  (`omnirl online` deletes its own at the end of a run);
- ``POST /omnirl/v1/latent_shape`` ``{"resolution": R or [H, W], "frames": F}`` (R a square's side, F
  default 1) → ``{"latent_shape": [...]}``.

Refusals: 400 a malformed request, 401 a missing token, 403 an adapter folder the server may not load (above),
404 an unknown route, 409 a rollout that asks for other weights than the server holds (or named weights, or a
version of them, it does not hold), 411/413 (`stages.web`), 413 a batch over --max-batch or `max_pixels`, or
whose cost (samples × frames × height × width × denoising steps, in megapixel-steps) is over
--max-request-cost (on every route that samples: its message names both), 422 an adapter that does not load
(the weights held stay as they were). One request runs the model at a time (a lock), so several clients may
call the server; a LoRA swap holds that lock while it copies, a pipeline loaded beside does not. A batch whose
client closed its connection (gave up, timed out, was killed) stops before its next denoising step and frees
the model for the next request; nothing is replied to it (`stages.web.client_gone`).
"""

from __future__ import annotations

import base64
import logging
import re
import secrets
import time
import urllib.parse
from http import HTTPStatus
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.knobs import MAX_FRAMES
from stages.models.conditioning import Entries
from stages.sample.engines import DiffusersEngine
from stages.sample.lockstep import Pipelines
from stages.sample.rollout import SampleConfig, stored_steps
from stages.sample.rollout_protocol import (
    PROTOCOL,
    ROUTE,
    VERSION,
    ProtocolError,
    RolloutRequest,
    decode_request,
    encode_response,
    refuse_settings,
)
from stages.sample.served_weights import WEIGHTS_ROUTE, ServedWeights, weights_name_field
from stages.web import (
    ClientGone,
    HttpError,
    JsonService,
    RawReply,
    client_gone,
    parse_form,
    parse_json_object,
)

logger = logging.getLogger(__name__)
IMAGES_ROUTE = "/v1/images/generations"
VIDEOS_ROUTE = "/v1/videos/sync"
VIDEO_FPS = 24  # vLLM-Omni's default frames per second of /v1/videos
LATENT_ROUTE = "/omnirl/v1/latent_shape"
LEASE_ROUTE = "/omnirl/v1/weights/lease"
MAX_PIXELS = 2**26  # pixels in one request (samples × frames × height × width)
MEGA = 10**6  # --max-request-cost counts megapixel-steps
MAX_SIDE = 8192  # pixels of one side
_SIZE_RE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
# vLLM-Omni 0.30.0 bounds of /v1/images/generations
MAX_IMAGES, MAX_IMAGE_STEPS, MAX_GUIDANCE = 10, 200, 20.0


def _int_field(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"{key} must be an integer in [{lo}, {hi}]")
    return value


def _size_field(size: Any) -> tuple[int, int]:
    """(height, width) of vLLM-Omni's ``size`` "WxH" (width first), each side in [1, MAX_SIDE]; 400
    otherwise."""
    match = _SIZE_RE.match(size) if isinstance(size, str) else None
    width, height = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise HttpError(
            HTTPStatus.BAD_REQUEST,
            f"size {size!r}: give 'WxH' (width first, e.g. '416x240'), each side in [1, {MAX_SIDE}]",
        )
    return height, width


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


def _stop_if_gone(step: int) -> None:
    """`on_step` of a batch: `ClientGone` when its client closed the connection, so the model goes to
    the next request instead of samples no one will read."""
    if client_gone():
        raise ClientGone(f"its batch stopped before denoising step {step}")


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
        max_named: int = 16,
        max_cost: int = 10_000,
        weights_root: str | Path | None = None,
        named_ttl: float = 600.0,
        pipelines: Pipelines | None = None,
    ):
        from stages.models.factory import default_text_length
        from stages.models.folders import check_pipeline_folder

        super().__init__(token=token, max_request_bytes=max_request_bytes)
        self.model = check_pipeline_folder(model)  # before hashing what may be any folder
        self.dtype = dtype
        self.served_name = served_name or self.model.name
        self.max_batch = max_batch
        self.max_pixels = max_pixels
        self.max_cost = max_cost  # megapixel-steps of one request (samples × frames × pixels × steps / 10^6)
        self.text_length = default_text_length(self.model)
        self.max_weights_bytes = max_weights_bytes
        # the pipeline and the weights on it (`weights` routes; `held.lock`: one request runs at a time)
        self.held = ServedWeights(
            self.model,
            adapter,
            device=device,
            dtype=dtype,
            max_named=max_named,
            named_ttl=named_ttl,
            weights_root=weights_root,
            any_folder=token is not None,
            pipelines=pipelines,
        )

    @property
    def engine(self) -> DiffusersEngine:
        """The pipeline now served (it changes when an adapter loads beside and swaps in)."""
        return self.held.engine

    @property
    def weights(self) -> dict[str, Any]:
        """The record of the unnamed weights now held (``/health``'s ``weights``)."""
        return self.held.weights

    # ---------------------------------------------------------------- routes
    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "protocols": [f"{PROTOCOL}/{VERSION}"],
            "model": self.served_name,
            "family": self.held.engine.family,
            "dtype": self.dtype,
            "weights": dict(self.held.weights),
            "named_weights": self.held.named_weights(),
        }

    def get(self, path: str) -> dict[str, Any]:
        if path == "/health":
            return self.health()
        if path == "/v1/models":
            card = {"id": self.served_name, "object": "model", "created": 0, "owned_by": "omnirl"}
            return {"object": "list", "data": [card]}
        if path == WEIGHTS_ROUTE:
            return {"weights": dict(self.held.weights), "named_weights": self.held.named_weights()}
        raise HttpError(
            HTTPStatus.NOT_FOUND, f"no route GET {path}; GET /health, /v1/models or {WEIGHTS_ROUTE}"
        )

    def delete(self, path: str, query: dict[str, list[str]]) -> dict[str, Any]:
        """``DELETE /omnirl/v1/weights?name=NAME[&version=N]`` (module docstring)."""
        if path != WEIGHTS_ROUTE:
            raise HttpError(HTTPStatus.NOT_FOUND, f"no route DELETE {path}; DELETE {WEIGHTS_ROUTE}?name=NAME")
        name = weights_name_field(query.get("name", [None])[-1])
        if name is None:
            raise HttpError(HTTPStatus.BAD_REQUEST, "name the weights to forget: ?name=NAME")
        version = query.get("version", [None])[-1]
        if version is not None and not re.fullmatch(r"\d{1,18}", version):
            raise HttpError(HTTPStatus.BAD_REQUEST, f"version {version!r} is not a non-negative integer")
        versions = self.held.forget(name, None if version is None else int(version))
        return {"deleted": {"name": name, "versions": versions}, "named_weights": self.held.named_weights()}

    def body_limit(self, path: str) -> tuple[int, str]:
        if path == WEIGHTS_ROUTE:
            return self.max_weights_bytes, "--max-weights-mb"
        return super().body_limit(path)

    def post_request(self, path: str, raw: bytes, content_type: str) -> dict[str, Any] | RawReply:
        if urllib.parse.urlsplit(path).path.rstrip("/") == VIDEOS_ROUTE:
            return self.videos(parse_form(raw, content_type))
        return self.post(path, raw)

    def post(self, path: str, raw: bytes) -> dict[str, Any]:
        parts = urllib.parse.urlsplit(path)
        route = parts.path.rstrip("/")
        if route == WEIGHTS_ROUTE:
            return self.held.load(raw, urllib.parse.parse_qs(parts.query))
        routes = {
            ROUTE: self.rollout,
            IMAGES_ROUTE: self.images,
            LATENT_ROUTE: self.latent_shape,
            LEASE_ROUTE: self.held.renew_lease,
        }
        if route not in routes:
            raise HttpError(
                HTTPStatus.NOT_FOUND,
                f"no route POST {path}; POST {', '.join([*routes, VIDEOS_ROUTE, WEIGHTS_ROUTE])}",
            )
        try:
            return routes[route](raw)
        except ProtocolError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None

    def _check_size(self, samples: int, steps: int, resolution: tuple[int, int], frames: int = 1) -> None:
        """413 for a request over `max_pixels` (memory: samples × frames × height × width) or over
        --max-request-cost (time: those pixels × denoising steps, in megapixel-steps)."""
        height, width = resolution
        pixels = samples * frames * height * width
        per = f"{frames} frames of {height}x{width}" if frames > 1 else f"{height}x{width}"
        if pixels > self.max_pixels:
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"{samples} samples of {per} pixels, more than the server's {self.max_pixels}; "
                "send fewer samples per request",
            )
        if pixels * steps > self.max_cost * MEGA:
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the request costs {pixels * steps / MEGA:g} megapixel-steps ({samples} samples of {per} "
                f"pixels × {steps} steps), more than the server's --max-request-cost {self.max_cost}; "
                "send fewer samples or steps per request",
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
        self._check_size(len(request.prompts), request.cfg.steps, request.cfg.resolution, request.cfg.frames)
        windows = {len(stored_steps(request.cfg, g)) for g in request.groups}
        if len(windows) > 1:
            raise ProtocolError("the samples' groups place windows of different lengths; batch them apart")
        with self.held.lock:
            version = self.held.select(request.weights)
            columns = self.held.rollout(
                request.cfg,
                request.prompts,
                request.negatives,
                request.seeds,
                request.init_seeds,
                groups=request.groups,
                sample_ids=request.sample_ids,
                on_step=_stop_if_gone,
            )
            conditioning = self._conditioning(request) if request.return_conditioning else None
        return encode_response(request.request_id, version, columns, conditioning)

    def _conditioning(self, request: RolloutRequest) -> Entries | None:
        """The prompt conditioning the batch of `request` was just sampled with (the policy's cache), or
        None when the pipeline cannot give it (`DiffusersEngine.conditioning`: text-encoder LoRA layers)."""
        keys = request.conditioning_keys()
        entries = self.held.engine.conditioning(keys)
        return entries if entries is not None and len(entries) == len(keys) else None

    def _generation(self, body: dict[str, Any], media: str) -> str:
        """The prompt of an images or videos request for `media` ("image", "video"), after the checks
        both routes share: this model makes that media, the prompt is given, the model is served here."""
        made = self.held.engine.policy.family.media
        if made != media:
            route = VIDEOS_ROUTE if made == "video" else IMAGES_ROUTE
            raise HttpError(
                HTTPStatus.BAD_REQUEST,
                f"{self.served_name} is a {made} model: it makes no {media}s; POST {route}",
            )
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise HttpError(HTTPStatus.BAD_REQUEST, "prompt is required (a non-empty string)")
        model = body.get("model")
        if model is not None and model != self.served_name:
            raise HttpError(
                HTTPStatus.BAD_REQUEST,
                f"model {model!r} is not served here; this serves {self.served_name!r}",
            )
        return prompt

    def _sample_one_kind(
        self, cfg: SampleConfig, prompts: list[str], negatives: list[str], seeds: list[int]
    ) -> dict[str, Any]:
        """ODE samples of the unnamed weights, one per seed (x_T from the seed too); settings the family
        refuses are 400."""
        with self.held.lock:
            self.held.activate(None)
            try:
                return self.held.rollout(
                    cfg,
                    prompts,
                    negatives,
                    seeds,
                    seeds,
                    groups=[0] * len(seeds),
                    sample_ids=[f"{self.held.engine.policy.family.media}-{i}" for i in range(len(seeds))],
                    on_step=_stop_if_gone,
                )
            except UserInputError as exc:
                raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None

    def images(self, raw: bytes) -> dict[str, Any]:
        """``POST /v1/images/generations`` as vLLM-Omni answers it (module docstring)."""
        body = parse_json_object(raw)
        prompt = self._generation(body, "image")
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
        resolution = _size_field(size)
        self._check_size(n, steps, resolution)
        cfg = SampleConfig(
            steps=steps,
            guidance=float(guidance),
            resolution=resolution,
            sampler="ode",
            max_sequence_length=self.text_length,
        )
        t0 = time.perf_counter()
        columns = self._sample_one_kind(cfg, [prompt] * n, [negative] * n, [seed + i for i in range(n)])
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

    def videos(self, form: dict[str, str]) -> RawReply:
        """``POST /v1/videos/sync`` as vLLM-Omni answers it (module docstring): one MP4."""
        fields: dict[str, Any] = dict(form)
        for key in ("width", "height", "num_frames", "fps", "num_inference_steps", "seed", "seconds"):
            if key in fields:
                try:
                    fields[key] = int(fields[key])
                except ValueError:
                    raise HttpError(HTTPStatus.BAD_REQUEST, f"{key} must be an integer") from None
        for key in ("guidance_scale", "guidance_scale_2"):
            if key in fields:
                try:
                    fields[key] = float(fields[key])
                except ValueError:
                    raise HttpError(HTTPStatus.BAD_REQUEST, f"{key} must be a number") from None
        prompt = self._generation(fields, "video")
        if "size" in fields:
            height, width = _size_field(fields["size"])
        elif "width" in fields and "height" in fields:
            height, width = _size_field(f"{fields['width']}x{fields['height']}")
        else:
            raise HttpError(
                HTTPStatus.BAD_REQUEST, "give a size 'WxH' (width first, e.g. '416x240') or width and height"
            )
        fps = _int_field(fields, "fps", VIDEO_FPS, 1, 1000)
        if "num_frames" not in fields and "seconds" in fields:
            fields["num_frames"] = _int_field(fields, "seconds", 1, 1, 3600) * fps
        if "num_frames" not in fields:
            raise HttpError(HTTPStatus.BAD_REQUEST, "num_frames (or seconds) is required")
        frames = _int_field(fields, "num_frames", 1, 1, MAX_FRAMES)
        steps = _int_field(fields, "num_inference_steps", SampleConfig.steps, 1, MAX_IMAGE_STEPS)
        self._check_size(1, steps, (height, width), frames)
        guidance = fields.get("guidance_scale", SampleConfig.guidance)
        guidance_2 = fields.get("guidance_scale_2")
        for key, value in (("guidance_scale", guidance), ("guidance_scale_2", guidance_2)):
            if value is not None and not 0 <= value <= MAX_GUIDANCE:
                raise HttpError(HTTPStatus.BAD_REQUEST, f"{key} must be a number in [0, {MAX_GUIDANCE:g}]")
        cfg = SampleConfig(
            steps=steps,
            guidance=float(guidance),
            guidance_2=guidance_2,
            resolution=(height, width),
            frames=frames,
            fps=float(fps),
            sampler="ode",
            max_sequence_length=self.text_length,
        )
        seed = _int_field(fields, "seed", secrets.randbelow(2**62), 0, 2**63 - 1)
        negative = fields.get("negative_prompt") or ""
        t0 = time.perf_counter()
        columns = self._sample_one_kind(cfg, [prompt], [negative], [seed])
        headers = {
            "X-Request-Id": f"video_sync-{secrets.token_hex(16)}",
            "X-Model": self.served_name,
            "X-Inference-Time-S": f"{time.perf_counter() - t0:.3f}",
            "X-Stage-Durations": "{}",
            "X-Peak-Memory-MB": "0.000",
        }
        return RawReply(columns["video"][0], "video/mp4", headers)

    def latent_shape(self, raw: bytes) -> dict[str, Any]:
        """``POST /omnirl/v1/latent_shape``: the stored latent of one sample of `resolution` (one side or
        [height, width]) and `frames` frames (default 1)."""
        body = parse_json_object(raw)
        resolution = _resolution_field(body, "resolution")
        frames = _int_field(body, "frames", 1, 1, MAX_FRAMES)
        try:
            return {"latent_shape": list(self.held.engine.latent_shape(resolution, frames))}
        except UserInputError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
