"""`omnirl inspect`: what a shard set holds, where it came from, and whether its bytes are intact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..console import emit_json, err
from ..errors import handle_errors
from ..options import JsonOpt


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _render(info: dict[str, Any], head: list[dict[str, Any]]) -> None:
    from rich.table import Table
    from rich.tree import Tree

    title = (
        f"[bold]{info['path']}[/]  {info['format']} v{info['schema_version']}  "
        f"{info['num_rows']} rows in {info['num_shards']} shards"
    )
    err.print(title)
    err.print(f"made by [cyan]{info.get('command', '?')}[/] at {info.get('created', '?')}  config {info.get('config_hash', '')[:12]}")
    if info.get("policy"):
        err.print(f"policy: {info['policy']}")

    stats = info.get("stats", {})
    cols = Table(title="columns", show_lines=False)
    for name in ("column", "kind", "dtype", "shape", "min", "mean", "max", "std", "nan/inf"):
        cols.add_column(name, justify="right" if name in ("min", "mean", "max", "std", "nan/inf") else "left")
    for col in info["columns"]:
        s = stats.get(col["name"])
        shape = "×".join(str(d) for d in col.get("shape") or ()) or "scalar" if col["kind"] == "tensor" else ""
        row = [col["name"], col["kind"], col.get("dtype") or "", shape]
        if s:
            row += [_fmt(s["min"]), _fmt(s["mean"]), _fmt(s["max"]), _fmt(s["std"]), f"{s['nan_count']}/{s['inf_count']}"]
        else:
            row += ["", "", "", "", ""]
        cols.add_row(*row)
    err.print(cols)

    shards = Table(title="shards")
    for name in ("file", "rows", "size", "sha256"):
        shards.add_column(name)
    for sh in info["shards"]:
        shards.add_row(sh["file"], str(sh["rows"]), _size(sh["bytes"]), sh.get("sha256", "")[:16])
    err.print(shards)

    if info.get("lineage"):
        tree = Tree("lineage")

        def add(node: Tree, parents: list[dict[str, Any]]) -> None:
            for p in parents:
                label = f"{p.get('path')}  [dim]{p.get('command', '')}[/]"
                if p.get("missing"):
                    label += "  [yellow](gone)[/]"
                add(node.add(label), p.get("parents", []))

        add(tree, info["lineage"])
        err.print(tree)

    if head:
        rows = Table(title=f"first {len(head)} rows")
        for name in head[0]:
            rows.add_column(name, overflow="fold", max_width=40)
        for r in head:
            rows.add_row(*(str(v) for v in r.values()))
        err.print(rows)
    if info.get("verified"):
        err.print("[green]verified:[/] every shard matches its size and sha256")


def _head_rows(path: Path, n: int) -> list[dict[str, Any]]:
    from stages.shards.reader import ShardSet

    shard_set = ShardSet(path)
    if n <= 0 or shard_set.num_shards == 0:
        return []
    batch = shard_set.read_shard(0)
    out = []
    for i in range(min(n, shard_set.manifest.shards[0].rows)):
        row: dict[str, Any] = {}
        for name, col in shard_set.columns.items():
            value = batch[name][i]
            if col.kind == "tensor":
                row[name] = f"{value.item():.5g}" if value.ndim == 0 else f"[{'×'.join(map(str, value.shape))}]"
            elif col.kind in ("binary", "image", "video"):
                row[name] = f"<{col.kind} {len(value)} B>"
            else:
                text = str(value)
                row[name] = text if len(text) <= 60 else text[:57] + "..."
        out.append(row)
    return out


@handle_errors
def inspect(
    path: Annotated[Path, typer.Argument(help="A shard-set directory (holding _manifest.json).")],
    verify: Annotated[bool, typer.Option("--verify", help="Re-check every shard's size and sha256.")] = False,
    head: Annotated[int, typer.Option("--head", min=0, help="Also show the first N rows.")] = 0,
    json_: JsonOpt = False,
) -> None:
    """Show a shard set: format, shards, rows, columns with dtype/shape and numeric stats, and lineage.

    Example: [bold]omnirl inspect run/it0/samples --verify --head 3[/]
    """
    from stages.shards.describe import describe
    from stages.shards.reader import ShardSet

    shard_set = ShardSet(path)
    if verify:
        shard_set.verify()
    info = describe(shard_set)
    info["verified"] = verify
    rows = _head_rows(path, head)
    if json_:
        if rows:
            info["head"] = rows
        emit_json(info)
    else:
        _render(info, rows)
