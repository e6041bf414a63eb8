"""Stored prompt conditioning: `omnirl logprob` and `omnirl update` on a rollout that stores it (no text
encoder, tokenizer or VAE loaded) ÷ the same commands on a copy without it (today's path: the encoders
load and re-encode every prompt), per family on its `small` build.

Each command runs in a fresh process, alternating the two settings; wall time is the best of --repeats,
peak memory the process's max RSS (`common.run_peak_rss`). The two replays are checked equal
first (|Δlogp| 0 on both).

    .venv/bin/python benchmarks/bench_conditioning.py --families sd3 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import parse_args, record, run_peak_rss  # noqa: E402

OMNIRL = [sys.executable, "-m", "omnirl_cli"]
PROMPTS = ["a red apple on a table", 'a sign that says "hello"', "a blue sky over hills", "a cat"]


def measured(args: list[str], source: Path | None = None) -> tuple[float, int, dict]:
    """(wall seconds, peak RSS bytes, --json result) of `omnirl ARGS --json` in a fresh process, importing
    omnirl from `source` (a checkout) when given. The peak is `common.run_peak_rss`'s: the command is
    started by a bare interpreter, so it does not inherit this process's memory (the built model)."""
    source = source or HERE.parent  # `python -m` imports from its working directory first
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(source)}
    t0 = time.perf_counter()
    peak, proc = run_peak_rss([*OMNIRL, *args, "--json"], env=env, cwd=source)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"omnirl {' '.join(args)} failed:\n{proc.stderr.decode()[-3000:]}")
    return wall, peak, json.loads(proc.stdout)


def run(args: list[str]) -> dict:
    return measured(args)[2]


def without_conditioning(samples: Path, out: Path) -> Path:
    shutil.copytree(samples, out, ignore=shutil.ignore_patterns("conditioning-*"))
    manifest = json.loads((out / "_manifest.json").read_text())
    del manifest["extra"]["conditioning"]
    (out / "_manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def bench_family(
    family: str, size: str, root: Path, repeats: int, group: int, steps: int, today: Path | None
) -> dict:
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
    # variant → (rollout, checkout it imports omnirl from: None = this one)
    variants: dict[str, tuple[str, Path | None]] = {"stored": ("stored", None), "encoded": ("plain", None)}
    if today is not None:
        variants["today"] = ("plain", today)
    found: dict[str, dict[str, list]] = {}
    for r in range(repeats):
        for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
            kind, source = variants[name]
            for stage in ("logprob", "update"):
                out = root / f"{name}-{stage}-{r}"
                if stage == "logprob":
                    args = ["logprob", "--model", str(model), "--in", str(root / kind), "--out", str(out)]
                else:
                    args = ["update", "--model", str(model), "--in", str(root / kind), "--in",
                            str(root / f"{kind}-a"), "--lora-rank", "32", "--out", str(out)]  # fmt: skip
                wall, rss, result = measured(args, source)
                if stage == "logprob" and result["abs_delta_max"] != 0.0:
                    raise SystemExit(f"{name} replay is not exact: {result['abs_delta_max']}")
                entry = found.setdefault(f"{stage}/{name}", {"wall": [], "rss": []})
                entry["wall"].append(wall)
                entry["rss"].append(rss)
                entry["loaded"] = result.get("loaded_components", "all (not reported)")
    metrics: dict = {}
    for stage in ("logprob", "update"):
        got = {name: found[f"{stage}/{name}"] for name in variants}
        metrics[stage] = {
            "wall_s": {name: min(g["wall"]) for name, g in got.items()},
            "peak_rss_mib": {name: max(g["rss"]) / 2**20 for name, g in got.items()},
            "loaded_components": {name: g["loaded"] for name, g in got.items()},
        }
        for name in variants:
            if name != "stored":
                metrics[stage][f"wall_ratio_vs_{name}"] = min(got["stored"]["wall"]) / min(got[name]["wall"])
                metrics[stage][f"peak_rss_ratio_vs_{name}"] = max(got["stored"]["rss"]) / max(
                    got[name]["rss"]
                )
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="sd3")
    parser.add_argument("--size", default="small")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (4 prompts)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--today",
        type=Path,
        help="a checkout of omnirl before stored conditioning (`git worktree add /tmp/old <commit>`): also "
        "measures its logprob and update (everything loaded, prompts encoded)",
    )
    args = parse_args(parser, smoke={"size": "tiny", "repeats": 1, "group": 2, "steps": 2})
    metrics, rows = {}, []
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench-cond-{family}-") as tmp:
            metrics[family] = bench_family(
                family, args.size, Path(tmp), args.repeats, args.group, args.steps, args.today
            )
        for stage, m in metrics[family].items():
            names = list(m["wall_s"])
            row = {"family": family, "stage": stage}
            for name in names[1:]:
                row[f"peak RSS stored ÷ {name}"] = round(m[f"peak_rss_ratio_vs_{name}"], 3)
                row[f"wall stored ÷ {name}"] = round(m[f"wall_ratio_vs_{name}"], 3)
            row[f"peak MiB ({' / '.join(names)})"] = " / ".join(f"{m['peak_rss_mib'][n]:.0f}" for n in names)
            row[f"wall s ({' / '.join(names)})"] = " / ".join(f"{m['wall_s'][n]:.1f}" for n in names)
            rows.append(row)
    print(json.dumps(metrics, indent=2))
    if not args.no_record:
        record(
            "conditioning",
            metrics,
            rows,
            description=(
                f"`omnirl logprob` and `omnirl update` (flow_grpo, LoRA r32) on a {args.size} rollout of 4 prompts × "
                f"{args.group}, {args.steps} SDE steps, with stored conditioning (no text encoder, tokenizer or VAE "
                "loaded) ÷ the same rollout without it (encoders loaded, prompts re-encoded) and, with --today, ÷ "
                "omnirl before stored conditioning (text encoders and VAE loaded). Fresh process per "
                f"call, best wall of {args.repeats}, peak = the process's max RSS (os.wait4)."
            ),
        )


if __name__ == "__main__":
    main()
