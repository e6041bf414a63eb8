"""Sampling overhead: omnirl's `sample` stage ÷ diffusers' own `StableDiffusion3Pipeline.__call__`.

Both sides use one `small` SD3 pipeline loaded once in this process (53M parameters, random
weights), the same B prompts (with empty negatives), steps, resolution, guidance (CFG: the
transformer sees 2B rows a step) and `max_sequence_length`, on a fixed number of torch threads:

- diffusers: `pipe(prompt=..., num_inference_steps=..., guidance_scale=..., output_type="pil")`,
  the Euler ODE sampler, PIL images in memory.
- omnirl: what `omnirl sample` runs after start-up: a `ShardSetWriter`, `run_sample` (Flow-GRPO
  SDE steps with per-sample noise and log-probs, stored latents, PNG encoding, one fsync'd shard)
  and `finalize`.

Each repeat uses new prompts, so omnirl's prompt cache never spares it the text encoding diffusers
does on every call. The sides alternate (order flipped every repeat) after a two-step warm-up of
each; the ratio is best omnirl time / best diffusers time (target <= 1.10). On a loaded machine the
transformer's time swings by several x between runs, so `ratio_pooled` is also reported: both sides
run the same transformer calls, so it takes their fastest transformer time over all runs plus each
side's fastest remaining time (see `pooled_ratio`). A breakdown of each side's best run times the
transformer (forward hooks), the sampler step math, text encoding, VAE decoding, conversion to PIL,
PNG encoding and the shard write; "other" is the rest.

    python benchmarks/bench_sample.py [--batch 4] [--steps 10] [--resolution 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import record

REGIONS = ("transformer", "step_math", "text_encode", "vae_decode", "to_pil", "png", "shard_write")


def small_model(model: str | None, scratch: Path) -> Path:
    """`model` if given, else a fresh `small` SD3 folder (seed 0) built under `scratch`."""
    if model:
        return Path(model)
    from stages.models.factory import init_model

    out = scratch / "sd3-small"
    init_model("sd3", out, size="small", seed=0)
    return out


class Probes:
    """Seconds spent per named region during one timed call; regions must not nest."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._started: dict[str, float] = {}

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        return wrapper

    @contextmanager
    def patch(self, owner: Any, attr: str, name: str) -> Iterator[None]:
        """Time every call of `owner.attr` (a module function or an instance's method) as `name`."""
        original = getattr(owner, attr)
        own = attr in vars(owner)
        setattr(owner, attr, self.timed(name, original))
        try:
            yield
        finally:
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)

    @contextmanager
    def module(self, module: torch.nn.Module, name: str) -> Iterator[None]:
        """Time every forward of `module` as `name` with hooks."""

        def pre(*_: Any) -> None:
            self._started[name] = time.perf_counter()

        def post(*_: Any) -> None:
            self.seconds[name] += time.perf_counter() - self._started.pop(name)

        handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def breakdown(self, total: float) -> dict[str, float]:
        regions = {k: self.seconds.get(k, 0.0) for k in REGIONS}
        return {"total": total, **regions, "other": total - sum(regions.values())}


