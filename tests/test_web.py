"""The HTTP layer shared by `omnirl serve` and `omnirl serve-reward` (`stages.web`): bounded threads and
connections, the request deadline, the listen backlog, deep JSON, and credentials in a client's URL."""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from stages.errors import RuntimeFailure, UserInputError
from stages.web import (
    HttpError,
    JsonClient,
    JsonServer,
    JsonService,
    ServerLimits,
    parse_json_object,
    redact_url,
)


class _Echo(JsonService):
    """GET answers ok; POST answers the JSON object it was sent."""

    def get(self, path: str) -> dict[str, Any]:
        return {"status": "ok"}

    def post(self, path: str, raw: bytes) -> dict[str, Any]:
        return parse_json_object(raw)


@pytest.fixture
def serving() -> Iterator[Any]:
    """serving(server) → `server`, serving in a thread until the test ends."""
    servers: list[JsonServer] = []

    def start(server: JsonServer) -> JsonServer:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _exchange(address: tuple[str, int], request: bytes, timeout: float = 10) -> bytes:
    """Send `request` on a fresh connection; everything the server sends until it closes."""
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def _health(address: tuple[str, int]) -> bytes:
    return _exchange(address, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")


def test_idle_connections_hold_no_thread_and_one_past_the_cap_gets_503_at_once(serving) -> None:
    server = serving(
        JsonServer(_Echo(token=None, max_request_bytes=1024), limits=ServerLimits(300, workers=4))
    )
    address = server.server_address[:2]
    assert _health(address).startswith(b"HTTP/1.1 200")  # the pool is up
    threads = threading.active_count()
    idle = [socket.create_connection(address, timeout=10) for _ in range(299)]
    try:
        t0 = time.monotonic()
        assert _health(address).startswith(b"HTTP/1.1 200")  # 299 idle connections block no request
        assert time.monotonic() - t0 < 2
        idle.append(socket.create_connection(address, timeout=10))  # the 300th: at the cap
        time.sleep(0.2)
        assert threading.active_count() == threads  # was one thread per connection: 300 more
        for _ in range(3):  # the 301st and more: refused at once, and told when to retry
            t0 = time.monotonic()
            reply = _health(address)
            assert time.monotonic() - t0 < 1
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head, reply
            assert "--max-connections (300 open)" in json.loads(body)["error"]["message"]
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10  # the closed ones are noticed and let go
    while (reply := _health(address)).startswith(b"HTTP/1.1 503") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reply.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    ("head", "trickle"),
    [
        (b"POST /echo HTTP/1.1\r\nHost: x\r\n", b"X"),  # one header byte at a time, never ending
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n", b" "),  # a body byte at a time
    ],
    ids=["headers", "body"],
)
def test_a_client_trickling_its_request_is_cut_off_at_the_deadline(
    serving, head: bytes, trickle: bytes
) -> None:
    """A per-read timeout restarts on every byte: a byte every 0.1 s used to hold the connection (and
    its thread) forever. The deadline runs from the request's first byte, whatever arrives."""
    limits = ServerLimits(request_timeout=0.6)
    server = serving(JsonServer(_Echo(token=None, max_request_bytes=4096), limits=limits))
    address = server.server_address[:2]
    with socket.create_connection(address, timeout=0.1) as sock:
        t0 = time.monotonic()
        sock.sendall(head)
        reply = b""
        while time.monotonic() - t0 < 5:
            try:
                sock.sendall(trickle)
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionError:
                break
            if not chunk:
                break
            reply += chunk
        took = time.monotonic() - t0
    assert 0.5 < took < 2.5, took
    head_out, _, body = reply.partition(b"\r\n\r\n")
    assert head_out.startswith(b"HTTP/1.1 408") and b"Connection: close" in head_out, reply
    assert "--request-timeout (0.6 s)" in json.loads(body)["error"]["message"]
    assert _health(address).startswith(b"HTTP/1.1 200")  # and the server serves on


