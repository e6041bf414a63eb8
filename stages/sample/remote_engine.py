"""The ``remote`` rollout engine: a client of `omnirl serve` speaking rollout protocol v1.

On open it polls ``GET /health`` until the server answers 200 (connection refused or 503 mean "still
starting"; after ``--server-startup-timeout`` seconds it gives up: `RuntimeFailure`, exit 1), then
checks that the server holds the weights this run names: the digest of the local --model and of the
--adapter (or none), as the run's identity records them. A server holding others is a one-line
`UserInputError` (exit 2), as are a URL that is not an http(s) URL, a host that does not resolve and
a server that is not `omnirl serve` (404, not JSON).

Each batch is one ``POST /omnirl/v1/rollout`` carrying the samples' seeds, so a batch sent again
returns the same samples. Connection errors, timeouts, 502, 503 and 504 are retried up to
``--server-retries`` times with exponential backoff (0.5 s doubling, capped at 30 s) and ±50% jitter;
a 500 once; a 4xx never (the request is wrong: exit 2). A server that stays down is a `RuntimeFailure`
naming the URL; the shards written before it are kept and a re-run resumes after them. Every reply is
validated (`rollout_protocol.decode_response`: request id, count, shapes, finiteness).

A run that trains (`online --engine remote`) opens the engine with `EngineOptions.pushed_weights`: it
sends each new LoRA itself (`push_weights`: the LoRA file's bytes with their SHA-256 and a version;
retried like a batch, since the same bytes and version may be sent twice), its requests accept any
adapter the server holds, and each sample records the version the server used.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import random
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Hashable, Sequence
from typing import Any

from stages.errors import RuntimeFailure, UserInputError
from stages.sample.engines import EngineOptions, RolloutEngine, register_engine
from stages.sample.rollout_protocol import (
    PROTOCOL,
    ROUTE,
    VERSION,
    ProtocolError,
    decode_response,
    encode_request,
)
from stages.web import error_message, one_line

logger = logging.getLogger(__name__)

BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
RETRY_STATUSES = frozenset({502, 503, 504})
CONNECT_TIMEOUT_S = 5.0
WEIGHTS_ROUTE = "/omnirl/v1/weights"
START_HINT = "start it with `omnirl serve --model M --port P` and pass --server-url http://HOST:P"


class _Retry(Exception):
    """A failure a later try may not meet (the server is down, restarting or overloaded)."""


def backoff(attempt: int, base: float = BACKOFF_S, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry `attempt` (0-based): base·2^attempt capped at `MAX_BACKOFF_S`,
    times a uniform jitter in [0.5, 1.5) so that clients of one restarted server spread out."""
    return min(base * 2**attempt, MAX_BACKOFF_S) * (0.5 + (rng or random).random())


