"""Reading shard sets: verified shard-by-shard access, and column groups zipped row by row.

A shard is memory-mapped; its size is checked against the manifest and, with `verify`, its
sha256 is computed on a background thread while it is decoded, so nothing unverified is
returned. Parquet tensors come back as read-only views of Arrow memory: `clone()` them before
in-place operations.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import torch

from stages.errors import CorruptShardError, UserInputError
from stages.shards.formats import codec
from stages.shards.manifest import MANIFEST_NAME, SUBSET_KEY, Manifest, manifest_sha256, read_manifest
from stages.shards.schema import Batch, Column

KEY_COLUMN = "sample_id"


def concat_batches(batches: list[Batch]) -> Batch:
    """Concatenate batches with the same columns row-wise (a single batch is returned as is)."""
    if not batches:
        return {}
    if len(batches) == 1:
        return batches[0]
    names = list(batches[0])
    out: Batch = {}
    for b in batches[1:]:
        if list(b) != names:
            diff = sorted(set(b) ^ set(names))
            detail = ", ".join(f"'{d}'" for d in diff) if diff else "same names in another order"
            raise UserInputError(f"cannot concatenate batches with different columns ({detail})")
    for name in names:
        first = batches[0][name]
        if isinstance(first, torch.Tensor):
            out[name] = torch.cat([b[name] for b in batches])
        else:
            out[name] = [v for b in batches for v in b[name]]
    return out


def take_rows(batch: Batch, rows: Sequence[int]) -> Batch:
    """Rows `rows` of a batch, in that order (tensors are copies)."""
    index = torch.tensor(rows, dtype=torch.long)
    return {k: v[index] if isinstance(v, torch.Tensor) else [v[i] for i in rows] for k, v in batch.items()}


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Rows [start, stop) of a batch; tensors are views."""
    return {k: v[start:stop] for k, v in batch.items()}


