"""Where output goes: a command's result on stdout (its lines and tables, or one JSON object with
--json), logs, progress and diagnostics on stderr, so `omnirl env > env.txt` keeps the report and a
pipe never reads a progress line."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
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

PROGRESS_INTERVAL_S = 30.0  # off a TTY, the longest stretch without a progress line
err = Console(stderr=True, highlight=False, soft_wrap=True)
# results: `print_result` lines and the tables of inspect, report, plan and env
out = Console(highlight=False, soft_wrap=True)
for _console in (err, out):
    if not _console.is_terminal:
        _console.width = 160  # logs, files and CI: wide enough for inspect's tables without truncation

QUIET, NORMAL, VERBOSE = -1, 0, 1
LOGGERS = ("stages", "omnirl_cli")  # omnirl's own loggers; libraries keep their settings
_LEVELS = {QUIET: logging.ERROR, NORMAL: logging.NOTSET, VERBOSE: logging.DEBUG}
_verbosity = NORMAL


class _ToStderr(logging.Handler):
    """Log records as plain lines on the stderr console (looked up per record, as `err` does)."""

    def emit(self, record: logging.LogRecord) -> None:
        err.print(self.format(record), markup=False, highlight=False)


_handler = _ToStderr()
_handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))


def set_verbosity(level: int) -> None:
    """-q (QUIET): no progress, no log lines, omnirl's loggers at ERROR; errors still print.
    -v (VERBOSE): omnirl's loggers at DEBUG, each record with its level and logger name.
    NORMAL restores the untouched state (warnings reach stderr through Python's last-resort handler)."""
    global _verbosity
    _verbosity = level
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(_LEVELS[level])
        if level == VERBOSE and _handler not in logger.handlers:
            logger.addHandler(_handler)
        elif level != VERBOSE and _handler in logger.handlers:
            logger.removeHandler(_handler)


def is_quiet() -> bool:
    """True under -q/--quiet: progress and log lines stay off."""
    return _verbosity == QUIET


class _Quiet:
    """Progress stand-in used when progress is off (-q)."""

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def advance(self, *args: Any, **kwargs: Any) -> None:
        return None

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Lines(_Quiet):
    """Progress off a TTY (Slurm logs, pipes): a plain line per task on stderr every `interval` seconds
    while the work runs (from a timer, so a long step still shows), and one when the block completes
    (not when it fails: then the error is the last line)."""

    def __init__(self, interval: float):
        self.tasks: list[dict[str, Any]] = []
        self.interval = interval
        self.start = time.monotonic()
        self.lock = threading.Lock()
        self.done = threading.Event()

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        with self.lock:
            self.tasks.append({"description": description, "total": total, "completed": 0, **fields})
            return len(self.tasks) - 1

    def advance(self, task: int, advance: float = 1) -> None:
        with self.lock:
            self.tasks[task]["completed"] += advance

    def update(self, task: int, *, advance: float = 0, **fields: Any) -> None:
        with self.lock:
            self.tasks[task].update(fields)
            self.tasks[task]["completed"] += advance

    def line(self) -> None:
        elapsed = int(time.monotonic() - self.start)
        with self.lock:
            for t in self.tasks:
                done = f"{t['completed']:g}" + (f"/{t['total']:g}" if t["total"] else "")
                rate = f" {t['rate']}" if t.get("rate") else ""
                err.print(f"{t['description']}: {done}{rate} [{elapsed // 60}:{elapsed % 60:02d}]")

    def tick(self) -> None:
        while not self.done.wait(self.interval):
            self.line()


@contextmanager
def progress(interval: float | None = None) -> Iterator[Any]:
    """A rich progress display on stderr; off a TTY, a plain progress line every `interval` seconds
    (default PROGRESS_INTERVAL_S, `_Lines`); nothing under -q. --json leaves it on: the result goes to
    stdout, progress to stderr, so a recipe can keep the one and still show the other."""
    if is_quiet():
        yield _Quiet()
        return
    if not err.is_terminal:
        lines = _Lines(PROGRESS_INTERVAL_S if interval is None else interval)
        timer = threading.Thread(target=lines.tick, daemon=True)
        timer.start()
        try:
            yield lines
        finally:
            lines.done.set()
            timer.join()
        lines.line()
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
    """One log line on stderr (suppressed with `quiet`, used by --json, and under -q)."""
    if not quiet and not is_quiet():
        err.print(message)


def print_result(message: str) -> None:
    """A command's human-readable result line on stdout (rich markup allowed), where --json would print
    its object instead. -q keeps it: it silences progress and logs, not results."""
    out.print(message)


def emit_json(result: dict[str, Any]) -> None:
    """The single result object of a command, on stdout."""
    sys.stdout.write(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()
