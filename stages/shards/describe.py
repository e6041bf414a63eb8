"""A JSON-able summary of a shard set for `omnirl inspect`: manifest, schema, stats, lineage."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from stages.errors import UserInputError
from stages.shards.manifest import manifest_sha256, read_manifest
from stages.shards.reader import ShardSet, ZippedShardSets

_NUMERIC = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


class _Moments:
    """Streaming count/min/max/mean/M2 over finite values (Chan et al.'s pairwise merge), in float64."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min: float | int | None = None
        self.max: float | int | None = None
        self.nan = 0
        self.inf = 0

    def add(self, t: torch.Tensor) -> None:
        if t.dtype == torch.bool:
            t = t.to(torch.uint8)
        if t.is_floating_point():
            self.nan += int(torch.isnan(t).sum())
            self.inf += int(torch.isinf(t).sum())
            t = t[torch.isfinite(t)]
        t = t.reshape(-1)
        if t.numel() == 0:
            return
        lo, hi = t.min().item(), t.max().item()
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        x = t.to(torch.float64)
        n_b = x.numel()
        mean_b = float(x.mean())
        m2_b = float(((x - mean_b) ** 2).sum())
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * self.count * n_b / n
        self.count = n

    def to_json(self) -> dict:
        has = self.count > 0
        return {
            "count": self.count,
            "min": self.min,
            "max": self.max,
            "mean": self.mean if has else None,
            "std": math.sqrt(self.m2 / self.count) if has else None,
            "nan_count": self.nan,
            "inf_count": self.inf,
        }


def column_stats(shard_set: ShardSet) -> dict[str, dict]:
    """Per numeric tensor column, over all its elements in all shards: count of finite values,
    their min, max, mean and population std, plus nan_count and inf_count."""
    names = [c.name for c in shard_set.columns.values() if c.kind == "tensor" and c.dtype in _NUMERIC]
    moments = {n: _Moments() for n in names}
    if names:
        for i in range(shard_set.num_shards):
            batch = shard_set.read_shard(i, names)
            for n in names:
                moments[n].add(batch[n])
    return {n: m.to_json() for n, m in moments.items()}


def lineage(directory: Path, parents: list[dict], depth: int) -> list[dict]:
    """Parent records, each annotated with whether it still exists unchanged and, up to `depth`
    levels, its own command, creation time and parents."""
    out = []
    for p in parents:
        entry = dict(p)
        if "path" not in p:  # an input named otherwise (a Hub dataset, several prompt files): as recorded
            out.append(entry)
            continue
        path = (directory / p["path"]).resolve() if not Path(p["path"]).is_absolute() else Path(p["path"])
        entry["resolved"] = str(path)
        if "manifest_sha256" in p:
            try:
                current = manifest_sha256(path)
            except UserInputError:
                entry["exists"] = False
                out.append(entry)
                continue
            entry["exists"] = True
            entry["unchanged"] = current == p["manifest_sha256"]
            if depth > 0:
                try:
                    m = read_manifest(path)
                except UserInputError:
                    out.append(entry)
                    continue
                entry["command"] = m.command
                entry["created"] = m.created
                entry["parents"] = lineage(path, m.parents, depth - 1)
        else:
            entry["exists"] = path.exists()
        out.append(entry)
    return out


def _describe_one(s: ShardSet, stats: bool, lineage_depth: int) -> dict:
    m = s.manifest
    return {
        "path": str(s.path),
        "format": m.format,
        "schema_version": m.schema_version,
        "command": m.command,
        "created": m.created,
        "num_rows": m.num_rows,
        "num_shards": s.num_shards,
        "shards": [{"file": sh.file, "rows": sh.rows, "bytes": sh.bytes} for sh in m.shards],
        "columns": [c.to_json() for c in m.columns],
        "stats": column_stats(s) if stats else {},
        "lineage": lineage(s.path, m.parents, lineage_depth - 1),
        "policy": m.policy,
        "config_hash": m.config_hash,
        "config": m.config,
        "extra": m.extra,
    }


def describe(shard_set: ShardSet | ZippedShardSets, *, stats: bool = True, lineage_depth: int = 3) -> dict:
    """Summary of a shard set; for zipped inputs, one summary per input under "inputs" plus the
    combined row/shard counts and columns."""
    if isinstance(shard_set, ShardSet):
        return _describe_one(shard_set, stats, lineage_depth)
    return {
        "inputs": [_describe_one(s, stats, lineage_depth) for s in shard_set.sets],
        "num_rows": shard_set.num_rows,
        "num_shards": shard_set.num_shards,
        "columns": [c.to_json() for c in shard_set.columns.values()],
    }


def short_number(x: object) -> str:
    """A number as `inspect` shows it: five significant digits, a whole float as an integer."""
    if isinstance(x, float):
        return f"{x:.5g}" if not x.is_integer() or abs(x) >= 1e6 else str(int(x))
    return str(x)


def head_rows(shard_set: ShardSet, n: int) -> list[dict[str, str]]:
    """The first `n` rows of the first shard as short strings per column, for `omnirl inspect --head`:
    a small tensor's values, a larger one's shape, media as their kind and byte count, text cut at 60
    characters."""
    if n <= 0 or shard_set.num_shards == 0:
        return []
    batch = shard_set.read_shard(0)
    rows = []
    for i in range(min(n, shard_set.manifest.shards[0].rows)):
        row: dict[str, str] = {}
        for name, col in shard_set.columns.items():
            value = batch[name][i]
            if col.kind == "tensor":
                if value.numel() <= 6:
                    row[name] = (
                        short_number(value.item())
                        if value.ndim == 0
                        else "[" + ", ".join(short_number(float(v)) for v in value.flatten()) + "]"
                    )
                else:
                    row[name] = f"[{'×'.join(map(str, value.shape))}]"
            elif col.kind in ("binary", "image", "video"):
                row[name] = f"<{col.kind} {len(value)} B>"
            elif col.kind in ("image_list", "audio_list"):
                what = "images" if col.kind == "image_list" else "audios"
                row[name] = f"<{len(value)} {what} {sum(map(len, value))} B>"
            elif col.kind == "video_list":
                frames = [f for video in value for f in video]
                row[name] = f"<{len(value)} videos {len(frames)} frames {sum(map(len, frames))} B>"
            else:
                text = str(value)
                row[name] = text if len(text) <= 60 else text[:57] + "..."
        rows.append(row)
    return rows
