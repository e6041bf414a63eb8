"""Update efficiency per model family: a `stages.update.trainer.Trainer` step ÷ a bare forward+backward of the
same transformer; with `--memory`, the peak memory of an update with and without activation
checkpointing instead.

For each family in `--families` (sd3, flux, qwen_image, z_image, wan2_1; default all; Wan 2.1 clips of
`--frames` frames), data: N real rollouts of
its `small` model (Flow-GRPO SDE sampler, a window of K stored steps, the family's recipe guidance as in
`bench_sample.STOCK_CALLS`: CFG for SD3, Qwen-Image and Z-Image, distilled for FLUX.1), old log-probs =
the rollout's, random per-sample advantages. Each (family, training mode) runs in its own subprocess
(so its peak RSS, VmHWM, is its own), one after another in one run, on a fixed number of threads:

- `lora`: a fresh rank-r LoRA on the family's default targets, as `omnirl update` adds it; `full`:
  every transformer weight trained.
- omnirl: a fresh `Trainer`'s `step` (flow_grpo loss, one epoch, micro-batch = the sampling batch): text encoding
  of the batch's prompts (new prompts every call, as in a fresh `omnirl update` process), per
  (micro-batch, stored step) the guided velocity, the SDE step's log-prob, the clipped loss, its
  backward and six metric `.item()`s, then grad-norm clipping, the finiteness check and an AdamW step.
- bare: the same trainable parameters, micro-batches and stored (x, σ): the family's guided velocity
  (`policy.family.velocity`: its CFG branches and combination) on precomputed text embeddings, an MSE
  to the stored next latent, backward; then the same AdamW step (no clipping). Both sides create their
  AdamW per call, as each `omnirl update` does.

Ratio = best omnirl time / best bare time for the same N × K (sample, stored step) pairs (target
<= 1.15), best of `--repeats` alternating calls after one warm-up call of each, and the load-robust
`ratio_pooled` (fastest transformer forward+backward time over both sides' calls plus each side's
fastest rest; see `bench_sample.pooled_ratio`); omnirl's warm-up
call comes first, so the worker's VmHWM right after it is the peak RSS of an update. The
breakdown of each side's best call times the transformer forward (hooks), `Tensor.backward`, the
sampler step, the loss, clipping, the optimizer step and text encoding; "other" is the rest.

With `--memory`, each (family, mode) runs one `Trainer` step (no bare side, no repeats) in two fresh
processes, `gradient_checkpointing` off and on (`omnirl update --gradient-checkpointing`: diffusers'
per-block checkpointing of every trained transformer). Measured on the CPU as peak RSS (VmHWM, the whole
process) after the update, and as the update's own increment: that peak less the VmHWM just before it
(model, rollouts and text embeddings loaded). Ratio = with ÷ without, of each; written to
`results/update_memory.json`.

    python benchmarks/bench_update.py [--families sd3,flux,qwen_image,z_image,wan2_1] [--samples 4]
        [--stored-steps 2] [--modes lora full] [--repeats 3] [--frames 9] [--memory]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bench_sample import (
    STOCK_CALLS,
    VIDEO_FAMILIES,
    Probes,
    add_family_options,
    pooled_ratio,
    small_model,
)
from benchmarks.common import parse_args, record

if TYPE_CHECKING:
    from stages.models.diffusion import FlowPolicy
    from stages.models.families import Condition
    from stages.sample.rollout import SampleConfig
    from stages.update.config import UpdateConfig

REGIONS = ("transformer_fwd", "backward", "step_math", "loss", "clip_grad", "optimizer", "text_encode")
RESULT = "RESULT "
TARGET = 1.15


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, MB: Linux's VmHWM, which starts afresh at exec, where
    `ru_maxrss` keeps the parent's peak across fork + exec (the parent has loaded every family's model);
    `ru_maxrss` (KiB) where there is no /proc."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_rollouts(
    model: Path, args: argparse.Namespace, guidance: float, frames: int, out: Path
) -> dict[str, Any]:
    """Sample `args.samples` trajectories (of `frames` frames) with omnirl's rollout and save the training
    columns to `out`."""
    from stages.models.diffusion import FlowPolicy
    from stages.sample.rollout import SampleConfig, rollout_batch

    window = 0 if args.stored_steps == args.steps else args.stored_steps
    cfg = SampleConfig(
        steps=args.steps,
        guidance=guidance,
        resolution=args.resolution,
        frames=frames,
        sampler="sde",
        window=window,
        seed=0,
        batch_size=args.micro_batch,
    )
    policy = FlowPolicy.load(model)
    prompts = [f"a red bicycle leaning on a blue door, sample {i}" for i in range(args.samples)]
    parts = []
    for start in range(0, args.samples, cfg.batch_size):
        idx = list(range(start, min(start + cfg.batch_size, args.samples)))
        parts.append(
            rollout_batch(
                policy,
                cfg,
                [prompts[i] for i in idx],
                [""] * len(idx),
                [7 + i for i in idx],
                [100 + i for i in idx],
                groups=idx,
                sample_ids=[str(i) for i in idx],
            )
        )
    log_probs = torch.cat([p["log_probs"] for p in parts])
    advantages = torch.randn(args.samples, 1, generator=torch.Generator().manual_seed(0)).expand_as(log_probs)
    data = {
        "prompt": prompts,
        "negative_prompt": [""] * args.samples,
        "latents": torch.cat([p["latents"] for p in parts]),
        "sigmas": torch.cat([p["sigmas"] for p in parts]),
        "log_probs": log_probs,
        "advantages": advantages.contiguous(),
    }
    torch.save(data, out)
    return cfg.record()


def bare_train(
    policy: FlowPolicy,
    data: dict[str, Any],
    cond: Condition,
    sample_cfg: SampleConfig,
    cfg: UpdateConfig,
    micro: int,
) -> None:
    """Forward + MSE + backward per (micro-batch, stored step) and one AdamW step per micro-batch."""
    params = policy.trainable_parameters(full=cfg.full)
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.adam_eps
    )
    latents, sigmas = data["latents"], data["sigmas"]
    n, k = latents.shape[0], latents.shape[1] - 1
    for start in range(0, n, micro):
        idx = torch.arange(start, min(start + micro, n))
        c = cond.select(idx)
        for j in range(k):
            x, target = latents[idx, j], latents[idx, j + 1]
            # the family's forward (CFG batch included) with nothing of omnirl's replay around it
            v = policy.family.velocity(policy.transformer, x, sigmas[idx, j], c, sample_cfg.guidance)
            ((v - target).pow(2).mean() / k).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Time one training mode (`args.worker`: lora or full) in this process; returns its measurements."""
    torch.set_num_threads(args.threads)
    from stages.models.diffusion import FlowPolicy
    from stages.sample import samplers
    from stages.sample.rollout import SampleConfig
    from stages.update import losses
    from stages.update.config import UpdateConfig
    from stages.update.trainer import Trainer

    full = args.worker == "full"
    sample_cfg = SampleConfig.from_record(json.loads(args.sample_config))
    cfg = UpdateConfig(
        full=full,
        lora_rank=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        micro_batch=args.micro_batch,
        gradient_checkpointing=args.checkpointing,
    )
    family, model = args.model[0]  # the one FAMILY=PATH main passes
    policy = FlowPolicy.load(model)
    if not full:
        policy.add_lora(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
    data = torch.load(args.data, weights_only=True)
    cond = policy.encode(
        data["prompt"],
        data["negative_prompt"],
        policy.needs_negative(sample_cfg.guidance),
        sample_cfg.max_sequence_length,
    )
    # as the `Trainer` sets it, so that bare's calls run the same CFG gradient path from the first one
    policy.family.detach_uncond = cfg.detach_uncond
    rss_loaded = peak_rss_mb()
    probes = Probes()
    calls = [0]

    def omnirl_call() -> list[dict[str, Any]]:
        calls[0] += 1
        fresh = [f"{p} (call {calls[0]})" for p in data["prompt"]]
        return Trainer.resume(policy, cfg, None).step({**data, "prompt": fresh}, sample_cfg)

    if args.memory:  # one update: its peak memory, and its loss to show both settings train alike
        metrics = omnirl_call()
        losses = [m.get("actor/pg_loss") for m in metrics]
        return {"rss_loaded_mb": rss_loaded, "rss_update_peak_mb": peak_rss_mb(), "losses": losses}

    def bare_call() -> None:
        bare_train(policy, data, cond, sample_cfg, cfg, args.micro_batch)

    sides = {"omnirl": omnirl_call, "bare": bare_call}
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    rss_update = None
    with ExitStack() as stack:
        stack.enter_context(probes.module(policy.transformer, "transformer_fwd"))
        for owner, attr, name in (
            (torch.Tensor, "backward", "backward"),
            (torch.nn.utils, "clip_grad_norm_", "clip_grad"),
            (torch.optim.AdamW, "step", "optimizer"),
            (policy, "encode", "text_encode"),
        ):
            stack.enter_context(probes.patch(owner, attr, name))
        # the sampler step and the loss are timed in whichever update module looks them up
        for fn, name in ((samplers.step, "step_math"), (losses.clipped_policy_loss, "loss")):
            for module in [m for n, m in sys.modules.items() if n.startswith("stages.update")]:
                for attr in [a for a, v in vars(module).items() if v is fn]:
                    stack.enter_context(probes.patch(module, attr, name))
        for side, fn in sides.items():
            fn()
            if side == "omnirl":
                rss_update = peak_rss_mb()
        for r in range(args.repeats):
            for side in list(sides) if r % 2 == 0 else list(reversed(sides)):
                probes.seconds.clear()
                t0 = time.perf_counter()
                sides[side]()
                total = time.perf_counter() - t0
                regions = {k: probes.seconds.get(k, 0.0) for k in REGIONS}
                runs[side].append({"total": total, **regions, "other": total - sum(regions.values())})
                print(
                    family,
                    args.worker,
                    side,
                    {k: round(v, 3) for k, v in runs[side][-1].items()},
                    file=sys.stderr,
                    flush=True,
                )
    trained = sum(p.numel() for p in policy.transformer.parameters() if p.requires_grad)
    return {
        "rss_loaded_mb": rss_loaded,
        "rss_update_peak_mb": rss_update,
        "trained_parameters": trained,
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_family_options(ap)
    ap.add_argument("--samples", type=int, default=4, help="N rollouts trained on")
    ap.add_argument(
        "--micro-batch", type=int, default=4, help="samples per forward (also the sampling batch)"
    )
    ap.add_argument("--steps", type=int, default=10, help="sampling steps")
    ap.add_argument("--stored-steps", type=int, default=2, help="K stored (trained) SDE steps per sample")
    ap.add_argument("--resolution", type=int, default=128)
    ap.add_argument("--frames", type=int, default=9, help="frames per clip of the video families (Wan: 4k+1)")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="measure the peak memory of one update with and without gradient checkpointing (no timing)",
    )
    ap.add_argument("--lora-rank", type=int, default=32, help="LoRA rank r (alpha = 2r, the default 32/64)")
    ap.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument(
        "--threads", type=int, default=2, help="torch intra-op threads (and OMP_NUM_THREADS), both sides"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    ap.add_argument("--worker", choices=["lora", "full"], help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--sample-config", help=argparse.SUPPRESS)
    ap.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(
        ap,
        smoke={
            "families": ["sd3", "wan2_1"],
            "modes": ["lora"],
            "samples": 1,
            "micro_batch": 1,
            "steps": 2,
            "stored_steps": 1,
            "resolution": 32,
            "frames": 5,
            "lora_rank": 2,
            "repeats": 1,
            "size": "tiny",
        },
    )
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    if args.worker:
        print(RESULT + json.dumps(worker(args)), flush=True)
        return

    torch.set_num_threads(args.threads)
    families: list[str] = args.families
    guidance = {f: STOCK_CALLS[f].guidance if args.guidance is None else args.guidance for f in families}
    metrics: dict[str, Any] = {
        "families": families,
        "guidance": guidance,
        **{
            k: getattr(args, k)
            for k in (
                "samples",
                "micro_batch",
                "steps",
                "stored_steps",
                "resolution",
                "frames",
                "lora_rank",
                "threads",
                "repeats",
            )
        },
    }
    metrics["load_average_before"] = os.getloadavg()[0]
    rows = []
    pairs = args.samples * args.stored_steps
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="omnirl-bench-") as tmp_name:
        tmp = Path(tmp_name)
        models = dict(args.model)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        for family in families:
            model = small_model(models.get(family), tmp, family, args.size)
            data = tmp / f"data-{family}.pt"
            frames = args.frames if family in VIDEO_FAMILIES else 1
            sample_cfg = make_rollouts(model, args, guidance[family], frames, data)
            metrics[family] = {}

            base = [
                sys.executable,
                __file__,
                "--model",
                f"{family}={model}",
                "--data",
                str(data),
                "--sample-config",
                json.dumps(sample_cfg),
                "--micro-batch",
                str(args.micro_batch),
                "--lora-rank",
                str(args.lora_rank),
                "--threads",
                str(args.threads),
                "--repeats",
                str(args.repeats),
            ]
            run_worker = partial(worker_process, base, env)
            for mode in args.modes:
                label = f"lora r{args.lora_rank}" if mode == "lora" else "full"
                if args.memory:
                    rows.append(memory_row(family, label, run_worker, mode, metrics[family]))
                    continue
                res = run_worker(mode)
                best = {side: min(rs, key=lambda b: b["total"]) for side, rs in res["runs"].items()}
                ratio = best["omnirl"]["total"] / best["bare"]["total"]
                pooled = pooled_ratio(res["runs"], "omnirl", "bare", ("transformer_fwd", "backward"))
                metrics[family][mode] = {**res, "best": best, "ratio": ratio, "ratio_pooled": pooled}
                for side, b in best.items():
                    rows.append(
                        {
                            "family": family,
                            "mode": label,
                            "side": side,
                            "s per sample-step": b["total"] / pairs,
                            "÷ bare": b["total"] / best["bare"]["total"],
                            "pooled ÷ bare": pooled if side == "omnirl" else 1.0,
                            "peak RSS MB": round(res["rss_update_peak_mb"]) if side == "omnirl" else "",
                            **{k: b[k] for k in (*REGIONS, "other")},
                        }
                    )
                print(
                    f"{family} {label}: omnirl / bare = {ratio:.3f} (pooled {pooled:.3f}; target <= {TARGET}); "
                    f"peak RSS {res['rss_update_peak_mb']:.0f} MB (after load {res['rss_loaded_mb']:.0f} MB), "
                    f"{res['trained_parameters']} trained parameters",
                    flush=True,
                )
    metrics["load_average_after"] = os.getloadavg()[0]
    if args.no_record:
        return
    scales = ", ".join(f"{f} {guidance[f]}" for f in families)
    setting = (
        f"each family's `{args.size}` model, {args.samples} samples × {args.stored_steps} stored steps, micro-batch "
        f"{args.micro_batch}, {args.resolution} px ({args.frames} frames per Wan clip), guidance ({scales}; CFG "
        f"except FLUX.1's distilled), {args.threads} threads"
    )
    load = f"load average {metrics['load_average_before']:.1f} on {os.cpu_count()} CPUs"
    if args.memory:
        path = record(
            "update_memory",
            metrics,
            rows,
            description=(
                f"Peak memory of one stages.update.trainer.Trainer step (flow_grpo) with and without activation "
                f"checkpointing (`--gradient-checkpointing`), {setting}; one fresh process per setting ({load}). "
                "CPU peak RSS = VmHWM of the whole process after the update; increment = that less the VmHWM "
                "before it (model and data loaded). Ratios: with ÷ without."
            ),
        )
    else:
        path = record(
            "update",
            metrics,
            rows,
            description=(
                f"a stages.update.trainer.Trainer step (flow_grpo) ÷ bare forward+MSE+backward of the same transformer and "
                f"the same AdamW step, {setting}; best of {args.repeats} alternating calls in one process per "
                f"(family, mode) ({load}). Target <= {TARGET}. Peak RSS = VmHWM of that process after one "
                "update. Columns after peak RSS: seconds of the best call per region; other = the rest."
            ),
        )
    print("recorded", path)


def worker_process(base: list[str], env: dict[str, str], mode: str, *extra: str) -> dict[str, Any]:
    """Run `base` (this script with a family's model and data) as a `mode` worker; its RESULT line."""
    cmd = [*base, "--worker", mode, *extra]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT))
    return json.loads(line[len(RESULT) :])


