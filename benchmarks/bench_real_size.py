"""Real-size GPU benchmark (`make bench-gpu`): full-size Qwen-Image with random weights, verl-omni's reference
recipe shape, one staged iteration and one online iteration, timed stage by stage on one device.

The model is built directly on the device (`stages.models.factory.make_model_on`: the family's maker
constructed under the device, its seeded initialisers run there, then cast to --dtype; no disk, no host
copy) and wrapped as the `FlowPolicy` the stages load, with a fresh LoRA (rank and α of the preset) as an
iteration after the first samples with its adapter. The settings are `recipes/configs/flow_grpo_qwen_image.yaml`
(verl-omni's Qwen-Image FlowGRPO LoRA recipe: LoRA r64/α128, 512 × 512, 10 SDE steps of which a window of
2 is stored and trained, true CFG 4, 16 samples per prompt, sampling batch 8, advantages clipped to ±5)
with --num-prompts prompts (default 1: 16 images) and, to fit one device, --micro-batch samples per
forward (default 1) and the accumulation that gives the preset's two optimizer steps per rollout.

After a warm-up (one sample of 2 steps, untimed in the iteration), the stages run in this process as the commands run them, on the in-memory model:
- staged: `run_sample` (the diffusers engine, a Parquet shard set), `score_shard` with
  jpeg_compressibility on the samples read back, `compute_advantages` on samples ⋈ rewards, and `Trainer.step`
  (flow_grpo) on samples ⋈ rewards ⋈ advantages followed by `Trainer.save` (adapter + trainer state), each
  writing its shard set as the command does. Every stage starts with an empty prompt cache, as a fresh
  process would.
- online: one iteration of the `omnirl online` driver's loop (`iteration_rows`, `sample_shard`,
  `score_shard`, `compute_advantages`, `Trainer.step`, `Trainer.save`) with the data in memory. Sampler and trainer
  share the one pipeline here; `omnirl online` itself spawns a sampler holding a second one (loaded from a
  model folder, which this benchmark never writes: 57 GB), which `omnirl plan` puts at its `online` column.

Reported: per stage its seconds and peak memory (the accelerator allocator's peak since the stage began;
on the CPU the process's peak RSS, which includes the interpreter and libraries) beside `omnirl plan`'s
prediction for the same settings (sample: its `sample` column; update and the online iteration: its
`update` column, one pipeline plus training); per iteration images/GPU/s and seconds, and the seconds of
a step of verl-omni's size per GPU (32 × 16 images on 4 GPUs = 128 per GPU) at that rate, beside verl-omni's
published 0.305 images/GPU/s (420 s/step, 4×H800). Results: `results/real_size.json` on an accelerator,
`results/real_size_rehearsal.json` on the CPU.

Time guard: `--budget-s` (default 420, so the run ends within 8 minutes) counts from the end of this
script's own imports (torch's, a few seconds), the model build included, and is checked before each stage: a stage is skipped, with a
note, once the budget is spent, and an online stage also when less is left than the same staged stage
took. An out-of-memory stage is recorded as such and the rest skipped.

Without an accelerator it rehearses on the CPU with `--size small` in fp32 at the size's own resolution
(128 px) and 4 samples per prompt, through the same functions; `--smoke` takes `tiny`, 2 samples of 5 steps.

    python benchmarks/bench_real_size.py [--size full] [--num-prompts 1] [--micro-batch 1] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import yaml

from benchmarks.common import markdown_table, parse_args, peak_memory, record, reset_peak_memory, synchronize

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "recipes" / "configs" / "flow_grpo_qwen_image.yaml"
FAMILY = "qwen_image"
REWARD = "jpeg_compressibility"
# verl-omni docs/algo/performance.md: Qwen-Image FlowGRPO LoRA, 4×H800, 32 prompts × 16 at 512², sync reward
REFERENCE = {"images_per_gpu_s": 0.305, "seconds_per_step": 420.0, "images_per_step": 32 * 16, "gpus": 4}
IMAGES_PER_GPU_STEP = REFERENCE["images_per_step"] // REFERENCE["gpus"]
PROMPTS = (
    'a shop window with a neon sign that says "OPEN ALL NIGHT"',
    'a wooden signpost reading "MOUNTAIN TRAIL 3 KM"',
    'a coffee cup printed with the words "good morning"',
    'a vintage poster titled "SPACE FAIR 1962"',
)
GIB = 2**30
STARTED = time.monotonic()  # the budget counts from here: the model build is device time too


class Budget:
    """Seconds left of `--budget-s`, counted from the start of the process."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - STARTED)


