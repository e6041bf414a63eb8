"""One connection's HTTP for a `JsonService` (what a server's owner implements: what a request means),
as `JsonServer` (server.py) hands it over: `JsonHandler` reads each request within its deadline, checks
the bearer token and the body's length against the path's limit (draining a refused body of at most
`DRAIN_FACTOR` × the limit), calls the service and replies JSON, msgpack or a `RawReply`; a refusal is
an `HttpError` reply, any other exception a 500. A long route asks `client_gone` between steps and
stops with `ClientGone`.
"""

from __future__ import annotations

import contextvars
import hmac
import io
import json
import logging
import select
import socket
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from stages.web.wire import (
    MSGPACK,
    HttpError,
    RawReply,
    one_line,
    pack_binary,
    wants_binary,
)

logger = logging.getLogger(__name__)

DRAIN_FACTOR = 4
CONNECTION_TIMEOUT_S = 120.0  # a connection idle between requests, or a reply stalled, this long is closed
_CHUNK = 1 << 20


class ClientGone(Exception):
    """The client of the request being answered closed its connection: stop, nothing is replied."""


_client: contextvars.ContextVar[socket.socket | None] = contextvars.ContextVar("client", default=None)


def client_gone() -> bool:
    """Whether the client of the request this thread answers has closed its connection (its socket
    reads EOF or fails; peeked, nothing consumed); False outside a request. One non-blocking poll, so a
    long route may ask between steps. A client that half-closes (shuts its sending side) to wait for the
    reply counts as gone: HTTP clients do not."""
    sock = _client.get()
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:  # reset by the peer
        return True


class JsonService:
    """What a server does with requests, apart from HTTP; subclasses implement `get` and `post`."""

    public_paths: tuple[str, ...] = ("/health",)

    def __init__(self, *, token: str | None, max_request_bytes: int):
        self.token = token
        self.max_request_bytes = max_request_bytes

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the server's bearer token (always, without one)."""
        if self.token is None:
            return True
        scheme, _, value = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())

    def body_limit(self, path: str) -> tuple[int, str]:
        """(the largest POST body `path` takes, in bytes; the server option that sets it)."""
        return self.max_request_bytes, "--max-request-mb"

    def get(self, path: str) -> dict[str, Any]:
        """The reply to ``GET path`` (the path without query); `HttpError` when refused."""
        raise HttpError(HTTPStatus.NOT_FOUND, f"no route GET {path}")

    def post(self, path: str, raw: bytes) -> dict[str, Any]:
        """The reply to ``POST path`` with body `raw`; `HttpError` when refused."""
        raise HttpError(HTTPStatus.NOT_FOUND, f"no route POST {path}")

    def delete(self, path: str, query: dict[str, list[str]]) -> dict[str, Any]:
        """The reply to ``DELETE path?query`` (no body); `HttpError` when refused."""
        raise HttpError(HTTPStatus.NOT_FOUND, f"no route DELETE {path}")

    def post_request(self, path: str, raw: bytes, content_type: str) -> dict[str, Any] | RawReply:
        """The reply to ``POST path`` with body `raw` sent as `content_type`: `post`, unless a service
        reads the content type (a form route) or answers a file."""
        return self.post(path, raw)


