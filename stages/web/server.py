"""The server side of `stages.web`: a `JsonService` decides what a request means; `JsonServer` and its handler do the HTTP, within
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

The bodies, `HttpError` and the forms a route reads are in `stages.web.wire`.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import hmac
import io
import ipaddress
import json
import logging
import queue
import select
import selectors
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from stages.knobs import MAX_CONNECTIONS, REQUEST_TIMEOUT_S, WORKERS
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
BACKLOG = 128  # the listen backlog, at least (the connection cap when higher)
LINGER_S = 2.0  # how long a refused connection's unread request is read and dropped before closing
RETRY_AFTER_S = 1  # the Retry-After of a 503 for a server at its connection cap
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


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


@dataclass(frozen=True)
class ServerLimits:
    """How much of the machine a server's clients may hold (docs/serving.md): at most `max_connections`
    open connections (one more is answered 503 with ``Retry-After`` and closed), served by `workers`
    threads (a connection between requests holds no thread; a request waits for a free one), each
    request read in full, headers and body, within `request_timeout` seconds of its first byte (408
    after), and a connection idle between requests closed after `idle_timeout` seconds."""

    max_connections: int = MAX_CONNECTIONS
    workers: int = WORKERS
    request_timeout: float = REQUEST_TIMEOUT_S
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
