"""`omnirl inspect`: what a shard set holds, where it came from, and whether its bytes are intact."""

from __future__ import annotations

from typing import Any

from stages.inspection import InspectConfig

from ..console import emit_json, out, progress
from ..generate import config_command


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _render(info: dict[str, Any], head: list[dict[str, Any]], sha: dict[str, str]) -> None:
    from rich.table import Table
    from rich.tree import Tree

    from stages.media.deferred import DEFERRED
    from stages.shards.describe import short_number

    out.print(
        f"[bold]{info['path']}[/]  {info['format']} v{info['schema_version']}  "
        f"[bold]{info['num_rows']}[/] rows in {info['num_shards']} shard(s)"
    )
    out.print(
        f"made by [cyan]omnirl {info.get('command', '?')}[/] at {info.get('created', '?')}, "
        f"config {info.get('config_hash', '')[:12]}"
    )
    if info.get("policy"):
        out.print("policy: " + ", ".join(f"{k}={v}" for k, v in info["policy"].items()))
    deferred = (info.get("extra") or {}).get(DEFERRED)
    if deferred:
        out.print(
            f"media: deferred (final latents, no image/video column); `omnirl score` decodes them with the "
            f"VAE of {deferred['model']}"
        )

    stats = info.get("stats", {})
    cols = Table(title="columns", title_justify="left")
    cols.add_column("column", no_wrap=True)
    for name in ("kind", "dtype", "shape"):
        cols.add_column(name, no_wrap=True)
    for name in ("min", "mean", "max", "std", "nan/inf"):
        cols.add_column(name, justify="right", no_wrap=True)
    for col in info["columns"]:
        st = stats.get(col["name"])
        shape = (
            ("×".join(str(d) for d in col.get("shape") or ()) or "scalar") if col["kind"] == "tensor" else ""
        )
        if col["kind"] == "video" and col.get("shape"):
            frames, height, width = col["shape"]
            shape = f"{frames} frames {width}×{height} @ {col['fps']:g} fps"
        row = [col["name"], col["kind"], col.get("dtype") or "", shape]
        if st:
            row += [
                short_number(st["min"]),
                short_number(st["mean"]),
                short_number(st["max"]),
                short_number(st["std"]),
                f"{st['nan_count']}/{st['inf_count']}",
            ]
        else:
            row += [""] * 5
        cols.add_row(*row)
    out.print(cols)

    shards = Table(title="shards", title_justify="left")
    for name in ("file", "rows", "size", "sha256"):
        shards.add_column(name, no_wrap=True)
    for sh in info["shards"]:
        shards.add_row(sh["file"], str(sh["rows"]), _size(sh["bytes"]), sha.get(sh["file"], "")[:16])
    out.print(shards)

    if info.get("lineage"):
        tree = Tree("lineage")

        def add(node: Tree, parents: list[dict[str, Any]]) -> None:
            for p in parents:
                label = f"{p.get('path') or p.get('source')}  [dim]omnirl {p.get('command', '?')}[/]"
                if not p.get("exists", True):
                    label += "  [yellow](gone)[/]"
                elif not p.get("unchanged", True):
                    label += "  [yellow](changed since)[/]"
                add(node.add(label), p.get("parents", []))

        add(tree, info["lineage"])
        out.print(tree)

    if head:
        rows = Table(title=f"first {len(head)} rows", title_justify="left")
        rows.add_column("column", no_wrap=True)
        for i in range(len(head)):
            rows.add_column(f"row {i}", overflow="fold")
        for name in head[0]:
            rows.add_row(name, *(str(r[name]) for r in head))
        out.print(rows)
    if info.get("verified"):
        out.print("[green]verified:[/] every shard matches its size and sha256")


def run(c: InspectConfig, json_: bool) -> None:
    """Show a shard set: format, shards, rows, columns with dtype/shape and numeric stats, and lineage.

    Example: [bold]omnirl inspect run/it0/samples --verify --head 3[/]
    """
    from stages.shards.describe import describe, head_rows
    from stages.shards.reader import ShardSet

    shard_set = ShardSet(c.path)
    if c.verify:
        with progress() as bar:
            bar.add_task(f"verifying {shard_set.num_shards} shards", total=None, rate="")
            shard_set.verify()
    info = describe(shard_set)
    info["verified"] = c.verify
    rows = head_rows(shard_set, c.head)
    if json_:
        if rows:
            info["head"] = rows
        emit_json(info)
    else:
        _render(info, rows, {sh.file: sh.sha256 for sh in shard_set.manifest.shards})


inspect = config_command(InspectConfig, "inspect", run, presets=False)
