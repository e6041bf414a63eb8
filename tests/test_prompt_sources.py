"""Prompt sources: folders, globs, repeated --prompts, save_to_disk folders and Hub datasets from the local
cache (offline, through `datasets`), streamed picks, and a content digest for every kind."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import ClassVar

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import fails, run, sample_args

from stages.errors import UserInputError
from stages.sample.prompts import pick_prompts, read_prompts, sample_prompts
from stages.sample.sources import PromptSource
from stages.shards.digest import content_digest
from stages.shards.reader import ShardSet

FEATURES = datasets.Features({"prompt": datasets.Value("string"), "ocr": datasets.Value("string")})


def _rows(prefix: str, n: int) -> list[dict]:
    return [{"prompt": f"{prefix} {i}", "ocr": f"{prefix.upper()}{i}"} for i in range(n)]


def _parquet(path: Path, rows: list[dict], row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


class _Cached(datasets.ArrowBasedBuilder):
    """Writes a Hub dataset into the `datasets` cache exactly as an online `load_dataset(NAME)` leaves it
    (`<ns>___<name>/<config>/0.0.0/<revision>/<name>-<split>.arrow` + dataset_info.json), offline."""

    SPLITS: ClassVar[dict[str, list[dict]]] = {"train": _rows("train", 5), "test": _rows("test", 2)}

    def _info(self) -> datasets.DatasetInfo:
        return datasets.DatasetInfo(features=FEATURES)

    def _split_generators(self, dl_manager: object) -> list:
        return [datasets.SplitGenerator(name=s, gen_kwargs={"split": s}) for s in self.SPLITS]

    def _generate_tables(self, split: str):
        yield 0, pa.Table.from_pylist(self.SPLITS[split], schema=FEATURES.arrow_schema)


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None) -> Path:
    """An empty Hugging Face home for this test only; any network access fails the test (`offline`)."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home


def _cache_dataset(home: Path) -> Path:
    builder = _Cached(
        cache_dir=str(home / "datasets"),
        repo_id="hiyouga/geometry3k",
        dataset_name="geometry3k",
        config_name="default",
        hash="a" * 40,
    )
    builder.download_and_prepare()
    return Path(builder.cache_dir)