class Stages:
    """Runs timed stages under the budget and records each one's seconds and peak memory."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.stopped = False  # after an out-of-memory stage nothing else runs

    def run(self, path: str, stage: str, fn: Callable[[], None], *, need: float = 0.0) -> bool:
        """`fn()` timed as `path`/`stage`; False (with a note) when it did not run to its end: the budget
        has fewer than `need` seconds left (or none), an earlier stage ran out of memory, or this one did."""
        left = self.budget.left()
        if self.stopped or left <= need:
            why = "an earlier stage ran out of memory" if self.stopped else f"{left:.0f} s of the budget left"
            self.note(f"skipped {path} {stage}: {why}")
            return False
        synchronize()
        reset_peak_memory()
        t0 = time.perf_counter()
        try:
            fn()
            synchronize()
        except torch.OutOfMemoryError as error:
            self.stopped = True
            self.note(f"{path} {stage} ran out of memory: {str(error).splitlines()[0]}")
            self.rows.append({"path": path, "stage": stage, "seconds": None, "peak_GiB": _gib(peak_memory())})
            return False
        seconds = time.perf_counter() - t0
        self.rows.append({"path": path, "stage": stage, "seconds": seconds, "peak_GiB": _gib(peak_memory())})
        print(
            f"[bench-gpu] {path} {stage}: {seconds:.1f} s, peak {self.rows[-1]['peak_GiB']} GiB",
            file=sys.stderr,
            flush=True,
        )
        return True

    def run_path(
        self, path: str, steps: list[tuple[str, Callable[[], None]]], need: Callable[[str], float]
    ) -> None:
        """Each stage of `path` in order (`need(stage)`: seconds it must have left); after one that did
        not run, the rest, which read its output, are skipped."""
        for i, (stage, fn) in enumerate(steps):
            if not self.run(path, stage, fn, need=need(stage)):
                for later, _ in steps[i + 1 :]:
                    self.note(f"skipped {path} {later}: it reads the output of {path} {stage}")
                return

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"[bench-gpu] {text}", file=sys.stderr, flush=True)

    def seconds(self, path: str, stage: str) -> float | None:
        return next((r["seconds"] for r in self.rows if (r["path"], r["stage"]) == (path, stage)), None)


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / GIB, 2)


def where() -> tuple[torch.device, str]:
    """The accelerator (`torch.accelerator`) and its name, or the CPU."""
    if torch.accelerator.is_available():
        device = torch.accelerator.current_accelerator()
        index = torch.accelerator.current_device_index()
        name = torch.get_device_module(device.type).get_device_name(index)
        return torch.device(device.type, index), name
    return torch.device("cpu"), "cpu"


def configs(args: argparse.Namespace, size_resolution: int) -> tuple[Any, Any, dict[str, Any]]:
    """The preset's sampling, update and advantage settings with this run's overrides."""
    from stages.knobs import option_names
    from stages.models.factory import DEFAULT_TEXT_LENGTH
    from stages.models.families import family_text_length
    from stages.sample.rollout import SampleConfig
    from stages.update.config import UpdateConfig

    preset = yaml.safe_load(PRESET.read_text())
    sample_options = {**preset["sample"], "steps": args.steps, "seed": args.seed}
    sample_options["resolution"] = args.resolution or size_resolution
    sample_options["batch_size"] = min(args.batch_size or preset["sample"]["batch_size"], args.group_size)
    sample_options["max_sequence_length"] = family_text_length("QwenImagePipeline") or DEFAULT_TEXT_LENGTH
    lo, hi = sample_options["sde_window_range"]
    sample_options["sde_window_range"] = [lo, min(hi, args.steps)]
    names = option_names(SampleConfig)  # the preset's option names (sde_window) → fields (window)
    scfg = SampleConfig(
        **{names[k]: tuple(v) if isinstance(v, list) else v for k, v in sample_options.items() if k in names}
    )
    rows = args.num_prompts * args.group_size
    micro = args.micro_batch
    # the preset's two optimizer steps per rollout, at this run's rows and micro-batch on one device
    step = max(1, -(-rows // (2 * micro))) * micro
    ucfg = UpdateConfig(**{**preset["update"], "micro_batch": micro, "samples_per_step": step})
    scfg.validate()
    ucfg.validate()
    return scfg, ucfg, preset["advantage"]


def build_policy(size: str, seed: int, device: torch.device, dtype: str, ucfg: Any, scratch: Path) -> Any:
    """The `FlowPolicy` of the family's `size` built on `device` (`make_model_on`) with a fresh LoRA."""
    from stages.models.diffusion import DTYPES, FlowPolicy
    from stages.models.factory import make_model_on
    from stages.models.families import adapter_class

    pipe = make_model_on(FAMILY, size, seed, device, DTYPES[dtype])
    pipe.set_progress_bar_config(disable=True)
    policy = FlowPolicy(
        pipe,
        adapter_class(type(pipe).__name__, FAMILY)(pipe),
        model_path=str(scratch / f"{FAMILY}-{size}-in-memory"),  # recorded in the adapter; never read
        adapter=None,
        device=device,
        dtype=DTYPES[dtype],
    )
    policy.add_lora(rank=ucfg.lora_rank, alpha=ucfg.lora_alpha, seed=ucfg.seed)
    return policy


