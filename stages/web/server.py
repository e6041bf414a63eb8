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

The request handling (`JsonService`, `JsonHandler`, `client_gone`) is `stages.web.handler`'s; the bodies,
`HttpError` and the forms a route reads are in `stages.web.wire`.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import json
import logging
import queue
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import HTTPServer
from typing import Any

from stages.knobs import MAX_CONNECTIONS, REQUEST_TIMEOUT_S, WORKERS
from stages.web.handler import CONNECTION_TIMEOUT_S, JsonHandler, JsonService

logger = logging.getLogger(__name__)

BACKLOG = 128  # the listen backlog, at least (the connection cap when higher)
LINGER_S = 2.0  # how long a refused connection's unread request is read and dropped before closing
RETRY_AFTER_S = 1  # the Retry-After of a 503 for a server at its connection cap


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