class _Late(TimeoutError):
    """A request not read within its deadline (`ServerLimits.request_timeout`)."""


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each bounded by what is left of the request's `deadline` (a `time.monotonic`
    instant; None: the socket's own timeout): a client trickling a byte at a time cannot stretch a
    request past it, as it could a per-read timeout, which restarts on every byte."""

    def __init__(self, sock: socket.socket):
        super().__init__()
        self.sock = sock
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        if self.deadline is None:
            try:
                return self.sock.recv_into(buffer)
            except BlockingIOError:  # a non-blocking peek (`JsonHandler.pending`)
                return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Late("the request deadline passed")
        stall = self.sock.gettimeout()
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        except TimeoutError:
            raise _Late("the request deadline passed") from None
        finally:
            self.sock.settimeout(stall)  # replies keep the stall timeout


class JsonHandler(BaseHTTPRequestHandler):
    """HTTP for `JsonServer.service`, one per connection: `serve` answers the requests that arrived on
    it each time it is readable; every reply is JSON (or a `RawReply`)."""

    protocol_version = "HTTP/1.1"
    server_version = "omnirl"
    timeout = CONNECTION_TIMEOUT_S  # a reply the client does not read for this long is dropped

    def __init__(self, request: socket.socket, client_address: Any, server: HTTPServer):
        # Unlike socketserver's handlers, set up only: the server calls `serve` when requests arrive.
        self.request, self.client_address, self.server = request, client_address, server
        self.idle_since = time.monotonic()
        self.setup()

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.reader = _DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self.reader)

    def serve(self, request_timeout: float) -> bool:
        """Answer the requests waiting on the connection, each read within `request_timeout` seconds
        of its first byte; whether to keep the connection open for more."""
        while True:
            self.reader.deadline = time.monotonic() + request_timeout
            try:
                self.handle_one_request()
            finally:
                self.reader.deadline = None
            if self.close_connection:
                return False
            if not self.pending():
                return True

    def pending(self) -> bool:
        """Whether the next request's first bytes are already here (read ahead, or pipelined)."""
        self.connection.setblocking(False)
        try:
            return bool(self.rfile.peek(1))
        except OSError:
            return False  # the poller sees the error as readable, and the next read closes
        finally:
            self.connection.settimeout(self.timeout)

    def _late(self) -> None:
        limit = self.server.limits.request_timeout  # type: ignore[attr-defined]
        self._refuse(
            HttpError(
                HTTPStatus.REQUEST_TIMEOUT,
                f"the request was not read in full within the server's --request-timeout ({limit:g} s); "
                "send it in one go, or ask for a longer --request-timeout",
            ),
            close=True,
        )

    def parse_request(self) -> bool:
        try:
            return super().parse_request()
        except _Late:  # the headers came too slowly (a late request line is closed quietly)
            self._late()
            return False

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    @property
    def service(self) -> JsonService:
        return self.server.service  # type: ignore[attr-defined]

    def _reply(self, status: int, payload: dict[str, Any] | RawReply, *, close: bool = False) -> None:
        extra: dict[str, str] = {}
        if isinstance(payload, RawReply):
            data, kind, extra = payload.data, payload.content_type, payload.headers
        elif status == HTTPStatus.OK and wants_binary(self.headers.get("Accept")):
            data, kind = pack_binary(payload), MSGPACK
        else:
            data, kind = json.dumps(payload, allow_nan=False).encode("utf-8"), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for name, value in extra.items():
            self.send_header(name, value)
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

    def _answer(self, call: Any, *args: Any) -> None:
        """Reply with `call(*args)`, or with the refusal or internal error it raised (none when the
        client went away: `ClientGone`)."""
        client = _client.set(self.connection)
        try:
            reply = call(*args)
        except ClientGone as exc:
            logger.info("%s %s: the client went away (%s)", self.command, self.path, exc)
            self.close_connection = True
            return
        except HttpError as exc:
            self._refuse(exc)
            return
        except Exception as exc:
            logger.exception("%s: internal error", self.server_version)
            message = one_line(f"{type(exc).__name__}: {exc}")
            self._refuse(HttpError(HTTPStatus.INTERNAL_SERVER_ERROR, message))
            return
        finally:
            _client.reset(client)
        self._reply(HTTPStatus.OK, reply)

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/") or "/"
        if path not in self.service.public_paths and not self.service.authorized(
            self.headers.get("Authorization")
        ):
            self._refuse(HttpError(HTTPStatus.UNAUTHORIZED, "a valid bearer token is required"))
            return
        self._answer(self.service.get, path)

    def do_DELETE(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        if (self.headers.get("Content-Length") or "0").strip() != "0" or self.headers.get(
            "Transfer-Encoding"
        ):
            self._refuse(HttpError(HTTPStatus.BAD_REQUEST, "DELETE takes no body"), close=True)
            return
        if not self.service.authorized(self.headers.get("Authorization")):
            self._refuse(HttpError(HTTPStatus.UNAUTHORIZED, "a valid bearer token is required"))
            return
        path = parts.path.rstrip("/") or "/"
        self._answer(self.service.delete, path, urllib.parse.parse_qs(parts.query))

    def _drain(self, length: int, limit: int) -> bool:
        """Read and drop a refused body of `length` bytes when it is small enough; False: close instead."""
        if length > DRAIN_FACTOR * limit:
            return False
        while length > 0:
            chunk = self.rfile.read(min(length, _CHUNK))
            if not chunk:
                return False
            length -= len(chunk)
        return True

    def do_POST(self) -> None:
        try:
            self._post()
        except _Late:  # the body came too slowly (it is read before any reply is sent)
            self._late()

    def _post(self) -> None:
        service = self.service
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
        limit, option = service.body_limit(urllib.parse.urlsplit(self.path).path.rstrip("/"))
        if not service.authorized(self.headers.get("Authorization")):
            refusal = HttpError(HTTPStatus.UNAUTHORIZED, "a valid bearer token is required")
        elif length > limit:
            refusal = HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the body is {length} bytes, more than the server's {option} ({limit} bytes); "
                "send less per request",
            )
        if refusal is not None:
            self._refuse(refusal, close=not self._drain(length, limit))
            return
        raw = self.rfile.read(length)
        if len(raw) < length:  # the client went away mid-body
            self.close_connection = True
            return
        self._answer(service.post_request, self.path, raw, self.headers.get("Content-Type") or "")
