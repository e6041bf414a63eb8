"""Online vs staged, and overlap: wall time per RL iteration of `omnirl online` ÷ the staged recipe.

One small Flow-GRPO preset (written to a temp dir) drives every run: the `small` SD3 model (`--size`),
64 px, 4 all-SDE steps, guidance 1 (no CFG), group 4 × 2 prompts = 8 samples per iteration in one batch
of 8, LoRA r8/α16, flow_grpo's clipped objective, `--reward jpeg_compressibility`. Every process
runs with OMP_NUM_THREADS=1 (and `omnirl online --threads 1`), so no side gets more cores than the
other by default and a 2-core machine can run two of them at once.

- staged: `make -f recipes/flow_grpo.mk ... ITERATIONS=N RUN/itN/policy/omnirl_adapter.json`, i.e.
  N iterations of sample → logprob → score → advantage → update (5 CLI processes each, serial make).
  The goal is the N-th policy rather than the default `all`, which also samples and scores that
  final policy: that evaluation is not part of the N training iterations, so it is left out (the
  per-stage times reported let one add it: about one sample + one score). It runs twice per repeat:
  REPLAY=yes (logprob replays every rollout) and REPLAY=auto (the recipe's default: these in-process
  rollouts cannot differ from a replay, so logprob loads no model and writes the sample ids only).
- online: `omnirl online --iterations N --max-staleness 0|1 --json` in one process launch: a
  sampler and a scorer worker feed the training driver.

Ratios (wall per iteration = total wall / N, start-up included):
- `ratio_staged_no_replay_vs_replay` = staged REPLAY=auto ÷ staged REPLAY=yes, reported (the share
  of an iteration the replay costs); `_logprob` the same for the logprob stage alone.
- `ratio_online_vs_staged` = online (staleness 0, the same computation as the recipe) ÷ staged
  (REPLAY=yes, as measured before REPLAY=auto existed), target <= 0.6; `_no_startup` uses the sum of the per-iteration `seconds` of the `--json` output
  (no driver start-up; iteration 0 still waits for the workers to load and sample), `_steady` the
  mean of iterations 1..N−1 (no start-up at all).
- `ratio_overlap` = online staleness 1 ÷ staleness 0, target <= 0.8; `_steady` likewise. With
  staleness 1 the sampler draws iteration k+1 while the driver trains on k, on the other core, so a
  steady iteration costs max(train, sample + score) instead of their sum; start-up and iteration 0
  (nothing to train yet) cannot overlap, which dilutes the whole-run ratio for small N.

The online runs alternate (order flipped each repeat), best of `--repeats` per quantity; the staged
run, which dominates the time, runs `--staged-repeats` times (default once; 0 measures the overlap
only, e.g. with more iterations). As a check that both sides do the same work, |Δ| of the
per-iteration reward means of staged and online (staleness 0) is recorded (`reward_mean_abs_diff`).

    python benchmarks/bench_online.py [--iterations 3] [--repeats 2] [--staged-repeats 1] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sample import add_size_option, small_model
from benchmarks.common import parse_args, record

ROOT = Path(__file__).resolve().parents[1]
REWARD = "jpeg_compressibility"
PROMPTS = (
    "a red apple on a wooden table",
    "a blue car in the rain",
    "a cat wearing a tiny hat",
    "a lighthouse on a cliff at dusk",
)
# The staged recipe's completion markers of one iteration k, in the order serial make builds them.
STAGES = (
    ("sample", "it{k}/samples/_manifest.json"),
    ("logprob", "it{k}/logprobs/_manifest.json"),
    ("score", "it{k}/rewards/_manifest.json"),
    ("advantage", "it{k}/advantages/_manifest.json"),
    ("update", "it{k1}/policy/omnirl_adapter.json"),
)


def preset_yaml(args: argparse.Namespace) -> str:
    """The benchmark's YAML preset (sample / advantage / update sections, as `recipes/configs`)."""
    return (
        f"sample:\n  steps: {args.steps}\n  guidance: 1.0\n  resolution: {args.resolution}\n  sampler: sde\n"
        f"  noise_level: 0.7\n  group_size: {args.group}\n  num_prompts: {args.num_prompts}\n"
        f"  batch_size: {args.batch}\n"
        "advantage:\n  estimator: grpo\n"
        f"update:\n  algo: flow_grpo\n  lr: 3.0e-4\n  clip_range: 1.0e-4\n  lora_rank: {args.lora_rank}\n"
        f"  lora_alpha: {2 * args.lora_rank}\n"
    )


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Run `cmd` from the repo root; (wall seconds, stdout). A failure stops the benchmark with its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def staged(
    omnirl: str, files: dict[str, Path], run_dir: Path, n: int, env: dict[str, str], replay: str = "yes"
) -> dict[str, Any]:
    """N staged iterations through make with REPLAY=`replay`; per-stage seconds from successive
    completion-marker times."""
    shutil.rmtree(run_dir, ignore_errors=True)
    goal = run_dir / f"it{n}" / "policy" / "omnirl_adapter.json"
    started = time.time()
    wall, _ = run(
        [
            "make",
            "-s",
            "-f",
            str(ROOT / "recipes" / "flow_grpo.mk"),
            f"OMNIRL={omnirl}",
            f"CONFIG={files['config']}",
            f"MODEL={files['model']}",
            f"PROMPTS={files['prompts']}",
            f"RUN={run_dir}",
            f"ITERATIONS={n}",
            f"REWARD=--reward {REWARD}",
            f"REPLAY={replay}",
            str(goal),
        ],
        env,
    )
    done = sorted(
        ((run_dir / path.format(k=k, k1=k + 1)).stat().st_mtime_ns / 1e9, name)
        for k in range(n)
        for name, path in STAGES
    )
    stage_s: dict[str, float] = dict.fromkeys((name for name, _ in STAGES), 0.0)
    previous = started
    for finished, name in done:
        stage_s[name] += (finished - previous) / n
        previous = finished
    return {
        "wall": wall,
        "per_iteration": wall / n,
        "stage_seconds_per_iteration": stage_s,
        "reward_means": [reward_mean(run_dir / f"it{k}" / "rewards") for k in range(n)],
    }


