"""Sampling overhead per model family: omnirl's `sample` stage ÷ the family's stock diffusers pipeline call.

For each family in `--families` (sd3, flux, qwen_image, z_image, wan2_1; default all) a `small` pipeline
(random weights, 128 px; Wan 2.1 clips of `--frames` frames) is loaded once in this process, and both sides use it with the same B prompts (empty
negatives), steps, resolution, guidance and `max_sequence_length`, on a fixed number of torch threads:

- diffusers: `pipe(prompt=..., num_inference_steps=..., <guidance>, output_type="pil")`, the Euler ODE
  sampler, PIL images in memory. Each stock pipeline takes the guidance its own way (`STOCK_CALLS`):
  SD3 `guidance_scale` > 1 is CFG (2B rows a step); FLUX.1's `guidance_scale` is distilled guidance (a
  model input, one forward); Qwen-Image needs `true_cfg_scale` and a negative prompt for true CFG (two
  forwards a step); Z-Image's `guidance_scale` w > 0 is CFG (2B rows). Each family's default scale is
  its Flow-GRPO recipe's (recipes/configs/flow_grpo_<family>.yaml).
- omnirl: what `omnirl sample` runs after start-up: a `ShardSetWriter` on a new output folder,
  `run_sample` (Flow-GRPO SDE steps with per-sample noise and log-probs, stored latents, PNG encoding,
  or for Wan the MP4 encoding of each clip, one fsync'd shard) and `finalize`.

Each repeat uses new prompts, so omnirl's prompt cache never spares it the text encoding diffusers
does on every call. After a two-step warm-up of every (family, side), each repeat runs every family's
two sides back to back, the order flipped every repeat; a family's ratio is its best omnirl time / its
best diffusers time (target <= 1.05). On a loaded machine the transformer's time swings by several x
between runs, so `ratio_pooled` is also reported: both sides run the same transformer calls, so it
takes their fastest transformer time over all runs plus each side's fastest remaining time (see
`pooled_ratio`); for Wan 2.1 the text encoding, VAE decoding and conversion to PIL are the same calls
on both sides too (`StockCall.shared`) and are pooled with it, so what differs is each side's own
work: omnirl's SDE step math with log-probs, MP4 encoding, shard write and glue; diffusers' Euler
steps and glue. A breakdown of each side's best run times the transformer (forward hooks), the
sampler step math, text encoding, VAE decoding, conversion to PIL, PNG encoding and the shard write;
"other" is the rest.

    python benchmarks/bench_sample.py [--families sd3,flux,qwen_image,z_image,wan2_1] [--batch 4]
        [--steps 10] [--resolution 128] [--frames 9] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import parse_args, record

REGIONS = ("transformer", "step_math", "text_encode", "vae_decode", "to_pil", "png", "mp4", "shard_write")
TARGET = 1.05


@dataclass(frozen=True)
class StockCall:
    """How a family's stock diffusers pipeline is called at the guidance omnirl samples with."""

    guidance: float  # the family's Flow-GRPO recipe scale (recipes/configs/flow_grpo_<family>.yaml)
    argument: str  # the `__call__` argument that takes it
    negative: bool  # guidance runs only when a negative prompt is passed
    # regions (`REGIONS`) where both sides make the same calls on the same inputs, pooled by `pooled_ratio`
    shared: tuple[str, ...] = ("transformer",)

    def kwargs(self, guidance: float, batch: int) -> dict[str, Any]:
        """The guidance arguments of one call of `batch` prompts (empty negatives, as omnirl's)."""
        return {self.argument: guidance, **({"negative_prompt": [""] * batch} if self.negative else {})}


STOCK_CALLS: dict[str, StockCall] = {
    # CFG for guidance > 1, both branches in one 2B batch; negatives default to "".
    "sd3": StockCall(4.5, "guidance_scale", negative=False),
    # Distilled guidance: the scale is a model input, one conditional forward a step.
    "flux": StockCall(3.5, "guidance_scale", negative=False),
    # True CFG (two forwards a step, norm-rescaled) needs true_cfg_scale > 1 and a negative prompt;
    # its `guidance_scale` is for guidance-distilled checkpoints only.
    "qwen_image": StockCall(4.0, "true_cfg_scale", negative=True),
    # CFG pos + w·(pos − neg) for any w > 0, both branches in one 2B batch; negatives default to "".
    "z_image": StockCall(3.0, "guidance_scale", negative=False),
    # Video: CFG for guidance > 1 as two forwards a step (cond, then uncond); negatives default to "".
    # omnirl encodes text with the pipeline's own `encode_prompt` (the same [B] prompts and [B] "" negatives,
    # the same tensors), decodes with its VAE and `postprocess_video` to PIL on the same latent shape.
    "wan2_1": StockCall(
        4.5, "guidance_scale", negative=False, shared=("transformer", "text_encode", "vae_decode", "to_pil")
    ),
}
VIDEO_FAMILIES = ("wan2_1",)  # called with num_frames; omnirl writes their MP4 `video` column


