"""`omnirl online` under faults: a killed or stopped driver leaves no worker behind, Ctrl-C and SIGTERM
exit cleanly, a re-run of another run is refused, and bad inputs fail before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import online_args, runner

from omnirl_cli.app import app

PRESET = """\
sample:
  steps: 2
  guidance: 1.0
  resolution: 32
  sampler: sde
  group_size: 2
  batch_size: 6
update:
  algo: flow_grpo
  lora_rank: 4
  lora_alpha: 8
"""
WAIT = 240  # seconds for the driver to get through its first iteration on a loaded 2-core machine

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for processes")


@pytest.fixture
def preset(tmp_path: Path) -> Path:
    path = tmp_path / "preset.yaml"
    path.write_text(PRESET)
    return path


def _children(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc: workers, multiprocessing's resource tracker)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, ppid in parents.items() if ppid == parent]
        found += kids
        todo += kids
    return [p for p in found if _alive(p)]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def driver(preset: Path, staged: dict[str, Path], tmp_path: Path) -> Iterator[subprocess.Popen]:
    """`omnirl online` for many iterations in its own session, once its workers have finished iteration 0."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "omnirl_cli",
        *online_args(preset, staged, out, "--reward", "jpeg_compressibility"),
    ]
    proc = subprocess.Popen(
        [*cmd, "--iterations", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        # SIGINT as a terminal's shell starts a command, whatever this test process inherited or left
        # behind: Python keeps an inherited SIG_IGN, and the Ctrl-C case needs the driver to get it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + WAIT
    while not (out / "it1" / "policy").is_dir():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first iteration did not finish"
        time.sleep(0.2)
    started = _children(proc.pid)  # orphans once the driver is gone: kill them by pid, whatever happened
    try:
        yield proc
    finally:
        for pid in dict.fromkeys([proc.pid, *_children(proc.pid), *started]):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)


def _gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after waiting up to `seconds` for them to end."""
    deadline = time.monotonic() + seconds
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_sigkill_of_the_driver_ends_its_workers(driver: subprocess.Popen) -> None:
    workers = _children(driver.pid)
    assert len(workers) >= 2  # sampler and scorer (and multiprocessing's resource tracker)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(10)
    assert _gone(workers, 10) == []


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm", "ctrl-c"])
def test_sigterm_and_ctrl_c_stop_the_run_cleanly(driver: subprocess.Popen, ctrl_c: bool) -> None:
    workers = _children(driver.pid)
    if ctrl_c:  # a terminal's Ctrl-C signals the whole foreground process group
        os.killpg(driver.pid, signal.SIGINT)
    else:
        driver.send_signal(signal.SIGTERM)
    _, stderr = driver.communicate(timeout=60)
    assert driver.returncode == 130, stderr[-3000:]
    assert "interrupted" in stderr and "re-run to resume" in stderr
    assert "Traceback" not in stderr
    assert _gone(workers, 10) == []


def test_a_rerun_of_another_run_is_refused(preset: Path, staged: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = runner.invoke(
        app,
        [
            *online_args(preset, staged, out, "--reward", "jpeg_compressibility"),
            "--iterations",
            "1",
            "--json",
        ],
    )
    assert first.exit_code == 0, first.output
    other_prompts = tmp_path / "other.txt"
    other_prompts.write_text("a green field\na white cat\na yellow car\n")
    for extra, what in [
        (["--reward", "jpeg_incompressibility"], "(rewards differs"),
        (["--reward", "jpeg_compressibility", "--set", "sample.steps=3"], "(sample.steps differs"),
        (["--reward", "jpeg_compressibility", "--prompts", str(other_prompts)], "(prompts content differs"),
    ]:
        result = runner.invoke(app, [*online_args(preset, staged, out), *extra, "--iterations", "2"])
        assert result.exit_code == 2, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert what in result.output and "--overwrite" in result.output
        assert not (out / "it2").exists()
    again = runner.invoke(
        app,
        [
            *online_args(preset, staged, out, "--reward", "jpeg_incompressibility"),
            "--iterations",
            "1",
            "--overwrite",
            "--json",
        ],
    )
    assert again.exit_code == 0, again.output
    assert '"iteration": 0' in again.stdout  # started over, not resumed after the old run's it1
    assert '"jpeg_incompressibility"' in (out / "online_run.json").read_text()
    # it<K> folders online did not write (a staged recipe's, or a run that recorded no identity) are
    # never discarded, not even with --overwrite
    (out / "online_run.json").unlink()
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for extra in ([], ["--overwrite"]):
        result = runner.invoke(
            app, [*online_args(preset, staged, out, "--reward", "jpeg_compressibility"), *extra]
        )
        assert result.exit_code == 2 and "did not write" in result.output, result.output
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
