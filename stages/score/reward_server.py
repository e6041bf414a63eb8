"""The reward server behind `omnirl serve-reward`: registered rewards over HTTP, JSON in and out, no pickle.

Endpoints (the client is `stages.score.remote`, protocol ``omnirl``):

- ``GET /health`` → ``{"status": "ok", "rewards": {NAME: WEIGHT}}``, without a token (for probes);
- ``POST /`` or ``POST /score`` scores every served reward, ``POST /NAME`` (NAME URL-quoted) only
  NAME. Body: ``{"images": [base64 PNG or JPEG], "prompts": [str], "meta": [object]}`` (``meta``
  optional). Reply: ``{"rewards": {NAME: [float | null]}, "reward": [float | null]}``, ``reward`` being
  Σ weight·value in float64 over the scored rewards (null where one is null); a reward that raised on
  the batch is null throughout and named in ``"errors": {NAME: "Type: message"}``. Values travel as
  JSON numbers (shortest repr, so a float64 comes back bit for bit); NaN and ±inf become null.

Images are decoded as `omnirl score` decodes a rollout's (PIL, converted to RGB), so a client that
sends lossless PNGs gets the numbers the same reward computes in-process.

Refusals reply ``{"error": {"code": STATUS, "message": ...}}`` and the server keeps serving: 400 a
body that is not the JSON above, or an image that does not decode; 401 a missing or wrong bearer
token (when the server has one); 404 an unknown route or reward; 411 no Content-Length (chunked
bodies are not read); 413 a body over the size limit, more images than the batch limit or an image
over `MAX_PIXELS`; 422 a `UserInputError` the reward raised (bad prompt metadata); 500 a bug here.
A body that is refused unread is drained when it is at most `DRAIN_FACTOR` × the limit (so the client
reads the reply), else the connection is closed.

Connections are served by threads (``/health`` answers while a batch scores); scoring itself runs one
request at a time under a lock, since a model-backed scorer is not thread-safe.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import json
import logging
import math
import socket
import sys
import threading
import urllib.parse
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BytesIO
from typing import Any

from PIL import Image

from stages.errors import UserInputError
from stages.score.registry import RewardArgs, get_reward

logger = logging.getLogger(__name__)

TOTAL_ROUTES = ("", "score")
MAX_PIXELS = 2**26  # 8192 × 8192: far above any rollout, far below what would exhaust memory
DRAIN_FACTOR = 4
CONNECTION_TIMEOUT_S = 120.0  # a connection idle or stalled this long is closed
_CHUNK = 1 << 20


class HttpError(Exception):
    """A refused request: its status and a one-line message for the client."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _decode(item: Any, index: int, max_pixels: int) -> Image.Image:
    """images[index] (base64 PNG/JPEG) → an RGB PIL image, as `omnirl score` decodes a rollout's."""
    if not isinstance(item, str):
        raise HttpError(HTTPStatus.BAD_REQUEST, f"images[{index}] is not a base64 string")
    try:
        blob = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        raise HttpError(HTTPStatus.BAD_REQUEST, f"images[{index}] is not valid base64") from None
    try:
        image = Image.open(BytesIO(blob))
        if image.format not in ("PNG", "JPEG"):
            raise HttpError(HTTPStatus.BAD_REQUEST, f"images[{index}] is {image.format}, not PNG or JPEG")
        width, height = image.size
        if width * height > max_pixels:
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"images[{index}] is {width}×{height}, more than {max_pixels} pixels",
            )
        return image.convert("RGB")
    except HttpError:
        raise
    except Exception:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"images[{index}] is not a readable PNG/JPEG image") from None


def _values(raw: Any, n: int) -> list[float | None]:
    """A scorer's output as n JSON-safe values (non-finite → None); ValueError when it is not n
    numbers or Nones."""
    try:
        items = list(raw)
    except TypeError:
        raise ValueError(f"returned a {type(raw).__name__}, not a list of {n} scores") from None
    if len(items) != n:
        raise ValueError(f"returned {len(items)} scores for {n} samples")
    out: list[float | None] = []
    for item in items:
        if item is None:
            out.append(None)
            continue
        try:
            number = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"returned {item!r}, not a number or None") from None
        out.append(number if math.isfinite(number) else None)
    return out


