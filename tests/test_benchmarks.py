"""Every benchmark in benchmarks/ runs end to end at its smallest setting (`--smoke`), as `make bench`
launches it, so a renamed import or option cannot rot a benchmark unseen. Numbers are not checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("bench_*.py"))  # what benchmarks/run_all.py runs


def test_every_benchmark_is_found() -> None:
    assert {p.stem for p in BENCHMARKS} >= {"bench_shard_io", "bench_vlm", "bench_online", "bench_remote"}


@pytest.mark.slow
@pytest.mark.parametrize("bench", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmark_runs_at_its_smallest_setting(bench: Path, tmp_path: Path) -> None:
    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(bench), "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, f"{bench.name} --smoke failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before  # --smoke records nothing