def pooled_ratio(
    runs: dict[str, list[dict[str, float]]], side: str, reference: str, shared: tuple[str, ...]
) -> float:
    """A load-robust ratio: (S + own_side) / (S + own_reference).

    Both sides run the same `shared` regions (the transformer, on the same shapes the same number of
    times), so S is their fastest total over every run of both sides, and own_x the fastest rest of x.
    """

    def core(b: dict[str, float]) -> float:
        return sum(b[k] for k in shared)

    s = min(core(b) for rs in runs.values() for b in rs)
    own = {k: min(b["total"] - core(b) for b in runs[k]) for k in (side, reference)}
    return (s + own[side]) / (s + own[reference])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="SD3 pipeline folder (default: build `small` in a temp dir)"
    )
    ap.add_argument(
        "--batch", type=int, default=4, help="images per call (B; the transformer sees 2B with CFG)"
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--resolution", type=int, default=128)
    ap.add_argument("--guidance", type=float, default=4.5)
    ap.add_argument("--max-sequence-length", type=int, default=128)
    ap.add_argument(
        "--sde-window", type=int, default=0, help="omnirl's stored SDE steps (0: all, as Flow-GRPO)"
    )
    ap.add_argument("--format", default="parquet", choices=["parquet", "webdataset"])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    ap.add_argument("--no-record", action="store_true", help="print only, do not write benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as transformers_logging

    from stages.models.diffusion import FlowPolicy
    from stages.sample import rollout
    from stages.sample.prompts import Prompt
    from stages.sample.rollout import SampleConfig
    from stages.sample.stage import KINDS, run_sample
    from stages.shards.writer import ShardSetWriter

    transformers_logging.disable_progress_bar()
    metrics: dict[str, Any] = {
        "batch": args.batch,
        "steps": args.steps,
        "resolution": args.resolution,
        "guidance": args.guidance,
        "max_sequence_length": args.max_sequence_length,
        "sde_window": args.sde_window,
        "format": args.format,
        "threads": args.threads,
        "repeats": args.repeats,
        "load_average_before": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="omnirl-bench-") as tmp_name:
        tmp = Path(tmp_name)
        policy = FlowPolicy.load(small_model(args.model, tmp))
        pipe = policy.pipe
        probes = Probes()

        def prompts_for(tag: str) -> list[str]:
            return [f"a watercolor lighthouse on a cliff at dusk, take {tag}.{i}" for i in range(args.batch)]

        def diffusers_call(texts: list[str], steps: int) -> None:
            pipe(
                prompt=texts,
                num_inference_steps=steps,
                guidance_scale=args.guidance,
                height=args.resolution,
                width=args.resolution,
                max_sequence_length=args.max_sequence_length,
                output_type="pil",
                generator=[torch.Generator().manual_seed(1000 + i) for i in range(len(texts))],
            )

        def omnirl_call(texts: list[str], steps: int) -> None:
            cfg = SampleConfig(
                steps=steps,
                guidance=args.guidance,
                resolution=args.resolution,
                sampler="sde",
                window=min(args.sde_window, steps),
                seed=0,
                batch_size=args.batch,
                max_sequence_length=args.max_sequence_length,
            )
            out = tmp / "samples"
            if out.exists():
                shutil.rmtree(out)
            writer = ShardSetWriter(
                out, num_shards=1, format=args.format, command="sample", config=asdict(cfg), kinds=KINDS
            )
            with ExitStack() as stack:
                stack.enter_context(probes.patch(writer, "write_shard", "shard_write"))
                stack.enter_context(probes.patch(writer, "finalize", "shard_write"))
                run_sample(
                    policy,
                    cfg,
                    [(i, Prompt(t)) for i, t in enumerate(texts)],
                    1,
                    writer,
                    num_shards=1,
                    shard_indices=[0],
                )
                writer.finalize(extra={"sample_config": asdict(cfg)})

        sides = {"diffusers": diffusers_call, "omnirl": omnirl_call}
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
        with ExitStack() as stack:
            stack.enter_context(probes.module(pipe.transformer, "transformer"))
            for owner, attr, name in (
                (pipe, "encode_prompt", "text_encode"),
                (pipe.vae, "decode", "vae_decode"),
                (pipe.image_processor, "postprocess", "to_pil"),
                (pipe.scheduler, "step", "step_math"),
                (rollout, "step", "step_math"),
                (rollout, "png_bytes", "png"),
            ):
                stack.enter_context(probes.patch(owner, attr, name))
            for side, fn in sides.items():
                fn(prompts_for(f"warm-{side}"), 2)
            for r in range(args.repeats):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for side in order:
                    probes.seconds.clear()
                    t0 = time.perf_counter()
                    sides[side](prompts_for(str(r)), args.steps)
                    runs[side].append(probes.breakdown(time.perf_counter() - t0))
                    print(side, {k: round(v, 3) for k, v in runs[side][-1].items()}, flush=True)

    best = {side: min(rs, key=lambda b: b["total"]) for side, rs in runs.items()}
    ratio = best["omnirl"]["total"] / best["diffusers"]["total"]
    pooled = pooled_ratio(runs, "omnirl", "diffusers", ("transformer",))
    metrics.update(
        ratio=ratio, ratio_pooled=pooled, best=best, runs=runs, load_average_after=os.getloadavg()[0]
    )
    rows = [
        {
            "path": side,
            "seconds": b["total"],
            "÷ diffusers": b["total"] / best["diffusers"]["total"],
            "images/s": args.batch / b["total"],
            **{k: b[k] for k in (*REGIONS, "other")},
        }
        for side, b in best.items()
    ]
    print(f"ratio omnirl / diffusers = {ratio:.3f} (pooled {pooled:.3f}; target <= 1.10)", flush=True)
    if not args.no_record:
        path = record(
            "sample",
            metrics,
            rows,
            description=(
                f"omnirl `sample` (writer + run_sample + finalize: SDE with log-probs, PNG, {args.format} shard) ÷ "
                f"diffusers StableDiffusion3Pipeline.__call__, same `small` model, {args.batch} prompts, "
                f"{args.steps} steps, {args.resolution} px, guidance {args.guidance}, max_sequence_length "
                f"{args.max_sequence_length}, {args.threads} threads; best of {args.repeats} alternating runs "
                f"(load average {metrics['load_average_before']:.1f} on {os.cpu_count()} CPUs). Target <= 1.10. "
                f"Pooled ratio (fastest shared transformer time + each side's fastest rest): {pooled:.3f}. "
                "Columns after images/s: seconds of each side's best run per region; other = the rest."
            ),
        )
        print("recorded", path)


if __name__ == "__main__":
    main()
