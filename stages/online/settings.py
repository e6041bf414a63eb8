"""`omnirl online`'s own settings as one typed config; torch-free.

`OnlineSettings` is the single declaration of every option of `omnirl online` but its preset's stage
sections (`sample:`, `score:`, `advantage:`, `update:`, which fill the staged commands' own configs), from
which the CLI generates its options (`omnirl_cli.generate`). The command builds the run's `OnlineConfig`
(`stages.online.config`) from both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages import knobs
from stages.knobs import ENGINE, knob
from stages.sample.config import DEFAULT_ENGINE, ENGINE_ENTRY_POINTS, ENGINES
from stages.score.config import BUILTIN_REWARDS
from stages.score.registry import ENTRY_POINT_GROUP


@dataclass
class OnlineSettings:
    """Every setting of `omnirl online` that no stage section holds: the run's model, prompts, rewards,
    length and directory, where its sampler rolls out, and its tracking."""

    model: str | None = knobs.model("Diffusers pipeline")
    prompts: list[str] | None = knob(
        None,
        "Prompt source, as for `omnirl sample`: a file, folder or glob, a save_to_disk folder or a "
        "cached Hugging Face dataset NAME@SPLIT; repeat to read several.",
        metavar="SOURCE",
        required=True,
    )
    out: Path | None = knob(
        None, "Run directory: it<K>/policy checkpoints (and shard sets).", short="-o", required=True
    )
    iterations: int = knob(4, "RL iterations to reach (resumes).", low=1)
    reward: list[str] | None = knob(
        None,
        "A reward (default: the preset's).",
        short="-r",
        names=BUILTIN_REWARDS,
        entry_points=ENTRY_POINT_GROUP,
        metavar="NAME[=WEIGHT]",
    )
    reward_args: list[str] | None = knob(
        None,
        "A reward's argument, e.g. pickscore.model=PATH, as for omnirl score (default: the preset's "
        "score.reward_args).",
        flag="--reward-arg",
        metavar="NAME.KEY=VALUE",
    )
    max_staleness: int = knob(0, "0: sample with the newest weights; 1: sample k+1 while training k.")
    save_trajectories: bool = knob(
        False,
        "Also write it<K>/samples (with the prompt conditioning and source images sampled with), rewards, "
        "advantages shard sets.",
    )
    media_every: int = knob(
        1,
        "With --save-trajectories: store the image/video columns only in every N-th iteration's samples (0, "
        "N, 2N, ...) and the last; the others keep their final latents, recorded as deferred media (`omnirl "
        "score --keep-media` decodes them). Every iteration is still decoded and scored. In-process sampling "
        "only (--engine diffusers).",
        low=1,
    )
    seed: int | None = knob(
        None,
        "Sampling seed of every iteration (default: the iteration number, as the staged recipe; a fixed "
        "seed re-samples the same prompts and noise).",
    )
    dtype: str = knobs.dtype(trains=False)
    threads: int = knob(1, "torch threads per worker process.", low=1)
    engine: str = knob(
        DEFAULT_ENGINE,
        "Where the sampler rolls out: diffusers (a worker process on the trainer's device, the default) or "
        "remote (a client of `omnirl serve --model M` at --server-url, on the server's device: the driver "
        "pushes each new LoRA to it under a name of this run's own, each iteration samples with one "
        "version, and the version gap is the staleness); vllm-omni takes no pushed weights and is refused.",
        names=ENGINES,
        entry_points=ENGINE_ENTRY_POINTS,
        panel=ENGINE,
    )
    server_url: str | None = knobs.server_url()
    server_token_env: str | None = knobs.server_token_env()
    server_timeout: float = knobs.server_timeout()
    server_startup_timeout: float = knobs.server_startup_timeout()
    server_retries: int = knobs.server_retries()
    report_to: list[str] | None = knobs.report_to()
    run_name: str | None = knobs.run_name()
    # the trainer's model parallelism and kernels (under a launcher every rank trains, rank 0 samples);
    # the in-process sampler runs the same kernels
    sp_degree: int = knobs.sp_degree("trainer")
    sp_kind: str = knobs.sp_kind()
    tp_degree: int = knobs.tp_degree()
    attention_backend: str | None = knobs.attention_backend()
    compile: bool = knobs.compile()
    overwrite: bool = knobs.overwrite()
