"""Writing a shard set: one shard file at a time, resumable, with the manifest written last.

Each shard is written to a hidden temp file, fsynced and renamed into place; then a hidden
completion record `.train-....done.json` (rows, bytes, sha256, run fingerprint, columns) is
written. A re-run with the same fingerprint skips shards whose record and bytes still match. In
distributed runs every process writes its own shard indices into the same directory and one of
them calls `finalize()` once all exist.

A process writing a shard holds its writer lock `.lock-train-...` (`atomic.hold_lock`: its pid and
host) from then until it finalizes the set or ends, so a second run writing the same shards of one
output (two launches onto one --out) is refused in one line naming the first, instead of both
rewriting each other's shards; processes writing different shards (the ranks of a launch, Slurm array
tasks) do not meet. A killed writer's lock is free at once and taken over by the next.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from stages.errors import UserInputError
from stages.shards.atomic import (
    atomic_output,
    atomic_write_bytes,
    fsync_dir,
    hold_lock,
    lock_holder,
    release_lock,
    remove_free_locks,
    remove_stale_temps,
    sha256_file,
)
from stages.shards.digest import content_digest
from stages.shards.formats import SHARD_GLOBS, codec, shard_file_name
from stages.shards.manifest import (
    FORMATS,
    MANIFEST_NAME,
    ROLLOUT_KEYS,
    SCHEMA_VERSION,
    Manifest,
    ShardInfo,
    config_hash,
    manifest_sha256,
    read_manifest,
    write_manifest,
)
from stages.shards.run_card import update_card
from stages.shards.schema import Batch, Column, infer_columns

logger = logging.getLogger(__name__)


@runtime_checkable
class Input(Protocol):
    """An input that is not one shard set or file (e.g. a prompt source of several files or a Hub
    dataset): it gives its own lineage record ({"path"} or {"source"}, with "sha256") and the local
    paths it reads."""

    @property
    def paths(self) -> list[Path]: ...

    def lineage(self) -> dict[str, Any]: ...


def input_paths(parents: Sequence[str | Path | Input]) -> list[Path]:
    """Every local path the inputs read (an output must be none of them, nor inside one)."""
    return [p for parent in parents for p in (parent.paths if isinstance(parent, Input) else [Path(parent)])]


def parent_entry(parent: str | Path | Input, out_dir: Path) -> dict:
    """Lineage record of an input: a shard set's manifest hash, a plain file's sha256, or the record
    an `Input` gives.

    A path is stored relative to `out_dir` so a run tree can be moved as a whole.
    """
    if isinstance(parent, Input):
        entry = parent.lineage()
        if "path" in entry:
            entry["path"] = Path(os.path.relpath(Path(entry["path"]).resolve(), out_dir.resolve())).as_posix()
        return entry
    p = Path(parent)
    rel = Path(os.path.relpath(p.resolve(), out_dir.resolve())).as_posix()
    if p.is_dir():
        return {"path": rel, "manifest_sha256": manifest_sha256(p)}
    if p.is_file():
        return {"path": rel, "sha256": content_digest(p, "input")}
    raise UserInputError(f"input {p} does not exist")


def check_output_path(out: Path, inputs: Sequence[str | Path], option: str = "--out") -> None:
    """Refuse an output path that cannot be a fresh directory or that would write over an input.

    A file or a dangling symlink in the way, an unwritable location, or an output that is (or
    contains) one of the command's own inputs is a one-line usage error, raised before any work.
    """
    if out.is_symlink() and not out.exists():
        raise UserInputError(f"{option} {out} is a dangling symlink; remove it or pick another {option}")
    if out.exists() and not out.is_dir():
        raise UserInputError(f"{option} {out} is a file; pass a directory")
    target = out.resolve()
    for item in inputs:
        source = Path(item).resolve()
        if source == target or target in source.parents:
            relation = "is" if source == target else "contains"
            raise UserInputError(
                f"{option} {out} {relation} the input {item}; no command writes over its own inputs, "
                f"pick another {option}"
            )
    ancestor = target
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserInputError(f"{option} {out}: {ancestor} is not writable; pick another {option}")


def run_fingerprint(
    config_hash_: str, format: str, num_shards: int, policy: dict | None, parents: list[dict]
) -> str:
    """What makes two runs produce the same output: config, format, sharding, policy and inputs."""
    return config_hash(
        {
            "config_hash": config_hash_,
            "format": format,
            "num_shards": num_shards,
            "policy": policy,
            "parents": parents,
        }
    )


def _manifest_fingerprint(m: Manifest) -> str:
    return run_fingerprint(m.config_hash, m.format, len(m.shards), m.policy, m.parents)


def _difference(old: Manifest, new: dict) -> str:
    if old.config_hash != new["config_hash"]:
        return "a different configuration"
    if old.parents != new["parents"]:
        return "different inputs"
    if config_hash({"policy": old.policy}) != config_hash({"policy": new["policy"]}):
        return "a different policy"
    return f"a different format or shard count ({old.format}, {len(old.shards)} shards)"


class ShardSetWriter:
    """Writes shard `index` of `num_shards` into `out_dir`, then the manifest in `finalize()`.

    If `out_dir` already holds a manifest with the same run fingerprint, `.complete` is True and
    `.manifest` is that manifest: there is nothing to do.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        num_shards: int,
        format: str = "parquet",
        command: str,
        config: dict,
        parents: Sequence[str | Path | Input] = (),
        policy: dict | None = None,
        kinds: dict[str, str] | None = None,
        overwrite: bool = False,
    ) -> None:
        if format not in FORMATS:
            raise UserInputError(f"unknown shard format {format!r}; use one of {', '.join(FORMATS)}")
        if not isinstance(num_shards, int) or num_shards < 1:
            raise UserInputError(f"--num-shards must be a positive integer, got {num_shards!r}")
        self.out_dir = Path(out_dir)
        check_output_path(self.out_dir, input_paths(parents))
        self.num_shards = num_shards
        self.format = format
        self.command = command
        self.config = config
        self.config_hash = config_hash(config)
        self.parents = [parent_entry(p, self.out_dir) for p in parents]
        # The rollout's family and modality pass down its lineage, so every derived set records them.
        self.inherited = next(
            (
                {k: m.extra[k] for k in ROLLOUT_KEYS if k in m.extra}
                for m in (read_manifest(p) for p in parents if not isinstance(p, Input) and Path(p).is_dir())
                if "modality" in (m.extra or {})
            ),
            {},
        )
        self.policy = policy
        self.kinds = dict(kinds or {})
        self.fingerprint = run_fingerprint(self.config_hash, format, num_shards, policy, self.parents)
        self._codec = codec(format)
        self._infos: dict[int, ShardInfo] = {}
        self._columns: list[Column] | None = None
        self._first_file: str | None = None
        self.manifest: Manifest | None = None
        self.complete = False
        if (self.out_dir / MANIFEST_NAME).exists():
            self._check_existing(overwrite)

    @property
    def content_id(self) -> str:
        """What the rows hold, apart from where and how they are stored (directory, format, shard
        count): a hash of the config, the policy and the contents of the inputs."""
        inputs = [p.get("manifest_sha256") or p.get("sha256") for p in self.parents]
        return config_hash({"config_hash": self.config_hash, "policy": self.policy, "inputs": inputs})

    @property
    def columns(self) -> list[Column] | None:
        """The columns of the shards written or found complete so far (None before any)."""
        return self._columns

    def _check_existing(self, overwrite: bool) -> None:
        try:
            old = read_manifest(self.out_dir)
        except UserInputError:
            if not overwrite:
                raise
            old = None
        if old is not None and _manifest_fingerprint(old) == self.fingerprint:
            damaged = [i for i, info in enumerate(old.shards) if not self._intact(info)]
            if not damaged:
                self.manifest = old
                self.complete = True
                return
            # A damaged shard of this very run: the intact shards get their completion records
            # back, the set is unlisted, and the resumed run writes only the damaged shards again
            # (all of them when the set has an older layout, so one set never mixes two).
            if old.schema_version == SCHEMA_VERSION:
                for i, info in enumerate(old.shards):
                    if i not in damaged:
                        self._write_record(i, info, old.columns)
            self._unlist()
            return
        if not overwrite:
            why = _difference(
                old, {"config_hash": self.config_hash, "parents": self.parents, "policy": self.policy}
            )
            raise UserInputError(
                f"{self.out_dir} already holds a finished output made with {why}; "
                "pass --overwrite to replace it or pick another --out"
            )
        self._unlist()
        keep = {shard_file_name(i, self.num_shards, self.format) for i in range(self.num_shards)}
        for p in [p for pattern in SHARD_GLOBS for p in self.out_dir.glob(pattern)]:
            if p.name not in keep:
                p.unlink(missing_ok=True)
        fsync_dir(self.out_dir)

    def _intact(self, info: ShardInfo) -> bool:
        """True when a listed shard still has its listed size and sha256."""
        path = self.out_dir / info.file
        try:
            return path.stat().st_size == info.bytes and sha256_file(path) == info.sha256
        except FileNotFoundError:
            return False

    def _unlist(self) -> None:
        """Remove the manifest first, so the set no longer looks finished while it is rewritten."""
        (self.out_dir / MANIFEST_NAME).unlink(missing_ok=True)
        fsync_dir(self.out_dir)

    def _ensure_dir(self) -> None:
        """Create the output directory on the first write, so a failure before it leaves nothing."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserInputError(
                f"--out {self.out_dir}: cannot create it ({e.strerror}); pick a writable location"
            ) from None

    def _remove_unlisted(self, listed: set[str]) -> None:
        """Drop completion records, crash leftovers and shard files of other runs after finalizing."""
        records = [p for pattern in SHARD_GLOBS for p in self.out_dir.glob(f".{pattern}")]
        for p in [*records, *(p for pattern in SHARD_GLOBS for p in self.out_dir.glob(pattern))]:
            if p.name not in listed:
                p.unlink(missing_ok=True)

    def _lock_paths(self) -> list[Path]:
        return sorted(self.out_dir.glob(".lock-*")) if self.out_dir.is_dir() else []

    def shard_file(self, index: int) -> Path:
        """Final path of shard `index`."""
        return self.out_dir / shard_file_name(index, self.num_shards, self.format)

    def _record_path(self, index: int) -> Path:
        return self.out_dir / f".{shard_file_name(index, self.num_shards, self.format)}.done.json"

    def _lock_path(self, index: int) -> Path:
        return self.out_dir / f".lock-{shard_file_name(index, self.num_shards, self.format)}"

    def _claim(self, index: int) -> None:
        """Hold shard `index`'s writer lock, or refuse naming the live process that holds it."""
        holder = hold_lock(self._lock_path(index), f"{self.command} {self.out_dir}")
        if holder is not None:
            raise UserInputError(
                f"{self.out_dir}: {_writer_name(holder)} is writing this output (shard "
                f"{index}); wait for it to end or stop it, or pick another --out"
            )

    def _check_index(self, index: int) -> None:
        if not isinstance(index, int) or not 0 <= index < self.num_shards:
            raise UserInputError(
                f"shard index {index!r} is outside 0..{self.num_shards - 1} (--num-shards {self.num_shards})"
            )

    def _read_record(self, index: int) -> tuple[ShardInfo, list[Column]] | None:
        """The completion record of a shard if it belongs to this run and its file has the listed size."""
        try:
            rec = json.loads(self._record_path(index).read_bytes())
            if rec["fingerprint"] != self.fingerprint or rec.get("schema_version", 1) != SCHEMA_VERSION:
                return None
            info = ShardInfo.from_json(rec)
            columns = [Column.from_json(c) for c in rec["columns"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if info.file != self.shard_file(index).name:
            return None
        try:
            if self.shard_file(index).stat().st_size != info.bytes:
                return None
        except FileNotFoundError:
            return None
        return info, columns

    def _adopt_columns(self, columns: list[Column], file: str) -> None:
        if self._columns is None:
            self._columns, self._first_file = columns, file
            return
        if columns != self._columns:
            raise UserInputError(
                f"{self.out_dir}: {_schema_difference(self._columns, columns, self._first_file, file)}"
            )

    def shard_done(self, index: int) -> bool:
        """True if shard `index` is complete and verified (sha256 re-checked) for this run."""
        self._check_index(index)
        if self.complete or index in self._infos:
            return True
        found = self._read_record(index)
        if found is None:
            return False
        info, columns = found
        if sha256_file(self.shard_file(index)) != info.sha256:
            return False
        self._adopt_columns(columns, info.file)
        self._infos[index] = info
        return True

    def write_shard(self, index: int, batch: Batch) -> ShardInfo:
        """Encode `batch` as shard `index` (atomically) and record it as complete."""
        self._check_index(index)
        if self.complete:
            raise ValueError(f"{self.out_dir} is already complete; check `.complete` before writing shards")
        known = {c.name: c.kind for c in self._columns or ()}
        columns = infer_columns(batch, {**known, **self.kinds})
        path = self.shard_file(index)
        self._adopt_columns(columns, path.name)
        self._ensure_dir()
        self._claim(index)
        self._record_path(index).unlink(missing_ok=True)
        remove_stale_temps(path)
        try:
            with atomic_output(path) as sink:
                rows = self._codec.encode(batch, columns, sink, index)
        except BaseException:
            release_lock(self._lock_path(index))  # no longer writing it; the shards written stay held
            raise
        info = ShardInfo(path.name, rows, sink.bytes, sink.sha256)
        self._write_record(index, info, columns)
        self._infos[index] = info
        return info

    def read_shard(self, index: int, columns: Sequence[str]) -> Batch:
        """The requested columns of shard `index`, complete for this run (`shard_done`), before the
        manifest exists: what a stage summarises into its manifest's `extra`."""
        import pyarrow as pa

        if not self.shard_done(index):
            raise ValueError(f"{self.shard_file(index)} is not written yet")
        known = {c.name: c for c in self._columns or ()}
        path = self.shard_file(index)
        buf = pa.py_buffer(path.read_bytes())
        return self._codec.decode(buf, [known[n] for n in columns], self._infos[index].rows, str(path))

    def _write_record(self, index: int, info: ShardInfo, columns: list[Column]) -> None:
        record = {
            **info.to_json(),
            "fingerprint": self.fingerprint,
            "config_hash": self.config_hash,
            "schema_version": SCHEMA_VERSION,
        }
        record["columns"] = [c.to_json() for c in columns]
        atomic_write_bytes(self._record_path(index), json.dumps(record).encode())

    def finalize(self, extra: dict | None = None) -> Manifest:
        """Check that every shard exists with one schema, then write the manifest (last)."""
        if self.complete:
            return self.manifest  # type: ignore[return-value]
        infos: list[ShardInfo] = []
        missing: list[str] = []
        columns_by_file: list[tuple[str, list[Column]]] = []
        for i in range(self.num_shards):
            found = self._read_record(i)
            if found is None:
                missing.append(self.shard_file(i).name)
                continue
            infos.append(found[0])
            columns_by_file.append((found[0].file, found[1]))
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            writing = next(filter(None, map(lock_holder, self._lock_paths())), None)
            raise UserInputError(
                f"{self.out_dir}: {len(missing)} of {self.num_shards} shards are not written yet ({shown}); "
                + (
                    f"{_writer_name(writing)} is writing this output: wait for it to end or stop it"
                    if writing is not None
                    else "run the missing shard indices, then finalize"
                )
            )
        first_file, columns = columns_by_file[0]
        for file, cols in columns_by_file[1:]:
            if cols != columns:
                raise UserInputError(f"{self.out_dir}: {_schema_difference(columns, cols, first_file, file)}")
        manifest = Manifest(
            format=self.format,
            command=self.command,
            config=self.config,
            config_hash=self.config_hash,
            parents=self.parents,
            policy=self.policy,
            shards=infos,
            columns=columns,
            num_rows=sum(s.rows for s in infos),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            extra={**self.inherited, **(extra or {})},
        )
        write_manifest(self.out_dir, manifest)
        self._remove_unlisted({s.file for s in infos})
        remove_free_locks(self._lock_paths())
        self.manifest = manifest
        self.complete = True
        try:
            update_card(self.out_dir)
        except OSError as exc:  # the set is complete; only the run folder's card could not be written
            logger.warning("%s: the run's dataset card was not updated: %s", self.out_dir, exc)
        return manifest


def _writer_name(holder: dict) -> str:
    """'pid 123 on host-a (sample runs/x)' from a writer lock's record ('another process' while it
    is being taken)."""
    if "pid" not in holder:
        return "another process"
    return f"pid {holder['pid']} on {holder.get('host', '?')} ({holder.get('what', '?')})"


def _describe_column(c: Column | None) -> str:
    if c is None:
        return "absent"
    if c.kind == "video" and c.shape:
        frames, height, width = c.shape
        return f"video of {frames} frames {width}×{height} at {c.fps:g} fps"
    return f"tensor {c.dtype}{list(c.shape)}" if c.kind == "tensor" else c.kind


def _schema_difference(a: list[Column], b: list[Column], file_a: str | None, file_b: str) -> str:
    """One line naming the first column whose schema differs between two shards."""
    by_name_a = {c.name: c for c in a}
    by_name_b = {c.name: c for c in b}
    for name in [*by_name_a, *by_name_b]:
        ca, cb = by_name_a.get(name), by_name_b.get(name)
        if ca != cb:
            return (
                f"column '{name}' is {_describe_column(ca)} in {file_a} but {_describe_column(cb)} in {file_b}; "
                "every shard of a shard set needs the same columns, dtypes and shapes"
            )
    return f"columns are in a different order in {file_a} and {file_b}; write them in one order"
