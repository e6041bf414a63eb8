"""`omnirl online`: sample → score → advantage → update fused through shared memory, N iterations."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Annotated, Any

import typer

from stages.knobs import ENGINE, WEIGHTS_FROM, WEIGHTS_METAVAR, option_names
from stages.sample.config import ENGINE_ENTRY_POINTS, ENGINES
from stages.update.config import RUN_KNOBS

from ..choices import REWARD_ENTRY_POINTS, REWARDS, Dtype, complete
from ..config import coerce, load_yaml, parse_set, resolve
from ..console import emit_json, err, is_quiet, log, progress
from ..errors import handle_errors
from ..options import (
    JsonOpt,
    OverwriteOpt,
    ReportToOpt,
    RunNameOpt,
    ServerRetriesOpt,
    ServerStartupTimeoutOpt,
    ServerTimeoutOpt,
    ServerTokenEnvOpt,
    ServerUrlOpt,
    SetOpt,
    no_model_parallel_opt,
)

# Preset keys of the `sample` section that are the run's, not SampleConfig's recorded settings.
RUN_KEYS = ("group_size", "num_prompts")
# The `score` settings omnirl online's scorer takes (the others name `score`'s files and media); every
# `advantage` setting but its files is online's, as the staged command's.
SCORE_KEYS = ("reward", "reward_args", "batch_size", "on_error")
ADVANTAGE_FILES = ("inputs", "out", "fmt", "overwrite")
# Settings the driver gives each iteration itself, and how.
DRIVER_KEYS = {
    "sample": {
        "seed": "iteration k samples with seed k, or with --seed",
        "iteration": "iteration k places its SDE window as iteration k",
    },
    "update": {"seed": "iteration k's update shuffles with seed k, as the staged recipe's update --seed k"},
}
# `update` settings online's trainer takes from no section: it runs no model parallelism, default kernels.
TRAINER_FIXED = ("sp_degree", "sp_kind", "tp_degree", "attention_backend", "compile")
# Why omnirl online runs no sequence or tensor parallelism, and what does.
NO_MODEL_PARALLEL = (
    "runs its sampler and scorer as spawned worker processes, not launcher ranks, so no group of ranks "
    "can share a sample"
)
STAGED = "the staged omnirl sample, logprob and update"
# Top-level preset keys spelled as a command's option that a stage section names otherwise.
SECTION_ALIASES = {"reward_arg": "reward_args"}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _dataclass(
    cls: type,
    values: dict[str, Any],
    section: str,
    rename: dict[str, str] | None = None,
    names: Collection[str] | None = None,
) -> Any:
    """`cls` of a preset section's `values` (keys as `rename`d), each of the type of its field's default;
    a key that is not one of `names` (default: every field) is a usage error naming it."""
    from stages.errors import UserInputError

    defaults = {
        f.name: None if f.default is MISSING else f.default
        for f in fields(cls)
        if names is None or f.name in names
    }
    kwargs = {}
    for key, value in values.items():
        name = (rename or {}).get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in (defaults if names is None else names):
            raise UserInputError(
                f"--config: '{section}.{key}' is not a setting of omnirl online's {section} stage"
            )
        value = coerce(f"{section}.{key}", value, defaults[name], "--config/--set")
        kwargs[name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def _section_keys(config: type, taken: Collection[str]) -> set[str]:
    """The names a preset section may key the `taken` fields of `config` by: the field's, or its option's."""
    return set(taken) | {name for name, field in option_names(config).items() if field in taken}


def _stage_keys() -> dict[str, set[str]]:
    """The settings each preset section of omnirl online has (names with underscores), from the staged
    commands' configs."""
    from stages.advantage.config import AdvantageConfig
    from stages.sample.config import SampleConfig
    from stages.score.config import ScoreConfig
    from stages.update.config import UpdateConfig

    advantage = {f.name for f in fields(AdvantageConfig)} - set(ADVANTAGE_FILES)
    return {
        "sample": _section_keys(SampleConfig, SampleConfig.RECORDED) | set(RUN_KEYS),
        "score": _section_keys(ScoreConfig, SCORE_KEYS),
        "advantage": _section_keys(AdvantageConfig, advantage),
        "update": {f.name for f in fields(UpdateConfig)} - set(RUN_KNOBS) - set(TRAINER_FIXED),
    }


