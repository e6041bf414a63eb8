"""CLI conventions: choice options listed and completed, OMNIRL_* variables, -q/-v, `omnirl env`,
required options checked after --config, and progress lines off a TTY."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import typer
from helpers import fails, staged_update_args
from typer.testing import CliRunner

from omnirl_cli import console
from omnirl_cli.app import app
from omnirl_cli.commands import COMMANDS
from omnirl_cli.config import choices_of, resolve
from stages.knobs import MIXED_PRECISION_MODES
from stages.sample.config import SAMPLERS
from stages.shards.manifest import read_manifest

runner = CliRunner()
ROOT = typer.main.get_command(app)


@pytest.fixture(autouse=True)
def _normal_verbosity():
    """-q/-v change process-wide logger levels: every test here leaves them as it found them."""
    yield
    console.set_verbosity(console.NORMAL)


def _param(command: str, flag: str):
    return next(p for p in ROOT.commands[command].params if flag in p.opts)


def _complete(command: str, flag: str, incomplete: str) -> list[str]:
    """What shell completion offers for `omnirl COMMAND FLAG <TAB>` (click's shell_complete API)."""
    cmd = ROOT.commands[command]
    ctx = cmd.make_context(command, [], resilient_parsing=True)
    return [item.value for item in _param(command, flag).shell_complete(ctx, incomplete)]


@pytest.mark.parametrize(
    ("command", "flag", "names"),
    [
        ("sample", "--sampler", "ode|sde|cps|dance"),
        ("sample", "--dtype", "fp32|bf16|fp16"),
        ("sample", "--format", "parquet|webdataset"),
        ("update", "--lr-scheduler", "constant|linear|cosine"),
        ("update", "--mixed-precision", "no|bf16|fp16"),
        ("update", "--strategy", "auto|ddp|fsdp2"),
        ("advantage", "--aggregation", "reward_aggr|advantage_aggr"),
        ("score", "--on-error", "fail|zero"),
        ("init-model", "--size", "tiny|small|demo|full|medium|1.3b|3b|4b|7b|8b"),
        ("pretrain", "--vae", "model|pixel"),
    ],
)
def test_help_lists_and_completion_offers_a_choice_options_names(command: str, flag: str, names: str) -> None:
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    line = next(line for line in result.output.splitlines() if re.match(rf"\W+{flag}\s", line))
    assert line.split()[1:3] == [flag, names]  # the names as its metavar
    assert _complete(command, flag, "") == names.split("|")
    first = names.split("|")[0]
    assert _complete(command, flag, first[:2]) == [n for n in names.split("|") if n.startswith(first[:2])]


def test_shell_completion_through_the_completion_protocol() -> None:
    env = {"_OMNIRL_COMPLETE": "complete_bash", "COMP_WORDS": "omnirl sample --sampler d", "COMP_CWORD": "3"}
    result = runner.invoke(app, [], env=env, prog_name="omnirl")
    assert result.output.split() == ["dance"]


@pytest.mark.parametrize(
    ("command", "flag", "incomplete", "offered"),
    [
        ("update", "--algo", "g", ["grpo_guard", "grpo", "gspo"]),
        ("advantage", "--estimator", "grpo_", ["grpo_group", "grpo_verl", "grpo_trl", "grpo_batch_std"]),
        ("score", "--reward", "jpeg", ["jpeg_compressibility", "jpeg_incompressibility"]),
        (
            "init-model",
            "--family",
            "q",
            [
                "qwen2_5_vl",
                "qwen3_omni_thinker",
                "qwen3_vl",
                "qwen3_vl_moe",
                "qwen_image",
                "qwen_image_edit",
                "qwen_image_edit_plus",
            ],
        ),
    ],
)
def test_open_registries_complete_builtins_and_refuse_no_plugin(
    command: str, flag: str, incomplete: str, offered: list[str]
) -> None:
    assert _complete(command, flag, incomplete) == offered
    assert choices_of(_param(command, flag)) is None  # a str option: `module:attribute` plugins pass


def test_a_plugin_estimator_passes_the_open_option(tiny_shard_set: Path, tmp_path: Path) -> None:
    plugin = tmp_path / "est.py"
    plugin.write_text(
        "import torch\n\ndef fn(rewards, group_ids, *, clip=None, sample_ids=None):\n    return rewards * 2\n"
    )
    out = tmp_path / "adv"
    result = runner.invoke(
        app,
        [
            "advantage",
            "--in",
            str(tiny_shard_set),
            "--estimator",
            f"{plugin}:fn",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    from stages.shards.reader import ShardSet

    assert ShardSet(out).read_all()["advantages"].flatten().tolist() == [0.0, 2.0, 4.0, 2.0, 4.0, 6.0]


def test_the_builtin_reward_names_are_the_registrys() -> None:
    """The torch-free list --reward completes (`stages.score.config.BUILTIN_REWARDS`) is the registry's."""
    from stages.score.config import BUILTIN_REWARDS
    from stages.score.registry import available_rewards

    assert set(BUILTIN_REWARDS) == set(available_rewards())


def _probe_app() -> typer.Typer:
    probe = typer.Typer()
    seen: dict = {}

    @probe.command()
    def sample(
        ctx: typer.Context,
        steps: int = typer.Option(10, "--steps", envvar="OMNIRL_TEST_STEPS"),
        sampler: Literal[SAMPLERS] = typer.Option("sde", "--sampler"),
        model: Path | None = typer.Option(None, "--model", envvar="OMNIRL_TEST_MODEL"),
        config: Path | None = typer.Option(None, "--config"),
        set_: list[str] | None = typer.Option(None, "--set"),
    ) -> None:
        seen.clear()
        seen.update(resolve(ctx, "sample", required=("model",)))

    probe.seen = seen  # type: ignore[attr-defined]
    return probe


def test_precedence_flags_over_set_over_env_over_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "preset.yaml"
    cfg.write_text("steps: 20\nmodel: from-yaml\n")
    probe = _probe_app()
    env = {"OMNIRL_TEST_STEPS": "30"}
    base = ["--config", str(cfg)]
    assert runner.invoke(probe, base).exit_code == 0 and probe.seen["steps"] == 20
    assert runner.invoke(probe, base, env=env).exit_code == 0 and probe.seen["steps"] == 30
    assert runner.invoke(probe, [*base, "--set", "steps=40"], env=env).exit_code == 0
    assert probe.seen["steps"] == 40
    assert runner.invoke(probe, [*base, "--set", "steps=40", "--steps", "50"], env=env).exit_code == 0
    assert probe.seen["steps"] == 50
    # a required option: the preset fills it, the environment beats the preset, a flag beats both
    assert probe.seen["model"] == Path("from-yaml")
    runner.invoke(probe, base, env={"OMNIRL_TEST_MODEL": "from-env"})
    assert probe.seen["model"] == Path("from-env")
    runner.invoke(probe, [*base, "--model", "m"], env={"OMNIRL_TEST_MODEL": "from-env"})
    assert probe.seen["model"] == Path("m")


def test_choice_values_from_yaml_set_and_env_are_checked(tmp_path: Path) -> None:
    from stages.errors import UserInputError

    cfg = tmp_path / "preset.yaml"
    cfg.write_text("model: m\nsampler: dance\n")
    probe = _probe_app()
    assert runner.invoke(probe, ["--config", str(cfg)]).exit_code == 0 and probe.seen["sampler"] == "dance"
    result = runner.invoke(probe, ["--config", str(cfg), "--set", "sampler=magic"])
    assert isinstance(result.exception, UserInputError)
    assert str(result.exception) == "--set: --sampler 'magic': choose one of ode, sde, cps, dance"
    cfg.write_text("model: m\nsampler: [sde]\n")
    assert "--sampler ['sde']" in str(runner.invoke(probe, ["--config", str(cfg)]).exception)
    # YAML 1.1 reads a bare `no` as false: taken back as the choice "no"
    from omnirl_cli.config import _check_choice

    assert _check_choice("--mixed-precision", False, MIXED_PRECISION_MODES, "--config p") == "no"


def test_environment_variables_set_options(tiny_shard_set: Path, tmp_path: Path) -> None:
    out = tmp_path / "adv"
    result = runner.invoke(
        app,
        ["advantage", "--in", str(tiny_shard_set), "--out", str(out)],
        env={"OMNIRL_FORMAT": "webdataset"},
    )
    assert result.exit_code == 0, result.output
    assert read_manifest(out).format == "webdataset"
    line = fails(["sample", "--prompts", "p.txt", "--out", str(tmp_path / "s")], "--model")
    result = runner.invoke(app, ["advantage", "--in", str(tiny_shard_set), "--out", str(tmp_path / "b")],
                           env={"OMNIRL_FORMAT": "csv"})  # fmt: skip
    assert result.exit_code == 2
    assert "--format csv (flag or OMNIRL_FORMAT): choose one of parquet, webdataset" in result.stderr
    assert "OMNIRL_MODEL" in line
    # the help's lines joined, as a long option help may wrap inside its panel's box
    sample_help = " ".join(
        re.sub(
            r"\s*│\s*", " ", runner.invoke(app, ["sample", "--help"], env={"COLUMNS": "200"}).output
        ).split()
    )
    for var in (
        "OMNIRL_MODEL",
        "OMNIRL_DTYPE",
        "OMNIRL_FORMAT",
        "OMNIRL_CONFIG",
        "OMNIRL_QUIET",
        "OMNIRL_VERBOSE",
    ):
        assert f"env var: {var}" in sample_help


def test_a_preset_fills_a_required_option_and_a_missing_one_is_one_line(
    tiny_shard_set: Path, tmp_path: Path
) -> None:
    out = tmp_path / "adv"
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"advantage:\n  out: {out}\n")
    result = runner.invoke(app, ["advantage", "--in", str(tiny_shard_set), "--config", str(preset), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["out"] == str(out) and read_manifest(out).num_rows == 6
    line = fails(["advantage", "--in", str(tiny_shard_set)], "--out is required", "--config")
    assert line == "error: --out is required: pass it as a flag, or as `out` in the --config YAML or --set"
    fails(["pairs", "--out", str(tmp_path / "p")], "--pairs is required")
    # a preset's value is parsed as the flag would be: ranges hold too
    fails(["pairs", "--pairs", "t.jsonl", "--out", str(tmp_path / "p"), "--set", "num_shards=0"],
          "--set: --num-shards 0", "greater than or equal to 1")  # fmt: skip
    fails(
        ["update", "--in", str(tiny_shard_set), "--out", str(tmp_path / "u")],
        "--model is required",
        "OMNIRL_MODEL",
    )


def test_env_reports_versions_devices_and_variables() -> None:
    env = {"OMNIRL_MODEL": "models/x", "ACCELERATE_MIXED_PRECISION": "bf16", "OMNIRL_API_TOKEN": "s3cret"}
    result = runner.invoke(app, ["env", "--json"], env=env)
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert set(info) == {
        "omnirl", "source", "python", "platform", "packages", "extras", "trackers", "devices",
        "accelerate_config", "environment",
    }  # fmt: skip
    import torch

    assert info["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert info["packages"]["torch"] == torch.__version__
    for name in ("diffusers", "transformers", "accelerate", "peft", "datasets", "pyarrow"):
        assert re.match(r"\d+\.\d+", info["packages"][name]), name
    assert {"ocr", "math", "vllm", "npu"} <= set(info["extras"])
    assert info["devices"]["count"] == torch.accelerator.device_count()
    assert info["devices"]["accelerator"] == (
        torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None
    )
    assert info["accelerate_config"]["path"].endswith("default_config.yaml")
    assert info["environment"]["OMNIRL_MODEL"] == "models/x"
    assert info["environment"]["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert info["environment"]["OMNIRL_API_TOKEN"] == "<redacted>"
    from importlib import metadata

    from stages.tracking import KNOWN

    assert set(info["trackers"]) == set(KNOWN)  # every tracker --report-to takes
    assert info["trackers"]["tensorboard"] == metadata.version("tensorboard")  # a dev dependency
    # the checkout this code runs from (tests run from one): its commit, as git names it
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert info["source"]["path"] == str(root) and info["source"]["commit"] == head.stdout.strip()
    assert isinstance(info["source"]["modified"], bool)
    human = runner.invoke(app, ["env"], env=env)
    assert human.exit_code == 0 and human.stderr == ""  # a report is a result: `omnirl env > env.txt`
    assert "OMNIRL_MODEL=models/x" in human.stdout and "s3cret" not in human.stdout
    assert f"(git {head.stdout.strip()[:12]}" in human.stdout.splitlines()[0]
    assert f"trackers: tensorboard {info['trackers']['tensorboard']}, wandb " in human.stdout


def _logging_inspect(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`inspect` logs one record per level through an omnirl logger, as a stage would; returns the
    list the logger's effective level is appended to on each call."""
    import importlib

    describe = importlib.import_module("stages.shards.describe")  # the package re-exports the function
    original, levels = describe.describe, []

    def logged(*args, **kwargs):
        log = logging.getLogger("stages.probe")
        levels.append(log.getEffectiveLevel())
        log.debug("debug record")
        log.info("info record")
        return original(*args, **kwargs)

    monkeypatch.setattr(describe, "describe", logged)
    return levels


@pytest.mark.parametrize(
    ("flags", "level", "shown"),
    [
        ([], logging.WARNING, []),
        (["-v"], logging.DEBUG, ["DEBUG stages.probe: debug record", "INFO stages.probe: info record"]),
        (["-q"], logging.ERROR, []),
    ],
)
def test_quiet_and_verbose_set_omnirl_log_levels(
    tiny_shard_set: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], level: int, shown: list[str]
) -> None:
    levels = _logging_inspect(monkeypatch)
    for args in ([*flags, "inspect", str(tiny_shard_set)], ["inspect", str(tiny_shard_set), *flags]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert levels.pop() == level
        assert all(s in result.stderr for s in shown), result.stderr
        if not shown:
            assert "record" not in result.stderr
    assert logging.getLogger("stages").level == {logging.WARNING: logging.NOTSET}.get(level, level)


def test_quiet_silences_progress_and_log_lines(tiny_shard_set: Path, tmp_path: Path) -> None:
    loud = runner.invoke(app, ["advantage", "--in", str(tiny_shard_set), "--out", str(tmp_path / "a")])
    assert loud.exit_code == 0 and "advantages: 6/6" in loud.stderr and "zero_std_ratio" not in loud.stderr
    assert loud.stdout.startswith(
        f"advantages → {tmp_path / 'a'}  reward 1.5000 ± 0.9574 (mean ± sd), "
    )  # rewards 0..2, 1..3
    quiet = runner.invoke(app, ["advantage", "--in", str(tiny_shard_set), "--out", str(tmp_path / "b"), "-q"])
    assert quiet.exit_code == 0 and quiet.stderr == ""  # -q silences progress and logs, not the result
    assert quiet.stdout == loud.stdout.replace(str(tmp_path / "a"), str(tmp_path / "b"))
    quiet = runner.invoke(app, ["advantage", "--in", str(tiny_shard_set), "--out", str(tmp_path / "c")],
                          env={"OMNIRL_QUIET": "1"})  # fmt: skip
    assert quiet.exit_code == 0 and quiet.stderr == ""
    assert read_manifest(tmp_path / "c").num_rows == 6
    errors = runner.invoke(app, ["-q", "inspect", str(tmp_path / "nope")])
    assert errors.exit_code == 2 and "nope" in errors.stderr  # errors still print


def test_json_keeps_the_result_on_stdout_and_progress_on_stderr(tiny_shard_set: Path, tmp_path: Path) -> None:
    """A recipe keeps each stage's --json result in a file and still shows its progress (off a TTY: a
    line at the end and at least every 30 s)."""
    result = runner.invoke(
        app, ["advantage", "--in", str(tiny_shard_set), "--out", str(tmp_path / "a"), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_samples"] == 6
    assert [line for line in result.stderr.splitlines() if line.startswith("advantages: ")] == [
        "advantages: 6/6 [0:00]"
    ]


def test_off_a_tty_a_long_step_still_prints_progress_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """init-model is one long call: the timer prints its line while it runs (interval shortened)."""
    import time

    import stages.models.factory as factory

    monkeypatch.setattr(console, "PROGRESS_INTERVAL_S", 0.05)
    original = factory.init_model

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return original(*args, **kwargs)

    monkeypatch.setattr(factory, "init_model", slow)
    result = runner.invoke(app, ["init-model", "--family", "sd3", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    lines = [
        line for line in result.stderr.splitlines() if line.startswith("building tiny sd3 model: 0 [0:00]")
    ]
    assert len(lines) >= 3


def test_online_off_a_tty_prints_a_line_per_iteration_and_timer_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Rich's live table prints nothing until the end off a TTY: `online` prints lines there instead."""
    import time
    from types import SimpleNamespace

    import stages.online.pipeline as pipeline
    from omnirl_cli.commands.online import _run_lines

    monkeypatch.setattr(console, "PROGRESS_INTERVAL_S", 0.05)
    stats = {"reward_std": 0.1, "zero_std_ratio": 0.0, "samples": 4, "seconds": 2.0, "version_gap_max": 0}

    def fake_run(cfg, device, on_iteration, tracking):
        for k, reward in ((0, 0.25), (1, 0.5)):
            time.sleep(0.2)  # a long iteration: the timer still reports
            on_iteration({**stats, "iteration": k, "reward_mean": reward, "pg_loss": 0.001})

    monkeypatch.setattr(pipeline, "run_online", fake_run)
    _run_lines(SimpleNamespace(iterations=2), tmp_path / "run", "cpu", None)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"omnirl online → {tmp_path / 'run'} on cpu"
    assert [line.split(",")[0] for line in lines if line.startswith("it ")] == [
        "it 0: reward 0.25 ± 0.1 (mean ± sd)",
        "it 1: reward 0.5 ± 0.1 (mean ± sd)",
    ]
    timer = [line for line in lines if line.startswith("online iterations: ")]
    assert timer[0].startswith("online iterations: 0/2 [0:00]") and len(timer) >= 4
    assert timer[-1].startswith("online iterations: 2/2 reward 0.5")


def test_every_long_command_reports_progress() -> None:
    """A command that can run for minutes draws progress (lines every 30 s off a TTY): through
    `console.progress` directly, `stages.outputs.map_shards` or `sample`'s shard runner (`run_shards`, which
    draws it). serve-reward and serve serve; env is instant."""
    import inspect

    from omnirl_cli.commands import sample_shards

    assert "progress(" in inspect.getsource(sample_shards.run_shards)
    for name, func in COMMANDS:
        if name in ("serve-reward", "serve", "env"):
            continue
        source = inspect.getsource(sys.modules[func.__module__])
        assert any(f"{way}(" in source for way in ("progress", "map_shards", "run_shards")), name


def test_help_output_stays_light() -> None:
    code = (
        "import sys; from omnirl_cli.app import app; from typer.testing import CliRunner; "
        "CliRunner().invoke(app, ['sample', '--help']); "
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("preset", sorted((Path(__file__).parents[1] / "recipes" / "configs").glob("*.yaml")))
def test_every_preset_value_parses_as_its_flag_would(preset: Path) -> None:
    """Presets' values pass the same checks as flags (types, ranges, choices) for each command section."""
    import yaml

    for section in yaml.safe_load(preset.read_text()):
        command = ROOT.commands[section]
        resolve(command.make_context(section, ["--config", str(preset)], resilient_parsing=True), section)


def test_online_sections_take_yaml_numbers_as_their_fields_types(tmp_path: Path) -> None:
    """YAML 1.1 reads `2e-3` as a string: an online section's value is converted to its field's type
    (as the staged commands' flags are), and one that does not convert is one line naming it."""
    from omnirl_cli.commands.online import _dataclass
    from stages.errors import UserInputError
    from stages.update.config import UpdateConfig

    assert _dataclass(UpdateConfig, {"lr": "2e-3", "inner_epochs": "2"}, "update").lr == 0.002
    assert _dataclass(UpdateConfig, {"inner_epochs": "2"}, "update").inner_epochs == 2
    with pytest.raises(UserInputError, match=r"update\.lr='fast' is not a valid float"):
        _dataclass(UpdateConfig, {"lr": "fast"}, "update")
    preset = tmp_path / "preset.yaml"
    preset.write_text("update:\n  lr: 1e-4\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    fails(
        ["online", "--config", str(preset), "--model", str(tmp_path), "--prompts", str(prompts),
         "--out", str(tmp_path / "o"), "--reward", "jpeg_compressibility", "--set", "update.lr=fast"],
        "update.lr",
    )  # fmt: skip


def test_online_update_section_takes_the_training_settings_only() -> None:
    """`update`'s knobs that name its data, weights and trackers, and the model parallelism and kernels
    online's trainer never runs, are no settings of online's update section: refused, not dropped."""
    from omnirl_cli.commands.online import _dataclass, _stage_keys
    from stages.errors import UserInputError
    from stages.update.config import UpdateConfig

    names = _stage_keys()["update"]
    assert {"lr", "betas", "strategy", "mixed_precision", "ema_every"} <= names
    for key in ("model", "out", "dtype", "sp_degree", "attention_backend", "compile"):
        with pytest.raises(UserInputError, match=rf"'update\.{key}' is not a setting"):
            _dataclass(UpdateConfig, {key: 2}, "update", names=names)


def test_inspect_prints_its_result_on_stdout_and_only_progress_on_stderr(tiny_shard_set: Path) -> None:
    result = runner.invoke(app, ["inspect", str(tiny_shard_set), "--verify", "--head", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{tiny_shard_set}  parquet v") and lines[0].endswith("6 rows in 2 shard(s)")
    assert "row 1" in result.stdout and lines[-1] == "verified: every shard matches its size and sha256"
    assert [line.split(":")[0] for line in result.stderr.splitlines()] == ["verifying 2 shards"]


def test_update_prints_the_step_means_report_shows(staged: dict[str, Path], tmp_path: Path) -> None:
    """`update`'s line and `report`'s table show one quantity, the mean over the update's optimizer
    steps (update printed the last step's); both are results on stdout."""
    run = tmp_path / "run"
    (run / "it0").mkdir(parents=True)
    for part in ("samples", "rewards"):
        (run / "it0" / part).symlink_to(staged[part])
    update = runner.invoke(app, staged_update_args(staged, run / "it1" / "policy"))
    assert update.exit_code == 0, update.output
    records = [
        json.loads(line) for line in (run / "it1" / "policy" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(records) == 2 and records[0]["actor/pg_loss"] != records[1]["actor/pg_loss"]
    report = runner.invoke(app, ["report", str(run), "--no-grids", "--json"])
    (row,) = json.loads(report.stdout)["iterations"]
    for name, key in (
        ("pg_loss", "actor/pg_loss"),
        ("ratio_mean", "actor/ratio_mean"),
        ("clipfrac", "actor/pg_clipfrac"),
    ):
        assert row[name] == pytest.approx(sum(r[key] for r in records) / 2, rel=1e-12), name
    (line,) = update.stdout.splitlines()
    assert line.startswith(f"updated → {run / 'it1' / 'policy'}  step 2  mean of 2 optimizer steps ")
    assert (
        f"pg_loss {row['pg_loss']:+.4e}  ratio {row['ratio_mean']:.6f}  clipfrac {row['clipfrac']:.3f}  "
        in line
    )
    human = runner.invoke(app, ["report", str(run), "--no-grids"])
    assert human.exit_code == 0, human.output
    assert f"{run}: reward per iteration" in human.stdout and "± is the standard error" in human.stdout
    assert f"{row['reward_mean']:.4g} ± {row['reward_se']:.2g}" in human.stdout
    assert f"reward curve: {run / 'reward_curve.png'}" in human.stdout
    assert [line.split(":")[0] for line in human.stderr.splitlines()] == [f"report {run}"]  # progress only


def _help(args: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    result = runner.invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    return result.stdout


def _heading(text: str, param) -> str:
    """The line of `text` that opens `param`'s entry (its names), without the panel's border."""
    names = ", ".join(sorted(param.opts, key=lambda opt: opt.startswith("--")))
    lines = [line.strip("│ ") for line in text.splitlines() if line.startswith("│ ") and line[2] != " "]
    return next(line for line in lines if line == names or line.startswith((f"{names} ", f"{names} /")))


@pytest.mark.parametrize("command", [name for name, _ in COMMANDS])
def test_help_fits_80_columns_with_no_word_cut_and_plain_metavars(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 80 columns typer's table cut option names and words (`torch.amp.GradScal…`) and showed
    `<bool>` on flags, `{path}` for positionals and `<list[str]>` for repeatable options."""
    from rich.text import Text

    text = _help([command], monkeypatch)
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    assert not re.search(r"<(bool|path|str|int|float|list)|\{path\}", text)
    words = set(text.replace("│", " ").split())
    for param in ROOT.commands[command].params:
        plain = Text.from_markup(" ".join((param.help or "").split())).plain
        assert not [w for w in plain.split() if w not in words], (command, param.name)  # no word cut
        if param.param_type_name == "argument":
            assert f"{param.name.upper()}\n" in text.replace(" ", "").replace("│", "")
            continue
        heading = _heading(text, param)
        if param.is_flag:  # names only, no metavar
            assert heading == " / ".join(
                ", ".join(sorted(opts, key=lambda opt: opt.startswith("--")))
                for opts in (param.opts, param.secondary_opts)
                if opts
            ), heading
        elif param.metavar:
            assert heading.endswith(f" {param.metavar}"), heading
        elif param.type_descriptor.is_path:
            assert heading.endswith(" PATH"), heading
        if getattr(param, "multiple", False):
            assert "repeatable" in text
    if command != "env":
        assert "--set KEY=VALUE" in text or "--set" not in text


def test_help_lists_every_family_and_estimator_of_the_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    from stages.advantage.estimators import ESTIMATORS
    from stages.models.factory import FAMILIES

    for command, flag, names in (
        ("init-model", "--family", FAMILIES),
        ("advantage", "--estimator", ESTIMATORS),
    ):
        text = " ".join(_help([command], monkeypatch).replace("│", " ").split())
        entry = text.split(f" {flag} TEXT ", 1)[1].split(" --", 1)[0]
        assert [name for name in names if not re.search(rf"\b{name}\b", entry)] == [], command
    assert "…" not in _help([], monkeypatch)  # the command list of `omnirl --help`
