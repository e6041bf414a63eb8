"""`omnirl plan`'s predicted peak ÷ the measured peak, per family (`small` builds; the VLMs, which have no
`small`, tiny) and stage: `sample`, `logprob`, `update` with LoRA and with `--full`, each command in a
fresh process.

Measured peak, on this CPU: the process's peak resident memory (`os.wait4`'s rusage of the child), with
glibc's allocator told to hand every block over 64 KiB straight back to the system
(`MALLOC_MMAP_THRESHOLD_=65536`). That is the CPU counterpart of the device figure the plan predicts on an
accelerator (`torch.accelerator.max_memory_allocated`: live tensors, not the allocator's cache); with
glibc's default the freed blocks it keeps for reuse add up to 1 GiB on the small SD3's update, which no
tensor holds. The plan is asked with `--cpu`, so its total includes the runtime the process itself
holds (interpreter, torch and the libraries). Each command is started through a bare interpreter
(`common.run_peak_rss`): Linux counts a child's peak from the memory of the process that forked it.

    .venv/bin/python benchmarks/bench_plan.py --families sd3,flux
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import parse_args, record, run_peak_rss  # noqa: E402

OMNIRL = [sys.executable, "-m", "omnirl_cli"]
MIB = 2**20
DIFFUSION = "sd3,flux,qwen_image,z_image,wan2_1,wan2_2_5b,wan2_2_a14b"
VLM = ("qwen2_5_vl", "qwen3_omni_thinker")  # built tiny: they have no small size
VLM_TOKENS = 32
PROMPTS = ["a red apple on a table", "a blue sky over hills"]
LORA_RANK = "32"
# An allocator that returns freed blocks to the system, so the resident peak counts live memory
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


def measured(args: list[str]) -> tuple[int, dict]:
    """(peak RSS bytes, --json result) of `omnirl ARGS --json` in a fresh process."""
    env = {**os.environ, **ENV, "PYTHONPATH": str(HERE.parent)}
    peak, proc = run_peak_rss([*OMNIRL, *args, "--json"], env=env, cwd=HERE.parent)
    if proc.returncode:
        raise SystemExit(f"omnirl {' '.join(args)} failed:\n{proc.stderr.decode()[-3000:]}")
    return peak, json.loads(proc.stdout)


def bench_family(family: str, size: str, root: Path, group: int, steps: int, stages: list[str]) -> list[dict]:
    model, prompts = root / "model", root / "prompts.txt"
    _, card = measured(["init-model", str(model), "--family", family, "--size", size])
    prompts.write_text("\n".join(PROMPTS) + "\n")
    resolution = str(card.get("details", {}).get("image_size") or 128)
    reward = "jpeg_compressibility@frames=mean" if family.startswith("wan") else "jpeg_compressibility"
    shared = ["--model", str(model)]
    samples, rewards, advantages = root / "samples", root / "rewards", root / "advantages"
    # a VLM generates up to VLM_TOKENS new tokens after a prompt cut to VLM_TOKENS; a diffusion family
    # draws images at its card's size
    sampling = ["--steps", str(steps), "--resolution", resolution]
    shape, algo = ["--resolution", resolution], ["--algo", "flow_grpo"]
    if family in VLM:
        algo = ["--algo", "grpo"]
        reward, tokens = "omnirl_length", str(VLM_TOKENS)
        sampling = ["--max-new-tokens", tokens, "--max-prompt-length", tokens]
        shape = ["--text-tokens", str(2 * VLM_TOKENS)]
    commands = {
        "sample": ["sample", *shared, "--prompts", str(prompts), "-n", str(group), *sampling,
                   "--batch-size", str(group), "--out", str(samples)],
        "logprob": ["logprob", *shared, "--in", str(samples), "--out", str(root / "logprobs")],
        "update": ["update", *shared, "--in", str(samples), "--in", str(advantages), *algo, "--lora-rank", LORA_RANK,
                   "--out", str(root / "update")],
        "update --full": ["update", *shared, "--in", str(samples), "--in", str(advantages), *algo, "--full",
                          "--out", str(root / "update-full")],
    }  # fmt: skip
    plan = ["plan", *shared, "--cpu", *shape, "--batch-size", str(group)]
    predicted = {
        lora: measured([*plan, *(["--full"] if lora == "full" else ["--lora-rank", LORA_RANK])])[1]["stages"]
        for lora in ("lora", "full")
    }
    rows = []
    for stage in ("sample", "logprob", "update", "update --full"):
        if stage == "sample" or stage in stages:
            peak, _ = measured(commands[stage])
        if stage == "sample" and any(s.startswith("update") for s in stages):
            measured(["score", "--in", str(samples), "--reward", reward, "--out", str(rewards)])
            measured(["advantage", "--in", str(samples), "--in", str(rewards), "--out", str(advantages)])
        if stage not in stages:
            continue
        column = "update" if stage.startswith("update") else stage
        total = predicted["full" if stage.endswith("--full") else "lora"][column]["total"]
        rows.append(
            {
                "family": family,
                "stage": stage,
                "predicted MiB": round(total / MIB),
                "measured MiB": round(peak / MIB),
                "predicted ÷ measured": round(total / peak, 3),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families", default=DIFFUSION, help="comma-separated (default: every diffusion family)"
    )
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", default="sample,logprob,update,update --full")
    parser.add_argument(
        "--group", type=int, default=4, help="samples per prompt (2 prompts), the sampling batch"
    )
    parser.add_argument("--steps", type=int, default=2)
    args = parse_args(parser, smoke={"families": "sd3", "size": "tiny", "stages": "logprob", "group": 2})
    stages = args.stages.split(",")
    rows = []
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench-plan-{family}-") as tmp:
            size = "tiny" if family in VLM else args.size
            rows += bench_family(family, size, Path(tmp), args.group, args.steps, stages)
    ratios = [r["predicted ÷ measured"] for r in rows]
    metrics = {"rows": rows, "ratio_min": min(ratios), "ratio_max": max(ratios)}
    print(json.dumps(metrics, indent=2))
    if not args.no_record:
        record(
            "plan",
            metrics,
            rows,
            description=(
                f"`omnirl plan --cpu` predicted peak ÷ the measured peak of each command in a fresh process "
                f"({args.size} builds; 2 prompts × {args.group}, sampling batch {args.group}, {args.steps} SDE "
                f"steps, update flow_grpo (VLMs: grpo, {VLM_TOKENS} prompt + {VLM_TOKENS} new tokens) LoRA r{LORA_RANK} or --full, "
                "fp32, micro-batch = the sampling batch). "
                "Measured: the process's peak RSS (os.wait4) under MALLOC_MMAP_THRESHOLD_=65536, so glibc "
                "returns freed blocks as a device allocator's max_memory_allocated ignores its cache."
            ),
        )


if __name__ == "__main__":
    main()