def _sectioned(
    layer: dict[str, Any], keys: dict[str, set[str]], own: set[str], others: set[str], origin: str
) -> dict[str, Any]:
    """One preset layer (the --config YAML, or the --set items) as stage sections: each top-level value
    goes to every stage section that has a setting of that name, as each staged command reads a shared
    preset (the section's own value wins). A top-level value named after one of omnirl online's `own`
    options is that option's (`resolve`), and the sections of the `others` commands are theirs. Anything
    else is a usage error rather than ignored, and so is a setting the driver gives each iteration."""
    from stages.errors import UserInputError

    def refuse_driver_key(section: str, key: str, shown: str) -> None:
        why = DRIVER_KEYS.get(section, {}).get(key.replace("-", "_"))
        if why:
            raise UserInputError(
                f"{origin}: '{shown}' is set by omnirl online for each iteration ({why}); drop it"
            )

    out = {name: dict(value) for name, value in layer.items() if name in keys and isinstance(value, dict)}
    for section, values in out.items():
        for key in values:
            refuse_driver_key(section, key, f"{section}.{key}")
    for key, value in layer.items():
        name = SECTION_ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name in own or ((name in keys or name in others) and isinstance(value, dict)):
            continue
        homes = [section for section, names in keys.items() if name in names]
        if not homes:
            raise UserInputError(
                f"{origin}: '{key}' is neither a stage section of omnirl online ({', '.join(keys)}) nor a "
                "setting of one; check the spelling, or name the section (e.g. update.lr)"
            )
        for section in homes:
            refuse_driver_key(section, name, key)
            if name not in {k.replace("-", "_") for k in out.get(section, {})}:
                out.setdefault(section, {})[name] = value
    return out