def test_a_burst_of_32_clients_is_queued_by_the_backlog_not_dropped(serving) -> None:
    """All 32 connect before the server accepts any: the listen backlog holds them (it was 5, and a
    client past it waited a second for its retried connection, or failed)."""
    server = JsonServer(_Echo(token=None, max_request_bytes=1024))
    address = server.server_address[:2]
    clients = [socket.create_connection(address, timeout=0.5) for _ in range(32)]
    try:
        for sock in clients:
            sock.settimeout(10)
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\nConnection: close\r\n\r\n")
            sock.sendall(b'{"a": 1}')
        serving(server)
        for sock in clients:
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"a": 1}'), reply
    finally:
        for sock in clients:
            sock.close()


def test_json_nested_too_deep_is_a_400_not_a_500(serving) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(HttpError, match="JSON nested too deep") as caught:
        parse_json_object(deep)
    assert caught.value.status == 400
    server = serving(JsonServer(_Echo(token=None, max_request_bytes=1 << 20)))
    head = f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(deep)}\r\nConnection: close\r\n\r\n"
    reply = _exchange(server.server_address[:2], head.encode() + deep)
    assert reply.startswith(b"HTTP/1.1 400") and b"JSON nested too deep" in reply, reply


def _one_reply_server(reply: bytes) -> tuple[str, list[bytes]]:
    """A listening socket that answers every connection with `reply`: (its URL, the requests it got)."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def answer() -> None:
        with listener:
            while True:
                conn, _ = listener.accept()
                with conn:
                    got.append(conn.recv(65536))
                    conn.sendall(reply)

    threading.Thread(target=answer, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}", got


def test_credentials_in_a_client_url_are_sent_as_basic_auth_and_never_shown(caplog) -> None:
    assert redact_url("http://alice:s3cret@host:1/v1") == "http://alice:***@host:1/v1"
    assert redact_url("https://tok3n@host/") == "https://***@host/"
    assert redact_url("http://host:1/a@b") == "http://host:1/a@b"  # an @ in the path is no userinfo

    def shown(exc: pytest.ExceptionInfo) -> str:
        assert "s3cret" not in str(exc.value) and "alice:***@" in str(exc.value), exc.value
        return str(exc.value)

    hostport, got = _one_reply_server(
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    client = JsonClient(f"http://alice:s3cret@{hostport}", token=None, timeout=5, retries=0)
    assert client.url == f"http://alice:***@{hostport}"
    with pytest.raises(UserInputError) as refused:
        client.call("/x")
    assert shown(refused).startswith(f"http://alice:***@{hostport}/x: HTTP 404")
    request = got[0].decode()
    assert request.startswith("GET /x HTTP/1.1\r\n") and "s3cret@" not in request
    assert f"Authorization: Basic {base64.b64encode(b'alice:s3cret').decode()}\r\n" in request

    hostport, _ = _one_reply_server(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\n<hi>")
    with pytest.raises(UserInputError, match="not JSON") as not_json:
        JsonClient(f"http://alice:s3cret@{hostport}", token=None, timeout=5, retries=0).call("/x")
    shown(not_json)

    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    down = JsonClient(f"http://alice:s3cret@127.0.0.1:{port}", token=None, timeout=2, retries=1)
    with caplog.at_level(logging.INFO, logger="stages.web"), pytest.raises(RuntimeFailure) as failed:
        down.call("/x")
    shown(failed)
    assert caplog.records and all("s3cret" not in record.getMessage() for record in caplog.records)
    with pytest.raises(UserInputError, match="no healthy server within") as unhealthy:
        down.wait_healthy(0.5)
    shown(unhealthy)
    with pytest.raises(UserInputError) as bad_port:
        JsonClient("http://alice:s3cret@host:port", token=None, timeout=1, retries=0)
    shown(bad_port)
    with pytest.raises(UserInputError, match="give only one") as both:
        JsonClient(f"http://alice:s3cret@127.0.0.1:{port}", token="t", timeout=1, retries=0)
    shown(both)
