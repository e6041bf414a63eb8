"""The `_manifest.json` of a shard set: what was written, by which command, from which inputs.

The manifest is written last and atomically; a directory without one is not a finished output.
Readers trust only the shards it lists and check them against its sizes and sha256 sums.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.knobs import FORMATS
from stages.shards.atomic import atomic_write_bytes
from stages.shards.schema import Column

MANIFEST_NAME = "_manifest.json"
# 2: Parquet tensors as nested fixed-size lists and images as {bytes, path} structs, which Hugging
# Face `datasets` reads (1: `arrow.fixed_shape_tensor` and plain binary); every version is still read.
SCHEMA_VERSION = 2
# What a rollout's manifest `extra` says about it (its model family and output modality); every set
# derived from it inherits them.
ROLLOUT_KEYS = ("family", "modality")
# The `extra` key of a shard set holding only some of its rollout's rows (`logprob --fraction`: a
# check), {"rows": kept, "of": the rollout's rows, "option": what made it so}: never a column group.
SUBSET_KEY = "subset"


@dataclass
class ShardInfo:
    """One listed shard file (a plain name inside the shard-set directory)."""

    file: str
    rows: int
    bytes: int
    sha256: str

    def to_json(self) -> dict:
        return {"file": self.file, "rows": self.rows, "bytes": self.bytes, "sha256": self.sha256}

    @classmethod
    def from_json(cls, d: dict) -> ShardInfo:
        info = cls(str(d["file"]), int(d["rows"]), int(d["bytes"]), str(d["sha256"]))
        if Path(info.file).name != info.file or info.file in ("", ".", ".."):
            raise ValueError(f"shard file {info.file!r} is not a plain file name")
        return info


@dataclass(kw_only=True)
class Manifest:
    """Everything a reader, `omnirl inspect` and a resumed run need to know about a shard set.

    `parents` entries are {"path", "manifest_sha256"} for shard sets (or {"path", "sha256"} for a
    plain input file), with `path` relative to the shard-set directory when possible.
    """

    format: str
    schema_version: int = SCHEMA_VERSION
    command: str
    config: dict
    config_hash: str
    parents: list[dict] = field(default_factory=list)
    policy: dict | None = None
    shards: list[ShardInfo]
    columns: list[Column]
    num_rows: int
    created: str
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "format": self.format,
            "schema_version": self.schema_version,
            "command": self.command,
            "config": self.config,
            "config_hash": self.config_hash,
            "parents": self.parents,
            "policy": self.policy,
            "shards": [s.to_json() for s in self.shards],
            "columns": [c.to_json() for c in self.columns],
            "num_rows": self.num_rows,
            "created": self.created,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: dict) -> Manifest:
        """Parse and validate; raises ValueError/KeyError/TypeError on malformed input."""
        m = cls(
            format=str(d["format"]),
            schema_version=int(d["schema_version"]),
            command=str(d["command"]),
            config=dict(d["config"]),
            config_hash=str(d["config_hash"]),
            parents=[dict(p) for p in d.get("parents", [])],
            policy=None if d.get("policy") is None else dict(d["policy"]),
            shards=[ShardInfo.from_json(s) for s in d["shards"]],
            columns=[Column.from_json(c) for c in d["columns"]],
            num_rows=int(d["num_rows"]),
            created=str(d["created"]),
            extra=dict(d.get("extra") or {}),
        )
        if m.format not in FORMATS:
            raise ValueError(f"unknown format {m.format!r}")
        if m.num_rows != sum(s.rows for s in m.shards):
            raise ValueError("num_rows is not the sum of the shard rows")
        if len({c.name for c in m.columns}) != len(m.columns):
            raise ValueError("duplicate column names")
        return m


def canonical_json(value: Any) -> bytes:
    """Key-sorted, whitespace-free UTF-8 JSON: equal values give equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def config_hash(config: dict) -> str:
    """sha256 of the canonical JSON of a resolved config (non-JSON values such as paths via str)."""
    return hashlib.sha256(canonical_json(config)).hexdigest()


def _manifest_path(directory: str | Path) -> Path:
    directory = Path(directory)
    if directory.name == MANIFEST_NAME and directory.is_file():
        return directory
    return directory / MANIFEST_NAME


def read_manifest(directory: str | Path) -> Manifest:
    """Load and validate the manifest of a shard-set directory."""
    path = _manifest_path(directory)
    if not path.parent.is_dir():
        raise UserInputError(
            f"{path.parent} does not exist or is not a directory; pass a shard-set directory"
        )
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserInputError(
            f"{path.parent} has no {MANIFEST_NAME}, so it is not a finished output; "
            "run (or re-run) the command that produces it"
        ) from None
    try:
        manifest = Manifest.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserInputError(
            f"{path} is corrupt ({e}); re-run the command that produced it with --overwrite"
        ) from e
    if manifest.schema_version > SCHEMA_VERSION:
        raise UserInputError(
            f"{path} has schema version {manifest.schema_version} but this omnirl reads up to {SCHEMA_VERSION}; upgrade omnirl"
        )
    return manifest


def write_manifest(directory: str | Path, manifest: Manifest) -> None:
    """Write `_manifest.json` atomically (temp file + fsync + os.replace + fsync of the dir)."""
    text = json.dumps(manifest.to_json(), indent=2, ensure_ascii=False, default=str, allow_nan=False) + "\n"
    atomic_write_bytes(Path(directory) / MANIFEST_NAME, text.encode())


def manifest_sha256(directory: str | Path) -> str:
    """sha256 of the manifest file's bytes: the identity of a finished shard set for lineage."""
    path = _manifest_path(directory)
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        raise UserInputError(
            f"{path.parent} has no {MANIFEST_NAME}, so it is not a finished output; "
            "run (or re-run) the command that produces it"
        ) from None