def _prefetch(path: Path) -> None:
    """Ask the kernel to read the whole file ahead: hashing and row-group decoding touch the
    memory map from several threads, which defeats sequential readahead on a cold cache."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


class _Hasher(threading.Thread):
    """sha256 of a buffer on a background thread (hashlib releases the GIL)."""

    def __init__(self, buf: pa.Buffer) -> None:
        super().__init__(name="omnirl-shard-verify", daemon=True)
        self._buf = buf
        self.digest = ""

    def run(self) -> None:
        self.digest = hashlib.sha256(self._buf).hexdigest()

    def result(self) -> str:
        self.join()
        return self.digest


class ShardSet:
    """A finished shard set directory (its manifest, columns and shards)."""

    def __init__(self, path: str | Path, *, verify: bool = True) -> None:
        path = Path(path)
        self.path = path.parent if path.name == MANIFEST_NAME and path.is_file() else path
        self.manifest: Manifest = read_manifest(self.path)
        self.manifest_sha256 = manifest_sha256(self.path)
        self.columns: dict[str, Column] = {c.name: c for c in self.manifest.columns}
        self.num_shards = len(self.manifest.shards)
        self.num_rows = self.manifest.num_rows
        self._verify = verify
        self._codec = codec(self.manifest.format)
        self._verified: dict[int, tuple[int, int, int]] = {}

    def __repr__(self) -> str:
        return f"ShardSet({str(self.path)!r}, {self.manifest.format}, {self.num_shards} shards, {self.num_rows} rows)"

    def shard_path(self, index: int) -> Path:
        """Path of shard `index`."""
        if not isinstance(index, int) or not 0 <= index < self.num_shards:
            raise UserInputError(f"{self.path}: shard index {index!r} is outside 0..{self.num_shards - 1}")
        return self.path / self.manifest.shards[index].file

    def shard_rows(self, index: int) -> int:
        """Rows in shard `index` per the manifest."""
        self.shard_path(index)
        return self.manifest.shards[index].rows

    def select(self, columns: Sequence[str] | None) -> list[Column]:
        """The requested columns (all when None), in request order; unknown names are an error."""
        if columns is None:
            return list(self.columns.values())
        if isinstance(columns, str):
            columns = [columns]
        out = []
        for name in dict.fromkeys(columns):
            if name not in self.columns:
                raise UserInputError(
                    f"column '{name}' is not in {self.path} (it has: {', '.join(self.columns) or 'no columns'})"
                )
            out.append(self.columns[name])
        return out

    def _rerun_hint(self) -> str:
        return (
            f"re-run the command that produced it (omnirl {self.manifest.command}) with the same options: "
            "it rewrites the damaged shards"
        )

    def _map(self, index: int) -> tuple[Path, pa.Buffer, tuple[int, int, int]]:
        """Memory-map shard `index` after checking that it exists with the listed size."""
        path = self.shard_path(index)
        info = self.manifest.shards[index]
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise CorruptShardError(
                f"{path} is listed in the manifest but missing; {self._rerun_hint()}"
            ) from None
        if st.st_size != info.bytes:
            raise CorruptShardError(
                f"{path} has {st.st_size} bytes but the manifest lists {info.bytes} (truncated or replaced); "
                f"{self._rerun_hint()}"
            )
        _prefetch(path)
        buf = pa.memory_map(str(path), "r").read_buffer() if info.bytes else pa.py_buffer(b"")
        return path, buf, (st.st_size, st.st_mtime_ns, st.st_ino)

    def _checksum_error(self, path: Path, digest: str, index: int) -> CorruptShardError:
        return CorruptShardError(
            f"{path}: sha256 {digest[:16]}... does not match the manifest's {self.manifest.shards[index].sha256[:16]}... "
            f"(corrupt or modified); {self._rerun_hint()}"
        )

    def _decode(self, buf: pa.Buffer, cols: list[Column], index: int, path: Path) -> Batch:
        try:
            return self._codec.decode(buf, cols, self.manifest.shards[index].rows, str(path))
        except (pa.ArrowException, OSError, ValueError, EOFError, tarfile.TarError) as e:
            raise CorruptShardError(
                f"{path}: cannot be decoded as {self.manifest.format} ({e}); {self._rerun_hint()}"
            ) from e

    def read_shard(self, index: int, columns: Sequence[str] | None = None) -> Batch:
        """The requested columns of shard `index` (tensor [rows, *shape], lists for the rest)."""
        cols = self.select(columns)
        path, buf, stamp = self._map(index)
        if not self._verify or self._verified.get(index) == stamp:
            return self._decode(buf, cols, index, path)
        hasher = _Hasher(buf)
        hasher.start()
        error: CorruptShardError | None = None
        batch: Batch = {}
        try:
            batch = self._decode(buf, cols, index, path)
        except CorruptShardError as e:
            error = e
        digest = hasher.result()
        if digest != self.manifest.shards[index].sha256:
            raise self._checksum_error(path, digest, index)
        if error is not None:
            raise error
        self._verified[index] = stamp
        return batch

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.num_shards):
            yield self.read_shard(i)

    def read_all(self, columns: Sequence[str] | None = None) -> Batch:
        """Every shard concatenated (copies tensor data when there is more than one shard)."""
        return concat_batches([self.read_shard(i, columns) for i in range(self.num_shards)])

    def verify(self) -> None:
        """Re-check every listed shard's size and sha256."""
        for i in range(self.num_shards):
            path, buf, stamp = self._map(i)
            digest = hashlib.sha256(buf).hexdigest()
            if digest != self.manifest.shards[i].sha256:
                raise self._checksum_error(path, digest, i)
            self._verified[i] = stamp


def _keys_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return list(a) == list(b)


