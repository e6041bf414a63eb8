"""`stages.reporting` on hand-made shard sets: the statistics against independent arithmetic, the
held-out evaluation rows, and grids laid out with a prompt column (before/after only for one prompt list)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from stages.report_sheets import LABEL_WIDTH, comparison_grid, image_grid
from stages.reporting import collect, reward_curve
from stages.sample.stage import KINDS
from stages.shards.writer import ShardSetWriter

PROMPTS = ["a photo of two circles", "a photo of a red square"]


def _png(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (value, 255 - value, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def _write(
    path: Path, columns: dict, *, kinds: dict | None = None, parents: list[Path] | None = None
) -> None:
    writer = ShardSetWriter(path, num_shards=1, command="test", config={}, kinds=kinds, parents=parents or [])
    writer.write_shard(0, columns)
    writer.finalize()


def _rollout(it: Path, rewards: list[float], strict: list[float], prompts: list[str] = PROMPTS) -> None:
    """it/samples (two prompts × len/2 images) and it/rewards with a total and a strict column."""
    per = len(rewards) // len(prompts)
    ids = [f"s{i}" for i in range(len(rewards))]
    _write(
        it / "samples",
        {
            "sample_id": ids,
            "group_id": [f"g{i // per}" for i in range(len(rewards))],
            "prompt": [prompts[i // per] for i in range(len(rewards))],
            "image": [_png(40 * i) for i in range(len(rewards))],
        },
        kinds=KINDS,
    )
    _write(
        it / "rewards",
        {
            "sample_id": ids,
            "reward": torch.tensor(rewards, dtype=torch.float32),
            "reward.geneval_shapes_strict": torch.tensor(strict, dtype=torch.float32),
        },
        parents=[it / "samples"],
    )


def test_collect_gives_standard_errors_named_means_and_the_eval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _rollout(run / "it0", [0.25, 0.5, 0.75, 1.0], [0, 0, 1, 1])
    _rollout(run / "it0" / "eval", [0.0, 1.0, 1.0, 1.0], [0, 1, 1, 1])
    _rollout(run / "it1" / "eval", [1.0, 1.0, 1.0, 1.0], [1, 1, 1, 1])  # evaluated only
    rows = collect(run)
    assert [r["iteration"] for r in rows] == [0, 1]
    first = rows[0]
    # mean 0.625; sample variance = (0.375² + 0.125² + 0.125² + 0.375²) / 3 = 0.3125 / 3
    assert first["reward_mean"] == pytest.approx(0.625)
    assert first["reward_se"] == pytest.approx(math.sqrt(0.3125 / 3) / 2)
    assert first["reward.geneval_shapes_strict_mean"] == pytest.approx(0.5)
    assert first["eval"]["reward_mean"] == pytest.approx(0.75)
    assert first["eval"]["reward_se"] == pytest.approx(math.sqrt(0.75 / 3) / 2)  # (3·0.25² + 0.75²) / 3
    assert first["eval"]["reward.geneval_shapes_strict_mean"] == pytest.approx(0.75)
    assert "reward_mean" not in rows[1] and rows[1]["eval"]["reward_se"] == 0.0
    curve = reward_curve(rows, run / "reward_curve.png")
    with Image.open(curve) as image:
        assert image.size == (640, 400)


def test_grids_put_the_prompt_beside_each_row(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _rollout(run / "it0", [0.0, 0.5, 0.5, 1.0], [0, 0, 0, 1])
    _rollout(run / "it1", [1.0, 1.0, 0.5, 1.0], [1, 1, 0, 1])
    grid = image_grid(run / "it0" / "samples", run / "it0" / "rewards", tmp_path / "grid.png", cell=32)
    with Image.open(grid) as image:
        assert image.width == LABEL_WIDTH + 2 * 32 and image.height == 2 * (32 + 18)
        prompt_column = image.crop((0, 0, LABEL_WIDTH, image.height)).convert("L")
        assert prompt_column.getextrema()[0] < 128  # the prompt is written there
    both = comparison_grid(
        (run / "it0" / "samples", run / "it0" / "rewards"),
        (run / "it1" / "samples", run / "it1" / "rewards"),
        tmp_path / "before_after.png",
        cell=32,
    )
    assert both is not None
    with Image.open(both) as image:
        assert image.width == LABEL_WIDTH + 2 * (2 * 32) + 12  # two blocks of two and the gap
        # the first row's first "after" tile is it1's first image, pixel for pixel
        tile = image.crop((LABEL_WIDTH + 64 + 12, 18 + 14, LABEL_WIDTH + 64 + 12 + 32, 18 + 14 + 32))
        assert tile.getpixel((16, 16)) == (0, 255, 0)
    _rollout(run / "it2", [1.0, 1.0, 1.0, 1.0], [1, 1, 1, 1], prompts=["a photo of a circle", PROMPTS[1]])
    assert (
        comparison_grid(
            (run / "it0" / "samples", None), (run / "it2" / "samples", None), tmp_path / "never.png"
        )
        is None
    )
    assert not (tmp_path / "never.png").exists()


def test_a_conditioned_runs_grids_show_source_then_result(tmp_path: Path) -> None:
    """An editing rollout's grid (and before/after) starts each row with its group's source image."""
    from stages.models.condition_images import (
        condition_images_file,
        condition_images_record,
        write_condition_images,
    )

    def edits(samples: Path) -> None:
        ids = ["s0", "s1", "s2", "s3"]
        writer = ShardSetWriter(samples, num_shards=1, command="test", config={}, kinds=KINDS)
        groups = {"g0": [_png(250)], "g1": [_png(5)]}  # each group's source: (250, 5, 0) and (5, 250, 0)
        samples.mkdir(parents=True)
        write_condition_images(samples / condition_images_file(0, 1), groups, writer.content_id)
        writer.write_shard(
            0,
            {
                "sample_id": ids,
                "group_id": ["g0", "g0", "g1", "g1"],
                "prompt": ["make the square green", "make the square green", "make it red", "make it red"],
                "image": [_png(40 * i) for i in range(4)],
            },
        )
        writer.finalize(condition_images_record(samples, 1, writer.content_id))

    edits(tmp_path / "it0" / "samples")
    edits(tmp_path / "it1" / "samples")
    grid = image_grid(tmp_path / "it0" / "samples", None, tmp_path / "grid.png", cell=32)
    top = 14 + 4  # the column headers ("source")
    with Image.open(grid) as image:
        assert image.width == LABEL_WIDTH + 32 + 12 + 2 * 32  # source, gap, two results
        for row, source in enumerate([(250, 5, 0), (5, 250, 0)]):
            y = top + row * (32 + 18) + 14 + 16
            assert image.getpixel((LABEL_WIDTH + 16, y)) == source
            assert image.getpixel((LABEL_WIDTH + 32 + 12 + 16, y)) == (80 * row, 255 - 80 * row, 0)
    both = comparison_grid(
        (tmp_path / "it0" / "samples", None),
        (tmp_path / "it1" / "samples", None),
        tmp_path / "ba.png",
        cell=32,
    )
    with Image.open(both) as image:
        assert image.width == LABEL_WIDTH + 32 + 2 * (2 * 32) + 2 * 12
        assert image.getpixel((LABEL_WIDTH + 16, top + 14 + 16)) == (250, 5, 0)


def test_report_iteration_prints_one_row_as_one_line_on_stdout(tmp_path: Path) -> None:
    """The recipes' line per finished iteration: the same numbers as `collect`, ± labelled se."""
    from typer.testing import CliRunner

    from omnirl_cli.app import app

    run = tmp_path / "run"
    _rollout(run / "it0", [0.25, 0.5, 0.75, 1.0], [0, 0, 1, 1])
    _rollout(run / "it0" / "eval", [0.0, 1.0, 1.0, 1.0], [0, 1, 1, 1])
    _rollout(run / "it1" / "eval", [1.0, 1.0, 1.0, 1.0], [1, 1, 1, 1])
    runner = CliRunner()
    first = runner.invoke(app, ["report", str(run), "--iteration", "0"])
    assert first.exit_code == 0, first.output
    # se = √(0.3125 / 3) / 2 = 0.161 and √(0.75 / 3) / 2 = 0.25; a strict mean equal to the total is not repeated
    assert first.stdout == (
        "it0  reward 0.625 ± 0.16 (se, n 4)  geneval_shapes_strict 0.5  "
        "held-out reward 0.75 ± 0.25 (se, n 4)  geneval_shapes_strict 0.75\n"
    )
    assert (
        runner.invoke(app, ["report", str(run), "--iteration", "1"]).stdout
        == "it1  held-out reward 1 ± 0 (se, n 4)\n"
    )
    assert not (run / "reward_curve.png").exists()  # the line alone: no curve, no grids
