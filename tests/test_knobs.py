"""One declaration per knob: the options of `advantage` and `score` are generated from their stage's
typed config (`stages.knobs`, `omnirl_cli.generate`), every source resolves into that config, and
neither their --help nor their config modules import torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import ClassVar, get_args, get_origin, get_type_hints

import pytest
import typer
from typer.testing import CliRunner

from omnirl_cli.app import app
from omnirl_cli.config import choices_of
from omnirl_cli.generate import config_command
from omnirl_cli.options import REQUIRED
from stages.advantage.config import ESTIMATOR_NAMES, AdvantageConfig
from stages.knobs import flag_of, knob, knobs
from stages.sample.config import SampleConfig, VLMSampleConfig
from stages.score.config import BUILTIN_REWARDS, ScoreConfig

ROOT = typer.main.get_command(app)
CONVERTED = [
    ("advantage", AdvantageConfig),
    ("score", ScoreConfig),
    ("sample", (SampleConfig, VLMSampleConfig)),  # two kinds: the union of their knobs
]
# Options every command has that steer resolution or verbosity, not the stage.
META = {"config", "set_", "json_", "quiet", "verbose", "help"}


def _element(annotation: object) -> tuple[object, bool]:
    """The value type of a field's annotation and whether it is a list: `X | None` → X, `list[X]` → X."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is list:
        return args[0], True
    if get_origin(annotation) is tuple:
        return annotation, False
    return _element(args[0]) if args else (annotation, False)


@pytest.mark.parametrize(("command", "config"), CONVERTED)
def test_every_option_is_derived_from_its_config(command: str, config: type | tuple[type, ...]) -> None:
    """Each option of the command is one knob of its config (of one of its configs), with the knob's
    flag, type, default, help, choices, panel, environment variable, metavar and bounds; no option is
    declared beside them."""
    params = {p.name: p for p in ROOT.commands[command].params}
    configs = config if isinstance(config, tuple) else (config,)
    fields = list({field.name: (field, declared) for c in configs for field, declared in knobs(c)}.values())
    assert set(params) - META == {field.name for field, _ in fields}
    hints = {name: hint for c in configs for name, hint in get_type_hints(c).items()}
    for field, declared in fields:
        param, hint = params[field.name], hints[field.name]
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
        assert param.is_flag == (value is bool), field.name
        assert described.parameter_info.min == declared.low, field.name
        assert described.parameter_info.max == declared.high, field.name


