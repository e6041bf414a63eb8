"""`JsonClient`: the client side of omnirl's HTTP servers (and of other JSON services). Health
polling with a start-up budget; retries with exponential backoff and jitter on connection errors,
timeouts, 502, 503 and 504 (a 500 once); a 4xx never (the request is wrong: `UserInputError`);
credentials in its URL go as Basic authentication and are never shown (`redact_url`).
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from stages.errors import RuntimeFailure, UserInputError
from stages.web.wire import (
    MSGPACK,
    Payload,
    error_message,
    http_url,
    one_line,
    redact_url,
    unpack_binary,
    wants_binary,
)

logger = logging.getLogger(__name__)

BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0

RETRY_STATUSES = frozenset({502, 503, 504})
CONNECT_TIMEOUT_S = 5.0
# while `wait_healthy` waits for a server: its first line on stderr after this many seconds, then one
# at least this often, so a person sees what it waits for
HEALTH_FIRST_NOTICE_S, HEALTH_NOTICE_S = 5.0, 30.0


class Retryable(Exception):
    """A failure a later try may not meet (the server is down, restarting or overloaded): its one-line
    description and the HTTP status (None: no reply)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def backoff(attempt: int, base: float = BACKOFF_S, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry `attempt` (0-based): base·2^attempt capped at `MAX_BACKOFF_S`,
    times a uniform jitter in [0.5, 1.5) so that clients of one restarted server spread out."""
    return min(base * 2**attempt, MAX_BACKOFF_S) * (0.5 + (rng or random).random())


class JsonClient:
    """JSON requests to one server at `url` (given as `option`), with a bearer token, timeouts and
    retries (module docstring). `what` names the server expected there, `noun` its kind and `hint` says
    how to start it, for the one-line errors of a URL that reaches something else; `binary` asks for
    msgpack replies.

    Credentials in the URL (``http://user:pw@host:port``, for a proxy that asks for them) are sent as
    HTTP Basic authentication, never with a bearer token too, and `url` (what every message and record
    shows) hides them: ``http://user:***@host:port``.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout: float,
        retries: int,
        option: str = "--server-url",
        what: str = "the server",
        noun: str = "server",
        hint: str = "",
        binary: bool = False,
    ):
        shown = redact_url(url)
        parts = http_url(url)
        if parts is None:
            raise UserInputError(f"{option} {shown!r}: not an http(s)://HOST:PORT URL; pass {what}'s address")
        try:
            parts.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            raise UserInputError(f"{option} {shown!r}: the port is not a number") from None
        userinfo, at, hostport = parts.netloc.rpartition("@")
        self.basic = None  # the URL's credentials, as an Authorization header value
        if at:
            if token:
                raise UserInputError(
                    f"{option} {shown}: credentials in the URL and a bearer token too; give only one"
                )
            import base64

            user, _, password = userinfo.partition(":")
            pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
            self.basic = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
        self.url = shown.rstrip("/")  # shown: in every message and record
        self.base = parts._replace(netloc=hostport).geturl().rstrip("/")  # requested: without credentials
        self.token = token
        self.timeout = timeout
        self.retries = retries
        self.option, self.what, self.noun, self.hint = option, what, noun, hint
        self.binary = binary  # ask for msgpack replies (the server may still answer JSON)

    def once(
        self,
        path: str,
        body: dict[str, Any] | bytes | Payload | None,
        timeout: float,
        accept: str | None = None,
        method: str | None = None,
    ) -> Any:
        """One request; the decoded JSON reply (None for an empty one), or with `accept` (a file's media
        type, e.g. video/mp4) the reply's bytes. `Retryable` for what may pass, `UserInputError` for what
        will not."""
        url = self.url + path  # what messages show
        headers = {"Accept": f"{MSGPACK}, application/json;q=0.5" if self.binary else "application/json"}
        if accept:
            headers["Accept"] = accept
        data = None
        if isinstance(body, bytes):  # a file pushed as it is (a LoRA's safetensors)
            body = Payload(body)
        if isinstance(body, Payload):
            data = body.data
            headers["Content-Type"] = body.content_type
        elif body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        elif self.basic:
            headers["Authorization"] = self.basic
        request = urllib.request.Request(
            self.base + path, data=data, headers=headers, method=method or ("GET" if data is None else "POST")
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
                kind = response.headers.get("Content-Type") or ""
        except urllib.error.HTTPError as exc:
            detail = error_message(exc.read() if exc.fp else b"") or str(exc.reason)
            if exc.code >= 500:
                raise Retryable(f"HTTP {exc.code}: {detail}", exc.code) from None
            raise self.refused(url, exc.code, detail) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, socket.gaierror):
                raise UserInputError(
                    f"{url}: the host does not resolve ({one_line(reason)}); fix {self.option}"
                ) from None
            if not isinstance(reason, OSError):
                raise UserInputError(
                    f"{url}: not a usable URL ({one_line(reason)}); fix {self.option}"
                ) from None
            raise Retryable(one_line(reason)) from None
        except (http.client.HTTPException, OSError) as exc:  # timeout, reset, cut reply
            what = (
                f"no reply within {timeout:g} s"
                if isinstance(exc, TimeoutError)
                else f"{type(exc).__name__}: {exc}"
            )
            raise Retryable(one_line(what)) from None
        if accept:
            return raw
        if not raw.strip():
            return None
        try:
            return unpack_binary(raw) if self.binary and wants_binary(kind) else json.loads(raw)
        except (ValueError, RecursionError):
            raise UserInputError(
                f"{url}: the reply is not JSON ({one_line(raw[:80].decode('utf-8', 'replace'))!r}); "
                f"is this {self.what}? {self.hint}"
            ) from None

    def refused(self, url: str, code: int, detail: str) -> UserInputError:
        """The one-line error for a 4xx reply, which a retry cannot fix."""
        if code in (401, 403):
            how = (
                "the token is refused; pass the server's token" if self.token else "the server wants a token"
            )
            return UserInputError(f"{url}: HTTP {code} ({detail}); {how} with --server-token-env VAR")
        if code == 404:
            return UserInputError(f"{url}: HTTP 404 ({detail}); is {self.option} {self.what}? {self.hint}")
        if code == 413:
            return UserInputError(
                f"{url}: HTTP 413 ({detail}); lower --batch-size or raise the server's limits"
            )
        return UserInputError(f"{url}: HTTP {code} ({detail})")

    def call(
        self, path: str, body: dict[str, Any] | bytes | Payload | None = None, *, accept: str | None = None
    ) -> Any:
        """The reply to `body` at `path` (GET without a body; `accept`: a file's bytes, see `once`),
        retried as the module docstring says; `RuntimeFailure` once the retries are spent."""
        start = time.monotonic()
        last, fives = "", 0
        for attempt in range(self.retries + 1):
            try:
                return self.once(path, body, self.timeout, accept)
            except Retryable as exc:
                last = str(exc)
                if exc.status is not None and exc.status not in RETRY_STATUSES:
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

    def wait_healthy(self, budget: float, check: Callable[[Any], None] | None = None) -> Any:
        """``GET /health`` until it answers 200 within `budget` seconds; its reply, after `check(reply)`
        (which raises for a server of another kind).

        Connection refused and 5xx mean "still starting" (`omnirl serve` loads its model before it
        listens), so they are waited for, with a line on stderr after `HEALTH_FIRST_NOTICE_S` and then
        every `HEALTH_NOTICE_S`; a host that does not resolve or a 4xx fails at once. No healthy server
        within `budget` is a `UserInputError` (exit 2) naming the URL: start it, or fix the option."""
        start = time.monotonic()
        deadline, notice = start + budget, start + HEALTH_FIRST_NOTICE_S
        last, attempt = "", 0
        while True:
            try:
                reply = self.once("/health", None, min(self.timeout, CONNECT_TIMEOUT_S + 5))
            except Retryable as exc:
                last = str(exc)
            else:
                if check is not None:
                    check(reply)
                return reply
            now = time.monotonic()
            if now >= deadline:
                what = f"{self.hint}, or raise" if self.hint else "start it, or raise"
                raise UserInputError(
                    f"{self.url}: no healthy {self.noun} within {budget:g} s (last: {last}); {what} "
                    "--server-startup-timeout"
                )
            if now >= notice:
                logger.warning(
                    "%s: waiting for a healthy %s, %.0f s of --server-startup-timeout %g (last: %s)",
                    self.url,
                    self.noun,
                    now - start,
                    budget,
                    last,
                )
                notice = now + HEALTH_NOTICE_S
            pause = min(backoff(attempt, rng=random.Random(attempt)), 5.0, deadline - now, notice - now)
            time.sleep(max(pause, 0.0))
            attempt += 1