def reward_mean(rewards_dir: Path) -> float:
    """Mean `reward` of a one-shard rewards shard set, in float64."""
    import pyarrow.parquet as pq

    values = [
        v
        for shard in sorted(rewards_dir.glob("*.parquet"))
        for v in pq.read_table(shard).column("reward").to_pylist()
    ]
    return sum(values) / len(values)


def online(
    omnirl: str,
    files: dict[str, Path],
    out: Path,
    n: int,
    staleness: int,
    threads: int,
    env: dict[str, str],
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One `omnirl online` launch of N iterations from scratch (plus `extra` options); wall time and its
    `--json` per-iteration seconds."""
    shutil.rmtree(out, ignore_errors=True)
    wall, stdout = run(
        [
            omnirl,
            "online",
            "--config",
            str(files["config"]),
            "--model",
            str(files["model"]),
            "--prompts",
            str(files["prompts"]),
            "--reward",
            REWARD,
            "--iterations",
            str(n),
            "--out",
            str(out),
            "--max-staleness",
            str(staleness),
            "--threads",
            str(threads),
            "--json",
            *extra,
        ],
        env,
    )
    its = json.loads(stdout)["iterations"]
    seconds = [it["seconds"] for it in its]
    steady = seconds[1:] or seconds
    return {
        "wall": wall,
        "per_iteration": wall / n,
        "no_startup": sum(seconds) / n,
        "steady": sum(steady) / len(steady),
        "startup": wall - sum(seconds),
        "iteration_seconds": seconds,
        "waiting": [it["seconds_waiting"] for it in its],
        "training": [it["seconds_training"] for it in its],
        "policy_versions": [it["policy_versions"] for it in its],
        "version_gaps": [it["version_gaps"] for it in its],
        "reward_means": [it["reward_mean"] for it in its],
    }


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Best of repeats, per timing quantity (each its own minimum); lists come from the fastest run."""
    fastest = min(runs, key=lambda r: r["wall"])
    timed = ("wall", "per_iteration", "no_startup", "steady", "startup")
    return {**fastest, **{k: min(r[k] for r in runs) for k in timed if k in fastest}}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="SD3 pipeline folder (default: build `--size` in a temp dir)"
    )
    ap.add_argument(
        "--iterations", type=int, default=3, help="N: RL iterations per run (online needs >= 2 for steady)"
    )
    ap.add_argument(
        "--repeats", type=int, default=2, help="alternating launches of each online staleness (>= 1)"
    )
    ap.add_argument(
        "--staged-repeats",
        type=int,
        default=1,
        help="launches of the staged recipe (each REPLAY=yes and REPLAY=auto), about 40 s/iteration (0: overlap only)",
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts per iteration")
    ap.add_argument("--batch", type=int, default=8, help="sampling batch size")
    ap.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (alpha = 2 × rank)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads per process (OMP_NUM_THREADS and --threads)"
    )
    ap.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    add_size_option(ap)
    args = parse_args(
        ap,
        smoke={
            "iterations": 1,
            "repeats": 1,
            "steps": 2,
            "group": 2,
            "num_prompts": 1,
            "batch": 2,
            "lora_rank": 2,
            "size": "tiny",
        },
    )
    if args.repeats < 1 or args.iterations < 1:
        ap.error("--repeats and --iterations must be at least 1")
    omnirl = str(Path(sys.executable).with_name("omnirl"))
    if not Path(omnirl).is_file():
        omnirl = shutil.which("omnirl") or sys.exit("omnirl is not installed next to this python nor on PATH")
    n = args.iterations
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    metrics: dict[str, Any] = {
        "iterations": n,
        "steps": args.steps,
        "resolution": args.resolution,
        "group": args.group,
        "num_prompts": args.num_prompts,
        "batch": args.batch,
        "lora_rank": args.lora_rank,
        "threads": args.threads,
        "repeats": args.repeats,
        "staged_repeats": args.staged_repeats,
        "reward": REWARD,
        "load_average_before": os.getloadavg()[0],
    }
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="omnirl-bench-online-") as tmp_name:
        tmp = Path(tmp_name)
        files = {
            "model": small_model(args.model, tmp, size=args.size).resolve(),
            "config": tmp / "preset.yaml",
            "prompts": tmp / "prompts.txt",
        }
        files["config"].write_text(preset_yaml(args))
        files["prompts"].write_text("\n".join(PROMPTS) + "\n")
        staged_runs: list[dict[str, Any]] = []
        unreplayed_runs: list[dict[str, Any]] = []  # REPLAY=auto: no replay for these rollouts
        online_runs: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        for r in range(max(args.repeats, args.staged_repeats)):
            if r < args.staged_repeats:
                for replay in ("yes", "auto") if r % 2 == 0 else ("auto", "yes"):
                    runs = staged_runs if replay == "yes" else unreplayed_runs
                    runs.append(staged(omnirl, files, tmp / "staged", n, env, replay))
                    print(
                        f"staged REPLAY={replay}: {runs[-1]['per_iteration']:.1f} s/iteration "
                        f"{ {k: round(v, 1) for k, v in runs[-1]['stage_seconds_per_iteration'].items()} }",
                        flush=True,
                    )
            if r < args.repeats:
                for s in (0, 1) if r % 2 == 0 else (1, 0):
                    online_runs[s].append(online(omnirl, files, tmp / f"online{s}", n, s, args.threads, env))
                    o = online_runs[s][-1]
                    print(
                        f"online staleness {s}: {o['per_iteration']:.1f} s/iteration (steady {o['steady']:.1f}, "
                        f"start-up {o['startup']:.1f}) iterations {[round(x, 1) for x in o['iteration_seconds']]}",
                        flush=True,
                    )
    on = {s: best(runs) for s, runs in online_runs.items()}
    ratios = {
        "ratio_overlap": on[1]["per_iteration"] / on[0]["per_iteration"],
        "ratio_overlap_no_startup": on[1]["no_startup"] / on[0]["no_startup"],
        "ratio_overlap_steady": on[1]["steady"] / on[0]["steady"],
    }
    rows: list[dict[str, Any]] = []
    staged_text = "No staged run. "
    per_it = None
    if staged_runs:
        st = min(staged_runs, key=lambda r: r["wall"])
        per_it = st["per_iteration"]
        auto = min(unreplayed_runs, key=lambda r: r["wall"])
        ratios = {
            "ratio_staged_no_replay_vs_replay": auto["per_iteration"] / per_it,
            "ratio_staged_no_replay_vs_replay_logprob": auto["stage_seconds_per_iteration"]["logprob"]
            / st["stage_seconds_per_iteration"]["logprob"],
            "ratio_online_vs_staged": on[0]["per_iteration"] / per_it,
            "ratio_online_vs_staged_no_startup": on[0]["no_startup"] / per_it,
            "ratio_online_vs_staged_steady": on[0]["steady"] / per_it,
            "ratio_online1_vs_staged": on[1]["per_iteration"] / per_it,
            **ratios,
        }
        stage_s = st["stage_seconds_per_iteration"]
        metrics.update(
            staged=st,
            staged_runs=staged_runs,
            staged_no_replay=auto,
            staged_no_replay_runs=unreplayed_runs,
            staged_final_eval_estimate=stage_s["sample"] + stage_s["score"],
            reward_mean_abs_diff=[abs(a - b) for a, b in zip(st["reward_means"], on[0]["reward_means"])],
        )
        for name, result in ((f"staged make, {n} its", st), (f"staged make REPLAY=auto, {n} its", auto)):
            rows.append(
                {
                    "run": name,
                    "wall s": result["wall"],
                    "s/it": result["per_iteration"],
                    "÷ staged": result["per_iteration"] / per_it,
                    **{f"{k} s/it": v for k, v in result["stage_seconds_per_iteration"].items()},
                }
            )
        staged_text = (
            f"Staged = recipes/flow_grpo.mk up to it{n}/policy (final-policy sample+score left out, "
            f"≈ {metrics['staged_final_eval_estimate']:.1f} s), REPLAY=yes, {len(staged_runs)} run(s); "
            f"REPLAY=auto (no replay: in-process rollouts) ÷ REPLAY=yes = "
            f"{ratios['ratio_staged_no_replay_vs_replay']:.3f} per iteration (logprob stage "
            f"{ratios['ratio_staged_no_replay_vs_replay_logprob']:.3f}). online (staleness 0) ÷ "
            f"staged = {ratios['ratio_online_vs_staged']:.3f} with start-up (no driver start-up "
            f"{ratios['ratio_online_vs_staged_no_startup']:.3f}, steady {ratios['ratio_online_vs_staged_steady']:.3f}), "
            "target <= 0.6. "
        )
    metrics.update(
        ratios,
        online0=on[0],
        online1=on[1],
        online_runs=online_runs,
        seconds_total=time.perf_counter() - t_start,
        load_average_after=os.getloadavg()[0],
    )
    for s, o in on.items():
        rows.append(
            {
                "run": f"online staleness {s}, {n} its",
                "wall s": o["wall"],
                "s/it": o["per_iteration"],
                **({"÷ staged": o["per_iteration"] / per_it} if per_it else {}),
                "s/it no start-up": o["no_startup"],
                "s/it steady": o["steady"],
                "start-up s": o["startup"],
                "waiting s/it steady": mean(o["waiting"][1:] or o["waiting"]),
                "training s/it steady": mean(o["training"][1:] or o["training"]),
            }
        )
    for key, value in ratios.items():
        print(f"{key} = {value:.3f}", flush=True)
    print(f"total {metrics['seconds_total']:.0f} s", flush=True)
    if not args.no_record:
        path = record(
            "online",
            metrics,
            rows,
            description=(
                f"Wall per RL iteration, {n} iterations per launch, `{args.size}` SD3, {args.resolution} px, {args.steps} "
                f"SDE steps, guidance 1, group {args.group} × {args.num_prompts} prompts, batch {args.batch}, LoRA "
                f"r{args.lora_rank}, reward {REWARD}, OMP_NUM_THREADS={args.threads} for every process (online "
                f"--threads {args.threads}); online best of {args.repeats} alternating launches. {staged_text}"
                f"Overlap staleness 1 ÷ 0 = {ratios['ratio_overlap']:.3f} with start-up (steady "
                f"{ratios['ratio_overlap_steady']:.3f}), target <= 0.8. Load average "
                f"{metrics['load_average_before']:.1f} on {os.cpu_count()} CPUs."
            ),
        )
        print("recorded", path)


if __name__ == "__main__":
    main()
