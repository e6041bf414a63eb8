"""Data-parallel `omnirl update` on gloo CPU ranks: step time of DDP and FSDP2 on 2 ranks ÷ one process
with the same global batch, and bf16 autocast ÷ fp32 in one process, for the record.

Data: one staged Flow-GRPO iteration of the `small` SD3 model (`--size`; `--samples` rollouts, the
demo's sampler settings, JPEG-compressibility reward, no replay: update trains on the rollout's
log-probs, as the recipe's REPLAY=auto does). Each run is `omnirl update` in its own process
(`torchrun --standalone --nproc_per_node 2` for the ranks, one torch thread per rank), one after another
in one run, LoRA (`--lora-rank 32`) or `--full`:

- every run: `--micro-batch 1 --samples-per-step 2`, so one process takes 2 micro-batches per optimizer
  step and each of 2 ranks takes 1 (the same micro-batches per step; each rank runs half of them).
- Step time: the median of the optimizer steps' times after the first (from `perf/samples_per_s` in
  metrics.jsonl); speed-up = 1-process step time ÷ 2-rank step time (2 is perfect on 2 free cores).
- Memory: rank 0's bytes of trained parameters and AdamW state (`memory/*` in the metrics).

    python benchmarks/bench_parallel.py [--samples 8] [--modes lora full] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sample import add_size_option, small_model
from benchmarks.common import parse_args, record

PROMPTS = ["a red circle", "two blue squares", "a green triangle on the left", "a cat", "a sign that says hi"]


def _omnirl(*args: str, ranks: int = 1) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    launch = [sys.executable, "-m", "omnirl_cli"]
    if ranks > 1:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        launch = [torchrun, "--standalone", "--nproc_per_node", str(ranks), "-m", "omnirl_cli"]
    subprocess.run([*launch, *args, "--json"], check=True, env=env, stdout=subprocess.DEVNULL)


def _stage(root: Path, samples: int, size: str) -> dict[str, Path]:
    p = {k: root / k for k in ("samples", "rewards", "advantages")}
    p["model"] = small_model(None, root, size=size)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[: max(1, samples // 2)]) + "\n")
    _omnirl(
        "sample", "--model", str(p["model"]), "--prompts", str(prompts), "--group-size", "2",
        "--steps", "4", "--resolution", "64", "--batch-size", "2", "--out", str(p["samples"]),
    )  # fmt: skip
    _omnirl(
        "score", "--in", str(p["samples"]), "--reward", "jpeg_compressibility", "--out", str(p["rewards"])
    )
    _omnirl("advantage", "--in", str(p["samples"]), "--in", str(p["rewards"]), "--out", str(p["advantages"]))
    return p


def _update(p: dict[str, Path], out: Path, mode: str, ranks: int, *extra: str) -> dict[str, float]:
    full = ("--full", "--lr", "1e-5") if mode == "full" else ("--lora-rank", "32", "--lora-alpha", "64")
    _omnirl(
        "update", "--model", str(p["model"]), "--in", str(p["samples"]), "--in", str(p["advantages"]),
        "--micro-batch", "1", "--samples-per-step", "2", "--no-shuffle",
        "--out", str(out), *full, *extra, ranks=ranks,
    )  # fmt: skip
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m["perf/time_per_step"] for m in metrics[1:]] or [metrics[0]["perf/time_per_step"]]
    last = metrics[-1]
    return {
        "step_s": statistics.median(steps),
        "param_MB": last["memory/param_bytes"] / 1e6,
        "optimizer_MB": last["memory/optimizer_bytes"] / 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=["lora", "full"])
    add_size_option(ap)
    args = parse_args(ap, smoke={"samples": 2, "modes": ["lora"], "size": "tiny"})
    rows, metrics = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        p = _stage(Path(tmp), args.samples, args.size)
        for mode in args.modes:
            one = _update(p, Path(tmp) / f"{mode}-one", mode, 1)
            runs = {
                "ddp": _update(p, Path(tmp) / f"{mode}-ddp", mode, 2, "--strategy", "ddp"),
                "fsdp2": _update(p, Path(tmp) / f"{mode}-fsdp2", mode, 2, "--strategy", "fsdp2"),
            }
            bf16 = _update(p, Path(tmp) / f"{mode}-bf16", mode, 1, "--mixed-precision", "bf16")
            rows.append({"mode": mode, "run": "1 process", **one, "speed-up": 1.0})
            for name, r in runs.items():
                rows.append(
                    {"mode": mode, "run": f"{name}, 2 ranks", **r, "speed-up": one["step_s"] / r["step_s"]}
                )
                metrics[f"{mode}_{name}_speedup"] = one["step_s"] / r["step_s"]
                metrics[f"{mode}_{name}_memory_ratio"] = (r["param_MB"] + r["optimizer_MB"]) / (
                    one["param_MB"] + one["optimizer_MB"]
                )
            rows.append(
                {
                    "mode": mode,
                    "run": "bf16 autocast, 1 process",
                    **bf16,
                    "speed-up": one["step_s"] / bf16["step_s"],
                }
            )
            metrics[f"{mode}_bf16_speedup"] = one["step_s"] / bf16["step_s"]
    for row in rows:
        print(row)
    if not args.no_record:
        record("parallel", metrics, rows, description=(__doc__ or "").split("\n\n")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
