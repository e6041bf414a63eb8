"""Maps errors to one-line messages and exit codes (0 ok, 1 runtime failure, 2 bad usage or input)."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import typer
from rich.markup import escape

from stages.errors import OmnirlError

from .console import err

F = TypeVar("F", bound=Callable[..., Any])

# Operating-system errors the user's environment causes, with what to do about them. A full disk
# leaves no half-written file under a final name (writes go through temp files), so re-running
# after freeing space resumes.
_USER_OS_ERRORS = {
    errno.ENOSPC: "the disk is full{where}; free space (or pick another --out) and re-run to resume",
    errno.EDQUOT: "the disk quota is exceeded{where}; free space (or pick another --out) and re-run to resume",
    errno.EFBIG: "a file grew past the size limit{where} (ulimit -f or the file system's limit); "
    "raise the limit or pick another --out, then re-run to resume",
    errno.EACCES: "permission denied{where}; pick a location you can write (or read) and re-run",
    errno.EPERM: "operation not permitted{where}; pick a location you can write and re-run",
    errno.EROFS: "read-only file system{where}; pick a writable --out and re-run",
}


def debug_enabled() -> bool:
    return os.environ.get("OMNIRL_DEBUG", "") not in ("", "0")


def handle_errors(func: F) -> F:
    """Run a command, turning known errors into one stderr line and the right exit code.

    `OMNIRL_DEBUG=1` re-raises so the full traceback is shown.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _sigterm_as_interrupt():
                return func(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except OmnirlError as exc:
            if debug_enabled():
                raise
            err.print(f"[bold red]error:[/] {escape(str(exc))}")
            raise typer.Exit(code=exc.exit_code) from None
        except OSError as exc:
            if debug_enabled():
                raise
            if exc.errno not in _USER_OS_ERRORS:
                _internal(exc)
            where = f" at {exc.filename}" if exc.filename else ""
            err.print(f"[bold red]error:[/] {escape(_USER_OS_ERRORS[exc.errno].format(where=where))}")
            raise typer.Exit(code=2) from None
        except SystemExit as exc:
            if debug_enabled():
                raise
            err.print(
                f"[bold red]error:[/] sys.exit({exc.code!r}) was called inside the command, by a plugin or "
                "library; plugins must return values or raise exceptions"
            )
            raise typer.Exit(code=2) from None
        except KeyboardInterrupt:
            if debug_enabled():
                raise
            err.print("[bold red]interrupted[/]: outputs without a manifest are incomplete; re-run to resume")
            raise typer.Exit(code=130) from None
        except Exception as exc:
            if debug_enabled():
                raise
            _internal(exc)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (kill, a batch scheduler's stop) ends a command as Ctrl-C does: the same one-line
    message and exit 130, workers stopped, nothing half-written left under a final name."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _internal(exc: BaseException) -> None:
    err.print(
        f"[bold red]internal error:[/] {type(exc).__name__}: {escape(str(exc))} "
        "(run again with OMNIRL_DEBUG=1 for the traceback)"
    )
    raise typer.Exit(code=1) from None
