"""FSDP2 memory: the per-rank peak of `omnirl update --full --strategy fsdp2` on 2 gloo CPU ranks ÷ one
process with the same global batch, and `omnirl plan`'s prediction for both ÷ the measured peaks.

Data: bench_parallel's staged Flow-GRPO iteration of the `small` SD3 (`--samples` rollouts, 64 px). The
update is a full fine-tune (`--full --lr 1e-5`, micro-batch 1, `--samples-per-step 2`: two micro-batches
per optimizer step in one process, one on each of 2 ranks), on the rollout's own log-probs. Each process is started
here with the variables torchrun gives a rank (RANK, WORLD_SIZE, MASTER_ADDR, ...), one torch thread
each, and its peak is its own max RSS (`os.wait4`): the process's peak, interpreter and libraries
included. Also measured: one process with glibc's mmap threshold pinned as FSDP2 pins it on CPU ranks
(`MALLOC_MMAP_THRESHOLD_`, stages/update/parallel.py), and the import baseline (a process that imports
what update imports and loads nothing), which the plan does not count.

    python benchmarks/bench_fsdp_memory.py [--samples 8] [--size small] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_parallel import _stage
from benchmarks.common import parse_args, record

MiB = 1 << 20
# what a rank of `update` imports before it loads anything
IMPORTS = (
    "import torch, diffusers, transformers, accelerate, peft, torch.distributed.fsdp; "
    "from diffusers import StableDiffusion3Pipeline; from omnirl_cli.app import app; "
    "import stages.update.stage"
)


def _peak(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait(proc: subprocess.Popen) -> int:
    """The process's peak RSS in bytes (its own rusage); raises on failure."""
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(map(str, proc.args))} failed:\n{proc.stderr.read().decode()[-3000:]}")
    return usage.ru_maxrss * 1024  # KiB on Linux


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **extra}


def _update_args(p: dict[str, Path], out: Path, ranks: int) -> list[str]:
    return [
        sys.executable, "-m", "omnirl_cli", "update", "--model", str(p["model"]), "--in", str(p["samples"]),
        "--in", str(p["advantages"]), "--micro-batch", "1", "--samples-per-step", "2", "--no-shuffle", "--full", "--lr", "1e-5", "--out", str(out), "--json",
        *(("--strategy", "fsdp2") if ranks > 1 else ()),
    ]  # fmt: skip


def one_process(p: dict[str, Path], out: Path, **env: str) -> int:
    return _wait(_peak(_update_args(p, out, 1), _env(**env)))


def ranks(p: dict[str, Path], out: Path, world: int = 2) -> list[int]:
    """Each rank's peak RSS (bytes) of the FSDP2 update on `world` gloo ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank_env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
    procs = [
        _peak(
            _update_args(p, out, world),
            _env(**rank_env, MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r)),
        )
        for r in range(world)
    ]
    return [_wait(proc) for proc in procs]


def plan(model: Path, world: int, cpu: bool = False) -> int:
    """`omnirl plan`'s per-rank total for `update` (bytes) of the same run; with `cpu`, `plan --cpu`: the
    process's peak, its runtime included."""
    strategy = ("--strategy", "fsdp2") if world > 1 else ()
    strategy += ("--cpu",) if cpu else ()
    out = subprocess.run(
        [
            sys.executable, "-m", "omnirl_cli", "plan", "--model", str(model), "--full", "--resolution", "64",
            "--micro-batch", "1", "--num-processes", str(world), *strategy, "--json",
        ],
        check=True, capture_output=True, text=True, env=_env(),
    ).stdout  # fmt: skip
    return int(json.loads(out)["stages"]["update"]["total"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--size", default="small", help="size of the SD3 build (init-model --size)")
    args = parse_args(ap, smoke={"samples": 2, "size": "tiny"})
    with tempfile.TemporaryDirectory() as tmp:
        p = _stage(Path(tmp), args.samples, args.size)
        one = one_process(p, Path(tmp) / "one")
        pinned = one_process(p, Path(tmp) / "pinned", MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
        per_rank = ranks(p, Path(tmp) / "fsdp2")
        base = _wait(_peak([sys.executable, "-c", IMPORTS], _env()))
        planned = {1: plan(p["model"], 1), 2: plan(p["model"], 2)}
        process = {1: plan(p["model"], 1, cpu=True), 2: plan(p["model"], 2, cpu=True)}
    peak = max(per_rank)
    metrics = {
        "fsdp2_rank_peak_vs_one_process": peak / one,
        "fsdp2_rank_peak_vs_one_process_same_allocator": peak / pinned,
        "fsdp2_rank_peak_vs_one_process_net_of_imports": (peak - base) / (one - base),
        "plan_vs_measured_one_process_net_of_imports": planned[1] / (pinned - base),
        "plan_vs_measured_fsdp2_net_of_imports": planned[2] / (peak - base),
        # `plan --cpu` (runtime included) ÷ the process peaks, glibc's threshold pinned in both
        "plan_cpu_vs_measured_one_process": process[1] / pinned,
        "plan_cpu_vs_measured_fsdp2_rank": process[2] / peak,
        # what FSDP2 saves per rank, planned ÷ measured (same allocator); a tiny build saves nothing
        "plan_fsdp2_saving_vs_measured": (planned[1] - planned[2]) / (pinned - peak)
        if pinned > peak
        else None,
    }
    rows = [
        {"run": "1 process", "peak_MiB": one / MiB, "plan_MiB": planned[1] / MiB},
        {"run": "1 process, mmap threshold pinned", "peak_MiB": pinned / MiB, "plan_MiB": planned[1] / MiB},
        *(
            {"run": f"fsdp2 rank {r} of 2", "peak_MiB": b / MiB, "plan_MiB": planned[2] / MiB}
            for r, b in enumerate(per_rank)
        ),
        {"run": "imports only", "peak_MiB": base / MiB, "plan_MiB": None},
    ]
    for row in rows:
        print(row)
    for k, v in metrics.items():
        print(f"{k}: {v:.2f}" if v is not None else f"{k}: -")
    if not args.no_record:
        record("fsdp_memory", metrics, rows, description=(__doc__ or "").split("\n\n")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
