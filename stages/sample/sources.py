"""Prompt sources: where the rows of `--prompts` come from, read as one table with stable row indices.

A source is one or more items, read in the order given (`--prompts` may be repeated); each item is

- a local file: .txt (one prompt a line), .csv, .jsonl/.json, read by omnirl itself (exact rows,
  line-numbered errors), or .parquet, streamed through Hugging Face `datasets`;
- a folder of .parquet/.jsonl files (all of them, recursively, in path order) or a glob of such files;
- a folder written by `Dataset.save_to_disk` (or `DatasetDict.save_to_disk`, then `FOLDER@SPLIT`);
- a Hugging Face Hub dataset `NAME@SPLIT` or `NAME:CONFIG@SPLIT` (EasyR1's `hiyouga/geometry3k@train`),
  read offline from the local cache only: the `datasets` cache a previous `load_dataset(NAME)` left,
  else a snapshot that `hf download --repo-type dataset NAME` left in the hub cache. Nothing is ever
  downloaded; a dataset in neither cache is a one-line error saying how to fetch it.

Parquet files, saved datasets and Hub datasets are streamed (`IterableDataset` in Arrow batches): a
stage that needs some rows (`--num-prompts`) converts only those to Python, so a large set is never
materialised at once. The source's `digest` (the sha256 of the bytes of every file it reads, in order,
with the config and split it selects) enters the run identity, whatever the kind of source.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import hashlib
import io
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.models.hub import no_such_path, spelled_as_path
from stages.shards.digest import content_digest
from stages.tables import read_rows, read_text

LINE_FORMATS = (".txt", ".text", "", ".jsonl", ".json", ".csv")
FOLDER_FORMATS = (".parquet", ".jsonl")
# NAME@SPLIT or NAME:CONFIG@SPLIT, NAME a Hub repo id ("user/name" or a bare name).
HUB_SPEC = re.compile(r"^(?P<name>[\w.-]+(?:/[\w.-]+)?)(?::(?P<config>[\w.-]+))?@(?P<split>[\w.-]+)$")
_BATCH_ROWS = 1024


@dataclass
class SourceRow:
    """One row of a source: its index in the whole source (stable across runs: group ids), its fields,
    where it is (for error messages), the folder that relative image paths resolve against and the
    name of what holds it (a file name, a dataset as given)."""

    index: int
    data: dict[str, Any]
    where: str
    base: Path
    name: str


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (library messages often span several)."""
    return " ".join(str(exc).split())[:400] or type(exc).__name__


@contextlib.contextmanager
def _offline() -> Iterator[Any]:
    """`datasets`, forced offline and quiet for the duration (its cache notices would look like errors)."""
    import datasets
    import datasets.config

    was_offline, verbosity = datasets.config.HF_HUB_OFFLINE, datasets.logging.get_verbosity()
    datasets.config.HF_HUB_OFFLINE = True
    datasets.logging.set_verbosity_error()
    bars = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.config.HF_HUB_OFFLINE = was_offline
        datasets.logging.set_verbosity(verbosity)
        if not bars:
            datasets.enable_progress_bars()


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()


def datasets_cache() -> Path:
    """The `datasets` cache folder, read from the environment now (HF_DATASETS_CACHE, HF_HOME)."""
    return Path(os.environ.get("HF_DATASETS_CACHE") or _hf_home() / "datasets").expanduser()


def hub_cache() -> Path:
    """The Hugging Face hub cache folder (HF_HUB_CACHE, HF_HOME/hub)."""
    return Path(os.environ.get("HF_HUB_CACHE") or _hf_home() / "hub").expanduser()


