"""Shared helpers for the ratio benchmarks: timing, and recording results.

Each benchmark writes `benchmarks/results/<name>.json` and the markdown summary
`benchmarks/results/README.md` is regenerated from all result files, one table per benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(ap: argparse.ArgumentParser, smoke: dict[str, Any]) -> argparse.Namespace:
    """Parse a benchmark's command line, with the two options every benchmark shares.

    `--no-record` prints only. `--smoke` runs the benchmark at its smallest setting: `smoke` gives
    the sizes (its keys are the parser's destinations) unless the command line sets them, and
    nothing is recorded. It checks that the benchmark still runs end to end, not its ratios;
    `tests/test_benchmarks.py` runs every benchmark so.
    """
    ap.add_argument("--no-record", action="store_true", help="print only, do not write benchmarks/results")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="smallest setting, nothing recorded: checks that the benchmark runs, its numbers mean nothing",
    )
    args = ap.parse_args()
    unknown = [k for k in smoke if not hasattr(args, k)]
    if unknown:
        raise ValueError(f"smoke setting names no option of this benchmark: {', '.join(unknown)}")
    if args.smoke:
        ap.set_defaults(**smoke, no_record=True)
        args = ap.parse_args()
    return args


def best_of(fn: Callable[[], Any], repeats: int = 3) -> float:
    """The fastest wall-clock time of `repeats` calls to `fn`, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def synchronize() -> None:
    """Wait for the accelerator's queued work (`torch.accelerator`), so a clock read after it counts it."""
    import torch

    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def reset_peak_memory() -> None:
    """Start a new memory peak: the accelerator allocator's (`torch.accelerator`), else this process's
    peak resident set (Linux VmHWM, reset by writing 5 to /proc/self/clear_refs; where that is refused
    the peak keeps counting from the start of the process)."""
    import torch

    if torch.accelerator.is_available():
        torch.accelerator.reset_peak_memory_stats()
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory() -> int | None:
    """Bytes at the memory peak since `reset_peak_memory`: allocated on the accelerator, else the
    process's peak resident set (VmHWM); None where neither is known."""
    import torch

    if torch.accelerator.is_available():
        return int(torch.accelerator.max_memory_allocated())
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


# Runs argv[2:], writes its peak RSS in bytes to argv[1] (os.wait4's rusage: ru_maxrss in KiB on Linux) and
# exits with its exit code.
_PEAK_RSS = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); _, status, usage = os.wait4(p.pid, 0); "
    "open(sys.argv[1], 'w').write(str(usage.ru_maxrss * 1024)); sys.exit(os.waitstatus_to_exitcode(status))"
)


def run_peak_rss(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[int, subprocess.CompletedProcess]:
    """Run `cmd` to its end in a fresh process: (its peak resident memory in bytes, the completed process,
    stdout and stderr captured). It is started by a bare interpreter in between, because Linux counts a
    child's peak from the memory of the process that forked it: started from a process that has imported
    torch or built a model, every child would measure at least that much."""
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp) / "peak"
        proc = subprocess.run(
            [sys.executable, "-c", _PEAK_RSS, str(peak), *cmd], capture_output=True, env=env, cwd=cwd
        )
        return (int(peak.read_text()) if peak.is_file() else 0), proc


def machine() -> dict:
    """Where the numbers were measured."""
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown_table(rows: list[dict]) -> list[str]:
    """`rows` as a markdown table, one column per key in order of first appearance."""
    if not rows:
        return ["(no rows)"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    return lines


def write_readme(results_dir: Path = RESULTS_DIR) -> Path:
    """Regenerate README.md from every `<name>.json` result in `results_dir`."""
    lines = [
        "# Benchmark results",
        "",
        "Generated by `benchmarks/common.py` from the JSON files in this directory.",
        "",
    ]
    for path in sorted(results_dir.glob("*.json")):
        res = json.loads(path.read_text())
        lines += [f"## {res['name']}", "", f"{res.get('description', '')}".strip(), ""]
        lines += [
            f"Measured {res['created']} on {res['machine']['platform']} ({res['machine']['cpus']} CPUs).",
            "",
        ]
        lines += [*markdown_table(res.get("table", [])), ""]
    readme = results_dir / "README.md"
    readme.write_text("\n".join(lines))
    return readme


def record(
    name: str,
    metrics: dict,
    table_rows: list[dict],
    *,
    description: str = "",
    results_dir: Path = RESULTS_DIR,
) -> Path:
    """Write `<results_dir>/<name>.json` (metrics, table rows, machine, time) and refresh README.md."""
    results_dir.mkdir(parents=True, exist_ok=True)
    res = {
        "name": name,
        "description": description,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "metrics": metrics,
        "table": table_rows,
    }
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    write_readme(results_dir)
    return path
