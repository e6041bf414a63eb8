"""One declaration per knob: the options of the converted commands are generated from their stage's
typed config (`stages.knobs`, `omnirl_cli.generate`), every source resolves into that config, and
neither their --help nor their config modules import torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

import pytest
import typer
from typer.testing import CliRunner

from omnirl_cli.app import app
from omnirl_cli.config import choices_of
from omnirl_cli.generate import config_command
from omnirl_cli.options import REQUIRED
from stages.advantage.config import ESTIMATOR_NAMES, AdvantageConfig
from stages.inspection import EnvConfig, InspectConfig, ReportConfig
from stages.knobs import flag_of, knob, knobs
from stages.sample.serve_config import ServeConfig
from stages.score.config import BUILTIN_REWARDS, ScoreConfig, ServeRewardConfig

ROOT = typer.main.get_command(app)
CONVERTED = [
    ("advantage", AdvantageConfig),
    ("score", ScoreConfig),
    ("serve", ServeConfig),
    ("serve-reward", ServeRewardConfig),
    ("report", ReportConfig),
    ("inspect", InspectConfig),
    ("env", EnvConfig),
]
# Commands that read no preset: their settings are their flags (`config_command(presets=False)`).
FLAGS_ONLY = {"report", "inspect", "env"}
# Options every command has that steer resolution or verbosity, not the stage.
META = {"config", "set_", "json_", "quiet", "verbose", "help"}


def _element(annotation: object) -> tuple[object, bool]:
    """The value type of a field's annotation and whether it is a list: `X | None` → X, `list[X]` → X."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is list:
        return args[0], True
    return _element(args[0]) if args else (annotation, False)


@pytest.mark.parametrize(("command", "config"), CONVERTED)
def test_every_option_is_derived_from_its_config(command: str, config: type) -> None:
    """Each option of the command is one knob of its config, with the knob's flag, type, default, help,
    choices, panel, environment variable, metavar and bounds; no option is declared beside them."""
    params = {p.name: p for p in ROOT.commands[command].params}
    fields = knobs(config)
    assert set(params) - META == {field.name for field, _ in fields}
    steering = {"config", "set_"} & set(params)
    assert steering == (set() if command in FLAGS_ONLY else {"config", "set_"}), command
    hints = get_type_hints(config)
    for field, declared in fields:
        param, hint = params[field.name], hints[field.name]
        assert (param.param_type_name == "argument") is declared.argument, field.name
        if declared.argument:  # positional: named after the field, given on the command line
            assert param.opts == [field.name] and param.required, field.name
        else:
            assert param.opts[0] == flag_of(field.name, declared), field.name
            assert param.opts[1:] == ([declared.short] if declared.short else []), field.name
        negative = [f"--no-{param.opts[0][2:]}"] if declared.negative else []
        assert param.secondary_opts == negative, field.name
        assert param.default == field.default, field.name
        assert param.help == (f"{declared.help} {REQUIRED}" if declared.required else declared.help)
        assert param.rich_help_panel == declared.panel, field.name
        assert param.envvar == declared.envvar, field.name
        assert param.metavar == declared.metavar, field.name
        assert choices_of(param) == declared.choices, field.name
        value, repeatable = _element(hint)
        assert param.multiple == repeatable, field.name
        described = param.type_descriptor  # typer's view of the option's type (typer 0.29)
        if declared.choices is None:
            assert described.annotation == (list[value] if repeatable else value), field.name
        assert getattr(param, "is_flag", False) == (value is bool), field.name  # an argument is no flag
        assert described.parameter_info.min == declared.low, field.name
        assert described.parameter_info.max == declared.high, field.name


def test_open_registries_complete_their_builtins() -> None:
    """--estimator and --reward offer the library's built-in names (plugins stay accepted)."""
    for command, flag, names in (
        ("advantage", "--estimator", ESTIMATOR_NAMES),
        ("score", "--reward", BUILTIN_REWARDS),
        ("serve-reward", "--reward", BUILTIN_REWARDS),
    ):
        cmd = ROOT.commands[command]
        param = next(p for p in cmd.params if flag in p.opts)
        ctx = cmd.make_context(command, [], resilient_parsing=True)
        offered = [item.value for item in param.shell_complete(ctx, "")]
        assert offered[: len(names)] == list(names)
    assert "dance" in ESTIMATOR_NAMES and "pairs" in ESTIMATOR_NAMES