def _stream(dataset: Any, wanted: list[int] | None, label: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, row) of the `wanted` indices (sorted; all when None) of an `IterableDataset`, read in
    Arrow batches so only the wanted rows become Python objects (images stay {bytes, path} structs)."""
    offset, k = 0, 0
    try:
        for table in dataset.with_format("arrow").iter(batch_size=_BATCH_ROWS):
            stop = offset + table.num_rows
            if wanted is None:
                yield from enumerate(table.to_pylist(), start=offset)
            else:
                take = []
                while k < len(wanted) and wanted[k] < stop:
                    take.append(wanted[k] - offset)
                    k += 1
                if take:
                    yield from zip((offset + i for i in take), table.take(take).to_pylist())
                if k == len(wanted):
                    return
            offset = stop
    except UserInputError:
        raise
    except Exception as exc:
        raise UserInputError(f"--prompts {label}: not readable by `datasets` ({_one_line(exc)})") from None


def _count(dataset: Any, label: str) -> int:
    """Rows of an `IterableDataset`, counted over its Arrow batches (no row becomes a Python object)."""
    try:
        return sum(t.num_rows for t in dataset.with_format("arrow").iter(batch_size=_BATCH_ROWS))
    except Exception as exc:
        raise UserInputError(f"--prompts {label}: not readable by `datasets` ({_one_line(exc)})") from None


@dataclass
class _Part:
    """One item of a source: its label (as the user wrote it), the local files it reads."""

    label: str
    paths: list[Path] = field(default_factory=list)

    def num_rows(self) -> int:
        raise NotImplementedError

    def rows(self, wanted: list[int] | None) -> Iterator[SourceRow]:
        """The rows at the `wanted` indices of this part (sorted; None: all), indices local to it."""
        raise NotImplementedError

    def digest(self) -> str:
        """sha256 of the bytes it reads, in order (a single file: that file's digest)."""
        if len(self.paths) == 1:
            return content_digest(self.paths[0], "--prompts")
        h = hashlib.sha256()
        for p in self.paths:
            h.update(content_digest(p, "--prompts").encode() + b"\n")
        return h.hexdigest()


@dataclass
class _LineFile(_Part):
    """A .txt / .csv / .jsonl / .json file, read by omnirl (blank .txt lines skipped)."""

    _rows: list[dict[str, Any]] | None = None

    def _load(self) -> list[dict[str, Any]]:
        if self._rows is not None:
            return self._rows
        path = self.paths[0]
        suffix = path.suffix.lower()
        if suffix in (".txt", ".text", ""):
            lines = read_text(path, "--prompts").splitlines()
            rows = [{"prompt": line.strip()} for line in lines if line.strip()]
        elif suffix == ".csv":
            reader = csv.DictReader(io.StringIO(read_text(path, "--prompts"), newline=""))
            try:
                rows = list(reader)
            except csv.Error as exc:
                raise UserInputError(
                    f"--prompts {path}: line {reader.line_num + 1} is not valid CSV ({exc})"
                ) from None
        else:
            rows = [r if isinstance(r, dict) else {"prompt": r} for r in read_rows(path, "--prompts")]
        self._rows = rows
        return rows

    def num_rows(self) -> int:
        return len(self._load())

    def rows(self, wanted: list[int] | None) -> Iterator[SourceRow]:
        rows, path = self._load(), self.paths[0]
        for i in range(len(rows)) if wanted is None else wanted:
            yield SourceRow(i, rows[i], f"{path}: row {i}", path.parent, path.name)


@dataclass
class _ParquetFiles(_Part):
    """Parquet files streamed through `datasets` as one table; row counts from the files' footers."""

    _counts: list[int] | None = None

    def counts(self) -> list[int]:
        if self._counts is None:
            import pyarrow.parquet as pq

            counts = []
            for p in self.paths:
                try:
                    counts.append(pq.ParquetFile(p).metadata.num_rows)
                except Exception as exc:
                    raise UserInputError(
                        f"--prompts {p}: not a readable Parquet file ({_one_line(exc)})"
                    ) from None
            self._counts = counts
        return self._counts

    def num_rows(self) -> int:
        return sum(self.counts())

    def rows(self, wanted: list[int] | None) -> Iterator[SourceRow]:
        counts = self.counts()
        if not sum(counts):
            return
        with _offline() as datasets:
            dataset = datasets.load_dataset(
                "parquet", data_files=[str(p) for p in self.paths], split="train", streaming=True
            )
            starts = [sum(counts[:k]) for k in range(len(counts))]
            f = 0
            for i, row in _stream(dataset, wanted, self.label):
                while i >= starts[f] + counts[f]:
                    f += 1
                path = self.paths[f]
                yield SourceRow(i, row, f"{path}: row {i - starts[f]}", path.parent, path.name)


@dataclass
class _Dataset(_Part):
    """A `datasets` table: a `save_to_disk` folder or a Hub dataset from the local cache. `open`
    returns (IterableDataset, rows or None when unknown, files, folder for relative paths)."""

    config: str | None = None
    split: str | None = None
    _opened: tuple[Any, int, Path] | None = None

    def open(self, datasets: Any) -> tuple[Any, int | None, list[Path], Path]:
        raise NotImplementedError

    def _dataset(self) -> tuple[Any, int, Path]:
        if self._opened is None:
            with _offline() as datasets:
                dataset, rows, self.paths, base = self.open(datasets)
                if rows is None:  # e.g. JSON files in a snapshot: one pass over the Arrow batches
                    rows = _count(dataset, self.label)
            self._opened = (dataset, rows, base)
        return self._opened

    def num_rows(self) -> int:
        return self._dataset()[1]

    def digest(self) -> str:
        self._dataset()
        return hashlib.sha256(f"{self.config}\0{self.split}\0{super().digest()}".encode()).hexdigest()

    def rows(self, wanted: list[int] | None) -> Iterator[SourceRow]:
        dataset, _, base = self._dataset()
        with _offline():
            for i, row in _stream(dataset, wanted, self.label):
                yield SourceRow(i, row, f"{self.label}: row {i}", base, self.label)


def _split_of(splits: Sequence[str], split: str | None, label: str, hint: str) -> str:
    if split is None and len(splits) == 1:
        return splits[0]
    if split not in splits:
        raise UserInputError(
            f"--prompts {label}: {'no split ' + repr(split) if split else 'several splits'} "
            f"(splits: {', '.join(splits)}); {hint}"
        )
    return split


@dataclass
class _Disk(_Dataset):
    """A folder written by `save_to_disk` (memory-mapped Arrow files, streamed)."""

    folder: Path = Path()

    def open(self, datasets: Any) -> tuple[Any, int | None, list[Path], Path]:
        try:
            data = datasets.load_from_disk(str(self.folder))
        except Exception as exc:
            raise UserInputError(
                f"--prompts {self.label}: not a readable `save_to_disk` folder ({_one_line(exc)})"
            ) from None
        if isinstance(data, datasets.DatasetDict):
            self.split = _split_of(list(data), self.split, self.label, f"write {self.folder}@SPLIT")
            data = data[self.split]
        elif self.split is not None:
            raise UserInputError(
                f"--prompts {self.label}: the folder holds one dataset, not splits; drop @SPLIT"
            )
        files = [Path(f["filename"]) for f in data.cache_files]
        return data.to_iterable_dataset(), len(data), files, self.folder


@dataclass
class _Hub(_Dataset):
    """A Hub dataset from the local cache: the `datasets` cache, else a hub-cache snapshot."""

    name: str = ""

    def _not_cached(self) -> UserInputError:
        return UserInputError(
            f"--prompts {self.label}: dataset {self.name!r} is not in the local Hugging Face cache "
            f"({datasets_cache()} or {hub_cache()}) and omnirl never downloads; fetch it once where there is "
            f"network (`hf download --repo-type dataset {self.name}`) or point HF_HOME at a cache that has it"
        )

    def open(self, datasets: Any) -> tuple[Any, int | None, list[Path], Path]:
        try:
            data = datasets.load_dataset(
                self.name, self.config, split=self.split, cache_dir=str(datasets_cache())
            )
        except ConnectionError:  # not in the `datasets` cache: offline, it would have to ask the Hub
            return self._snapshot(datasets)
        except ValueError as exc:  # cached, but not this config or split
            raise UserInputError(
                f"--prompts {self.label}: {_one_line(exc)} in the `datasets` cache"
            ) from None
        files = [Path(f["filename"]) for f in data.cache_files]
        return data.to_iterable_dataset(), len(data), files, files[0].parent if files else datasets_cache()

    def _snapshot(self, datasets: Any) -> tuple[Any, int | None, list[Path], Path]:
        import huggingface_hub

        try:
            folder = Path(
                huggingface_hub.snapshot_download(
                    self.name, repo_type="dataset", local_files_only=True, cache_dir=str(hub_cache())
                )
            )
        except Exception:
            raise self._not_cached() from None
        try:
            builder = datasets.load_dataset_builder(str(folder), self.config)
            splits = list(builder.config.data_files or {})
            split = _split_of(splits, self.split, self.label, f"write {self.name}@SPLIT")
            files = [Path(f) for f in builder.config.data_files[split]]
            dataset = datasets.load_dataset(str(folder), self.config, split=split, streaming=True)
        except UserInputError:
            raise
        except Exception as exc:
            raise UserInputError(
                f"--prompts {self.label}: the cached snapshot {folder} does not load ({_one_line(exc)})"
            ) from None
        rows = None
        if files and all(f.suffix == ".parquet" for f in files):
            rows = _ParquetFiles(self.label, files).num_rows()
        return dataset, rows, files, folder


def _folder_files(folder: Path) -> list[Path]:
    """The .parquet/.jsonl files under `folder`, recursively, hidden entries skipped, in path order."""
    found = [
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in FOLDER_FORMATS
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    ]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _file_parts(files: list[Path], label: str) -> list[_Part]:
    """Parts for a list of files: consecutive Parquet files share one stream, others are read alone."""
    parts: list[_Part] = []
    for f in files:
        suffix = f.suffix.lower()
        if suffix == ".parquet":
            if parts and isinstance(parts[-1], _ParquetFiles):
                parts[-1].paths.append(f)
            else:
                parts.append(_ParquetFiles(label, [f]))
        elif suffix in LINE_FORMATS:
            parts.append(_LineFile(label, [f]))
        else:
            raise UserInputError(
                f"--prompts {f}: unknown prompt format '{suffix}' (use .txt, .jsonl, .csv or .parquet)"
            )
    return parts


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _parts(item: str) -> list[_Part]:
    """The parts one `--prompts` value names (see the module docstring for the forms)."""
    path = Path(item).expanduser()
    if path.is_file():
        return _file_parts([path], item)
    if path.is_dir():
        if _is_saved_dataset(path):
            return [_Disk(item, folder=path)]
        files = _folder_files(path)
        if not files:
            raise UserInputError(f"--prompts {item}: the folder holds no .parquet or .jsonl files")
        return _file_parts(files, item)
    folder, at, split = item.rpartition("@")
    if at and Path(folder).expanduser().is_dir() and _is_saved_dataset(Path(folder).expanduser()):
        return [_Disk(item, folder=Path(folder).expanduser(), split=split)]
    if any(ch in item for ch in "*?["):
        files = sorted(
            Path(p) for p in glob.glob(os.path.expanduser(item), recursive=True) if Path(p).is_file()
        )
        if not files:
            raise UserInputError(f"--prompts {item}: the pattern matches no file")
        return _file_parts(files, item)
    if at and Path(folder).expanduser().exists():
        raise UserInputError(
            f"--prompts {item}: {folder} is not a `save_to_disk` dataset folder (no dataset_dict.json or "
            "state.json); name its .parquet/.jsonl files or the folder itself"
        )
    hub = HUB_SPEC.match(item)
    if hub and not spelled_as_path(folder if at else item):
        return [_Hub(item, config=hub["config"], split=hub["split"], name=hub["name"])]
    raise no_such_path(
        "--prompts",
        item,
        ""
        if spelled_as_path(folder if at else item)
        else " (a Hugging Face dataset is NAME@SPLIT or NAME:CONFIG@SPLIT, e.g. hiyouga/geometry3k@train)",
    )


class PromptSource:
    """The rows of every item of `--prompts`, concatenated in order (see the module docstring)."""

    def __init__(self, spec: str | Path | Sequence[str | Path] | None):
        items = [spec] if isinstance(spec, (str, Path)) else list(spec or [])
        if not items:
            raise UserInputError("--prompts: name at least one prompt source")
        self.items = [str(i) for i in items]
        self.parts = [part for item in self.items for part in _parts(item)]
        self._counts: list[int] | None = None

    @property
    def label(self) -> str:
        return ", ".join(self.items)

    @property
    def paths(self) -> list[Path]:
        """The local files and folders the source reads (an output must not be written over them)."""
        return [Path(i) for i in self.items if Path(i).exists()] + [
            p for part in self.parts for p in part.paths
        ]

    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = [part.num_rows() for part in self.parts]
        return self._counts

    @property
    def num_rows(self) -> int:
        return sum(self.counts())

    def rows(self, indices: Sequence[int] | None = None) -> Iterator[SourceRow]:
        """The rows at `indices` (indices into the whole source, any order; None: every row), in
        source order; each part streams only its wanted rows."""
        wanted = None if indices is None else sorted(set(indices))
        start, k = 0, 0
        for part, count in zip(self.parts, self.counts()):
            stop = start + count
            if wanted is None:
                local = None
            else:
                first = k
                while k < len(wanted) and wanted[k] < stop:
                    k += 1
                local = [i - start for i in wanted[first:k]]
                if not local:
                    start = stop
                    continue
            for row in part.rows(local):
                row.index += start
                yield row
            start = stop

    def digest(self) -> str:
        """sha256 naming the source's contents (a single file: the file's own digest)."""
        if len(self.parts) == 1:
            return self.parts[0].digest()
        joined = json.dumps([[p.label, p.digest()] for p in self.parts])
        return hashlib.sha256(joined.encode()).hexdigest()

    def lineage(self) -> dict[str, Any]:
        """The record of this input in an output's manifest: the local path (one file or folder) or
        the values as given, and the content digest."""
        if len(self.items) == 1 and Path(self.items[0]).exists():
            return {"path": str(Path(self.items[0]).resolve()), "sha256": self.digest()}
        return {"source": self.items, "sha256": self.digest()}