@handle_errors
def online(
    ctx: typer.Context,
    config: Annotated[
        Path,
        typer.Option(
            "--config",
            envvar="OMNIRL_CONFIG",
            help="YAML preset: sample / score / advantage / update sections; a top-level key sets online's "
            "option of that name, else every stage setting of that name.",
        ),
    ],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            envvar="OMNIRL_MODEL",
            metavar=WEIGHTS_METAVAR,
            help=f"Diffusers pipeline: {WEIGHTS_FROM}.",
        ),
    ],
    prompts: Annotated[
        list[str],
        typer.Option(
            "--prompts",
            metavar="SOURCE",
            help="Prompt source, as for `omnirl sample`: a file, folder or glob, a save_to_disk folder or a "
            "cached Hugging Face dataset NAME@SPLIT; repeat to read several.",
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Run directory: it<K>/policy checkpoints (and shard sets).")
    ],
    iterations: Annotated[
        int, typer.Option("--iterations", min=1, help="RL iterations to reach (resumes).")
    ] = 4,
    reward: Annotated[
        list[str] | None,
        typer.Option(
            "--reward",
            "-r",
            autocompletion=complete(REWARDS, REWARD_ENTRY_POINTS),
            metavar="NAME[=WEIGHT]",
            help="A reward (default: the preset's).",
        ),
    ] = None,
    reward_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--reward-arg",
            metavar="NAME.KEY=VALUE",
            help="A reward's argument, e.g. pickscore.model=PATH, as for "
            "omnirl score (default: the preset's score.reward_args).",
        ),
    ] = None,
    max_staleness: Annotated[
        int,
        typer.Option(
            "--max-staleness", help="0: sample with the newest weights; 1: sample k+1 while training k."
        ),
    ] = 0,
    save_trajectories: Annotated[
        bool,
        typer.Option(
            "--save-trajectories",
            help="Also write it<K>/samples (with the prompt conditioning and source images sampled with), rewards, advantages shard sets.",
        ),
    ] = False,
    media_every: Annotated[
        int,
        typer.Option(
            "--media-every",
            min=1,
            help="With --save-trajectories: store the image/video columns only in every N-th iteration's "
            "samples (0, N, 2N, ...) and the last; the others keep their final latents, recorded as deferred "
            "media (`omnirl score --keep-media` decodes them). Every iteration is still decoded and scored. "
            "In-process sampling only (--engine diffusers).",
        ),
    ] = 1,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            help="Sampling seed of every iteration (default: the iteration number, "
            "as the staged recipe; a fixed seed re-samples the same prompts and noise).",
        ),
    ] = None,
    dtype: Annotated[Dtype, typer.Option("--dtype", envvar="OMNIRL_DTYPE", help="Weights dtype.")] = "fp32",
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch threads per worker process.")] = 1,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            autocompletion=complete(ENGINES, ENGINE_ENTRY_POINTS),
            help="Where the sampler rolls out: diffusers (a worker process on the trainer's device, the "
            "default) or remote (a client of `omnirl serve --model M` at --server-url, on the server's "
            "device: the driver pushes each new LoRA to it under a name of this run's own, each iteration "
            "samples with one version, and the version gap is the staleness); vllm-omni takes no pushed "
            "weights and is refused.",
            rich_help_panel=ENGINE,
        ),
    ] = "diffusers",
    server_url: ServerUrlOpt = None,
    server_token_env: ServerTokenEnvOpt = None,
    server_timeout: ServerTimeoutOpt = 600.0,
    server_startup_timeout: ServerStartupTimeoutOpt = 120.0,
    server_retries: ServerRetriesOpt = 8,
    report_to: ReportToOpt = None,
    run_name: RunNameOpt = None,
    sp_degree: no_model_parallel_opt("--sp-degree", "online", STAGED) = 1,
    tp_degree: no_model_parallel_opt("--tp-degree", "online", STAGED) = 1,
    overwrite: OverwriteOpt = False,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Run RL iterations with the stages fused: a sampler and a scorer worker feed the trainer through a
    shared-memory ring; weights go back to the sampler after each update, with a version number.

    Each iteration checkpoints it<K>/policy; a re-run of the same run resumes after the last one. The
    run's settings and the content digests of its model, prompts and plugin files are recorded in
    online_run.json: a re-run with others is refused (--overwrite discards the old run's it<K>
    directories and starts over). SIGTERM stops the run as Ctrl-C does (exit 130); the workers end
    with the driver, even when it is killed. With --max-staleness 0 and the same seeds an iteration
    computes what the staged commands compute. --report-to logs each iteration's reward statistics and
    actor metrics as the staged score and update do (the run directory is --out). With --engine remote
    the sampler is a client of `omnirl serve` (same model) and each update's LoRA is pushed to it; each
    iteration reports its samples' version gaps (iterations between the weights that drew them and the
    ones trained), at most --max-staleness. The trainer loads no text encoder, tokenizer or VAE: the
    sampler (in process, or a server at this --dtype) hands over each iteration's prompt conditioning;
    each iteration's --json lists the trainer's loaded_components.

    Example: [bold]omnirl online --config recipes/configs/demo_tiny.yaml --model models/sd3-tiny \\
    --prompts recipes/demo_prompts.txt --reward jpeg_compressibility --iterations 4 --out runs/online[/]
    """
    from stages.advantage.config import AdvantageConfig
    from stages.errors import UserInputError
    from stages.models.vlm_families import is_vlm_model
    from stages.online.pipeline import OnlineConfig, prepare_run, run_online
    from stages.parallelism import ModelParallel
    from stages.precision import launcher_mixed_precision
    from stages.sample.config import SampleConfig
    from stages.sample.engines import EngineOptions
    from stages.sample.prompts import read_prompts
    from stages.score.config import ON_ERROR_MODES, ScoreConfig
    from stages.score.registry import check_reward_args, parse_reward_args, parse_reward_spec
    from stages.tracking import Tracking, parse_report_to
    from stages.update.config import UpdateConfig

    from ..runtime import device

    keys = _stage_keys()
    c = resolve(ctx, "online", shared=set().union(*keys.values()))
    ModelParallel.from_options(c).refuse("omnirl online", NO_MODEL_PARALLEL, STAGED)
    model, out = c["model"], c["out"]
    tracking = Tracking(parse_report_to(c["report_to"]), out, c["run_name"])

    if is_vlm_model(model):
        raise UserInputError(
            f"--model {model}: omnirl online trains diffusion models; run a VLM through the staged "
            "commands (recipes/vlm_grpo.mk)"
        )
    # --reward and --reward-arg are the score section's settings in a preset (the flags beat it)
    own = set(c) - {"reward", "reward_arg"}
    others = {name.replace("-", "_") for name in ctx.find_root().command.list_commands(ctx)} - set(keys)
    preset = _merge(
        _sectioned(load_yaml(config), keys, own, others, f"--config {config}"),
        _sectioned(parse_set(list(set_ or [])), keys, own, others, "--set"),
    )
    from stages.models.factory import DEFAULT_RESOLUTION, default_text_length

    # the T5 length the model was made for (its card's text_length, else 128) unless the preset sets one,
    # the launcher's mixed precision (as the update's) unless it sets sample.mixed_precision, and 512 px
    sample = {
        "max_sequence_length": default_text_length(model),
        "resolution": DEFAULT_RESOLUTION,
        "mixed_precision": launcher_mixed_precision(),
        **(preset.get("sample") or {}),
    }
    run = {key: sample.pop(key) for key in RUN_KEYS if key in sample}
    advantage = _dataclass(
        AdvantageConfig,
        dict(preset.get("advantage") or {}),
        "advantage",
        option_names(AdvantageConfig),
        keys["advantage"],
    )
    score = _dataclass(
        ScoreConfig, dict(preset.get("score") or {}), "score", option_names(ScoreConfig), keys["score"]
    )
    if score.on_error not in ON_ERROR_MODES:
        raise UserInputError(
            f"--config: score.on_error {score.on_error!r}: choose one of {', '.join(ON_ERROR_MODES)}"
        )
    specs = reward or score.reward or []
    rewards = [parse_reward_spec(s) for s in ([specs] if isinstance(specs, str) else specs)]
    reward_args = parse_reward_args(reward_arg or score.reward_args)
    cfg = OnlineConfig(
        model=str(model),
        prompts=read_prompts(c["prompts"]),
        out=out,
        iterations=c["iterations"],
        sample=_dataclass(SampleConfig, sample, "sample", option_names(SampleConfig), SampleConfig.RECORDED),
        update=_dataclass(UpdateConfig, dict(preset.get("update") or {}), "update", names=keys["update"]),
        group_size=int(run.get("group_size", 4)),
        num_prompts=run.get("num_prompts"),
        rewards=rewards,
        reward_args=check_reward_args([name for name, _ in rewards], reward_args),
        advantage=advantage,
        score_batch_size=int(score.batch_size),
        on_error=score.on_error,
        max_staleness=c["max_staleness"],
        save_trajectories=c["save_trajectories"],
        media_every=c["media_every"],
        dtype=c["dtype"],
        threads=c["threads"],
        seed=c["seed"],
        engine=c["engine"],
        rollout=EngineOptions.from_options(
            {
                "model": model,
                **{k: v for k, v in c.items() if k.startswith("server_")},
            }
        ),
    )
    prepare_run(cfg, overwrite=c["overwrite"])
    with tracking:
        if is_quiet():
            stats = run_online(cfg, device=device(), tracking=tracking)
        elif not err.is_terminal:
            stats = _run_lines(cfg, out, device(), tracking)
        else:
            stats = _run_live(cfg, out, device(), tracking)
        if json_:
            emit_json({"out": str(out), "iterations": stats})


def _run_lines(cfg: Any, out: Path, dev: Any, tracking: Any) -> list[dict[str, Any]]:
    """Off a TTY (Slurm logs, pipes): one line per iteration, and the progress timer's line at least
    every PROGRESS_INTERVAL_S seconds while an iteration runs. Returns `run_online`'s statistics."""
    from stages.online.pipeline import run_online

    log(f"omnirl online → {out} on {dev}")
    with progress() as bar:
        task = bar.add_task("online iterations", total=cfg.iterations, rate="")

        def show(s: dict[str, Any]) -> None:
            bar.update(task, completed=s["iteration"] + 1, rate=f"reward {s['reward_mean']:.5g}")
            log(
                f"it {s['iteration']}: reward {s['reward_mean']:.5g} ± {s['reward_std']:.3g} (mean ± sd), "
                f"zero-std {s['zero_std_ratio']:.2f}, step means: pg_loss {s.get('pg_loss', 0):+.3e}, ratio "
                f"{s.get('ratio_mean', 1):.5f}, version gap ≤ {s['version_gap_max']}, "
                f"{s['samples'] / s['seconds']:.1f} samples/s, "
                f"{s['seconds']:.1f} s"
            )

        return run_online(cfg, device=dev, on_iteration=show, tracking=tracking)