def _snapshot(home: Path, name: str, files: dict[str, bytes], readme: str | None = None) -> Path:
    """The hub-cache layout `hf download --repo-type dataset NAME` leaves: blobs, a snapshot of links, refs/main."""
    repo = home / "hub" / f"datasets--{name.replace('/', '--')}"
    commit = "b" * 40
    snapshot = repo / "snapshots" / commit
    if readme is not None:
        files = {**files, "README.md": readme.encode()}
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (len(Path(rel).parts) + 1), "blobs", blob.name))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_folders_globs_and_repeated_sources_concatenate_in_order(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _parquet(data / "b" / "part-1.parquet", _rows("b", 3))
    _parquet(data / "a.parquet", _rows("a", 2))
    (data / "c.jsonl").write_text("\n".join(json.dumps(r) for r in _rows("c", 2)) + "\n")
    (data / ".hidden.parquet").write_bytes(b"not parquet")  # hidden files are skipped
    extra = tmp_path / "extra.txt"
    extra.write_text("x 0\n\nx 1\n")

    folder = read_prompts(data)  # path order: a.parquet, b/part-1.parquet, c.jsonl
    assert [p.text for p in folder] == ["a 0", "a 1", "b 0", "b 1", "b 2", "c 0", "c 1"]
    assert folder[3].meta == {"ocr": "B1"}
    assert [p.text for p in read_prompts(str(data / "**" / "*.parquet"))] == [p.text for p in folder[:5]]
    both = read_prompts([str(extra), str(data / "c.jsonl"), str(data / "a.parquet")])
    assert [p.text for p in both] == ["x 0", "x 1", "c 0", "c 1", "a 0", "a 1"]

    source = PromptSource([str(extra), str(data)])
    assert source.num_rows == 9
    rows = list(source.rows([8, 0, 4]))  # any order in, source order out, indices into the whole source
    assert [(r.index, r.data["prompt"]) for r in rows] == [(0, "x 0"), (4, "b 0"), (8, "c 1")]
    assert (
        rows[1].where == f"{data / 'b' / 'part-1.parquet'}: row 0"
        and rows[2].where == f"{data / 'c.jsonl'}: row 1"
    )

    with pytest.raises(UserInputError, match="matches no file"):
        PromptSource(str(tmp_path / "*.nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match=r"holds no \.parquet or \.jsonl files"):
        PromptSource(str(tmp_path / "empty"))
    with pytest.raises(
        UserInputError,
        match=r"^--prompts hiyouga/geometry3k: no such folder/file \(a Hugging Face dataset is NAME@SPLIT",
    ):
        PromptSource("hiyouga/geometry3k")


def test_a_source_spelled_as_a_path_is_never_a_hub_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`./x@train` was looked up as the Hub dataset `./x`; a path-like spelling is a local path only."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.txt").write_text("a\n")
    for item, says in (
        ("./shapes@train", r"\./shapes@train: no such folder/file$"),
        ("../shapes@train", r"\.\./shapes@train: no such folder/file$"),
        ("data/promts.txt", r"data/promts\.txt: no such folder/file; did you mean data/prompts\.txt\?$"),
        ("data/shapes@train", "data/shapes@train: no such folder/file$"),
        ("data@train", "data@train: data is not a `save_to_disk` dataset folder"),
    ):
        with pytest.raises(UserInputError, match=f"^--prompts {says}") as caught:
            PromptSource(item)
        assert "Hugging Face" not in str(caught.value), item


def test_a_large_parquet_set_is_streamed_and_read_only_as_far_as_the_picked_rows(tmp_path: Path) -> None:
    data = tmp_path / "big"
    for k in range(3):
        _parquet(data / f"part-{k}.parquet", _rows(f"p{k}", 4000), row_group_size=500)
    every = read_prompts(data)
    assert len(every) == 12000
    picked = sample_prompts(data, 5, seed=11)
    # the very draw `pick_prompts` makes over the whole list, so group ids do not depend on streaming
    assert [(i, p.text) for i, p in picked] == [(i, p.text) for i, p in pick_prompts(every, 5, seed=11)]
    for k in (1, 2):  # wreck the data pages of the later files, keep their footers (the row counts)
        path = data / f"part-{k}.parquet"
        raw = bytearray(path.read_bytes())
        raw[4 : len(raw) // 2] = b"\xff" * (len(raw) // 2 - 4)
        path.write_bytes(bytes(raw))
    source = PromptSource(data)
    assert source.num_rows == 12000
    assert [r.data["prompt"] for r in source.rows([3, 1, 3000])] == ["p0 1", "p0 3", "p0 3000"]
    with pytest.raises(UserInputError, match=r"^--prompts .*big: not readable by `datasets`"):
        list(source.rows([4000]))


def test_save_to_disk_folders(tmp_path: Path) -> None:
    datasets.Dataset.from_list(_rows("d", 3), features=FEATURES).save_to_disk(str(tmp_path / "one"))
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(_rows("tr", 4)),
            "test": datasets.Dataset.from_list(_rows("te", 2)),
        }
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    assert [p.text for p in read_prompts(tmp_path / "one")] == ["d 0", "d 1", "d 2"]
    assert [p.text for p in read_prompts(f"{tmp_path / 'dict'}@test")] == ["te 0", "te 1"]
    with pytest.raises(UserInputError, match=r"several splits \(splits: train, test\); write .*@SPLIT"):
        _ = PromptSource(str(tmp_path / "dict")).num_rows
    with pytest.raises(UserInputError, match=r"no split 'val' \(splits: train, test\)"):
        _ = PromptSource(f"{tmp_path / 'dict'}@val").num_rows
    train, test = PromptSource(f"{tmp_path / 'dict'}@train"), PromptSource(f"{tmp_path / 'dict'}@test")
    assert train.digest() != test.digest()


def test_hub_dataset_resolves_offline_from_the_datasets_cache(hf_home: Path) -> None:
    cached = _cache_dataset(hf_home)
    source = PromptSource("hiyouga/geometry3k@test")
    assert [r.data for r in source.rows()] == _rows("test", 2)
    assert source.parts[0].paths == [cached / "geometry3k-test.arrow"]  # datasets' own cache files
    assert [p.text for p in read_prompts("hiyouga/geometry3k:default@train")] == [
        f"train {i}" for i in range(5)
    ]
    train = PromptSource("hiyouga/geometry3k@train")
    assert [(i, p.text) for i, p in sample_prompts(train, 2, seed=0)] == [
        (i, f"train {i}") for i in sorted(random.Random(0).sample(range(5), 2))
    ]
    assert train.digest() != source.digest()
    with pytest.raises(UserInputError, match=r"Unknown split \"val\".*in the `datasets` cache"):
        _ = PromptSource("hiyouga/geometry3k@val").num_rows
    with pytest.raises(UserInputError, match="for config 'other'"):
        _ = PromptSource("hiyouga/geometry3k:other@train").num_rows


def test_hub_dataset_resolves_offline_from_a_hub_snapshot(hf_home: Path, tmp_path: Path) -> None:
    train = _parquet(tmp_path / "src" / "train.parquet", _rows("snap", 3))
    snapshot = _snapshot(
        hf_home,
        "org/shapes",
        {"data/train-00000-of-00001.parquet": train.read_bytes()},
    )
    source = PromptSource("org/shapes@train")
    assert [p.text for p in read_prompts(source)] == ["snap 0", "snap 1", "snap 2"]
    assert source.parts[0].paths == [snapshot / "data" / "train-00000-of-00001.parquet"]
    before = source.digest()
    assert before == PromptSource("org/shapes@train").digest()
    with pytest.raises(UserInputError, match=r"no split 'test' \(splits: train\)"):
        _ = PromptSource("org/shapes@test").num_rows


def test_a_dataset_not_in_the_cache_is_one_line_exit_2(hf_home: Path, tiny_sd3: Path, tmp_path: Path) -> None:
    line = fails(
        sample_args(tiny_sd3, Path("nobody/nothing@train"), tmp_path / "out"),
        "--prompts nobody/nothing@train",
        "not in the local Hugging Face cache",
        "hf download --repo-type dataset nobody/nothing",
    )
    assert str(hf_home) in line


def test_sample_records_every_source_kind_by_content(hf_home: Path, tiny_sd3: Path, tmp_path: Path) -> None:
    """`sample` reads a folder, a glob and a cached Hub dataset; the manifest's lineage holds each one's
    content digest, so editing a file of a folder makes a re-run refuse the finished output."""
    _cache_dataset(hf_home)
    data = tmp_path / "data"
    _parquet(data / "a.parquet", _rows("a", 2))
    _parquet(data / "b.parquet", _rows("b", 1))
    out = tmp_path / "hub"
    result = run(*sample_args(tiny_sd3, Path("hiyouga/geometry3k@train"), out, "--num-prompts", "2"))
    assert result["rows"] == 2 * 2
    (parent,) = ShardSet(out).manifest.parents
    assert parent == {
        "source": ["hiyouga/geometry3k@train"],
        "sha256": PromptSource("hiyouga/geometry3k@train").digest(),
    }
    assert set(ShardSet(out).read_all(["prompt"])["prompt"]) < {f"train {i}" for i in range(5)}

    folder = tmp_path / "folder"
    run(*sample_args(tiny_sd3, data, folder))
    (parent,) = ShardSet(folder).manifest.parents
    digests = [content_digest(data / f, "test") for f in ("a.parquet", "b.parquet")]
    assert parent == {
        "path": "../data",
        "sha256": hashlib.sha256("".join(d + "\n" for d in digests).encode()).hexdigest(),
    }
    _parquet(data / "b.parquet", _rows("B", 1))
    fails(sample_args(tiny_sd3, data, folder), "already holds a finished output made with different inputs")
    shutil.rmtree(folder)