def memory_row(family: str, label: str, run_worker: Any, mode: str, out: dict[str, Any]) -> dict[str, Any]:
    """One update without and one with gradient checkpointing, each in a fresh worker; their peak RSS
    and increments (module docstring), also stored in `out[mode]`."""
    plain, ckpt = run_worker(mode, "--memory"), run_worker(mode, "--memory", "--checkpointing")
    inc = {k: r["rss_update_peak_mb"] - r["rss_loaded_mb"] for k, r in (("plain", plain), ("ckpt", ckpt))}
    peak_ratio = ckpt["rss_update_peak_mb"] / plain["rss_update_peak_mb"]
    inc_ratio = inc["ckpt"] / inc["plain"]
    out[mode] = {
        "plain": plain,
        "checkpointing": ckpt,
        "peak_ratio": peak_ratio,
        "increment_ratio": inc_ratio,
    }
    print(
        f"{family} {label}: peak RSS {plain['rss_update_peak_mb']:.0f} → {ckpt['rss_update_peak_mb']:.0f} MB "
        f"with checkpointing (× {peak_ratio:.3f}); the update's increment {inc['plain']:.0f} → "
        f"{inc['ckpt']:.0f} MB (× {inc_ratio:.3f}); losses {plain['losses']} / {ckpt['losses']}",
        flush=True,
    )
    return {
        "family": family,
        "mode": label,
        "peak RSS MB": round(plain["rss_update_peak_mb"]),
        "peak RSS MB, checkpointing": round(ckpt["rss_update_peak_mb"]),
        "peak ratio": peak_ratio,
        "increment MB": round(inc["plain"]),
        "increment MB, checkpointing": round(inc["ckpt"]),
        "increment ratio": inc_ratio,
    }


if __name__ == "__main__":
    main()