def warm_up(policy: Any, scfg: Any) -> None:
    """One sample of 2 steps through the rollout engine: the first calls' one-time costs (kernel selection,
    allocator growth) are then out of the timed stages, as they are out of a long run's steady state."""
    from stages.sample.engines import DiffusersEngine

    cfg = replace(scfg, steps=2, window=1, window_range=None, batch_size=1)
    DiffusersEngine(policy).rollout(cfg, [PROMPTS[0]], [""], [0], [0], groups=[0], sample_ids=["warm-up"])
    policy.forget_prompts()


def staged_iteration(
    stages: Stages,
    policy: Any,
    scfg: Any,
    ucfg: Any,
    advantage: dict[str, Any],
    prompts: list[Any],
    group: int,
    run: Path,
) -> None:
    """sample → score → advantage → update, each writing its shard set (or adapter) under `run`."""
    from stages.advantage.stage import compute_advantages
    from stages.media import output_modality
    from stages.sample.engines import DiffusersEngine
    from stages.sample.rollout import sample_config_of
    from stages.sample.stage import KINDS, run_sample
    from stages.score.stage import needed_columns, score_shard
    from stages.shards.reader import open_inputs, rollout_modality
    from stages.shards.writer import ShardSetWriter
    from stages.update.losses import get_algorithm
    from stages.update.stage import BASE_COLUMNS
    from stages.update.trainer import Trainer

    samples, rewards, advantages, adapter = (run / n for n in ("samples", "rewards", "advantages", "policy"))

    def sample() -> None:
        policy.forget_prompts()
        writer = ShardSetWriter(samples, num_shards=1, command="sample", config=scfg.record(), kinds=KINDS)
        engine = DiffusersEngine(policy)
        run_sample(engine, scfg, prompts, group, writer, num_shards=1, shard_indices=[0])
        modality = output_modality([column.kind for column in writer.columns])
        writer.finalize(
            extra={
                "sample_config": scfg.record(),
                "family": FAMILY,
                "engine": engine.describe(),
                "modality": modality,
            }
        )

    def score() -> None:
        src = open_inputs([samples])
        modality = rollout_modality(src.manifests)
        scored = score_shard(
            src.read_all(needed_columns(modality, src.columns)), [(REWARD, 1.0)], modality=modality
        )
        writer = ShardSetWriter(
            rewards, num_shards=1, command="score", config={"reward": REWARD}, parents=[samples]
        )
        writer.write_shard(0, scored)
        writer.finalize()

    def advantage_stage() -> None:
        src = open_inputs([samples, rewards])
        cols, stats = compute_advantages(
            src.read_all(["sample_id", "group_id", "reward"]),
            estimator=advantage["estimator"],
            clip=advantage["clip"],
            num_steps=src.columns["log_probs"].shape[0],
        )
        writer = ShardSetWriter(
            advantages, num_shards=1, command="advantage", config=advantage, parents=[samples, rewards]
        )
        writer.write_shard(0, cols)
        writer.finalize(extra={"stats": stats})

    def update() -> None:
        policy.forget_prompts()
        inputs = open_inputs([samples, rewards, advantages])
        wanted = dict.fromkeys((*BASE_COLUMNS, *get_algorithm(ucfg.algo).columns))
        data = inputs.read_all(columns=[c for c in wanted if c in inputs.columns])
        trainer = Trainer.resume(policy, ucfg, None)
        trainer.save(adapter, trainer.step(data, sample_config_of(inputs.manifests)), extra={})

    steps = [("sample", sample), ("score", score), ("advantage", advantage_stage), ("update", update)]
    stages.run_path("staged", steps, lambda _: 0.0)


