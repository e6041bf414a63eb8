"""Stored prompt conditioning: `omnirl logprob` and `omnirl update` on a rollout that stores it (no text
encoder, tokenizer or VAE loaded) ÷ the same commands on a copy without it (today's path: the encoders
load and re-encode every prompt), per family on its `small` build.

Each command runs in a fresh process, alternating the two settings; wall time is the best of --repeats,
peak memory the process's max RSS (`os.wait4`'s rusage of that child). The two replays are checked equal
first (|Δlogp| 0 on both).

    .venv/bin/python benchmarks/bench_conditioning.py --families sd3 --repeats 2
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import record  # noqa: E402

OMNIRL = [sys.executable, "-m", "omnirl_cli"]
PROMPTS = ["a red apple on a table", 'a sign that says "hello"', "a blue sky over hills", "a cat"]


def measured(args: list[str]) -> tuple[float, int, dict]:
    """(wall seconds, peak RSS bytes, --json result) of `omnirl ARGS --json` in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([*OMNIRL, *args, "--json"], stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: ru_maxrss in KiB (Linux)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise SystemExit(f"omnirl {' '.join(args)} failed:\n{err.read().decode()[-3000:]}")
        return wall, usage.ru_maxrss * 1024, json.loads(out.read())


def run(args: list[str]) -> dict:
    return measured(args)[2]


def without_conditioning(samples: Path, out: Path) -> Path:
    shutil.copytree(samples, out, ignore=shutil.ignore_patterns("conditioning-*"))
    manifest = json.loads((out / "_manifest.json").read_text())
    del manifest["extra"]["conditioning"]
    (out / "_manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def bench_family(family: str, size: str, root: Path, repeats: int, group: int, steps: int) -> dict:
    from stages.models.factory import init_model

    model = root / "model"
    card = init_model(family, model, size=size, seed=0)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    resolution = str(card.get("details", {}).get("image_size") or 128)
    run(
        ["sample", "--model", str(model), "--prompts", str(prompts), "-n", str(group), "--steps", str(steps),
         "--resolution", resolution, "--batch-size", str(group), "--out", str(root / "stored")]
    )  # fmt: skip
    without_conditioning(root / "stored", root / "plain")
    for kind in ("stored", "plain"):
        run(
            [
                "score",
                "--in",
                str(root / kind),
                "--reward",
                "jpeg_compressibility",
                "--out",
                str(root / f"{kind}-r"),
            ]
        )
        run(
            [
                "advantage",
                "--in",
                str(root / kind),
                "--in",
                str(root / f"{kind}-r"),
                "--out",
                str(root / f"{kind}-a"),
            ]
        )
    found: dict[str, dict[str, list]] = {}
    for r in range(repeats):
        for kind in ("stored", "plain") if r % 2 == 0 else ("plain", "stored"):
            for stage in ("logprob", "update"):
                out = root / f"{kind}-{stage}-{r}"
                if stage == "logprob":
                    args = ["logprob", "--model", str(model), "--in", str(root / kind), "--out", str(out)]
                else:
                    args = ["update", "--model", str(model), "--in", str(root / kind), "--in",
                            str(root / f"{kind}-a"), "--lora-rank", "32", "--out", str(out)]  # fmt: skip
                wall, rss, result = measured(args)
                if stage == "logprob" and result["abs_delta_max"] != 0.0:
                    raise SystemExit(f"{kind} replay is not exact: {result['abs_delta_max']}")
                entry = found.setdefault(f"{stage}/{kind}", {"wall": [], "rss": [], "loaded": []})
                entry["wall"].append(wall)
                entry["rss"].append(rss)
                entry["loaded"] = result["loaded_components"]
    metrics: dict = {}
    for stage in ("logprob", "update"):
        s, p = found[f"{stage}/stored"], found[f"{stage}/plain"]
        metrics[stage] = {
            "wall_s": {"stored": min(s["wall"]), "plain": min(p["wall"])},
            "peak_rss_mib": {"stored": max(s["rss"]) / 2**20, "plain": max(p["rss"]) / 2**20},
            "wall_ratio": min(s["wall"]) / min(p["wall"]),
            "peak_rss_ratio": max(s["rss"]) / max(p["rss"]),
            "loaded_components": {"stored": s["loaded"], "plain": p["loaded"]},
        }
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="sd3")
    parser.add_argument("--size", default="small")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (4 prompts)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-record", action="store_true", help="print only; write no results file")
    args = parser.parse_args()
    metrics, rows = {}, []
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench-cond-{family}-") as tmp:
            metrics[family] = bench_family(family, args.size, Path(tmp), args.repeats, args.group, args.steps)
        for stage, m in metrics[family].items():
            rows.append(
                {
                    "family": family,
                    "stage": stage,
                    "peak RSS stored ÷ encoded": round(m["peak_rss_ratio"], 3),
                    "wall stored ÷ encoded": round(m["wall_ratio"], 3),
                    "peak MiB (stored / encoded)": f"{m['peak_rss_mib']['stored']:.0f} / {m['peak_rss_mib']['plain']:.0f}",
                    "wall s (stored / encoded)": f"{m['wall_s']['stored']:.2f} / {m['wall_s']['plain']:.2f}",
                }
            )
    print(json.dumps(metrics, indent=2))
    if not args.no_record:
        record(
            "conditioning",
            metrics,
            rows,
            description=(
                f"`omnirl logprob` and `omnirl update` (flow_grpo, LoRA r32) on a {args.size} rollout of 4 prompts × "
                f"{args.group}, {args.steps} SDE steps, with stored conditioning (no text encoder, tokenizer or VAE "
                "loaded) ÷ the same rollout without it (encoders loaded, prompts re-encoded). Fresh process per "
                f"call, best wall of {args.repeats}, peak = the process's max RSS (os.wait4)."
            ),
        )


if __name__ == "__main__":
    main()
