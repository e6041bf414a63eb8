"""Where output goes: logs and progress on stderr, one JSON result object on stdout."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

err = Console(stderr=True, highlight=False, soft_wrap=True)
if not err.is_terminal:
    err.width = 160  # logs and CI: wide enough for inspect's tables without truncation


class _Quiet:
    """Progress stand-in used when bars are off (JSON mode, no TTY)."""

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def advance(self, *args: Any, **kwargs: Any) -> None:
        return None

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None


@contextmanager
def progress(enabled: bool = True) -> Iterator[Any]:
    """A rich progress display on stderr, or a silent stand-in when `enabled` is false or stderr is no TTY."""
    if not enabled or not err.is_terminal:
        yield _Quiet()
        return
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    )
    with bar:
        yield bar


def log(message: str, *, quiet: bool = False) -> None:
    """One log line on stderr (suppressed with `quiet`, used by --json)."""
    if not quiet:
        err.print(message)


def emit_json(result: dict[str, Any]) -> None:
    """The single result object of a command, on stdout."""
    sys.stdout.write(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()
