"""The reward server behind `omnirl serve-reward`: registered rewards over HTTP, JSON in and out, no pickle.

Endpoints (the client is `stages.score.remote`, protocol ``omnirl``):

- ``GET /health`` → ``{"status": "ok", "rewards": {NAME: WEIGHT}}``, without a token (for probes);
- ``POST /`` or ``POST /score`` scores every served reward, ``POST /NAME`` (NAME URL-quoted) only
  NAME. Body: ``{"images": [base64 PNG or JPEG], "prompts": [str], "meta": [object]}`` (``meta``
  optional; a conditioned rollout's ``meta[i]["condition_images"]`` holds base64 PNGs, decoded like the
  images). Reply: ``{"rewards": {NAME: [float | null]}, "reward": [float | null]}``, ``reward`` being
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
A body that is refused unread is drained when it is at most `stages.web.DRAIN_FACTOR` × the limit (so the client
reads the reply), else the connection is closed.

Connections are served by a bounded pool of threads (`stages.web.ServerLimits`; ``/health`` answers
while a batch scores); scoring itself runs one request at a time under a lock, since a model-backed
scorer is not thread-safe.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import threading
import urllib.parse
from collections.abc import Sequence
from http import HTTPStatus
from io import BytesIO
from typing import Any

from PIL import Image

from stages.errors import UserInputError
from stages.models.condition_images import RECORD as CONDITION_IMAGES
from stages.score.registry import RewardArgs, get_reward, score_value
from stages.web import HttpError, JsonServer, JsonService, ServerLimits, parse_json_object

logger = logging.getLogger(__name__)

TOTAL_ROUTES = ("", "score")
MAX_PIXELS = 2**26  # 8192 × 8192: far above any rollout, far below what would exhaust memory

__all__ = ["HttpError", "RewardServer", "RewardService"]


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
        try:
            number = score_value(item)
        except TypeError as exc:
            raise ValueError(f"returned {exc}; scores must be numbers or None") from None
        out.append(number if number is not None and math.isfinite(number) else None)
    return out


class RewardService(JsonService):
    """What the server does with a request, apart from HTTP (`stages.web`): routing, checks, scoring.

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
        super().__init__(token=token, max_request_bytes=max_request_bytes)
        self.weights = dict(specs)
        self.scorers = {name: get_reward(name, (reward_args or {}).get(name)) for name in names}
        self.max_batch = max_batch
        self.max_pixels = max_pixels
        self.lock = threading.Lock()

    def health(self) -> dict[str, Any]:
        """The reply to ``GET /health``."""
        return {"status": "ok", "rewards": dict(self.weights)}

    def get(self, path: str) -> dict[str, Any]:
        """The reply to ``GET /health``; any other GET is a 404."""
        if path == "/health":
            return self.health()
        raise HttpError(HTTPStatus.NOT_FOUND, f"no route GET {path}; GET /health or POST /NAME")

    def post(self, path: str, raw: bytes) -> dict[str, Any]:
        return self.score(path, raw)

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
        body = parse_json_object(raw)
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
        meta = [dict(m or {}) for m in meta]
        for i, item in enumerate(meta):  # a conditioned rollout's source images (`remote._wire_meta`)
            if CONDITION_IMAGES in item:
                sources = item[CONDITION_IMAGES]
                if not isinstance(sources, list):
                    raise HttpError(HTTPStatus.BAD_REQUEST, f"meta[{i}].{CONDITION_IMAGES} is not a list")
                item[CONDITION_IMAGES] = [_decode(x, i, self.max_pixels) for x in sources]
        return decoded, prompts, meta

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


class RewardServer(JsonServer):
    """A threaded HTTP server for a `RewardService` on (host, port); port 0 picks a free one (see `url`)."""

    def __init__(
        self,
        service: RewardService,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ServerLimits | None = None,
    ):
        super().__init__(service, host, port, limits=limits)