class RolloutClient:
    """JSON requests to one `omnirl serve` at `url`, with its token, timeouts and retries."""

    def __init__(self, url: str, *, token: str | None, timeout: float, retries: int):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise UserInputError(
                f"--server-url {url!r}: not an http(s)://HOST:PORT URL; pass the address `omnirl serve` printed"
            )
        try:
            parts.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            raise UserInputError(f"--server-url {url!r}: the port is not a number") from None
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.retries = retries

    @classmethod
    def from_options(cls, options: EngineOptions) -> RolloutClient:
        """The client of `options.server_url`, with the token of `options.token_env`."""
        if not options.server_url:
            raise UserInputError(f"--engine remote needs --server-url; {START_HINT}")
        token = None
        if options.token_env:
            token = os.environ.get(options.token_env)
            if not token:
                raise UserInputError(
                    f"--server-token-env {options.token_env}: ${options.token_env} is not set"
                )
        return cls(options.server_url, token=token, timeout=options.request_timeout, retries=options.retries)

    def _once(self, path: str, body: dict[str, Any] | bytes | None, timeout: float) -> Any:
        """One request (a JSON body, or raw bytes); the decoded JSON reply. `_Retry` for what may pass,
        `UserInputError` else."""
        url = self.url + path
        headers = {"Accept": "application/json"}
        data = None
        if isinstance(body, bytes):
            data = body
            headers["Content-Type"] = "application/octet-stream"
        elif body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(
            url, data=data, headers=headers, method="GET" if data is None else "POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = error_message(exc.read() if exc.fp else b"") or str(exc.reason)
            if exc.code in RETRY_STATUSES or exc.code >= 500:
                raise _Retry(f"HTTP {exc.code}: {detail}", exc.code) from None
            raise self._refused(url, exc.code, detail) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, socket.gaierror):
                raise UserInputError(
                    f"{url}: the host does not resolve ({one_line(reason)}); fix --server-url"
                ) from None
            if not isinstance(reason, OSError):
                raise UserInputError(
                    f"{url}: not a usable URL ({one_line(reason)}); fix --server-url"
                ) from None
            raise _Retry(one_line(reason)) from None
        except (http.client.HTTPException, OSError) as exc:  # timeout, reset, cut reply
            what = (
                f"no reply within {timeout:g} s"
                if isinstance(exc, TimeoutError)
                else f"{type(exc).__name__}: {exc}"
            )
            raise _Retry(one_line(what)) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise UserInputError(
                f"{url}: the reply is not JSON ({one_line(raw[:80].decode('utf-8', 'replace'))!r}); "
                f"is this `omnirl serve`? {START_HINT}"
            ) from None

    def _refused(self, url: str, code: int, detail: str) -> UserInputError:
        """The one-line error for a 4xx reply, which a retry cannot fix."""
        if code in (401, 403):
            how = (
                "the token is refused; pass the server's token" if self.token else "the server wants a token"
            )
            return UserInputError(f"{url}: HTTP {code} ({detail}); {how} with --server-token-env VAR")
        if code == 404:
            return UserInputError(
                f"{url}: HTTP 404 ({detail}); is --server-url an `omnirl serve`? {START_HINT}"
            )
        if code == 413:
            return UserInputError(
                f"{url}: HTTP 413 ({detail}); lower --batch-size or raise the server's limits"
            )
        return UserInputError(f"{url}: HTTP {code} ({detail})")

    def call(self, path: str, body: dict[str, Any] | bytes | None = None) -> Any:
        """The reply to `body` at `path` (GET without a body), retried as the module docstring says."""
        start = time.monotonic()
        last, fives = "", 0
        for attempt in range(self.retries + 1):
            try:
                return self._once(path, body, self.timeout)
            except _Retry as exc:
                last = str(exc.args[0])
                status = exc.args[1] if len(exc.args) > 1 else None
                if status is not None and status not in RETRY_STATUSES:
                    fives += 1
                    if fives > 1:  # a 500 is retried once: it is more often a bug than a hiccup
                        break
            if attempt < self.retries:
                wait = backoff(attempt)
                logger.info(
                    "%s%s: %s; retry %d of %d in %.1f s",
                    self.url,
                    path,
                    last,
                    attempt + 1,
                    self.retries,
                    wait,
                )
                time.sleep(wait)
        raise RuntimeFailure(
            f"{self.url}{path}: no answer after {attempt + 1} tries over {time.monotonic() - start:.1f} s "
            f"(last: {last}); check the server (its log), then re-run: finished shards are kept"
        )

    def wait_healthy(self, budget: float) -> dict[str, Any]:
        """``GET /health`` until it answers 200 within `budget` seconds; its reply."""
        deadline = time.monotonic() + budget
        last, attempt = "", 0
        while True:
            try:
                reply = self._once("/health", None, min(self.timeout, CONNECT_TIMEOUT_S + 5))
            except _Retry as exc:
                last = str(exc.args[0])
            else:
                if not isinstance(reply, dict) or f"{PROTOCOL}/{VERSION}" not in (
                    reply.get("protocols") or []
                ):
                    raise UserInputError(
                        f"{self.url}/health: not an `omnirl serve` speaking {PROTOCOL}/{VERSION}; {START_HINT}"
                    )
                return reply
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeFailure(
                    f"{self.url}: no healthy rollout server within {budget:g} s (last: {last}); {START_HINT}, "
                    "or raise --server-startup-timeout"
                )
            time.sleep(min(backoff(attempt, rng=random.Random(attempt)), 5.0, left))
            attempt += 1


