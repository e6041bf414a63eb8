"""A run folder's dataset card (stages/shards/run_card.py): every shard set finished inside RUN/it<K>/
rewrites RUN/README.md so that `datasets.load_dataset(RUN, KIND, split="it<K>")` reads each kind of set
on its own; a README.md the user wrote is never touched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from test_shards import write_set

from stages.shards.run_card import MARKER

datasets = pytest.importorskip("datasets")


def rollout(rows: int, offset: int) -> dict:
    return {
        "sample_id": [f"s{offset + i}" for i in range(rows)],
        "latents": torch.arange(rows * 6, dtype=torch.float32).reshape(rows, 2, 3) + offset,
    }


def rewards(rows: int, offset: int) -> dict:
    return {"sample_id": [f"s{offset + i}" for i in range(rows)], "reward": torch.linspace(0, 1, rows)}


def front_matter(card: Path) -> dict:
    text = card.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_each_finished_set_lists_its_kind_and_iteration(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_set(run / "it0" / "samples", [rollout(3, 0), rollout(2, 3)], "parquet")
    write_set(run / "it0" / "rewards", [rewards(3, 0), rewards(2, 3)], "parquet")
    write_set(run / "it1" / "samples", [rollout(4, 10)], "parquet")
    write_set(run / "it1" / "eval" / "rewards", [rewards(2, 20)], "parquet")
    write_set(run / "it1" / "advantages", [rewards(4, 10)], "webdataset")  # not readable beside Parquet
    (run / "it1" / "rewards").mkdir()  # being written: no manifest yet, so not listed
    (run / "it1" / "rewards" / "train-00000-of-00001.parquet").write_bytes(b"partial")
    configs = front_matter(run / "README.md")["configs"]
    assert configs == [
        {
            "config_name": "samples",
            "data_files": [
                {"split": "it0", "path": "it0/samples/train-*-of-00002.parquet"},
                {"split": "it1", "path": "it1/samples/train-*-of-00001.parquet"},
            ],
            "default": True,
        },
        {"config_name": "rewards", "data_files": [{"split": "it0", "path": "it0/rewards/train-*-of-00002.parquet"}]},
        {"config_name": "eval_rewards", "data_files": [{"split": "it1", "path": "it1/eval/rewards/train-*-of-00001.parquet"}]},
    ]  # fmt: skip
    text = (run / "README.md").read_text()
    assert MARKER in text and "Not listed: advantages, in another shard format" in text

    cache = str(tmp_path / "cache")
    samples = datasets.load_dataset(str(run), "samples", cache_dir=cache)
    assert {split: ds["sample_id"] for split, ds in samples.items()} == {
        "it0": ["s0", "s1", "s2", "s3", "s4"],
        "it1": ["s10", "s11", "s12", "s13"],
    }
    assert samples["it1"]["latents"][0] == [[10.0, 11.0, 12.0], [13.0, 14.0, 15.0]]
    scored = datasets.load_dataset(str(run), "rewards", split="it0", cache_dir=cache)
    assert scored["reward"] == pytest.approx([0.0, 0.5, 1.0, 0.0, 1.0])
    held_out = datasets.load_dataset(str(run), "eval_rewards", split="it1", cache_dir=cache)
    assert held_out["sample_id"] == ["s20", "s21"] and held_out["reward"] == [0.0, 1.0]
    # the default config: the folder itself loads as the samples, not as a mix of every set's columns
    assert datasets.load_dataset(str(run), split="it1", cache_dir=cache)["sample_id"] == [
        "s10",
        "s11",
        "s12",
        "s13",
    ]


def test_a_readme_the_user_wrote_is_left_alone(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "README.md").write_text("# my notes\n")
    write_set(run / "it0" / "samples", [rollout(2, 0)], "parquet")
    assert (run / "README.md").read_text() == "# my notes\n"


def test_a_set_outside_a_run_folder_writes_no_card(tmp_path: Path) -> None:
    write_set(tmp_path / "data" / "samples", [rollout(2, 0)], "parquet")
    write_set(tmp_path / "it0" / "deep" / "samples", [rollout(2, 0)], "parquet")
    assert list(tmp_path.rglob("README.md")) == []


def test_a_webdataset_run_lists_its_tar_shards(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_set(run / "it0" / "samples", [rollout(2, 0)], "webdataset")
    write_set(run / "it0" / "rewards", [rewards(2, 0)], "webdataset")
    configs = front_matter(run / "README.md")["configs"]
    assert [c["data_files"] for c in configs] == [
        [{"split": "it0", "path": "it0/samples/train-*-of-00001.tar"}],
        [{"split": "it0", "path": "it0/rewards/train-*-of-00001.tar"}],
    ]
    scored = datasets.load_dataset(str(run), "rewards", split="it0", cache_dir=str(tmp_path / "cache"))
    assert scored["sample_id.txt"] == ["s0", "s1"] and scored["reward.npy"] == [0.0, 1.0]