def online_iteration(
    stages: Stages,
    policy: Any,
    scfg: Any,
    ucfg: Any,
    advantage: dict[str, Any],
    prompts: list[Any],
    args: argparse.Namespace,
    run: Path,
) -> None:
    """Iteration 1 of the `omnirl online` driver's loop at staleness 0, the data in memory."""
    from stages.advantage.config import AdvantageConfig
    from stages.online.pipeline import TENSORS, OnlineConfig, iteration_advantages, iteration_rows
    from stages.sample.engines import DEFAULT_ENGINE, DiffusersEngine
    from stages.sample.stage import in_rollout, sample_shard
    from stages.score.config import ScoreConfig
    from stages.score.stage import score_shard
    from stages.update.trainer import Trainer

    cfg = OnlineConfig(
        model=policy.model_path,
        prompts=[p for _, p in prompts],
        out=run,
        iterations=2,
        sample=scfg,
        update=ucfg,
        group_size=args.group_size,
        rewards=[(REWARD, 1.0)],
        advantage=AdvantageConfig(estimator=advantage["estimator"], clip=advantage["clip"]),
        dtype=args.dtype,
        score_batch_size=ScoreConfig.batch_size,
        on_error=ScoreConfig.on_error,
        max_staleness=0,
        save_trajectories=False,
        media_every=1,
        threads=1,
        seed=None,
        engine=DEFAULT_ENGINE,
    )
    k = 1
    engine = DiffusersEngine(policy)
    held: dict[str, Any] = {}

    def sample() -> None:
        policy.forget_prompts()
        cols = in_rollout(sample_shard(engine, cfg.sampling(k), iteration_rows(cfg, k), 0), f"online{k:02d}")
        held["data"] = {
            name: cols[name]
            for name in (*TENSORS, "sample_id", "group_id", "prompt", "negative_prompt", "prompt_meta")
            if name in cols
        }
        held["job"] = {
            "k": k,
            **{name: cols[name] for name in ("sample_id", "prompt", "prompt_meta", "image")},
        }

    def score() -> None:
        held["rewards"] = score_shard(held["job"], cfg.rewards, modality="image", reward_args=cfg.reward_args)

    def advantage_stage() -> None:
        iteration_advantages(cfg, held["data"], held["rewards"])

    def update() -> None:
        policy.forget_prompts()
        trainer = Trainer.resume(policy, cfg.update, None)
        trainer.save(
            cfg.out / f"it{k + 1}" / "policy",
            trainer.step(held["data"], cfg.sampling(k), seed=k),
            extra={"online_iteration": k + 1, "max_staleness": cfg.max_staleness},
        )

    steps = [("sample", sample), ("score", score), ("advantage", advantage_stage), ("update", update)]
    # an online stage starts only when at least the time the same staged stage took is left
    stages.run_path("online", steps, lambda name: stages.seconds("staged", name) or 0.0)