def family_list(text: str) -> list[str]:
    """`--families`: comma-separated names of `STOCK_CALLS`, in the given order, without repeats."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in STOCK_CALLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of {', '.join(STOCK_CALLS)}")
    return names


def model_option(text: str) -> tuple[str, Path]:
    """`--model FAMILY=PATH`: a pipeline folder to use instead of the built `small` one."""
    family, sep, path = text.partition("=")
    if not sep or family not in STOCK_CALLS or not path:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write FAMILY=PATH, FAMILY one of {', '.join(STOCK_CALLS)}"
        )
    return family, Path(path)


def add_size_option(ap: argparse.ArgumentParser) -> None:
    """--size: the factory build a benchmark makes when given no model (`small_model`); smoke runs take
    `tiny`, the tests' build, which loads and steps in a fraction of `small`'s time."""
    ap.add_argument(
        "--size",
        choices=("small", "tiny"),
        default="small",
        help="factory build made when no model is given (--smoke: tiny)",
    )


def add_family_options(ap: argparse.ArgumentParser) -> None:
    """The options both family benchmarks share: --families, --model, --guidance and --size."""
    ap.add_argument(
        "--families",
        type=family_list,
        default=list(STOCK_CALLS),
        help=f"comma-separated families to measure (default: {','.join(STOCK_CALLS)})",
    )
    ap.add_argument(
        "--model",
        type=model_option,
        action="append",
        default=[],
        metavar="FAMILY=PATH",
        help="a family's pipeline folder (repeatable; default: build `--size` in a temp dir)",
    )
    ap.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="guidance of every family (default: each family's recipe scale, see STOCK_CALLS)",
    )
    add_size_option(ap)


def small_model(model: str | Path | None, scratch: Path, family: str = "sd3", size: str = "small") -> Path:
    """`model` if given, else a fresh `size` (`small`; `tiny` for a smoke run) `family` folder (seed 0)
    built under `scratch`."""
    if model:
        return Path(model)
    from stages.models.factory import init_model

    out = scratch / f"{family}-{size}"
    init_model(family, out, size=size, seed=0)
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
    add_family_options(ap)
    ap.add_argument(
        "--batch", type=int, default=4, help="images per call (B; the transformer sees 2B with batched CFG)"
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--resolution", type=int, default=128)
    ap.add_argument("--frames", type=int, default=9, help="frames per clip of the video families (Wan: 4k+1)")
    ap.add_argument("--max-sequence-length", type=int, default=128)
    ap.add_argument(
        "--sde-window", type=int, default=0, help="omnirl's stored SDE steps (0: all, as Flow-GRPO)"
    )
    ap.add_argument("--format", default="parquet", choices=["parquet", "webdataset"])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    args = parse_args(
        ap,
        smoke={
            "batch": 1,
            "steps": 2,
            "resolution": 32,
            "frames": 5,
            "max_sequence_length": 16,
            "repeats": 1,
            "size": "tiny",
        },
    )
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as transformers_logging

    from stages import media
    from stages.models.diffusion import FlowPolicy
    from stages.sample import rollout
    from stages.sample.engines import DiffusersEngine
    from stages.sample.prompts import Prompt
    from stages.sample.rollout import SampleConfig
    from stages.sample.stage import KINDS, run_sample
    from stages.shards.writer import ShardSetWriter

    transformers_logging.disable_progress_bar()
    families: list[str] = args.families
    guidance = {f: STOCK_CALLS[f].guidance if args.guidance is None else args.guidance for f in families}
    metrics: dict[str, Any] = {
        "families": families,
        "guidance": guidance,
        "batch": args.batch,
        "steps": args.steps,
        "resolution": args.resolution,
        "max_sequence_length": args.max_sequence_length,
        "sde_window": args.sde_window,
        "format": args.format,
        "threads": args.threads,
        "repeats": args.repeats,
        "load_average_before": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="omnirl-bench-") as tmp_name:
        tmp = Path(tmp_name)
        models = dict(args.model)
        policies = {f: FlowPolicy.load(small_model(models.get(f), tmp, f, args.size)) for f in families}
        probes = Probes()
        calls = itertools.count()

        def prompts_for(tag: str) -> list[str]:
            return [f"a watercolor lighthouse on a cliff at dusk, take {tag}.{i}" for i in range(args.batch)]

        def frames(family: str) -> dict[str, int]:
            return {"num_frames": args.frames} if family in VIDEO_FAMILIES else {}

        def diffusers_call(family: str, texts: list[str], steps: int) -> None:
            policies[family].pipe(
                **frames(family),
                prompt=texts,
                num_inference_steps=steps,
                **STOCK_CALLS[family].kwargs(guidance[family], len(texts)),
                height=args.resolution,
                width=args.resolution,
                max_sequence_length=args.max_sequence_length,
                output_type="pil",
                generator=[torch.Generator().manual_seed(1000 + i) for i in range(len(texts))],
            )

        def omnirl_call(family: str, texts: list[str], steps: int) -> None:
            cfg = SampleConfig(
                steps=steps,
                guidance=guidance[family],
                resolution=args.resolution,
                frames=args.frames if family in VIDEO_FAMILIES else 1,
                sampler="sde",
                window=min(args.sde_window, steps),
                seed=0,
                batch_size=args.batch,
                max_sequence_length=args.max_sequence_length,
            )
            out = tmp / f"samples-{family}-{next(calls)}"  # a fresh folder: `sample` into a new --out
            writer = ShardSetWriter(
                out, num_shards=1, format=args.format, command="sample", config=cfg.record(), kinds=KINDS
            )
            with ExitStack() as stack:
                stack.enter_context(probes.patch(writer, "write_shard", "shard_write"))
                stack.enter_context(probes.patch(writer, "finalize", "shard_write"))
                run_sample(
                    DiffusersEngine(policies[family]),
                    cfg,
                    [(i, Prompt(t)) for i, t in enumerate(texts)],
                    1,
                    writer,
                    num_shards=1,
                    shard_indices=[0],
                )
                writer.finalize(extra={"sample_config": cfg.record()})

        sides: dict[str, Callable[[str, list[str], int], None]] = {
            "diffusers": diffusers_call,
            "omnirl": omnirl_call,
        }
        runs: dict[str, dict[str, list[dict[str, float]]]] = {f: {s: [] for s in sides} for f in families}
        with ExitStack() as stack:
            stack.enter_context(probes.patch(rollout, "step", "step_math"))
            stack.enter_context(probes.patch(media, "png_bytes", "png"))
            stack.enter_context(probes.patch(media, "encode_mp4s", "mp4"))
            for policy in policies.values():
                pipe = policy.pipe
                stack.enter_context(probes.module(pipe.transformer, "transformer"))
                video = getattr(pipe, "video_processor", None)
                for owner, attr, name in (
                    (pipe, "encode_prompt", "text_encode"),
                    (pipe.vae, "decode", "vae_decode"),
                    (video, "postprocess_video", "to_pil")
                    if video is not None
                    else (pipe.image_processor, "postprocess", "to_pil"),
                    (pipe.scheduler, "step", "step_math"),
                ):
                    stack.enter_context(probes.patch(owner, attr, name))
            for family in families:
                for side, fn in sides.items():
                    fn(family, prompts_for(f"warm-{side}"), 2)
            for r in range(args.repeats):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for family in families:
                    for side in order:
                        probes.seconds.clear()
                        t0 = time.perf_counter()
                        sides[side](family, prompts_for(str(r)), args.steps)
                        runs[family][side].append(probes.breakdown(time.perf_counter() - t0))
                        print(
                            family,
                            side,
                            {k: round(v, 3) for k, v in runs[family][side][-1].items()},
                            flush=True,
                        )

    rows = []
    for family in families:
        best = {side: min(rs, key=lambda b: b["total"]) for side, rs in runs[family].items()}
        ratio = best["omnirl"]["total"] / best["diffusers"]["total"]
        pooled = pooled_ratio(runs[family], "omnirl", "diffusers", STOCK_CALLS[family].shared)
        metrics[family] = {"ratio": ratio, "ratio_pooled": pooled, "best": best, "runs": runs[family]}
        rows += [
            {
                "family": family,
                "path": side,
                "seconds": b["total"],
                "÷ diffusers": b["total"] / best["diffusers"]["total"],
                "pooled ÷ diffusers": pooled if side == "omnirl" else 1.0,
                "samples/s": args.batch / b["total"],
                **{k: b[k] for k in (*REGIONS, "other")},
            }
            for side, b in best.items()
        ]
        print(
            f"{family}: omnirl / diffusers = {ratio:.3f} (pooled {pooled:.3f}; target <= {TARGET})",
            flush=True,
        )
    metrics["load_average_after"] = os.getloadavg()[0]
    if not args.no_record:
        scales = ", ".join(f"{f} {STOCK_CALLS[f].argument}={guidance[f]}" for f in families)
        path = record(
            "sample",
            metrics,
            rows,
            description=(
                f"omnirl `sample` (writer + run_sample + finalize: SDE with log-probs, PNG or MP4, {args.format} shard) ÷ "
                f"the family's stock diffusers pipeline call, same `{args.size}` model per family, {args.batch} prompts, "
                f"{args.steps} steps, {args.resolution} px ({args.frames} frames per Wan clip), guidance ({scales}), max_sequence_length "
                f"{args.max_sequence_length}, {args.threads} threads; best of {args.repeats} alternating runs per "
                f"family, families interleaved in one process (load average {metrics['load_average_before']:.1f} "
                f"on {os.cpu_count()} CPUs). Target <= {TARGET}. Pooled ratio: the fastest time of the "
                "regions both sides share (transformer; Wan 2.1 also text encoding, VAE decoding and to PIL) + "
                "each side's fastest rest. Columns after samples/s: seconds of each side's best run per "
                "region; other = the rest."
            ),
        )
        print("recorded", path)


if __name__ == "__main__":
    main()