def test_open_registries_complete_their_builtins() -> None:
    """--estimator and --reward offer the library's built-in names (plugins stay accepted)."""
    for command, flag, names in (
        ("advantage", "--estimator", ESTIMATOR_NAMES),
        ("score", "--reward", BUILTIN_REWARDS),
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
    """`omnirl advantage --help`, `omnirl score --help`, `omnirl sample --help` and the knob modules
    leave torch unloaded."""
    code = (
        "import sys\n"
        "import stages.advantage.config, stages.score.config, stages.sample.config, stages.knobs\n"
        "from typer.testing import CliRunner\n"
        "from omnirl_cli.app import app\n"
        "for command in ('advantage', 'score', 'sample'):\n"
        "    result = CliRunner().invoke(app, [command, '--help'])\n"
        "    assert result.exit_code == 0 and '--out' in result.output, result.output\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_sample_closed_sets_are_the_library_s() -> None:
    """The sampler, window, latent-dtype and engine names `omnirl sample` offers are the ones the torch
    modules validate and register: declared once, in `stages.sample.config`."""
    from stages.sample import config, engines, rollout, samplers, windows

    assert samplers.SAMPLERS is config.SAMPLERS == ("ode", "sde", "cps", "dance")
    assert ("all", *config.WINDOW_STRATEGIES) == windows.STRATEGIES
    assert tuple(rollout.LATENT_DTYPES) == config.LATENT_DTYPE_NAMES == ("fp32", "bf16")
    assert engines.engine_names() == list(config.DIFFUSION_ENGINES)  # no plugin engine installed here
    assert engines.ENTRY_POINT_GROUP == config.ENGINE_ENTRY_POINTS == "omnirl.engines"
    cmd = ROOT.commands["sample"]
    param = next(p for p in cmd.params if "--engine" in p.opts)
    ctx = cmd.make_context("sample", [], resilient_parsing=True)
    assert [item.value for item in param.shell_complete(ctx, "")] == list(config.ENGINES)


@dataclasses.dataclass
class _Run:
    model: str | None = knob(None, "Weights.", required=True)
    seed: int = knob(0, "Seed.")


@dataclasses.dataclass
class _Pictures(_Run):
    KIND: ClassVar[str] = "pictures"
    steps: int = knob(10, "Steps.", envvar="PROBE_STEPS")


@dataclasses.dataclass
class _Words(_Run):
    KIND: ClassVar[str] = "words"
    temperature: float = knob(1.0, "Temperature.")


def test_a_knob_of_the_other_kind_is_refused_from_every_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command of two configs has the union of their options; the kind `choose` picks from the resolved
    values gets its own instance, and a knob of the other kind given from a flag, the environment, a
    preset or --set (even at its default value) is one line naming it there and the kind."""
    seen: list[object] = []
    probe = typer.Typer()
    probe.command("probe")(
        config_command(
            (_Pictures, _Words),
            "probe",
            lambda c, json_: seen.append(c),
            choose=lambda resolved: _Words if Path(resolved["model"]).name == "words" else _Pictures,
        )
    )
    words, pictures = tmp_path / "words", tmp_path / "pictures"
    words.mkdir(), pictures.mkdir()
    runner = CliRunner()
    assert runner.invoke(probe, ["--model", str(pictures), "--steps", "3", "--seed", "1"]).exit_code == 0
    assert runner.invoke(probe, ["--model", str(words), "--temperature", "0.5"]).exit_code == 0
    assert seen == [
        _Pictures(model=pictures, seed=1, steps=3),
        _Words(model=words, temperature=0.5),
    ]
    preset = tmp_path / "preset.yaml"
    preset.write_text("probe:\n  steps: 10\n")
    for args, env, line in (
        (["--steps", "10"], {}, "--steps: words and never reads it; drop it"),
        ([], {"PROBE_STEPS": "4"}, "PROBE_STEPS: words and never reads it; drop it"),
        (
            ["--config", str(preset)],
            {},
            f"steps (from --config {preset}): words and never reads it; drop it",
        ),
        (["--set", "steps=4"], {}, "steps (from --set): words and never reads it; drop it"),
    ):
        result = runner.invoke(probe, ["--model", str(words), *args], env=env)
        assert result.exit_code == 2 and result.output.strip() == f"error: {line}", args
    monkeypatch.delenv("PROBE_STEPS", raising=False)
    result = runner.invoke(probe, ["--model", str(pictures), "--set", "temperature=2"])
    assert result.output.strip() == "error: temperature (from --set): pictures and never reads it; drop it"
    assert len(seen) == 2


def test_sample_resolves_into_the_config_of_its_model_kind(
    tiny_sd3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`omnirl sample` hands its body a SampleConfig for a diffusers pipeline, with every source resolved
    into its fields (--sde-window sets `window`, --no-roll-back `roll_back`); one flag of the VLM kind
    is refused before any model loads."""
    from omnirl_cli.commands.sample import _kind

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)  # so --mixed-precision's default is no
    seen: list[object] = []
    probe = typer.Typer()
    probe.command("sample")(
        config_command((SampleConfig, VLMSampleConfig), "sample", lambda c, j: seen.append(c), choose=_kind)
    )
    preset = tmp_path / "preset.yaml"
    preset.write_text("sample:\n  sde_window: 2\n  sampler: cps\n  resolution: 32x64\n")
    base = ["--model", str(tiny_sd3), "--prompts", "p.txt", "--out", str(tmp_path / "s")]
    result = CliRunner().invoke(probe, [*base, "--config", str(preset), "--no-roll-back", "-n", "3"])
    assert result.exit_code == 0, result.output
    [c] = seen
    assert type(c) is SampleConfig and (c.window, c.sampler, c.roll_back, c.group_size) == (
        2,
        "cps",
        False,
        3,
    )
    assert c.resolution == (32, 64) and c.engine == "diffusers" and c.mixed_precision == "no"
    assert c.record()["window"] == 2 and "prompts" not in c.record()
    result = CliRunner().invoke(app, ["sample", *base, "--top-p", "0.5"])
    assert result.exit_code == 2
    assert "--top-p: a diffusion --model samples media and never reads it; drop it" in result.output
