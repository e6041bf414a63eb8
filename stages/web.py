"""JSON over HTTP for omnirl's servers (`omnirl serve-reward`, `omnirl serve`) and their clients, stdlib
only, no pickle.

A `JsonService` decides what a request means; `JsonServer` and its handler do the HTTP, within
`ServerLimits` (docs/serving.md):

- at most `max_connections` open connections (one more: 503 with ``Retry-After``, closed at once),
  answered by `workers` threads (a connection between requests holds none), each request read in
  full within `request_timeout` seconds of its first byte (408 after);
- ``GET`` paths in `JsonService.public_paths` (``/health``) answer without a token, for probes;
- every other request must carry the service's bearer token, when it has one (401 otherwise);
- a POST needs a Content-Length (411; chunked bodies are not read) of at most the
  `JsonService.body_limit` of its path (413; `max_request_bytes` unless a route takes more); a body
  refused unread is drained when it is at most `DRAIN_FACTOR` × the limit (so the client reads the
  reply), else the connection is closed;
- a refusal replies ``{"error": {"code": STATUS, "message": ...}}`` and the server keeps serving; an
  exception other than `HttpError` is a 500 with its one-line message (and a logged traceback); a
  JSON body nested too deep to parse is a 400 (`parse_json_object`);
- a route may answer a file instead of JSON (`RawReply`: an MP4 with its headers), and read an HTML
  form (`parse_form`: ``multipart/form-data`` or urlencoded, as FastAPI's ``Form`` fields take it);
- a long route may ask whether its client is still there (`client_gone`, between steps) and stop with
  `ClientGone`: nothing is replied and the connection is closed.

A request whose ``Accept`` names ``application/x-msgpack`` (`MSGPACK`) gets its reply as msgpack, every
``{"encoding": "base64", "data": str}`` object in it carried as ``{"encoding": "raw", "data": bytes}``
(`pack_binary`): a third smaller and no base64 work for large tensors and video.

Clients parse both this error shape (also OpenAI's) and FastAPI's ``{"detail": ...}`` (a string, or
pydantic's list of ``{"loc", "msg"}``): `error_message`. `JsonClient` is the client side: health
polling with a start-up budget; retries with exponential backoff and jitter on connection errors,
timeouts, 502, 503 and 504 (a 500 once); a 4xx never (the request is wrong: `UserInputError`);
credentials in its URL go as Basic authentication and are never shown (`redact_url`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import hmac
import http.client
import io
import ipaddress
import json
import logging
import os
import queue
import random
import re
import select
import selectors
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from stages.errors import RuntimeFailure, UserInputError

logger = logging.getLogger(__name__)

DRAIN_FACTOR = 4
CONNECTION_TIMEOUT_S = 120.0  # a connection idle between requests, or a reply stalled, this long is closed
BACKLOG = 128  # the listen backlog, at least (the connection cap when higher)
LINGER_S = 2.0  # how long a refused connection's unread request is read and dropped before closing
RETRY_AFTER_S = 1  # the Retry-After of a 503 for a server at its connection cap
_CHUNK = 1 << 20
MSGPACK = "application/x-msgpack"
BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
MAX_FORM_BYTES = 64 * 1024  # an HTML form's body (text fields only)
MAX_FORM_FIELDS = 64
RETRY_STATUSES = frozenset({502, 503, 504})
CONNECT_TIMEOUT_S = 5.0
# while `wait_healthy` waits for a server: its first line on stderr after this many seconds, then one
# at least this often, so a person sees what it waits for
HEALTH_FIRST_NOTICE_S, HEALTH_NOTICE_S = 5.0, 30.0


@dataclass(frozen=True)
class RawReply:
    """A reply that is a file (an MP4), sent as it is with its content type and extra headers."""

    data: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Payload:
    """A request body that is not JSON (a pushed file, an encoded form) and its content type."""

    data: bytes
    content_type: str = "application/octet-stream"


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


class HttpError(Exception):
    """A refused request: its status and a one-line message for the client."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(" ".join(message.split()))  # one line, whatever a request's fields held
        self.status = status


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def env_token(var: str | None, where: str) -> str | None:
    """The secret in environment variable `var` (None without one): a bearer token or API key, never
    written on a command line. An unset or empty `var` is a one-line usage error starting with `where`
    (the option or reward argument that named it)."""
    if not var:
        return None
    token = os.environ.get(var)
    if not token:
        raise UserInputError(f"{where}: ${var} is not set; export it")
    return token