def memory_plan(size: str, scfg: Any, ucfg: Any, dtype: str) -> dict[str, Any]:
    """`omnirl plan --family qwen_image --size SIZE` for this run's settings (the plan's JSON)."""
    from stages.models.plan import PlanConfig, plan
    from stages.models.plan_arch import from_family

    settings = PlanConfig(
        resolution=scfg.resolution,
        batch_size=scfg.batch_size,
        micro_batch=ucfg.micro_batch,
        guidance=scfg.guidance,
        text_tokens=scfg.max_sequence_length,
        lora_rank=ucfg.lora_rank,
        dtype=dtype,
    )  # the verdict against the visible accelerator's memory
    return plan(from_family(FAMILY, size), settings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    device, device_name = where()
    on_accelerator = device.type != "cpu"
    ap.add_argument(
        "--size", default="full" if on_accelerator else "small", help="qwen_image size (CPU: small)"
    )
    ap.add_argument("--dtype", default="bf16" if on_accelerator else "fp32", choices=["bf16", "fp32", "fp16"])
    ap.add_argument(
        "--resolution", type=int, default=None, help="pixels (default: 512 for full, else the size's own)"
    )
    ap.add_argument("--steps", type=int, default=10, help="denoising steps (the preset's 10)")
    ap.add_argument(
        "--num-prompts", type=int, default=1, help="prompts per iteration (verl-omni: 32 on 4 GPUs)"
    )
    ap.add_argument(
        "--group-size",
        type=int,
        default=16 if on_accelerator else 4,
        help="samples per prompt (the preset's 16; CPU rehearsal: 4)",
    )
    ap.add_argument("--batch-size", type=int, default=None, help="sampling batch (default: the preset's 8)")
    ap.add_argument("--micro-batch", type=int, default=1, help="samples per training forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--budget-s", type=float, default=420.0, help="seconds from start after which stages are skipped"
    )
    ap.add_argument(
        "--tmp", default=None, help="scratch directory for shard sets and adapters (default: system temp)"
    )
    args = parse_args(ap, smoke={"size": "tiny", "group_size": 2, "steps": 5, "batch_size": 2})
    if args.num_prompts > len(PROMPTS):
        ap.error(f"--num-prompts: at most {len(PROMPTS)}")
    if not on_accelerator:
        print(
            f"[bench-gpu] no accelerator: a CPU rehearsal with --size {args.size} (no GPU figure)",
            file=sys.stderr,
        )
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from stages.models.qwen_image import SIZES
    from stages.sample.prompts import Prompt

    diffusers_logging.disable_progress_bar()
    diffusers_logging.set_verbosity_error()  # ModelMixin.to(dtype)'s advice to load with torch_dtype instead
    transformers_logging.disable_progress_bar()
    size_resolution = 512 if args.size == "full" else SIZES[args.size].image_size
    scfg, ucfg, advantage = configs(args, size_resolution)
    prompts = [(i, Prompt(text)) for i, text in enumerate(PROMPTS[: args.num_prompts])]
    rows = args.num_prompts * args.group_size
    stages = Stages(Budget(args.budget_s))
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="omnirl-bench-real-") as tmp_name:
        scratch = Path(tmp_name)
        built: dict[str, Any] = {}

        def build() -> None:
            built["policy"] = build_policy(args.size, args.seed, device, args.dtype, ucfg, scratch)

        if stages.run("setup", "build", build) and stages.run(
            "setup", "warm-up", lambda: warm_up(built["policy"], scfg)
        ):
            policy = built["policy"]
            staged_iteration(
                stages, policy, scfg, ucfg, advantage, prompts, args.group_size, scratch / "staged"
            )
            online_iteration(stages, policy, scfg, ucfg, advantage, prompts, args, scratch / "online")
        built.clear()
    planned = memory_plan(args.size, scfg, ucfg, args.dtype)
    plan_gib = {name: round(stage["total"] / GIB, 2) for name, stage in planned["stages"].items()}
    for row in stages.rows:
        column = {"sample": "sample", "update": "update"}.get(row["stage"])
        row["plan_GiB"] = plan_gib[column] if column and row["path"] != "setup" else None
        if on_accelerator and row["plan_GiB"] and row["peak_GiB"]:  # a CPU's process peak is no device figure
            row["peak ÷ plan"] = row["peak_GiB"] / row["plan_GiB"]
    iterations: dict[str, Any] = {}
    for path in ("staged", "online"):
        times = [stages.seconds(path, s) for s in ("sample", "score", "advantage", "update")]
        if all(t is not None for t in times):
            seconds = sum(times)
            rate = rows / seconds
            iterations[path] = {
                "seconds": seconds,
                "images": rows,
                "images_per_gpu_s": rate,
                "seconds_per_reference_step": IMAGES_PER_GPU_STEP / rate,
            }
            stages.rows.append(
                {
                    "path": path,
                    "stage": "iteration",
                    "seconds": seconds,
                    "images/GPU/s": rate,
                    f"s/step at {IMAGES_PER_GPU_STEP} images/GPU": IMAGES_PER_GPU_STEP / rate,
                    "verl-omni images/GPU/s": REFERENCE["images_per_gpu_s"],
                    "verl-omni s/step": REFERENCE["seconds_per_step"],
                }
            )
    metrics = {
        "device": device_name,
        "accelerator": on_accelerator,
        "size": args.size,
        "dtype": args.dtype,
        "sample_config": scfg.record(),
        "update_config": ucfg.settings(),
        "advantage": advantage,
        "num_prompts": args.num_prompts,
        "group_size": args.group_size,
        "iterations": iterations,
        "reference": REFERENCE,
        "plan_GiB": plan_gib,
        "plan_parameters": planned["parameters"],
        "peak_memory": "accelerator allocator peak" if on_accelerator else "process peak RSS (VmHWM)",
        "budget_s": args.budget_s,
        "wall_s": time.monotonic() - STARTED,
        "notes": stages.notes,
    }
    print("\n".join(markdown_table(stages.rows)))
    for path, it in iterations.items():
        print(
            f"{path}: {it['images_per_gpu_s']:.3f} images/GPU/s ({it['seconds']:.1f} s for {rows} images; "
            f"{it['seconds_per_reference_step']:.0f} s per step of {IMAGES_PER_GPU_STEP} images/GPU) vs verl-omni "
            f"{REFERENCE['images_per_gpu_s']} ({REFERENCE['seconds_per_step']:.0f} s/step)"
        )
    print(
        f"plan (GiB): {plan_gib}; online spawns a second pipeline: its plan total is {plan_gib['online']} GiB"
    )
    for note in stages.notes:
        print(f"note: {note}")
    if not args.no_record:
        where_run = f"{device_name}, {args.dtype}" if on_accelerator else f"CPU rehearsal, {args.dtype}"
        path = record(
            "real_size" if on_accelerator else "real_size_rehearsal",
            metrics,
            stages.rows,
            description=(
                f"Qwen-Image `{args.size}` with random weights built on the device ({where_run}); verl-omni's "
                f"recipe shape (flow_grpo_qwen_image.yaml: LoRA r{ucfg.lora_rank}, {scfg.resolution[0]} px, "
                f"{scfg.steps} SDE steps of which {scfg.window} trained, CFG {scfg.guidance}, {args.group_size} per "
                f"prompt) × {args.num_prompts} prompt(s), micro-batch {ucfg.micro_batch}; one staged and one "
                "online iteration in one process (online: sampler and trainer share one pipeline). Peak: "
                f"{metrics['peak_memory']} per stage, beside `omnirl plan`. verl-omni: 0.305 images/GPU/s, "
                "420 s/step (4×H800, 32 × 16)."
            ),
        )
        print("recorded", path)


if __name__ == "__main__":
    main()