def _run_live(cfg: Any, out: Path, dev: Any, tracking: Any) -> list[dict[str, Any]]:
    """Run with a live table on stderr, one row per iteration; returns `run_online`'s statistics."""
    from rich.live import Live
    from rich.table import Table

    from stages.online.pipeline import run_online

    table = Table(title=f"omnirl online → {out} on {dev}  (one row per iteration)", title_justify="left")
    for name in (
        "it",
        "reward mean",
        "sd",
        "zero-std",
        "pg_loss (step mean)",
        "ratio (step mean)",
        "versions",
        "gap",
        "samples/s",
        "wait s",
        "train s",
        "total s",
    ):
        table.add_column(name, justify="right")

    def show(s: dict[str, Any]) -> None:
        table.add_row(
            str(s["iteration"]),
            f"{s['reward_mean']:.5g}",
            f"{s['reward_std']:.3g}",
            f"{s['zero_std_ratio']:.2f}",
            f"{s.get('pg_loss', 0):+.3e}",
            f"{s.get('ratio_mean', 1):.5f}",
            ",".join(map(str, s["policy_versions"])),
            ",".join(map(str, s["version_gaps"])),
            f"{s['samples'] / s['seconds']:.1f}",
            f"{s['seconds_waiting']:.1f}",
            f"{s['seconds_training']:.1f}",
            f"{s['seconds']:.1f}",
        )

    with Live(table, console=err, refresh_per_second=2):
        return run_online(cfg, device=dev, on_iteration=show, tracking=tracking)
