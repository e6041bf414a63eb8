"""Off a TTY (Slurm logs, pipes) long commands print a plain progress line at a fixed interval, even
while one step runs long, and a last one at the end; -q keeps stderr quiet."""

from __future__ import annotations

import time

import pytest

from omnirl_cli.console import NORMAL, QUIET, progress, set_verbosity


def test_off_a_tty_progress_prints_a_line_every_interval_and_at_the_end(
    capsys: pytest.CaptureFixture,
) -> None:
    with progress(interval=0.05) as bar:
        task = bar.add_task("updating", total=4, rate="")
        bar.update(task, advance=1, rate="loss +1.000e-03")
        time.sleep(0.3)  # one long step: the timer still reports
        bar.advance(task, 3)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3
    assert lines[0].startswith("updating: 1/4 loss +1.000e-03 [0:00]")
    assert lines[-1].startswith("updating: 4/4 loss +1.000e-03")


def test_quiet_prints_no_progress(capsys: pytest.CaptureFixture) -> None:
    set_verbosity(QUIET)
    try:
        with progress(interval=0.01) as bar:
            bar.add_task("sampling", total=2, rate="")
            time.sleep(0.05)
    finally:
        set_verbosity(NORMAL)
    assert capsys.readouterr().err == ""