def test_every_source_resolves_into_the_typed_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """YAML, --set, OMNIRL_* and flags give one AdvantageConfig, each value of its declared type and
    from the source with the highest precedence."""
    seen: list[tuple[AdvantageConfig, bool]] = []
    probe = typer.Typer()
    probe.command("advantage")(
        config_command(AdvantageConfig, "advantage", lambda c, json_: seen.append((c, json_)))
    )
    preset = tmp_path / "preset.yaml"
    preset.write_text("advantage:\n  clip: '2.5'\n  std: group\n  drop_zero_std: true\n  out: from_yaml\n")
    monkeypatch.setenv("OMNIRL_FORMAT", "webdataset")
    args = ["--config", str(preset), "--set", "clip=3", "--std", "none", "--in", "a", "--in", "b", "--json"]
    result = CliRunner().invoke(probe, args)
    assert result.exit_code == 0, result.output
    [(c, json_)] = seen
    assert json_ is True
    assert c == AdvantageConfig(
        inputs=[Path("a"), Path("b")],
        out=Path("from_yaml"),
        std="none",
        clip=3.0,
        drop_zero_std=True,
        fmt="webdataset",
    )
    assert isinstance(c.clip, float) and isinstance(c.out, Path)
    assert c.estimator_name() == "drgrpo"
    assert dataclasses.replace(c, std=None).estimator_name() == "grpo"


def test_a_negative_knob_is_a_two_way_flag(tmp_path: Path) -> None:
    """A bool knob declared `negative` (on by default) is turned off by --no-FLAG, and from a preset or
    --set as any knob; its flag wins over both."""

    @dataclasses.dataclass
    class Probe:
        shuffle: bool = knob(True, "Shuffle.", negative=True)

    seen: list[bool] = []
    probe = typer.Typer()
    probe.command("probe")(config_command(Probe, "probe", lambda c, json_: seen.append(c.shuffle)))
    preset = tmp_path / "preset.yaml"
    preset.write_text("probe:\n  shuffle: false\n")
    for args, expected in (
        ([], True),
        (["--no-shuffle"], False),
        (["--config", str(preset)], False),
        (["--set", "shuffle=false"], False),
        (["--config", str(preset), "--shuffle"], True),
    ):
        result = CliRunner().invoke(probe, args)
        assert result.exit_code == 0, result.output
        assert seen.pop() is expected, args
    assert "--no-shuffle" in CliRunner().invoke(probe, ["--help"]).output


def test_an_argument_knob_is_positional_and_a_flags_only_command_reads_no_preset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A knob declared `argument` is a positional argument the command line must give; a command
    generated with presets=False has no --config / --set and ignores OMNIRL_CONFIG, so its settings
    are its flags."""

    @dataclasses.dataclass
    class Probe:
        path: Path | None = knob(None, "Where.", argument=True)
        head: int = knob(0, "Rows.", low=0)

    seen: list[Probe] = []
    probe = typer.Typer()
    probe.command("probe")(config_command(Probe, "probe", lambda c, json_: seen.append(c), presets=False))
    preset = tmp_path / "preset.yaml"
    preset.write_text("head: 5\nprobe:\n  head: 7\n")
    monkeypatch.setenv("OMNIRL_CONFIG", str(preset))
    result = CliRunner().invoke(probe, ["somewhere", "--head", "3"])
    assert result.exit_code == 0, result.output
    assert seen.pop() == Probe(path=Path("somewhere"), head=3)
    result = CliRunner().invoke(probe, ["somewhere"])
    assert result.exit_code == 0, result.output
    assert seen.pop() == Probe(path=Path("somewhere"), head=0)
    for args in ([], ["somewhere", "--set", "head=1"], ["somewhere", "--config", str(preset)]):
        assert CliRunner().invoke(probe, args).exit_code == 2, args
    assert not seen


def test_a_choice_from_a_preset_is_checked_against_the_knob(tmp_path: Path) -> None:
    """A value outside a knob's `choices` is refused from a preset as from a flag, in one line."""
    preset = tmp_path / "preset.yaml"
    preset.write_text("advantage:\n  aggregation: sum\n")
    result = CliRunner().invoke(app, ["advantage", "--config", str(preset), "--in", "x", "--out", "y"])
    assert result.exit_code == 2
    assert "--aggregation 'sum': choose one of reward_aggr, advantage_aggr" in result.output


def test_help_and_configs_do_not_import_torch() -> None:
    """`omnirl CMD --help` of every converted command and the knob modules leave torch unloaded."""
    code = (
        "import sys\n"
        "import stages.advantage.config, stages.score.config, stages.knobs\n"
        "import stages.sample.serve_config, stages.inspection\n"
        "from typer.testing import CliRunner\n"
        "from omnirl_cli.app import app\n"
        f"for command in {[command for command, _ in CONVERTED]!r}:\n"
        "    result = CliRunner().invoke(app, [command, '--help'])\n"
        "    assert result.exit_code == 0 and '--json' in result.output, result.output\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