def _first_difference(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if (x != y).any() if isinstance(x, torch.Tensor) else x != y:
            return i
    return min(len(a), len(b))


def rollout_modality(manifests: Sequence[Manifest]) -> str:
    """The modality ("image" or "text") of the rollout the zipped inputs belong to, as its manifests
    record it: the rollout's own (`sample`, `pairs`) and every set derived from it (inherited by the
    writer). Stages dispatch on it rather than on which columns happen to be present."""
    for manifest in manifests:
        modality = (manifest.extra or {}).get("modality")
        if modality:
            return str(modality)
    raise UserInputError(
        "--in: no input records its rollout's modality (written by an older omnirl); re-run `omnirl sample` "
        "and the stages after it"
    )


def _lineage(s: ShardSet, inputs: dict[str, ShardSet]) -> set[str]:
    """Manifest hashes of `s`, of the shard sets its manifest lists as parents and, through parents
    that are themselves among `inputs` (keyed by manifest hash), of their parents in turn."""
    seen = {s.manifest_sha256}
    todo = [s]
    while todo:
        for parent in todo.pop().manifest.parents:
            digest = parent.get("manifest_sha256")
            if digest is not None and digest not in seen:
                seen.add(digest)
                if digest in inputs:
                    todo.append(inputs[digest])
    return seen


def _check_one_rollout(sets: Sequence[ShardSet]) -> None:
    """Refuse column groups of different rollouts: their lineages must share a shard set.

    Every derived set (score, logprob, advantage, encode) lists the manifest hashes of its inputs,
    so the sets of one rollout all lead back to the set that owns it (`sample`, `pairs`); a set
    derived from another rollout, or from an earlier run of the same command, does not. Equal
    `sample_id`s alone cannot tell, since the same command with another seed gives the same layout.
    """
    inputs = {s.manifest_sha256: s for s in sets}
    lineages = [_lineage(s, inputs) for s in sets]
    common = set(lineages[0])
    for i, s in enumerate(sets[1:], start=1):
        common &= lineages[i]
        if not common:
            other = next((sets[j] for j in range(i) if not lineages[j] & lineages[i]), sets[0])
            raise UserInputError(
                f"{other.path} and {s.path} come from different rollouts (their manifests' lineage shares no "
                "shard set; one was derived from another rollout or an earlier run of it); "
                "pass column groups of one rollout, re-running the stage that derived the stale one"
            )


class ZippedShardSets:
    """Several shard sets of one rollout (column groups) read as one, row by row.

    They must come from one rollout (`_check_one_rollout`), have the same shard count and rows per
    shard, no column in common except `sample_id`, and equal `sample_id` values wherever two of them
    carry it; a set of only some of the rollout's rows (`SUBSET_KEY`) is refused.
    """

    def __init__(self, sets: Sequence[ShardSet]) -> None:
        if not sets:
            raise UserInputError("no input shard set given; pass at least one --in")
        self.sets = list(sets)
        for s in self.sets:
            subset = (s.manifest.extra or {}).get(SUBSET_KEY)
            if subset:
                raise UserInputError(
                    f"{s.path} holds {subset['rows']} of its rollout's {subset['of']} rows (`omnirl "
                    f"{s.manifest.command} {subset['option']}`, a check): no stage reads it as a column "
                    f"group; drop it from --in, or write one without {subset['option'].split()[0]}"
                )
        _check_one_rollout(self.sets)
        first = self.sets[0]
        for s in self.sets[1:]:
            if s.num_shards != first.num_shards:
                raise UserInputError(
                    f"{first.path} has {first.num_shards} shards but {s.path} has {s.num_shards}; "
                    "column groups of one rollout need the same --num-shards"
                )
            for i in range(first.num_shards):
                if s.shard_rows(i) != first.shard_rows(i):
                    raise UserInputError(
                        f"{first.shard_path(i)} has {first.shard_rows(i)} rows but {s.shard_path(i)} has "
                        f"{s.shard_rows(i)}; these inputs are not column groups of the same rollout"
                    )
        self._owner: dict[str, ShardSet] = {}
        for s in self.sets:
            for name in s.columns:
                if name in self._owner and name != KEY_COLUMN:
                    raise UserInputError(
                        f"column '{name}' is in both {self._owner[name].path} and {s.path}; "
                        "pass each column group once (or drop one of the inputs)"
                    )
                self._owner.setdefault(name, s)
        self.columns: dict[str, Column] = {name: s.columns[name] for name, s in self._owner.items()}
        self.num_shards = first.num_shards
        self.num_rows = first.num_rows

    @property
    def paths(self) -> list[Path]:
        return [s.path for s in self.sets]

    def shard_path(self, index: int, column: str | None = None) -> Path:
        """The file of shard `index` in the input that holds `column` (the first input without one)."""
        return (
            self._owner.get(column, self.sets[0]).shard_path(index)
            if column
            else self.sets[0].shard_path(index)
        )

    @property
    def manifests(self) -> list[Manifest]:
        return [s.manifest for s in self.sets]

    def __repr__(self) -> str:
        return f"ZippedShardSets({[str(p) for p in self.paths]!r})"

    def read_shard(self, index: int, columns: Sequence[str] | None = None) -> Batch:
        """The requested columns of shard `index` from whichever set holds them, keys checked."""
        names = (
            list(self.columns)
            if columns is None
            else list(dict.fromkeys([columns] if isinstance(columns, str) else columns))
        )
        for name in names:
            if name not in self.columns:
                raise UserInputError(
                    f"column '{name}' is not in any of {', '.join(str(p) for p in self.paths)} "
                    f"(they have: {', '.join(self.columns)})"
                )
        keyed = [s for s in self.sets if KEY_COLUMN in s.columns]
        check_keys = len(keyed) > 1
        parts: dict[int, Batch] = {}
        for s in self.sets:
            wanted = [n for n in names if self._owner[n] is s]
            if check_keys and s in keyed and KEY_COLUMN not in wanted:
                wanted.append(KEY_COLUMN)
            if wanted:
                parts[id(s)] = s.read_shard(index, wanted)
        if check_keys:
            ref = keyed[0]
            for s in keyed[1:]:
                a, b = parts[id(ref)][KEY_COLUMN], parts[id(s)][KEY_COLUMN]
                if not _keys_equal(a, b):
                    row = _first_difference(a, b)
                    raise UserInputError(
                        f"sample_id differs at row {row} of shard {index}: {ref.shard_path(index)} vs "
                        f"{s.shard_path(index)}; these inputs are not column groups of the same rollout (or not in the same order)"
                    )
        return {n: parts[id(self._owner[n])][n] for n in names}

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.num_shards):
            yield self.read_shard(i)

    def read_all(self, columns: Sequence[str] | None = None) -> Batch:
        """Every shard concatenated."""
        return concat_batches([self.read_shard(i, columns) for i in range(self.num_shards)])

    def read_rows(self, rows: Sequence[int], columns: Sequence[str]) -> Batch:
        """Rows `rows` (global row numbers, ascending and unique) of `columns`, in that order.

        Shards are read one at a time and only the wanted rows are kept, so memory holds the selection
        plus one shard, never the whole set; shards without a wanted row are not read.
        """
        wanted = torch.as_tensor(list(rows), dtype=torch.int64)
        if wanted.numel() and (bool((wanted[1:] <= wanted[:-1]).any()) or int(wanted[-1]) >= self.num_rows):
            raise ValueError(f"read_rows: rows must be ascending, unique and below {self.num_rows}")
        parts: list[Batch] = []
        start = 0
        for i in range(self.num_shards):
            stop = start + self.sets[0].shard_rows(i)
            lo, hi = torch.searchsorted(wanted, torch.tensor([start, stop])).tolist()
            if hi > lo:
                shard = self.read_shard(i, columns)
                local = wanted[lo:hi] - start
                parts.append(
                    {
                        k: v[local] if isinstance(v, torch.Tensor) else [v[j] for j in local.tolist()]
                        for k, v in shard.items()
                    }
                )
            start = stop
        if not parts:
            return {k: v[:0] for k, v in self.read_shard(0, columns).items()} if self.num_shards else {}
        return concat_batches(parts)

    def verify(self) -> None:
        """Re-check every shard of every input."""
        for s in self.sets:
            s.verify()


def open_inputs(paths: Sequence[str | Path], *, verify: bool = True) -> ZippedShardSets:
    """Open one or more `--in` shard sets as one zipped view."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    return ZippedShardSets([ShardSet(p, verify=verify) for p in paths])
