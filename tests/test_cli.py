"""The command line: help for every command, config precedence, one-line errors and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from helpers import fails, run
from typer.testing import CliRunner

from omnirl_cli.app import app
from omnirl_cli.commands import COMMANDS
from omnirl_cli.config import parse_set, resolve

runner = CliRunner()


@pytest.mark.parametrize("name", [name for name, _ in COMMANDS])
def test_every_command_has_help_with_an_example(name: str) -> None:
    result = runner.invoke(app, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output
    assert f"omnirl {name}" in result.output


def test_root_help_lists_every_command_and_version() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name, _ in COMMANDS:
        assert name in result.output
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("omnirl ")


def test_help_stays_light_because_torch_is_imported_lazily() -> None:
    code = "import sys, omnirl_cli.app; print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_parse_set_builds_nested_typed_values() -> None:
    assert parse_set(["steps=10", "sample.guidance=4.5", "name=abc", "flag=true"]) == {
        "steps": 10,
        "sample": {"guidance": 4.5},
        "name": "abc",
        "flag": True,
    }


def _probe_app() -> typer.Typer:
    probe = typer.Typer()
    seen: dict = {}

    @probe.command()
    def sample(
        ctx: typer.Context,
        steps: int = typer.Option(10, "--steps"),
        guidance: float = typer.Option(4.5, "--guidance"),
        fmt: str = typer.Option("parquet", "--format"),
        tag: list[str] | None = typer.Option(None, "--tag"),
        config: Path | None = typer.Option(None, "--config"),
        set_: list[str] | None = typer.Option(None, "--set"),
    ) -> None:
        seen.update(resolve(ctx, "sample"))

    probe.seen = seen  # type: ignore[attr-defined]
    return probe


def test_precedence_flags_over_set_over_yaml_over_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "preset.yaml"
    cfg.write_text(
        "steps: 20\nguidance: 7.0\nformat: webdataset\nsample:\n  steps: 30\nscore:\n  reward: [ocr]\n"
    )
    probe = _probe_app()
    result = runner.invoke(probe, ["--config", str(cfg)])
    assert result.exit_code == 0, result.output
    assert probe.seen["steps"] == 30 and probe.seen["guidance"] == 7.0 and probe.seen["fmt"] == "webdataset"
    result = runner.invoke(probe, ["--config", str(cfg), "--set", "steps=40", "--set", "guidance=2"])
    assert probe.seen["steps"] == 40 and probe.seen["guidance"] == 2.0
    result = runner.invoke(probe, ["--config", str(cfg), "--set", "steps=40", "--steps", "50"])
    assert probe.seen["steps"] == 50
    result = runner.invoke(probe, [])
    assert probe.seen["steps"] == 10 and probe.seen["fmt"] == "parquet" and not probe.seen["tag"]


def test_one_value_of_a_repeatable_option_is_a_list_of_one(tmp_path: Path) -> None:
    """`--set tag=a` and a YAML `tag: a` mean what `--tag a` means (a bare value was refused as not
    iterable); a YAML list is kept."""
    cfg = tmp_path / "preset.yaml"
    probe = _probe_app()
    for text, args, expected in (
        ("tag: a\n", [], ["a"]),
        ("tag: [a, b]\n", [], ["a", "b"]),
        ("steps: 3\n", ["--set", "tag=c"], ["c"]),
        ("tag: a\n", ["--tag", "d"], ["d"]),
    ):
        cfg.write_text(text)
        result = runner.invoke(probe, ["--config", str(cfg), *args])
        assert result.exit_code == 0, result.output
        assert probe.seen["tag"] == expected


def test_unknown_key_in_own_section_is_rejected(tmp_path: Path) -> None:
    from stages.errors import UserInputError

    cfg = tmp_path / "preset.yaml"
    cfg.write_text("sample:\n  stepz: 3\n")
    probe = _probe_app()
    result = runner.invoke(probe, ["--config", str(cfg)])
    assert isinstance(result.exception, UserInputError)
    assert "sample.stepz" in str(result.exception)


def test_a_top_level_key_nothing_reads_is_refused_in_one_line(tmp_path: Path) -> None:
    """`stepps: 3` at the top level ran silently with the default (a section typo was refused); a key
    another command reads (group_size: sample's) and a section of another command still pass."""
    cfg = tmp_path / "preset.yaml"
    args = ["advantage", "--in", str(tmp_path / "none"), "--config", str(cfg), "--out", str(tmp_path / "o")]
    cfg.write_text("stepps: 3\n")
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --config {cfg}: top-level key 'stepps' is not an option of any omnirl command; "
        "did you mean 'steps'?"
    ]
    cfg.write_text("smaple:\n  steps: 3\n")
    result = runner.invoke(app, args)
    assert (
        result.exit_code == 2
        and "'smaple' is not a command's section; did you mean 'sample'?" in result.stderr
    )
    cfg.write_text("group_size: 4\nsample:\n  steps: 3\n")
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "none" in result.stderr and "top-level" not in result.stderr