@register_engine("remote")
class RemoteEngine(RolloutEngine):
    """Rollouts computed by `omnirl serve` (module docstring)."""

    def __init__(
        self, client: RolloutClient, health: dict[str, Any], weights: dict[str, Any], pushed: bool = False
    ):
        self.client = client
        self.family = str(health.get("family"))
        self.weights = weights  # what every request asks the server to hold
        self.server_weights = dict(health.get("weights") or {})
        self.pushed = pushed  # the run pushes its weights: samples record the version the server used

    @classmethod
    def open(cls, options: EngineOptions, device: Any) -> RemoteEngine:
        """The client of `options.server_url`, once healthy and holding the weights of `options` (with
        `options.pushed_weights`: holding the model; the adapter is the one the run pushes)."""
        from stages.shards.digest import content_digest

        client = RolloutClient.from_options(options)
        weights: dict[str, Any] = {"model_sha256": content_digest(options.model, "--model")}
        if not options.pushed_weights:
            weights["adapter_sha256"] = (
                None if options.adapter is None else content_digest(options.adapter, "--adapter")
            )
            weights["version"] = None
        health = client.wait_healthy(options.startup_timeout)
        held = health.get("weights") or {}
        if held.get("model_sha256") != weights["model_sha256"]:
            raise UserInputError(
                f"--server-url {client.url} serves model {health.get('model')!r}, not the weights of --model "
                f"{options.model}; start `omnirl serve --model {options.model}`"
            )
        if not options.pushed_weights and held.get("adapter_sha256") != weights["adapter_sha256"]:
            have = held.get("adapter") or "the base model"
            want = options.adapter or "the base model (no --adapter)"
            raise UserInputError(
                f"--server-url {client.url} holds {have}, not {want}; load it with POST "
                f"{client.url}/omnirl/v1/weights or restart `omnirl serve` with that --adapter"
            )
        return cls(client, health, weights, options.pushed_weights)

    def rollout(
        self,
        cfg: Any,
        prompts: list[str],
        negatives: list[str],
        seeds: list[int],
        init_seeds: list[int],
        *,
        groups: Sequence[Hashable],
        sample_ids: Sequence[str],
    ) -> dict[str, Any]:
        ids = list(sample_ids)
        request_id = hashlib.sha256(json.dumps([ids, list(seeds)]).encode()).hexdigest()[:16]
        body = encode_request(
            request_id, cfg, prompts, negatives, seeds, init_seeds, list(groups), ids, self.weights
        )
        reply = self.client.call(ROUTE, body)
        try:
            version, columns = decode_response(reply, body)
        except ProtocolError as exc:
            raise RuntimeFailure(
                f"{self.client.url}{ROUTE}: a malformed reply ({exc}); check the server"
            ) from None
        self.server_weights["version"] = version
        if self.pushed:
            import torch

            columns["policy_version"] = torch.full((len(ids),), version, dtype=torch.int64)
        return columns

    def push_weights(self, lora: bytes, version: int) -> dict[str, Any]:
        """Send a LoRA file's bytes as weights `version` (``POST /omnirl/v1/weights?sha256=&version=``);
        the server swaps them in before answering. Returns its reply (weights held, how loaded)."""
        digest = hashlib.sha256(lora).hexdigest()
        query = urllib.parse.urlencode({"sha256": digest, "version": int(version)})
        reply = self.client.call(f"{WEIGHTS_ROUTE}?{query}", lora)
        held = reply.get("weights") if isinstance(reply, dict) else None
        if (
            not isinstance(held, dict)
            or held.get("adapter_sha256") != digest
            or held.get("version") != version
        ):
            raise RuntimeFailure(
                f"{self.client.url}{WEIGHTS_ROUTE}: the server did not take weights version {version} (it "
                f"answered {one_line(reply)!r}); check the server"
            )
        self.server_weights = dict(held)
        return reply

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        reply = self.client.call("/omnirl/v1/latent_shape", {"resolution": resolution})
        return tuple(int(d) for d in reply["latent_shape"])

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "server_url": self.client.url, "server_weights": self.server_weights}
