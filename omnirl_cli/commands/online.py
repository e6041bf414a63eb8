"""`omnirl online`: sample → score → advantage → update fused through shared memory, N iterations.

Its own options are generated from `stages.online.settings.OnlineSettings`; its preset's stage sections
fill the staged commands' configs (`_online_config`), as each staged command reads the same preset.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.knobs import knobs, option_names
from stages.online.settings import OnlineSettings
from stages.update.config import RUN_KNOBS

from ..config import Presets, coerce
from ..console import emit_json, err, is_quiet, log, progress
from ..generate import config_command

if TYPE_CHECKING:
    from stages.online.config import OnlineConfig

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
# `update` settings online's trainer takes from online's own options, not from a stage section: its model
# parallelism over the launch's ranks and its kernels (which the in-process sampler runs too).
TRAINER_FIXED = ("sp_degree", "sp_kind", "tp_degree", "attention_backend", "compile")
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
        _drop_trainer_settings(values, section, origin)
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


def _drop_trainer_settings(values: dict[str, Any], section: str, origin: str) -> None:
    """Take a staged preset's model-parallel and kernel settings (sp_degree, sp_kind, tp_degree,
    attention_backend, compile) out of a stage section's `values`: online's trainer takes them from its
    own options, so a default value is dropped and another one is a usage error naming the option."""
    from stages.errors import UserInputError
    from stages.update.config import UpdateConfig

    defaults = {f.name: f.default for f in fields(UpdateConfig) if f.name in TRAINER_FIXED}
    for key in [k for k in values if k.replace("-", "_") in defaults]:
        name = key.replace("-", "_")
        if coerce(f"{section}.{key}", values.pop(key), defaults[name], origin) != defaults[name]:
            sampler = "; its in-process sampler is one process" if section == "sample" else ""
            raise UserInputError(
                f"{origin}: '{section}.{key}' is omnirl online's own --{name.replace('_', '-')} (its "
                f"trainer's, over the launch's ranks{sampler}); give it at the preset's top level or as the option"
            )


def run(s: OnlineSettings, json_: bool, presets: Presets) -> None:
    """Run RL iterations with the stages fused: a sampler and a scorer worker feed the trainer through a
    shared-memory ring; weights go back to the sampler after each update, with a version number.

    The --config YAML's sample / score / advantage / update sections are the staged commands' settings;
    a top-level key sets online's option of that name, else every stage setting of that name (--set
    alike). Each iteration checkpoints it<K>/policy; a re-run of the same run resumes after the last
    one. The run's settings and the content digests of its model, prompts and plugin files are
    recorded in online_run.json: a re-run with others is refused (--overwrite discards the old run's
    it<K> directories and starts over). SIGTERM stops the run as Ctrl-C does (exit 130); the workers
    end with the driver, even when it is killed. With --max-staleness 0 and the same seeds an iteration
    computes what the staged commands compute. --report-to logs each iteration's reward statistics and
    actor metrics as the staged score and update do (the run directory is --out). With --engine remote
    the sampler is a client of `omnirl serve` (same model) and each update's LoRA is pushed to it; each
    iteration reports its samples' version gaps (iterations between the weights that drew them and the
    ones trained), at most --max-staleness. The trainer loads no text encoder, tokenizer or VAE: the
    sampler (in process, or a server at this --dtype) hands over each iteration's prompt conditioning;
    each iteration's --json lists the trainer's loaded_components. Under a launcher (torchrun, accelerate
    launch) every rank trains, as update's ranks do (dp, or dp × --sp-degree / --tp-degree; DDP or FSDP2),
    while rank 0 alone samples, scores, reports and hands each iteration's training columns to the others
    (docs/scaling.md, "Online under a launcher"); --attention-backend / --compile set the trainer's and
    the in-process sampler's kernels.

    Example: [bold]omnirl online --config recipes/configs/demo_tiny.yaml --model models/sd3-tiny \\
    --prompts recipes/demo_prompts.txt --reward jpeg_compressibility --iterations 4 --out runs/online[/]
    """
    from stages.dist import world_and_rank
    from stages.errors import UserInputError
    from stages.models.vlm_families import is_vlm_model
    from stages.online.pipeline import prepare_run, run_online
    from stages.parallelism import layout
    from stages.tracking import Tracking, parse_report_to

    from ..runtime import device

    if is_vlm_model(s.model):
        raise UserInputError(
            f"--model {s.model}: omnirl online trains diffusion models; run a VLM through the staged "
            "commands (recipes/vlm_grpo.mk)"
        )
    tracking = Tracking(parse_report_to(s.report_to), s.out, s.run_name)
    cfg = _online_config(s, presets)
    layout(cfg.update.parallel)  # a launch the degrees do not fit is refused before anything loads
    prepare_run(cfg, overwrite=s.overwrite)
    if world_and_rank()[1] != 0:  # another rank of a launch trains beside rank 0, which reports
        run_online(cfg, device=device())
        return
    with tracking:
        if is_quiet():
            stats = run_online(cfg, device=device(), tracking=tracking)
        elif not err.is_terminal:
            stats = _run_lines(cfg, s.out, device(), tracking)
        else:
            stats = _run_live(cfg, s.out, device(), tracking)
        if json_:
            emit_json({"out": str(s.out), "iterations": stats})


def _online_config(s: OnlineSettings, presets: Presets) -> OnlineConfig:
    """The run's `OnlineConfig`: online's own settings `s`, and the stage sections of the preset
    layers in the staged commands' configs (the --reward / --reward-arg flags beat the score
    section's)."""
    from stages.advantage.config import AdvantageConfig
    from stages.errors import UserInputError
    from stages.models.factory import DEFAULT_RESOLUTION, default_text_length
    from stages.online.config import OnlineConfig
    from stages.precision import launcher_mixed_precision
    from stages.sample.config import SampleConfig, SampleRun
    from stages.sample.engines import EngineOptions
    from stages.sample.prompts import read_prompts
    from stages.score.config import ON_ERROR_MODES, ScoreConfig
    from stages.score.registry import check_reward_args, parse_reward_args, parse_reward_spec
    from stages.update.config import UpdateConfig

    keys = _stage_keys()
    own = {field.name for field, _ in knobs(OnlineSettings)} - {"reward", "reward_args"}
    others = presets.sections - set(keys)
    preset: dict[str, Any] = {}
    for layer, origin in presets.layers:
        preset = _merge(preset, _sectioned(layer, keys, own, others, origin))
    # the T5 length the model was made for (its card's text_length, else 128) unless the preset sets one,
    # the launcher's mixed precision (as the update's) unless it sets sample.mixed_precision, and 512 px
    sample = {
        "max_sequence_length": default_text_length(s.model),
        "resolution": DEFAULT_RESOLUTION,
        "mixed_precision": launcher_mixed_precision(),
        **(preset.get("sample") or {}),
    }
    drawn = {key: sample.pop(key) for key in RUN_KEYS if key in sample}
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
    specs = s.reward or score.reward or []
    rewards = [parse_reward_spec(spec) for spec in ([specs] if isinstance(specs, str) else specs)]
    reward_args = parse_reward_args(s.reward_args or score.reward_args)
    given = asdict(s)
    built = dict(
        model=str(s.model),
        prompts=read_prompts(s.prompts),
        sample=_dataclass(SampleConfig, sample, "sample", option_names(SampleConfig), SampleConfig.RECORDED),
        update=_dataclass(
            UpdateConfig,
            {**(preset.get("update") or {}), **{name: given[name] for name in TRAINER_FIXED}},
            "update",
            names=keys["update"] | set(TRAINER_FIXED),
        ),
        group_size=int(drawn.get("group_size", SampleRun.group_size)),
        num_prompts=drawn.get("num_prompts"),
        rewards=rewards,
        reward_args=check_reward_args([name for name, _ in rewards], reward_args),
        advantage=advantage,
        score_batch_size=int(score.batch_size),
        on_error=score.on_error,
        rollout=EngineOptions.from_options(
            {"model": s.model, **{k: v for k, v in given.items() if k.startswith("server_")}}
        ),
    )
    # online's other settings the run config holds under the same name, as they are
    own = {f.name: given[f.name] for f in fields(OnlineConfig) if f.name in given and f.name not in built}
    return OnlineConfig(**built, **own)


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


online = config_command(OnlineSettings, "online", run, shared=set().union(*_stage_keys().values()))
