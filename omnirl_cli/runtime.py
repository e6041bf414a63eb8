"""Plumbing shared by the commands: quiet libraries, the device, saying an output was complete already,
and serving until stopped. (What makes a stage's output shard set is `stages.outputs`.)"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from stages.errors import UserInputError

from .console import emit_json, log

if TYPE_CHECKING:
    from stages.web import ServerLimits


def quiet_libraries() -> None:
    """Silence library loading bars and advisory warnings (omnirl draws its own progress); no imports."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def device() -> Any:
    """The device Accelerate picks for this process (an accelerator or the CPU); under a launcher it
    also joins the process group (`stages.dist.device`)."""
    from stages.dist import device as accelerate_device

    return accelerate_device()


def report_complete(out: Path, json_: bool, result: dict[str, Any] | None = None) -> None:
    """Say that `out` was already complete before this run, so it did nothing: one line on stderr,
    or with --json the stage's `result` (what it reports of its output) with `"skipped": true`."""
    log(f"{out} is already complete; nothing to do", quiet=json_)
    if json_:
        emit_json({"out": str(out), **(result or {}), "skipped": True})


class ServerSettings(Protocol):
    """The knobs every server command's config has (`stages.knobs.host` ... `request_timeout`)."""

    host: str
    port: int
    token_env: str | None
    max_connections: int
    workers: int
    request_timeout: float


def server_token(c: ServerSettings) -> str | None:
    """The bearer token `--token-env VAR` names (None without the option); an unset VAR is a usage error."""
    from stages.web import env_token

    return env_token(c.token_env, f"--token-env {c.token_env}")


def serve_until_stopped(
    bind: Callable[[str, int, ServerLimits], Any],
    c: ServerSettings,
    *,
    token: str | None,
    json_: bool,
    ready: Callable[[Any], dict],
    banner: str,
) -> None:
    """Bind a server (`bind(host, port, limits)`) on --host/--port, with the connection limits of
    --max-connections, --workers and --request-timeout, and serve until SIGTERM or Ctrl-C.

    When ready it says so: with --json one JSON line on stdout (`ready(server)` plus the pid, for the
    process that started it), else `banner` with the URL. Serving off the loopback without a token
    gets a warning.
    """
    from stages.web import ServerLimits, is_loopback

    limits = ServerLimits(
        max_connections=c.max_connections, workers=c.workers, request_timeout=c.request_timeout
    )
    try:
        server = bind(c.host, c.port, limits)
    except OSError as exc:
        raise UserInputError(
            f"--host {c.host} --port {c.port}: cannot bind ({exc.strerror or exc}); "
            "pick a free --port (0 picks one) or a local address"
        ) from None
    if not is_loopback(c.host) and token is None:
        log(f"[yellow]warning:[/] serving on {c.host} without --token-env: anyone who reaches it can use it")
    try:  # from here on, SIGTERM or Ctrl-C (a KeyboardInterrupt, see handle_errors) is a normal stop
        if json_:
            sys.stdout.write(json.dumps({**ready(server), "pid": os.getpid()}, sort_keys=True) + "\n")
            sys.stdout.flush()
        else:
            log(f"[green]serving[/] {banner} at {server.url}; Ctrl-C stops")
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    log("[green]stopped[/] server", quiet=json_)
