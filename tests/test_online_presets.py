"""Every diffusion preset a staged recipe takes, `omnirl online` takes, into the same stage settings.

For each preset in recipes/configs whose `update.algo` trains a diffusion model, the settings online
builds for its sample, score, advantage and update sections (`OnlineConfig`) equal those the staged
commands resolve from the same file (`sample`'s recorded settings, `score`'s rewards, `advantage`'s and
`update`'s typed configs), but for what the driver sets per iteration (seed, SDE window position) or per
model (resolution, text length, mixed precision).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from omnirl_cli.app import app
from omnirl_cli.generate import config_command
from stages.advantage.config import AdvantageConfig
from stages.sample.config import SampleConfig
from stages.score.config import ScoreConfig
from stages.update.config import RUN_KNOBS, UpdateConfig

PRESETS = sorted((Path(__file__).parents[1] / "recipes" / "configs").glob("*.yaml"))
TOKEN_ALGOS = {"grpo", "dapo", "gspo"}
# per-iteration or per-model sample settings online derives itself, as each staged recipe passes them
DRIVEN = {"seed", "iteration", "resolution", "max_sequence_length", "mixed_precision"}


def _diffusion(preset: Path) -> bool:
    update = yaml.safe_load(preset.read_text()).get("update") or {}
    return update.get("algo", "flow_grpo") not in TOKEN_ALGOS


def _staged(config: Any, command: str, args: list[str]) -> Any:
    """The typed config the staged `command` resolves from `args` (a probe of its generated options)."""
    seen: list[Any] = []
    probe = typer.Typer()
    probe.command(command)(config_command(config, command, lambda c, _: seen.append(c)))
    result = CliRunner().invoke(probe, args)
    assert result.exit_code == 0, result.output
    return seen[0]


class _Built(Exception):
    """Raised in place of running the online driver, once the config it would run is captured."""


@pytest.mark.parametrize("preset", [p for p in PRESETS if _diffusion(p)], ids=lambda p: p.stem)
def test_online_takes_every_diffusion_preset_as_the_staged_commands_do(
    preset: Path, tiny_sd3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.online import pipeline

    captured: list[Any] = []

    def built(cfg: Any, overwrite: bool) -> None:
        captured.append(cfg)
        raise _Built

    monkeypatch.setattr(pipeline, "prepare_run", built)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    common = ["--config", str(preset)]
    rewarded = (yaml.safe_load(preset.read_text()).get("score") or {}).get("reward")
    result = CliRunner().invoke(
        app,
        ["online", *common, "--model", str(tiny_sd3), "--prompts", str(prompts), "--out", str(tmp_path / "o")]
        + ([] if rewarded else ["--reward", "jpeg_compressibility"]),
    )
    assert captured, result.output
    [cfg] = captured

    io = ["--in", "x", "--out", "y"]
    sample_args = [*common, "--model", str(tiny_sd3), "--prompts", str(prompts), "--out", "y"]
    sample = _staged((SampleConfig,), "sample", sample_args)
    assert {k: v for k, v in cfg.sample.record().items() if k not in DRIVEN} == {
        k: v for k, v in sample.record().items() if k not in DRIVEN
    }
    assert (cfg.group_size, cfg.num_prompts) == (sample.group_size, sample.num_prompts)
    score = _staged(ScoreConfig, "score", [*common, *io])
    if score.reward:
        assert [name for name, _ in cfg.rewards] == [s.split("=")[0] for s in score.reward]
    assert (cfg.score_batch_size, cfg.on_error) == (score.batch_size, score.on_error)
    advantage = _staged(AdvantageConfig, "advantage", [*common, *io])
    assert asdict(cfg.advantage) == {**asdict(advantage), "inputs": None, "out": None}
    update = _staged(UpdateConfig, "update", [*common, *io, "--model", str(tiny_sd3)])
    assert {k: v for k, v in asdict(cfg.update).items() if k not in RUN_KNOBS and k != "seed"} == {
        k: v for k, v in asdict(update).items() if k not in RUN_KNOBS and k != "seed"
    }


def test_a_preset_names_one_gate_reward_as_the_flag_given_once() -> None:
    """`advantage: {gate_reward: NAME}` is the list the repeatable flag gives, not the name's letters."""
    from omnirl_cli.commands.online import _dataclass

    section = _dataclass(AdvantageConfig, {"gate_reward": "aesthetic"}, "advantage")
    assert section.gate_reward == ["aesthetic"]


def test_online_without_a_preset_takes_each_staged_commands_defaults(
    tiny_sd3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--config is optional for online as for every command: without one, each stage section is its
    staged command's defaults (flow_grpo, 4 per group), and a preset's --model would do for the flag."""
    from stages.online import pipeline

    captured: list[Any] = []

    def built(cfg: Any, overwrite: bool) -> None:
        captured.append(cfg)
        raise _Built

    monkeypatch.setattr(pipeline, "prepare_run", built)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    preset = tmp_path / "model.yaml"
    preset.write_text(f"model: {tiny_sd3}\n")
    for n, args in enumerate((["--model", str(tiny_sd3)], ["--config", str(preset)]), start=1):
        result = CliRunner().invoke(
            app, ["online", *args, "--prompts", str(prompts), "-r", "ocr", "--out", str(tmp_path / "o")]
        )
        assert len(captured) == n, result.output
    default_update = _staged(UpdateConfig, "update", ["--in", "x", "--out", "y", "--model", str(tiny_sd3)])
    for cfg in captured:
        assert cfg.model == str(tiny_sd3) and cfg.rewards == [("ocr", 1.0)] and cfg.group_size == 4
        assert cfg.update.algo == default_update.algo == "flow_grpo" and cfg.update.lr == default_update.lr
        assert asdict(cfg.advantage) == asdict(AdvantageConfig())