def redact_url(url: str) -> str:
    """`url` with the secret of its userinfo hidden, for messages and records:
    ``http://user:***@host/`` (``***@host`` when it has no user part)."""

    def hide(match: re.Match[str]) -> str:
        user, colon, _ = match[2].partition(":")
        return f"{match[1]}{user}:***@" if colon else f"{match[1]}***@"

    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)@", hide, url)


def one_line(text: Any, limit: int = 300) -> str:
    """`text` on one line, at most `limit` characters."""
    return " ".join(str(text).split())[:limit]


def error_message(raw: bytes) -> str:
    """The message of an error reply: omnirl's / OpenAI's ``{"error": {"message"}}``, FastAPI's
    ``{"detail"}``, else the text."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return one_line(raw.decode("utf-8", "replace"))
    inner = body.get("error") if isinstance(body, dict) else None
    for source in (inner, body):
        if isinstance(source, dict):
            for key in ("message", "detail"):
                if isinstance(source.get(key), list):  # pydantic's validation errors (FastAPI 422)
                    return one_line("; ".join(_validation_error(e) for e in source[key]))
                if source.get(key):
                    return one_line(source[key])
        if isinstance(source, str) and source:
            return one_line(source)
    return one_line(str(body))


def _validation_error(error: Any) -> str:
    """``body.n: Input should be less than or equal to 10`` of one pydantic error object."""
    if not isinstance(error, dict):
        return str(error)
    loc = ".".join(str(part) for part in error.get("loc") or [])
    return f"{loc}: {error.get('msg', '')}" if loc else str(error.get("msg", error))


def _binary(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.get("encoding") == "base64" and isinstance(obj.get("data"), str):
            import base64

            return {**obj, "encoding": "raw", "data": base64.b64decode(obj["data"])}
        return {k: _binary(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_binary(v) for v in obj]
    return obj


def pack_binary(payload: Any) -> bytes:
    """`payload` as msgpack, its base64 objects as raw bytes (module docstring)."""
    import msgpack

    return msgpack.packb(_binary(payload), use_bin_type=True)


def unpack_binary(raw: bytes) -> Any:
    """A `pack_binary` body (raw objects stay raw: the decoders take both); `ValueError` when it is not
    msgpack. Maps, arrays, strings, bytes and numbers only: msgpack extension types are refused."""
    import msgpack

    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"not a msgpack body ({type(exc).__name__})") from None


def wants_binary(accept: str | None) -> bool:
    """Whether an ``Accept`` header names msgpack."""
    return MSGPACK in (accept or "").lower()


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


def parse_form(raw: bytes, content_type: str) -> dict[str, str]:
    """The text fields of an HTML form body: ``multipart/form-data`` (file parts are refused) or
    ``application/x-www-form-urlencoded``; a repeated field keeps its last value. 400 for anything else;
    413 past `MAX_FORM_BYTES` or `MAX_FORM_FIELDS` fields, checked before parsing (the MIME parser's time
    grows faster than its input on crafted bodies)."""
    import email.parser
    import email.policy

    if len(raw) > MAX_FORM_BYTES:
        raise HttpError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the form is {len(raw)} bytes, more than {MAX_FORM_BYTES}: a form carries short text fields",
        )
    kind = content_type.split(";", 1)[0].strip().lower()
    boundary = re.search(r'boundary="?([^";]+)', content_type)
    separator = (
        b"&"
        if kind == "application/x-www-form-urlencoded"
        else b"--" + (boundary[1] if boundary else "").encode("latin-1", "replace")
    )
    if raw.count(separator) > MAX_FORM_FIELDS + 1:
        raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"more than {MAX_FORM_FIELDS} form fields")
    if kind == "application/x-www-form-urlencoded":
        try:
            pairs = urllib.parse.parse_qsl(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not a urlencoded form") from None
        return dict(pairs)
    if kind != "multipart/form-data":
        raise HttpError(
            HTTPStatus.BAD_REQUEST,
            f"Content-Type {kind or '(none)'}: send the fields as multipart/form-data (curl -F NAME=VALUE)",
        )
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
    if not message.is_multipart() or message.defects:
        raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not a well-formed multipart/form-data form")
    fields: dict[str, str] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise HttpError(HTTPStatus.BAD_REQUEST, "a form part has no name")
        if part.get_filename() is not None:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"form field {str(name)!r}: files are not taken here")
        payload = part.get_payload(decode=True) or b""
        try:
            fields[str(name)] = payload.decode(part.get_content_charset() or "utf-8")
        except (UnicodeDecodeError, LookupError):
            raise HttpError(HTTPStatus.BAD_REQUEST, f"form field {str(name)!r} is not UTF-8 text") from None
    return fields


def encode_form(fields: Mapping[str, Any]) -> Payload:
    """`fields` (each value as its `str`) as a ``multipart/form-data`` body, what ``curl -F`` sends."""
    import secrets

    boundary = f"omnirl-{secrets.token_hex(12)}"
    parts = []
    for name, value in fields.items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
            + str(value).encode("utf-8")
            + b"\r\n"
        )
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return Payload(body, f"multipart/form-data; boundary={boundary}")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (400 otherwise, also for one nested deeper than the
    parser's recursion limit, about 1000 levels)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not JSON") from None
    except RecursionError:
        raise HttpError(HTTPStatus.BAD_REQUEST, "JSON nested too deep: send a flatter body") from None
    if not isinstance(body, dict):
        raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not a JSON object")
    return body


@dataclass(frozen=True)
class ServerLimits:
    """How much of the machine a server's clients may hold (docs/serving.md): at most `max_connections`
    open connections (one more is answered 503 with ``Retry-After`` and closed), served by `workers`
    threads (a connection between requests holds no thread; a request waits for a free one), each
    request read in full, headers and body, within `request_timeout` seconds of its first byte (408
    after), and a connection idle between requests closed after `idle_timeout` seconds."""

    max_connections: int = 256
    workers: int = 16
    request_timeout: float = 60.0
    idle_timeout: float = CONNECTION_TIMEOUT_S


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

    def __init__(self, request: socket.socket, client_address: Any, server: JsonServer):
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


class JsonServer(HTTPServer):
    """An HTTP server for `service` on (host, port); port 0 picks a free one (see `url`).

    Threads and connections are bounded by `limits` (`ServerLimits`). `serve_forever`'s thread accepts,
    and answers a connection past the cap itself (503 with ``Retry-After``, then closed); a poller
    thread watches the connections between requests, without a thread each, and hands one that is
    readable to the pool of `ServerLimits.workers` threads, which read and answer its requests under
    the request deadline, then give it back (keep-alive) or close it. The listen backlog is `BACKLOG`,
    or the connection cap when higher, so that a burst of clients is accepted rather than left to
    retry its connection a second later.
    """

    def __init__(
        self,
        service: JsonService,
        host: str = "127.0.0.1",
        port: int = 0,
        handler: type[JsonHandler] = JsonHandler,
        *,
        limits: ServerLimits | None = None,
    ):
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.service = service
        self.limits = limits or ServerLimits()
        self.request_queue_size = max(BACKLOG, self.limits.max_connections)
        self._lock = threading.Lock()
        self._open: set[JsonHandler] = set()  # accepted connections not yet closed
        self._ready: queue.SimpleQueue[JsonHandler | None] = queue.SimpleQueue()  # for the workers
        self._handed: collections.deque[JsonHandler | socket.socket] = collections.deque()  # to the poller
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._threads: list[threading.Thread] = []
        self._closing = False
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

    def process_request(self, request: Any, client_address: Any) -> None:
        """A connection just accepted: watched for its requests, or refused when at the cap."""
        if not self._threads:
            self._start()
        if len(self._open) >= self.limits.max_connections:  # only this thread adds connections
            self._refuse_overloaded(request)
            return
        handler = self.RequestHandlerClass(request, client_address, self)
        with self._lock:
            self._open.add(handler)
        if handler.pending():  # the request came with the connection: straight to a worker
            self._ready.put(handler)
        else:
            self._hand(handler)

    def server_close(self) -> None:
        """Stop listening, stop the poller and the workers, and close every connection."""
        super().server_close()
        self._closing = True
        for _ in self._threads[1:]:
            self._ready.put(None)
        with self._lock:
            busy = list(self._open)
        for handler in busy:  # unblock a worker waiting on its client
            with contextlib.suppress(OSError):
                handler.connection.shutdown(socket.SHUT_RDWR)
        self._wake()
        for thread in self._threads:
            thread.join(timeout=5)
        with self._lock:
            left = list(self._open)
        for handler in left:  # handed back or queued while the threads stopped
            self._close(handler)
        for item in self._handed:
            if isinstance(item, socket.socket):
                item.close()
        self._wake_r.close()
        self._wake_w.close()

    def _start(self) -> None:
        self._threads.append(threading.Thread(target=self._poll, name="omnirl-http-poller", daemon=True))
        for i in range(self.limits.workers):
            self._threads.append(threading.Thread(target=self._work, name=f"omnirl-http-{i}", daemon=True))
        for thread in self._threads:
            thread.start()

    def _refuse_overloaded(self, sock: socket.socket) -> None:
        """503 with Retry-After, written at once (a fresh socket's buffer takes it), then a lingering
        close: the request is read and dropped for up to `LINGER_S`, so that closing over unread bytes
        does not reset the connection before the client reads the reply."""
        cap = self.limits.max_connections
        body = json.dumps(
            {
                "error": {
                    "code": 503,
                    "message": f"the server is at its --max-connections ({cap} open); retry later",
                }
            }
        ).encode()
        head = (
            f"HTTP/1.1 503 Service Unavailable\r\nServer: {JsonHandler.server_version}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n"
        )
        try:
            sock.setblocking(False)
            sock.send(head.encode("latin-1") + body)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        self._hand(sock)

    def _hand(self, item: JsonHandler | socket.socket) -> None:
        """Give the poller a connection between requests (a handler), or a refused socket to linger."""
        self._handed.append(item)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (the poller is already woken) or closed
            self._wake_w.send(b"\0")

    def _close(self, handler: JsonHandler) -> None:
        with self._lock:
            if handler not in self._open:
                return
            self._open.discard(handler)
        with contextlib.suppress(OSError):
            handler.finish()
        self.shutdown_request(handler.request)

    def _work(self) -> None:
        """A worker: answer the requests of each connection handed to it."""
        while (handler := self._ready.get()) is not None:
            try:
                keep = handler.serve(self.limits.request_timeout) and not self._closing
            except Exception:
                self.handle_error(handler.request, handler.client_address)
                keep = False
            if keep:
                handler.idle_since = time.monotonic()
                self._hand(handler)
            else:
                self._close(handler)

    def _poll(self) -> None:
        """The poller: watch connections between requests and hand a readable one to a worker; close
        one idle past `ServerLimits.idle_timeout`, and a refused one once read to its end or after
        `LINGER_S`."""
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        idle: dict[JsonHandler, None] = {}
        lingering: dict[socket.socket, float] = {}  # → when to close it
        sweep = 0.0
        try:
            while not self._closing:
                for key, _ in selector.select(timeout=1.0):
                    if key.fileobj is self._wake_r:
                        self._wake_r.recv(4096)
                    elif isinstance(key.data, JsonHandler):
                        selector.unregister(key.fileobj)
                        del idle[key.data]
                        self._ready.put(key.data)
                    elif not _discard(key.fileobj):  # type: ignore[arg-type]
                        selector.unregister(key.fileobj)
                        del lingering[key.fileobj]  # type: ignore[arg-type]
                        key.fileobj.close()  # type: ignore[union-attr]
                while self._handed:
                    item = self._handed.popleft()
                    if isinstance(item, JsonHandler):
                        idle[item] = None
                        selector.register(item.connection, selectors.EVENT_READ, item)
                    elif len(lingering) >= self.limits.max_connections:
                        item.close()
                    else:
                        lingering[item] = time.monotonic() + LINGER_S
                        selector.register(item, selectors.EVENT_READ)
                now = time.monotonic()
                if now >= sweep:
                    sweep = now + 0.25
                    for handler in [h for h in idle if now - h.idle_since > self.limits.idle_timeout]:
                        selector.unregister(handler.connection)
                        del idle[handler]
                        self._close(handler)
                    for sock in [s for s, until in lingering.items() if now >= until]:
                        selector.unregister(sock)
                        del lingering[sock]
                        sock.close()
        finally:
            for handler in list(idle):
                self._close(handler)
            for sock in lingering:
                sock.close()
            selector.close()


def _discard(sock: socket.socket) -> bool:
    """Read and drop what a refused connection sent; False once it is at its end (or broken)."""
    try:
        return bool(sock.recv(65536))
    except BlockingIOError:
        return True
    except OSError:
        return False


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
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError:  # a bracketed host that is not closed
            parts = urllib.parse.urlsplit("")
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
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
