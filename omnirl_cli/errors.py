"""Maps errors to one-line messages and exit codes (0 ok, 1 runtime failure, 2 bad usage or input)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.markup import escape

from stages.errors import OmnirlError

from .console import err

F = TypeVar("F", bound=Callable[..., Any])


def debug_enabled() -> bool:
    return os.environ.get("OMNIRL_DEBUG", "") not in ("", "0")


def handle_errors(func: F) -> F:
    """Run a command, turning known errors into one stderr line and the right exit code.

    `OMNIRL_DEBUG=1` re-raises so the full traceback is shown.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except OmnirlError as exc:
            if debug_enabled():
                raise
            err.print(f"[bold red]error:[/] {escape(str(exc))}")
            raise typer.Exit(code=exc.exit_code) from None
        except KeyboardInterrupt:
            if debug_enabled():
                raise
            err.print("[bold red]interrupted[/]: outputs without a manifest are incomplete; re-run to resume")
            raise typer.Exit(code=130) from None
        except Exception as exc:
            if debug_enabled():
                raise
            err.print(
                f"[bold red]internal error:[/] {type(exc).__name__}: {escape(str(exc))} "
                "(run again with OMNIRL_DEBUG=1 for the traceback)"
            )
            raise typer.Exit(code=1) from None

    return wrapper  # type: ignore[return-value]