@pytest.mark.parametrize("option", ["--model", "--adapter"])
def test_a_value_spelled_as_a_path_is_never_a_hub_id(
    option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """./x, ../x, /x and a path under an existing folder are never looked up in the Hub cache (they
    said "fetch it with `hf download models/sd3-tin`", the ./ stripped): a missing one is one line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "sd3-tiny").mkdir(parents=True)
    for value, shown in (
        ("./nonexistent/dir", "./nonexistent/dir: no such folder/file"),
        ("../nonexistent", "../nonexistent: no such folder/file"),
        (str(tmp_path / "gone"), f"{tmp_path / 'gone'}: no such folder/file"),
        ("models/sd3-tin", "models/sd3-tin: no such folder/file; did you mean models/sd3-tiny?"),
    ):
        model = value if option == "--model" else "models/sd3-tiny"
        args = ["logprob", "--model", model, "--in", "samples", "--out", "out"]
        args += ["--adapter", value] if option == "--adapter" else []
        line = fails(args, f"error: {option} {shown}")
        assert "hf download" not in line and "Hub" not in line, line
    assert not (tmp_path / "out").exists()


def test_sample_draws_at_the_native_resolution_an_init_model_folder_records(
    tiny_sd3: Path, tmp_path: Path
) -> None:
    """Without --resolution, sample drew at 512 px, which the tiny model refuses; it now takes the side
    the model card records (64 px for the tiny SD3). A folder without the record keeps 512."""
    import shutil

    from stages.shards.manifest import read_manifest

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a red circle\n")
    card = json.loads((tiny_sd3 / "omnirl_model.json").read_text())
    args = ["sample", "--prompts", str(prompts), "-n", "2", "--steps", "2", "--guidance", "1"]
    run(*args, "--model", str(tiny_sd3), "--out", str(tmp_path / "s"))
    assert read_manifest(tmp_path / "s").config["resolution"] == card["details"]["image_size"] == 64
    bare = tmp_path / "bare"  # a checkpoint without omnirl's card, as a real one is
    shutil.copytree(tiny_sd3, bare)
    (bare / "omnirl_model.json").unlink()
    fails([*args, "--model", str(bare), "--out", str(tmp_path / "b")], "--resolution 512: ", "at most 256 px")


def test_missing_shard_set_is_one_line_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omnirl_cli", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "nope" in lines[0] and "Traceback" not in result.stderr


def test_debug_env_shows_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omnirl_cli", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "OMNIRL_DEBUG": "1"},
    )
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_bad_config_file_is_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [unclosed\n")
    result = runner.invoke(
        app, ["advantage", "--in", str(tmp_path), "--config", str(bad), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2
    assert "bad.yaml" in result.output


def test_json_mode_prints_one_object(tiny_shard_set: Path) -> None:
    result = runner.invoke(app, ["inspect", str(tiny_shard_set), "--json", "--verify"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["num_rows"] == 6 and info["verified"] is True


@pytest.mark.parametrize("preset", sorted((Path(__file__).parents[1] / "recipes" / "configs").glob("*.yaml")))
def test_every_preset_names_real_options(preset: Path) -> None:
    """Each section of a preset is a command, each key one of its options (else --config fails at run time)."""
    import yaml

    root = typer.main.get_command(app)
    data = yaml.safe_load(preset.read_text())
    assert preset.read_text().startswith("#"), (
        "a preset opens with a header saying where its numbers come from"
    )
    for section, values in data.items():
        command = root.commands[section]
        names = {p.name for p in command.params} | {
            opt[2:].replace("-", "_") for p in command.params for opt in p.opts if opt.startswith("--")
        }
        unknown = sorted(k for k in values if k.replace("-", "_") not in names)
        assert not unknown, f"{preset.name}: {section}.{unknown}"
