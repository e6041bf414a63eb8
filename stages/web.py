"""JSON over HTTP for omnirl's servers (`omnirl serve-reward`, `omnirl serve`), stdlib only, no pickle.

A `JsonService` decides what a request means; `JsonServer` (threaded) and its handler do the HTTP:

- ``GET`` paths in `JsonService.public_paths` (``/health``) answer without a token, for probes;
- every other request must carry the service's bearer token, when it has one (401 otherwise);
- a POST needs a Content-Length (411; chunked bodies are not read) of at most the
  `JsonService.body_limit` of its path (413; `max_request_bytes` unless a route takes more); a body
  refused unread is drained when it is at most `DRAIN_FACTOR` × the limit (so the client reads the
  reply), else the connection is closed;
- a refusal replies ``{"error": {"code": STATUS, "message": ...}}`` and the server keeps serving; an
  exception other than `HttpError` is a 500 with its one-line message (and a logged traceback).

Clients parse both this error shape (also OpenAI's) and FastAPI's ``{"detail": ...}``: `error_message`.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import socket
import sys
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

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


def one_line(text: Any, limit: int = 300) -> str:
    """`text` on one line, at most `limit` characters."""
    return " ".join(str(text).split())[:limit]


def error_message(raw: bytes) -> str:
    """The message of an error reply: omnirl's / OpenAI's ``{"error": {"message"}}``, FastAPI's
    ``{"detail"}``, else the text."""
    try:
        body = json.loads(raw)
    except ValueError:
        return one_line(raw.decode("utf-8", "replace"))
    inner = body.get("error") if isinstance(body, dict) else None
    for source in (inner, body):
        if isinstance(source, dict):
            for key in ("message", "detail"):
                if source.get(key):
                    return one_line(source[key])
        if isinstance(source, str) and source:
            return one_line(source)
    return one_line(str(body))


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


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (400 otherwise)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not a JSON object")
    return body


class JsonHandler(BaseHTTPRequestHandler):
    """HTTP for `JsonServer.service`; every reply is JSON."""

    protocol_version = "HTTP/1.1"
    server_version = "omnirl"
    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    @property
    def service(self) -> JsonService:
        return self.server.service  # type: ignore[attr-defined]

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

    def _answer(self, call: Any, *args: Any) -> None:
        """Reply with `call(*args)`, or with the refusal or internal error it raised."""
        try:
            reply = call(*args)
        except HttpError as exc:
            self._refuse(exc)
            return
        except Exception as exc:
            logger.exception("%s: internal error", self.server_version)
            message = one_line(f"{type(exc).__name__}: {exc}")
            self._refuse(HttpError(HTTPStatus.INTERNAL_SERVER_ERROR, message))
            return
        self._reply(HTTPStatus.OK, reply)

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/") or "/"
        if path not in self.service.public_paths and not self.service.authorized(
            self.headers.get("Authorization")
        ):
            self._refuse(HttpError(HTTPStatus.UNAUTHORIZED, "a valid bearer token is required"))
            return
        self._answer(self.service.get, path)

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
        self._answer(service.post, self.path, raw)


class JsonServer(ThreadingHTTPServer):
    """A threaded HTTP server for `service` on (host, port); port 0 picks a free one (see `url`)."""

    daemon_threads = True

    def __init__(
        self, service: JsonService, host: str = "127.0.0.1", port: int = 0, handler: type = JsonHandler
    ):
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.service = service
        super().__init__((host, port), handler)

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
        logger.exception("%s: error serving %s", type(self).__name__, client_address)
