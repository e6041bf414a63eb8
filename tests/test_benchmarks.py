"""Every benchmark in benchmarks/ runs end to end at its smallest setting (`--smoke`), as `make bench`
launches it, so a renamed import or option cannot rot a benchmark unseen. Numbers are not checked."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("bench_*.py"))  # what benchmarks/run_all.py runs


def test_every_benchmark_is_found() -> None:
    assert {p.stem for p in BENCHMARKS} >= {
        "bench_shard_io",
        "bench_vlm",
        "bench_vlm_pack",
        "bench_online",
        "bench_remote",
    }


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


def test_real_size_guard_skips_what_memory_or_the_budget_leaves_no_room_for() -> None:
    """bench_real_size's stage guard, whose out-of-memory and over-budget paths a CPU smoke run never takes."""
    import torch

    from benchmarks.bench_real_size import Budget, Stages

    ran: list[str] = []

    def step(name: str) -> tuple[str, Callable[[], None]]:
        return name, lambda: ran.append(name)

    def out_of_memory() -> None:
        raise torch.OutOfMemoryError("out of memory: tried to allocate 2.00 GiB\nmore detail")

    stages = Stages(Budget(1e9))
    stages.run_path("staged", [step("sample"), ("score", out_of_memory), step("advantage")], lambda _: 0.0)
    stages.run_path("online", [step("sample")], lambda _: 0.0)
    assert ran == ["sample"]
    assert [(r["path"], r["stage"], r["seconds"] is None) for r in stages.rows] == [
        ("staged", "sample", False),
        ("staged", "score", True),
    ]
    assert stages.notes == [
        "staged score ran out of memory: out of memory: tried to allocate 2.00 GiB",
        "skipped staged advantage: it reads the output of staged score",
        "skipped online sample: an earlier stage ran out of memory",
    ]

    stages = Stages(Budget(1e9))  # an online stage needs as long as its staged twin took
    stages.run_path("online", [step("sample"), step("update")], {"sample": 0.0, "update": 2e9}.__getitem__)
    assert ran == ["sample", "sample"]
    assert [r["stage"] for r in stages.rows] == ["sample"]
    assert len(stages.notes) == 1
    assert stages.notes[0].startswith("skipped online update: ")
    assert stages.notes[0].endswith(" s of the budget left")
    assert Stages(Budget(-1.0)).run("setup", "build", lambda: ran.append("build")) is False
    assert "build" not in ran
