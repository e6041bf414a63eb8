"""The rollout server behind `omnirl serve`: a diffusion pipeline on its own device, over HTTP.

Routes (JSON in and out, never pickle; HTTP, token and size checks in `stages.web`):

- ``GET /health`` (no token): ``{"status": "ok", "protocols", "model", "family", "dtype", "weights"}``,
  where ``dtype`` is the weights dtype (--dtype) and ``weights`` is ``{"model_sha256", "adapter",
  "adapter_sha256", "version"}``;
- ``GET /v1/models``: the OpenAI list shape, one model whose ``id`` is the served model name;
- ``POST /omnirl/v1/rollout``: omnirl rollout protocol v1 (`stages.sample.rollout_protocol`): the
  trajectories of `rollout_batch`, which `omnirl logprob` replays exactly, and when asked the prompt
  conditioning they were sampled with (which `omnirl sample` stores and `online`'s trainer trains on);
- ``POST /v1/images/generations``: vLLM-Omni's (OpenAI's) images API: ``prompt``, ``n`` (1–10),
  ``size`` ("WxH"), ``num_inference_steps`` (1–200), ``guidance_scale`` (0–20),
  ``negative_prompt``, ``seed`` (random when absent; image i draws from seed + i), ``model`` (400 when
  it is not the served name), ``response_format`` b64_json; deterministic (ode) sampling; the reply is
  ``{"created", "data": [{"b64_json", "url": null, "revised_prompt": null}], "output_format": "png",
  "size", "metrics"}``; other fields are ignored;
- ``POST /v1/videos/sync`` (a video family): vLLM-Omni's synchronous videos API, a form
  (``multipart/form-data`` or urlencoded, as its FastAPI ``Form`` fields): ``prompt``, ``model``,
  ``size`` "WxH" or ``width``/``height``, ``num_frames`` (or ``seconds`` × ``fps``), ``fps``
  (default 24), ``num_inference_steps`` (1–200), ``guidance_scale`` (0–20), ``guidance_scale_2`` (the
  low-noise expert's, two-expert families), ``negative_prompt``,
  ``seed`` (random when absent); deterministic (ode) sampling; the reply is the MP4 itself
  (``video/mp4``) with headers ``X-Request-Id``, ``X-Model``, ``X-Inference-Time-S``,
  ``X-Stage-Durations``, ``X-Peak-Memory-MB``; other fields are ignored;
- ``GET /omnirl/v1/weights`` the weights held; ``POST /omnirl/v1/weights`` changes them without a
  restart and answers ``{"weights", "load": {"how", "seconds"}}``, either
  - a JSON body ``{"adapter": PATH | null, "version": int | null}``: an adapter folder on the server's
    file system (null: the base model); version defaults to the adapter's step. A path makes the server
    read with its own rights, so it loads only under --weights-root (a relative PATH is taken there;
    symlinks are resolved first) and, without one, only for a server with a token (its holders may
    name any folder); any other path is 403 with one reply, whether it exists or not (`_adapter_folder`);
    or
  - a pushed LoRA: ``?sha256=HEX&version=N`` with the bytes of a diffusers LoRA file as the body
    (`stages.models.lora_weights`, what `omnirl update` writes as pytorch_lora_weights.safetensors), at
    most --max-weights-mb; the body's SHA-256 must be HEX (400 otherwise); the weights record it as
    adapter "pushed" with that digest;
  a LoRA (pushed, or a folder in diffusers' layout) is swapped onto the pipeline in place
  (`FlowPolicy.set_lora`: copied into the LoRA layers of the same config, else unloaded and added);
  other adapters (PEFT folders, full fine-tunes) load as a second pipeline beside, then swap in;
  with a ``name`` (``?name=NAME``, or ``"name"`` in the JSON body) the LoRA is kept as version N of the
  named weights NAME instead (the latest `KEEP_VERSIONS` pushed of each name), leaving the unnamed
  weights as they are: several trainers share the server, each rollout request naming its weights
  (``weights.name``, optionally pinning ``weights.version``; 409 for a name or version not held) and
  the pipeline swapping them in before the batch when another batch used other weights; a push of a
  new name when the server holds --max-named-weights names is 409 (delete one first). Each name is
  held on a lease of --named-weights-ttl seconds (``lease_s`` in the push's reply), renewed by every
  push, rollout request and ``POST /omnirl/v1/weights/lease`` naming it: a name not renewed for that
  long (its trainer was killed) is forgotten, before any use of the table (so before the cap is
  checked);
- ``POST /omnirl/v1/weights/lease`` ``{"name": NAME}`` renews the lease of named weights NAME (a
  trainer's heartbeat while it trains), answering ``{"name", "versions", "lease_s"}``; 404 when not
  held (never pushed, deleted, or expired);
- ``DELETE /omnirl/v1/weights?name=NAME[&version=N]`` forgets named weights NAME (every version, or
  version N), answering ``{"deleted": {"name", "versions"}, "named_weights"}``; 404 when not held
  (`omnirl online` deletes its own at the end of a run);
- ``POST /omnirl/v1/latent_shape`` ``{"resolution": R or [H, W], "frames": F}`` (R a square's side, F
  default 1) → ``{"latent_shape": [...]}``.

Refusals: 400 a malformed request, 401 a missing token, 403 an adapter folder the server may not load
(above), 404 an unknown route, 409 a rollout that asks for other weights than the server holds (or named
weights, or a version of them, it does not hold), 411/413 (`stages.web`), 413 a batch over --max-batch
or `max_pixels`, or whose cost (samples × frames × height × width × denoising steps, in megapixel-steps)
is over --max-request-cost (on every route that samples: its message names both), 422 an adapter that
does not load (the weights held stay as they were). One request runs the model at a time (a lock), so
several clients may call the server; a LoRA swap holds that lock while it copies, a pipeline loaded
beside does not. A batch whose client closed its connection (gave up, timed out, was killed) stops
before its next denoising step and frees the model for the next request; nothing is replied to it
(`stages.web.client_gone`).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import secrets
import threading
import time
import urllib.parse
from http import HTTPStatus
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.media.video import MAX_FRAMES
from stages.models.conditioning import Entries
from stages.sample.engines import DiffusersEngine
from stages.sample.rollout import SampleConfig, stored_steps
from stages.sample.rollout_protocol import (
    PROTOCOL,
    ROUTE,
    VERSION,
    WEIGHTS_NAME,
    WEIGHTS_NAME_RULE,
    ProtocolError,
    RolloutRequest,
    check_weights,
    decode_request,
    encode_response,
    refuse_settings,
)
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
WEIGHTS_ROUTE = "/omnirl/v1/weights"
LATENT_ROUTE = "/omnirl/v1/latent_shape"
LEASE_ROUTE = "/omnirl/v1/weights/lease"
PUSHED = "pushed"  # the `adapter` of weights a client pushed as a LoRA file
# versions of each named weights the server keeps (the latest pushed): a sampler at --max-staleness 1
# pins the version before the one its trainer pushes meanwhile
KEEP_VERSIONS = 2
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_PIXELS = 2**26  # pixels in one request (samples × frames × height × width)
MEGA = 10**6  # --max-request-cost counts megapixel-steps
MAX_SIDE = 8192  # pixels of one side
_SIZE_RE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
# vLLM-Omni 0.30.0 bounds of /v1/images/generations
MAX_IMAGES, MAX_IMAGE_STEPS, MAX_GUIDANCE = 10, 200, 20.0


def _weights_name(value: Any) -> str | None:
    """The `name` of named weights (None: the unnamed ones); 400 unless 1–64 letters, digits, ``._-``."""
    if value is None:
        return None
    if not isinstance(value, str) or not WEIGHTS_NAME.match(value):
        raise HttpError(HTTPStatus.BAD_REQUEST, f"name must be {WEIGHTS_NAME_RULE}")
    return value


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
        self.max_cost = max_cost  # megapixel-steps of one request (samples × frames × pixels × steps / 10^6)
        self.text_length = default_text_length(self.model)
        self.model_sha256 = content_digest(self.model, "--model")
        self.max_weights_bytes = max_weights_bytes
        self.max_named = max_named  # names of named weights held at once (each up to KEEP_VERSIONS LoRAs)
        self.named_ttl = named_ttl  # seconds a name is held without a renewal (`_renew`)
        self.weights_root = None if weights_root is None else Path(weights_root).resolve()
        if self.weights_root is not None and not self.weights_root.is_dir():
            raise UserInputError(f"--weights-root {weights_root}: not a folder; create it or pass another")
        self.lock = threading.Lock()  # the model runs one request at a time
        self.loading = threading.Lock()  # one adapter loads at a time
        self.weights = self._start(adapter)
        self.engine = self._open(adapter)
        # named weights (several trainers on one server): name → version → (layers, config, record),
        # the latest KEEP_VERSIONS pushed of each, behind `table` (never held while the model runs, so
        # pushes and /health do not wait for a batch); `active` is the one on the pipeline (None: the
        # unnamed weights, `self.weights`, whose LoRA `default_lora` holds once swapped away from) and
        # `active_entry` the table entry it was copied from (a version pushed again is a new entry)
        self.table = threading.Lock()
        self.named: dict[str, dict[int, tuple[Any, Any, dict[str, Any]]]] = {}
        self.leases: dict[str, float] = {}  # name → when (time.monotonic) it is forgotten unless renewed
        self.active: tuple[str, int] | None = None
        self.active_entry: tuple[Any, Any, dict[str, Any]] | None = None
        self.default_lora: tuple[Any, Any] | None = None

    # ---------------------------------------------------------------- weights
    def _open(self, adapter: str | Path | None) -> DiffusersEngine:
        from stages.models.diffusion import FlowPolicy

        return DiffusersEngine(
            FlowPolicy.load(self.model, adapter=adapter, device=self.device, dtype=self.dtype)
        )

    def _record(
        self, adapter: str | None, digest: str | None, version: int, name: str | None = None
    ) -> dict[str, Any]:
        record = {
            "model_sha256": self.model_sha256,
            "adapter": adapter,
            "adapter_sha256": digest,
            "version": version,
        }
        return record if name is None else {"name": name, **record}

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
                self.active, self.active_entry, self.default_lora = None, None, (layers, config)
            return {"how": f"reloaded, {how}"}
        with self.lock:  # no rollout sees half-copied weights
            how = self.engine.policy.set_lora(layers, config)
            self.weights = record
            self.active, self.active_entry, self.default_lora = None, None, (layers, config)
        return {"how": how}

    def _store_named(self, name: str, layers: Any, config: Any, record: dict[str, Any]) -> dict[str, Any]:
        """Keep LoRA `layers` as version ``record["version"]`` of the weights `name` (the latest
        KEEP_VERSIONS pushed stay); the pipeline changes only when a request asks for them."""
        if self.full or self.engine.policy.untrained_loras():
            raise HttpError(
                HTTPStatus.UNPROCESSABLE_ENTITY,
                "named weights are LoRAs swapped onto the base model, and this server holds a full adapter or "
                "text-encoder LoRAs (its --adapter); serve the base model for named weights",
            )
        version = record["version"]
        with self.table:  # a version on the pipeline now is swapped anew by the next batch asking for it
            self._forget_expired()
            if name not in self.named and len(self.named) >= self.max_named:
                raise HttpError(
                    HTTPStatus.CONFLICT,
                    f"the server holds {len(self.named)} named weights, its --max-named-weights; forget "
                    f"one first (DELETE {WEIGHTS_ROUTE}?name=NAME; GET {WEIGHTS_ROUTE} lists them)",
                )
            held = self.named.setdefault(name, {})
            held.pop(version, None)
            held[version] = (layers, config, record)
            while len(held) > KEEP_VERSIONS:
                held.pop(next(iter(held)))  # the oldest pushed
            self._renew(name)
            return {
                "how": "stored",
                "weights": {**record, "versions": sorted(held), "lease_s": self.named_ttl},
            }

    def _forget_expired(self) -> None:
        """Forget the named weights whose lease ran out (the caller holds `table`)."""
        now = time.monotonic()
        for name in [n for n, until in self.leases.items() if until <= now]:
            del self.named[name], self.leases[name]
            logger.info("forgot weights %r: no push, batch or lease renewal for %g s", name, self.named_ttl)

    def _renew(self, name: str) -> None:
        """Hold the named weights `name` --named-weights-ttl seconds more (the caller holds `table`)."""
        self.leases[name] = time.monotonic() + self.named_ttl

    def _activate(
        self, target: tuple[str, int] | None, entry: tuple[Any, Any, dict[str, Any]] | None = None
    ) -> None:
        """Put the unnamed weights (None) or version `target` of named weights (its table `entry`) on
        the pipeline, in place; the caller holds the model lock."""
        from stages.models.lora_weights import read_lora_file

        if target == self.active and entry is self.active_entry:
            return
        if target is None:
            layers, config = self.default_lora  # type: ignore[misc]  (kept when swapped away)
        else:
            if self.full:
                raise HttpError(
                    HTTPStatus.CONFLICT,
                    "the server now holds a full adapter: named LoRAs no longer swap onto it; push again "
                    "after loading a LoRA or the base model",
                )
            if self.active is None and self.default_lora is None:
                policy = self.engine.policy
                self.default_lora = (
                    read_lora_file(policy.lora_file(), policy.family.trained_module)
                    if policy.lora
                    else (None, None)
                )
            layers, config, _ = entry  # type: ignore[misc]
        self.engine.policy.set_lora(layers, config)
        self.active, self.active_entry = target, entry

    def _select(self, weights: dict[str, Any]) -> int:
        """Put the weights a rollout request names on the pipeline (the caller holds the model lock);
        their version. 409 when the server does not hold them (module docstring)."""
        name = weights.get("name")
        if name is None:
            conflict = check_weights(weights, self.weights)
            if conflict:
                raise HttpError(
                    HTTPStatus.CONFLICT,
                    f"{conflict}; load those weights (POST {WEIGHTS_ROUTE}) or restart with that --adapter",
                )
            self._activate(None)
            return int(self.weights["version"])
        model = weights.get("model_sha256")
        if model is not None and model != self.model_sha256:
            raise HttpError(
                HTTPStatus.CONFLICT,
                f"model_sha256 {model!r} was asked, the server holds {self.model_sha256!r}",
            )
        with self.table:
            self._forget_expired()
            held = dict(self.named.get(name) or {})
            if held:
                self._renew(name)
        if not held:
            raise HttpError(
                HTTPStatus.CONFLICT,
                f"no weights named {name!r} here (never pushed, deleted, or its lease ran out); push them "
                f"first (POST {WEIGHTS_ROUTE}?name={name}&sha256=...&version=N)",
            )
        version = weights.get("version")
        version = next(reversed(held)) if version is None else version  # the latest pushed
        if version not in held:
            raise HttpError(
                HTTPStatus.CONFLICT,
                f"weights {name!r} version {version} was asked; the server holds versions "
                f"{sorted(held)} of it (the latest {KEEP_VERSIONS} pushed): push that version again",
            )
        digest = weights.get("adapter_sha256")
        if digest is not None and digest != held[version][2]["adapter_sha256"]:
            raise HttpError(
                HTTPStatus.CONFLICT,
                f"weights {name!r} version {version} hold adapter_sha256 {held[version][2]['adapter_sha256']!r}, "
                f"not the {digest!r} asked",
            )
        try:
            self._activate((name, version), held[version])
        except UserInputError as exc:  # a model whose LoRA does not swap in place (two experts)
            raise HttpError(HTTPStatus.UNPROCESSABLE_ENTITY, str(exc)) from None
        return int(version)

    def named_weights(self) -> dict[str, Any]:
        """``{name: {"versions", "version", "adapter_sha256", "lease_left_s"}}`` of the named weights
        held (latest last)."""
        with self.table:
            self._forget_expired()
            now = time.monotonic()
            return {
                name: {
                    "versions": sorted(held),
                    "version": next(reversed(held)),
                    "adapter_sha256": held[next(reversed(held))][2]["adapter_sha256"],
                    "lease_left_s": round(self.leases[name] - now, 3),
                }
                for name, held in self.named.items()
            }

    def renew_lease(self, raw: bytes) -> dict[str, Any]:
        """``POST /omnirl/v1/weights/lease`` ``{"name": NAME}``: NAME is held --named-weights-ttl seconds
        more; 404 when it is not held."""
        name = _weights_name(parse_json_object(raw).get("name"))
        if name is None:
            raise HttpError(HTTPStatus.BAD_REQUEST, 'name the weights whose lease to renew: {"name": NAME}')
        with self.table:
            self._forget_expired()
            if name not in self.named:
                raise HttpError(
                    HTTPStatus.NOT_FOUND,
                    f"no weights named {name!r} here (never pushed, deleted, or its lease ran out); push them again",
                )
            self._renew(name)
            return {"name": name, "versions": sorted(self.named[name]), "lease_s": self.named_ttl}

    def _load_folder(self, adapter: str | None, version: int | None, name: str | None) -> dict[str, Any]:
        """``POST /omnirl/v1/weights`` with a folder path (module docstring)."""
        from stages.models.diffusion import LORA_WEIGHTS, read_adapter_config
        from stages.models.lora_weights import read_lora_file
        from stages.shards.digest import content_digest

        if adapter is None:
            if name is not None:
                return self._store_named(name, None, None, self._record(None, None, version or 0, name))
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
                record = self._record(adapter, digest, step, name)
                if name is not None:
                    return self._store_named(name, layers, lora, record)
                return self._swap(layers, lora, record)
        if name is not None:
            raise HttpError(
                HTTPStatus.UNPROCESSABLE_ENTITY,
                f"named weights must be a LoRA in diffusers' layout ({LORA_WEIGHTS}); {adapter} is not",
            )
        engine = self._open(adapter)  # a PEFT folder or a full adapter: a pipeline beside, then swapped
        with self.lock:
            self.engine, self.full = engine, config["kind"] == "full"
            self.weights = self._record(adapter, digest, step)
            self.active, self.active_entry, self.default_lora = None, None, None
        return {"how": "reloaded"}

    def _adapter_folder(self, adapter: str) -> str:
        """The folder a weights request names, resolved (symlinks followed), when this server may load
        it: under --weights-root when there is one, else anywhere for a server with a token (a token
        holder is trusted with its files). 403 otherwise, one reply whether the path exists or not, so
        that it tells nothing about the server's files."""
        if self.weights_root is None:
            if self.token is None:
                raise HttpError(
                    HTTPStatus.FORBIDDEN,
                    "this server loads no adapter folder by path: start it with --weights-root DIR "
                    "(folders under DIR) or --token-env VAR, or push the LoRA file (?sha256=HEX&version=N)",
                )
            return adapter
        try:
            folder = (self.weights_root / adapter).resolve()  # an absolute `adapter` replaces the root
        except (OSError, RuntimeError):  # a symlink loop
            folder = None
        if folder is None or not folder.is_relative_to(self.weights_root) or not folder.is_dir():
            raise HttpError(
                HTTPStatus.FORBIDDEN,
                "adapter: no such folder under this server's --weights-root; put the adapter there, or "
                "push its LoRA file (?sha256=HEX&version=N)",
            )
        return str(folder)

    def _load_pushed(self, raw: bytes, query: dict[str, list[str]], name: str | None) -> dict[str, Any]:
        """``POST /omnirl/v1/weights?sha256=HEX&version=N[&name=NAME]`` with a LoRA file's bytes (module
        docstring)."""
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
        if name is not None:
            return self._store_named(name, layers, lora, self._record(PUSHED, digest, version, name))
        return self._swap(layers, lora, self._record(PUSHED, digest, version))

    def load_weights(self, raw: bytes, query: dict[str, list[str]]) -> dict[str, Any]:
        """``POST /omnirl/v1/weights``: a pushed LoRA file (``?sha256=``) or a JSON body naming a folder;
        answers the weights now held and how they were loaded (``how``, ``seconds``)."""
        t0 = time.perf_counter()
        with self.loading:
            try:
                if "sha256" in query:
                    name = _weights_name(query.get("name", [None])[-1])
                    load = self._load_pushed(raw, query, name)
                else:
                    body = parse_json_object(raw)
                    adapter, version = body.get("adapter"), body.get("version")
                    name = _weights_name(body.get("name"))
                    if adapter is not None and not isinstance(adapter, str):
                        raise HttpError(
                            HTTPStatus.BAD_REQUEST, "adapter must be a folder path on the server or null"
                        )
                    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
                        raise HttpError(HTTPStatus.BAD_REQUEST, "version must be an integer or null")
                    folder = None if adapter is None else self._adapter_folder(adapter)
                    load = self._load_folder(folder, version, name)
            except UserInputError as exc:
                raise HttpError(HTTPStatus.UNPROCESSABLE_ENTITY, str(exc)) from None
        held = load.pop("weights", None) or dict(self.weights)  # the named weights stored, else those held
        return {"weights": held, "load": {**load, "seconds": time.perf_counter() - t0}}

    # ---------------------------------------------------------------- routes
    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "protocols": [f"{PROTOCOL}/{VERSION}"],
            "model": self.served_name,
            "family": self.engine.family,
            "dtype": self.dtype,
            "weights": dict(self.weights),
            "named_weights": self.named_weights(),
        }

    def get(self, path: str) -> dict[str, Any]:
        if path == "/health":
            return self.health()
        if path == "/v1/models":
            card = {"id": self.served_name, "object": "model", "created": 0, "owned_by": "omnirl"}
            return {"object": "list", "data": [card]}
        if path == WEIGHTS_ROUTE:
            return {"weights": dict(self.weights), "named_weights": self.named_weights()}
        raise HttpError(
            HTTPStatus.NOT_FOUND, f"no route GET {path}; GET /health, /v1/models or {WEIGHTS_ROUTE}"
        )

    def delete(self, path: str, query: dict[str, list[str]]) -> dict[str, Any]:
        """``DELETE /omnirl/v1/weights?name=NAME[&version=N]`` (module docstring)."""
        if path != WEIGHTS_ROUTE:
            raise HttpError(HTTPStatus.NOT_FOUND, f"no route DELETE {path}; DELETE {WEIGHTS_ROUTE}?name=NAME")
        name = _weights_name(query.get("name", [None])[-1])
        if name is None:
            raise HttpError(HTTPStatus.BAD_REQUEST, "name the weights to forget: ?name=NAME")
        version = query.get("version", [None])[-1]
        if version is not None and not re.fullmatch(r"\d{1,18}", version):
            raise HttpError(HTTPStatus.BAD_REQUEST, f"version {version!r} is not a non-negative integer")
        with self.table:  # the pipeline keeps what it has on it until a batch asks for other weights
            self._forget_expired()
            held = self.named.get(name) or {}
            versions = sorted(held) if version is None else [int(version)]
            if not held:
                raise HttpError(HTTPStatus.NOT_FOUND, f"no weights named {name!r} here")
            if versions[0] not in held:
                raise HttpError(
                    HTTPStatus.NOT_FOUND,
                    f"weights {name!r} version {version} is not held (versions {sorted(held)})",
                )
            for v in versions:
                del held[v]
            if not held:
                del self.named[name], self.leases[name]
        return {"deleted": {"name": name, "versions": versions}, "named_weights": self.named_weights()}

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
            return self.load_weights(raw, urllib.parse.parse_qs(parts.query))
        routes = {
            ROUTE: self.rollout,
            IMAGES_ROUTE: self.images,
            LATENT_ROUTE: self.latent_shape,
            LEASE_ROUTE: self.renew_lease,
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
        with self.lock:
            version = self._select(request.weights)
            columns = self.engine.rollout(
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
        entries = self.engine.conditioning(keys)
        return entries if entries is not None and len(entries) == len(keys) else None

    def _generation(self, body: dict[str, Any], media: str) -> str:
        """The prompt of an images or videos request for `media` ("image", "video"), after the checks
        both routes share: this model makes that media, the prompt is given, the model is served here."""
        made = self.engine.policy.family.media
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
        with self.lock:
            self._activate(None)
            try:
                return self.engine.rollout(
                    cfg,
                    prompts,
                    negatives,
                    seeds,
                    seeds,
                    groups=[0] * len(seeds),
                    sample_ids=[f"{self.engine.policy.family.media}-{i}" for i in range(len(seeds))],
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
            return {"latent_shape": list(self.engine.latent_shape(resolution, frames))}
        except UserInputError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