class RewardService:
    """What the server does with a request, apart from HTTP: routing, checks, scoring.

    `specs` are (reward name, weight) pairs, `reward_args[name]` configures a reward as in
    `registry.get_reward`; every scorer is built here (models still load on the first batch).
    """

    def __init__(
        self,
        specs: Sequence[tuple[str, float]],
        reward_args: RewardArgs | None = None,
        *,
        token: str | None = None,
        max_request_bytes: int = 64 * 2**20,
        max_batch: int = 256,
        max_pixels: int = MAX_PIXELS,
    ):
        if not specs:
            raise UserInputError(
                "--reward: give at least one reward to serve, e.g. --reward jpeg_compressibility"
            )
        names = [name for name, _ in specs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise UserInputError(f"--reward {duplicates[0]}: given more than once; give each reward once")
        self.weights = dict(specs)
        self.scorers = {name: get_reward(name, (reward_args or {}).get(name)) for name in names}
        self.token = token
        self.max_request_bytes = max_request_bytes
        self.max_batch = max_batch
        self.max_pixels = max_pixels
        self.lock = threading.Lock()

    def health(self) -> dict[str, Any]:
        """The reply to ``GET /health``."""
        return {"status": "ok", "rewards": dict(self.weights)}

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the server's bearer token (always, without one)."""
        if self.token is None:
            return True
        scheme, _, value = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())

    def route(self, path: str) -> list[str]:
        """The rewards a POST to `path` scores: all for ``/`` and ``/score``, else the one it names."""
        name = urllib.parse.unquote(urllib.parse.urlsplit(path).path.strip("/"))
        if name in TOTAL_ROUTES:
            return list(self.weights)
        if name not in self.weights:
            served = ", ".join(self.weights)
            raise HttpError(HTTPStatus.NOT_FOUND, f"no reward {name!r} here; this server scores {served}")
        return [name]

    def parse(self, raw: bytes) -> tuple[list[Image.Image], list[str], list[dict]]:
        """(images, prompts, meta) of a request body, checked."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not a JSON object")
        images, prompts = body.get("images"), body.get("prompts")
        if not isinstance(images, list) or not isinstance(prompts, list):
            raise HttpError(HTTPStatus.BAD_REQUEST, "the body needs lists 'images' and 'prompts'")
        meta = body.get("meta")
        meta = [{}] * len(images) if meta is None else meta
        if not isinstance(meta, list) or not len(images) == len(prompts) == len(meta):
            raise HttpError(
                HTTPStatus.BAD_REQUEST, "'images', 'prompts' and 'meta' must be lists of one length"
            )
        if len(images) > self.max_batch:
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"{len(images)} images in one request, more than --max-batch {self.max_batch}",
            )
        if not all(isinstance(p, str) for p in prompts):
            raise HttpError(HTTPStatus.BAD_REQUEST, "'prompts' must hold strings")
        if not all(m is None or isinstance(m, dict) for m in meta):
            raise HttpError(HTTPStatus.BAD_REQUEST, "'meta' must hold objects (or null)")
        decoded = [_decode(item, i, self.max_pixels) for i, item in enumerate(images)]
        return decoded, prompts, [dict(m or {}) for m in meta]

    def score(self, path: str, raw: bytes) -> dict[str, Any]:
        """The reply to a POST of body `raw` to `path` (module docstring); `HttpError` when refused."""
        names = self.route(path)
        images, prompts, meta = self.parse(raw)
        n = len(images)
        rewards: dict[str, list[float | None]] = {}
        errors: dict[str, str] = {}
        with self.lock:
            for name in names:
                try:
                    rewards[name] = _values(self.scorers[name](images, prompts, meta), n)
                except UserInputError as exc:
                    raise HttpError(HTTPStatus.UNPROCESSABLE_ENTITY, f"reward {name!r}: {exc}") from None
                except Exception as exc:
                    errors[name] = " ".join(f"{type(exc).__name__}: {exc}".split())
                    logger.warning("reward %r failed on a batch of %d: %s", name, n, errors[name])
                    rewards[name] = [None] * n
        total = [_weighted([(self.weights[name], rewards[name][i]) for name in names]) for i in range(n)]
        reply: dict[str, Any] = {"rewards": rewards, "reward": total}
        if errors:
            reply["errors"] = errors
        return reply


def _weighted(terms: Sequence[tuple[float, float | None]]) -> float | None:
    """Σ weight·value over (weight, value) `terms` in float64 and in order, as `scoring.score_batch`
    sums (so the total matches bit for bit); None when a value is None."""
    total = 0.0
    for weight, value in terms:
        if value is None:
            return None
        total += weight * value
    return total


class _Handler(BaseHTTPRequestHandler):
    """HTTP for `RewardServer.service`; every reply is JSON."""

    protocol_version = "HTTP/1.1"
    server_version = "omnirl-reward"
    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _reply(self, status: int, payload: dict[str, Any], *, close: bool = False) -> None:
        data = json.dumps(payload, allow_nan=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", "Bearer")
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, error: HttpError, *, close: bool = False) -> None:
        body = {"error": {"code": int(error.status), "message": str(error)}}
        self._reply(error.status, body, close=close)

    def do_GET(self) -> None:
        if urllib.parse.urlsplit(self.path).path.rstrip("/") == "/health":
            self._reply(HTTPStatus.OK, self.server.service.health())  # type: ignore[attr-defined]
        else:
            self._refuse(
                HttpError(HTTPStatus.NOT_FOUND, f"no route GET {self.path}; GET /health or POST /NAME")
            )

    def _drain(self, length: int) -> bool:
        """Read and drop a refused body of `length` bytes when it is small enough; False: close instead."""
        limit = self.server.service.max_request_bytes  # type: ignore[attr-defined]
        if length > DRAIN_FACTOR * limit:
            return False
        while length > 0:
            chunk = self.rfile.read(min(length, _CHUNK))
            if not chunk:
                return False
            length -= len(chunk)
        return True

    def do_POST(self) -> None:
        service: RewardService = self.server.service  # type: ignore[attr-defined]
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self._refuse(HttpError(HTTPStatus.LENGTH_REQUIRED, "send a Content-Length body"), close=True)
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
            if length < 0:
                raise ValueError
        except ValueError:
            self._refuse(HttpError(HTTPStatus.LENGTH_REQUIRED, "send a valid Content-Length"), close=True)
            return
        refusal = None
        if not service.authorized(self.headers.get("Authorization")):
            refusal = HttpError(HTTPStatus.UNAUTHORIZED, "a valid bearer token is required")
        elif length > service.max_request_bytes:
            refusal = HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the body is {length} bytes, more than --max-request-mb "
                f"({service.max_request_bytes} bytes); send fewer images per request",
            )
        if refusal is not None:
            self._refuse(refusal, close=not self._drain(length))
            return
        raw = self.rfile.read(length)
        if len(raw) < length:  # the client went away mid-body
            self.close_connection = True
            return
        try:
            reply = service.score(self.path, raw)
        except HttpError as exc:
            self._refuse(exc)
            return
        except Exception as exc:
            logger.exception("reward server: internal error")
            message = " ".join(f"{type(exc).__name__}: {exc}".split())
            self._refuse(HttpError(HTTPStatus.INTERNAL_SERVER_ERROR, message))
            return
        self._reply(HTTPStatus.OK, reply)


class RewardServer(ThreadingHTTPServer):
    """A threaded HTTP server for `service` on (host, port); port 0 picks a free one (see `url`)."""

    daemon_threads = True

    def __init__(self, service: RewardService, host: str = "127.0.0.1", port: int = 0):
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.service = service
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        """The base URL clients use, e.g. ``http://127.0.0.1:18090``."""
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else str(host)
        return f"http://{shown}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet when a client hung up mid-exchange; anything else is logged with its traceback."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        logger.exception("reward server: error serving %s", client_address)
