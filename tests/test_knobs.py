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
from stages.knobs import flag_of, knob, knobs
from stages.logprob.config import LogprobConfig
from stages.models.config import FAMILY_NAMES, MODEL_SIZES, InitModelConfig, PlanConfig
from stages.offline.config import EncodeConfig, PairsConfig
from stages.pretrain.config import PretrainConfig
from stages.score.config import BUILTIN_REWARDS, ScoreConfig

ROOT = typer.main.get_command(app)
CONVERTED = [
    ("advantage", AdvantageConfig),
    ("score", ScoreConfig),
    ("logprob", LogprobConfig),
    ("encode", EncodeConfig),
    ("pairs", PairsConfig),
    ("pretrain", PretrainConfig),
    ("init-model", InitModelConfig),
    ("plan", PlanConfig),
]
# The config modules of the converted commands: none may import torch.
CONFIG_MODULES = [config.__module__ for _, config in CONVERTED]
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
        ("init-model", "--family", FAMILY_NAMES),
        ("plan", "--family", FAMILY_NAMES),
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
        f"import stages.knobs, {', '.join(CONFIG_MODULES)}\n"
        "from typer.testing import CliRunner\n"
        "from omnirl_cli.app import app\n"
        f"for command in {[command for command, _ in CONVERTED]}:\n"
        "    result = CliRunner().invoke(app, [command, '--help'])\n"
        "    assert result.exit_code == 0 and '--json' in result.output, result.output\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_model_sizes_are_those_the_families_offer() -> None:
    """`MODEL_SIZES` (what --size takes) is the union of every family module's `SIZES` and Wan's
    `PUBLISHED`, and the factory builds exactly the `FAMILIES` the CLI names."""
    import importlib

    from stages.models import factory, wan
    from stages.models.config import FAMILIES

    modules = {importlib.import_module(target.split(":")[0]) for target in FAMILIES.values()}
    sizes = {size for module in modules for size in module.SIZES}
    sizes |= {size for published in wan.PUBLISHED.values() for size in published}
    assert sizes == set(MODEL_SIZES)
    assert factory.available_families() == sorted(FAMILY_NAMES)
    assert all(callable(factory.get_builder(name)) for name in FAMILY_NAMES)


def test_init_model_keeps_its_positional_out_and_reads_no_preset(tmp_path: Path) -> None:
    """init-model's OUT stays a positional argument the command line must give, and its settings are
    its flags alone (no --config / --set), as before it was generated."""
    seen: list[InitModelConfig] = []
    probe = typer.Typer()
    probe.command("init-model")(
        config_command(InitModelConfig, "init-model", lambda c, json_: seen.append(c), presets=False)
    )
    missing = CliRunner().invoke(probe, ["--size", "tiny"])
    assert missing.exit_code == 2 and "missing argument" in missing.output.lower()
    assert CliRunner().invoke(probe, ["--set", "seed=3", str(tmp_path / "m")]).exit_code == 2
    result = CliRunner().invoke(probe, ["--family", "flux", "--seed", "3", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert seen == [InitModelConfig(out=tmp_path / "m", family="flux", size="tiny", seed=3)]
    assert "--config" not in {opt for p in ROOT.commands["init-model"].params for opt in p.opts}
