"""Run reports: per-iteration reward table, a reward-curve PNG and per-iteration image grids.

A run directory holds `it<K>/{samples,rewards,advantages,...}` shard sets and `it<K>/policy`
adapters (the layout the recipes write). Plots are drawn with Pillow, so no plotting stack is needed.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.shards.manifest import MANIFEST_NAME, read_manifest

ITER_DIR = re.compile(r"^it(\d+)$")
TAG_KEY = "tag"  # the prompt_meta key of a prompt's task family (GenEval metadata's "tag")


def iterations(run: Path) -> list[tuple[int, Path]]:
    """(k, it<k> directory) pairs of a run, in order."""
    if not run.is_dir():
        raise UserInputError(f"{run}: no such run directory")
    found = sorted(
        (int(m.group(1)), p) for p in run.iterdir() if (m := ITER_DIR.match(p.name)) and p.is_dir()
    )
    return found


def reward_statistics(rewards: Mapping[str, Any], meta: Sequence[Any] | None = None) -> dict[str, float]:
    """`<column>/mean` and `<column>/std` (population) of every float reward column (`reward`,
    `reward.<name>`) of a scored batch: what `score` reports and the trackers log.

    With `meta`, the rows' prompt_meta, also `<column>/tag/<tag>/mean` over the rows of each `tag`
    (GenEval's task families: single_object, two_object, counting, colors, position, color_attr), so a
    strict 0/1 reward such as geneval_strict reports GenEval's per-tag accuracy, and `<column>/tag_mean`,
    their unweighted mean (GenEval's overall score).
    """
    import torch

    tags = [m.get(TAG_KEY) if isinstance(m, Mapping) else None for m in meta or ()]
    groups: dict[str, torch.Tensor] = {}
    for tag in sorted({t for t in tags if isinstance(t, str) and t}):
        groups[tag] = torch.tensor([t == tag for t in tags])
    stats = {}
    for key, column in rewards.items():
        if key.startswith("reward") and column.dtype.is_floating_point:
            stats[f"{key}/mean"] = float(column.mean())
            stats[f"{key}/std"] = float(column.std(unbiased=False))
            per_tag = [float(column[rows].double().mean()) for rows in groups.values()]
            for tag, value in zip(groups, per_tag):
                stats[f"{key}/tag/{tag}/mean"] = value
            if per_tag:
                stats[f"{key}/tag_mean"] = sum(per_tag) / len(per_tag)
    return stats


def collect(run: Path) -> list[dict[str, Any]]:
    """One summary row per iteration that has scored samples."""
    from stages.shards.reader import ShardSet

    rows = []
    for k, it in iterations(run):
        rewards_dir = it / "rewards"
        if not (rewards_dir / MANIFEST_NAME).is_file():
            continue
        rewards = ShardSet(rewards_dir).read_all()
        r = rewards["reward"].double()
        row: dict[str, Any] = {
            "iteration": k,
            "samples": int(r.numel()),
            "reward_mean": float(r.mean()),
            "reward_std": float(r.std(unbiased=False)),
            "reward_min": float(r.min()),
            "reward_max": float(r.max()),
        }
        for key in rewards:
            if key.startswith("reward.") and rewards[key].dtype.is_floating_point:
                row[f"{key}_mean"] = float(rewards[key].double().mean())
        adv_dir = it / "advantages"
        if (adv_dir / MANIFEST_NAME).is_file():
            stats = read_manifest(adv_dir).extra.get("stats", {})
            row["zero_std_ratio"] = stats.get("zero_std_ratio")
        lp_dir = it / "logprobs"
        if (lp_dir / MANIFEST_NAME).is_file():
            row["replay_abs_delta_max"] = read_manifest(lp_dir).extra.get("abs_delta_max")
        metrics = run / f"it{k + 1}" / "policy" / "metrics.jsonl"
        if metrics.is_file():
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            if records:
                row["pg_loss"] = sum(m.get("actor/pg_loss", 0.0) for m in records) / len(records)
                row["ratio_mean"] = records[-1].get("actor/ratio_mean")
                row["clipfrac"] = sum(m.get("actor/pg_clipfrac", 0.0) for m in records) / len(records)
                row["grad_norm"] = records[-1].get("actor/grad_norm")
        rows.append(row)
    return rows


def reward_curve(rows: list[dict[str, Any]], path: Path, *, size: tuple[int, int] = (640, 400)) -> Path:
    """Mean reward per iteration with a ±std band, as a PNG at `path`."""
    from PIL import Image, ImageDraw

    if not rows:
        raise UserInputError("no scored iterations to plot (no it<K>/rewards shard sets)")
    w, h = size
    left, right, top, bottom = 70, 20, 30, 45
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    xs = [r["iteration"] for r in rows]
    lo = min(r["reward_mean"] - r["reward_std"] for r in rows)
    hi = max(r["reward_mean"] + r["reward_std"] for r in rows)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    x_span = max(xs) - min(xs) or 1

    def px(x: float, y: float) -> tuple[float, float]:
        return (
            left + (x - min(xs)) / x_span * (w - left - right),
            top + (hi - y) / (hi - lo) * (h - top - bottom),
        )

    band = [px(r["iteration"], r["reward_mean"] + r["reward_std"]) for r in rows]
    band += [px(r["iteration"], r["reward_mean"] - r["reward_std"]) for r in reversed(rows)]
    if len(rows) > 1:
        draw.polygon(band, fill=(205, 222, 245))
    draw.line([(left, top), (left, h - bottom), (w - right, h - bottom)], fill="black")
    for i in range(5):
        y = lo + (hi - lo) * i / 4
        _, yy = px(min(xs), y)
        draw.line([(left - 4, yy), (left, yy)], fill="black")
        draw.text((5, yy - 6), f"{y:.3g}", fill="black")
    for x in xs:
        xx, _ = px(x, lo)
        draw.text((xx - 4, h - bottom + 6), str(x), fill="black")
    points = [px(r["iteration"], r["reward_mean"]) for r in rows]
    if len(points) > 1:
        draw.line(points, fill=(30, 90, 200), width=3)
    for x, y in points:
        draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=(30, 90, 200))
    draw.text((left, 8), "mean reward per iteration (band: ±1 std)", fill="black")
    draw.text((w // 2 - 20, h - 18), "iteration", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def image_grid(
    samples: Path, rewards: Path | None, path: Path, *, groups: int = 4, per_group: int = 8, cell: int = 96
) -> Path:
    """A grid of the first `groups` prompt groups (rows) × `per_group` members, labelled with rewards."""
    from PIL import Image, ImageDraw

    from stages.shards.reader import ShardSet, open_inputs

    paths = [samples] + ([rewards] if rewards and (rewards / MANIFEST_NAME).is_file() else [])
    src = open_inputs(paths) if len(paths) > 1 else ShardSet(samples)
    cols = ["sample_id", "group_id", "image"] + (["reward"] if len(paths) > 1 else [])
    data = src.read_shard(0, columns=cols)
    order: dict[str, list[int]] = {}
    for i, g in enumerate(data["group_id"]):
        order.setdefault(g, []).append(i)
    chosen = list(order.items())[:groups]
    n_cols = min(per_group, max(len(v) for _, v in chosen))
    label = 14
    img = Image.new("RGB", (n_cols * cell, len(chosen) * (cell + label)), "white")
    draw = ImageDraw.Draw(img)
    for r, (_, members) in enumerate(chosen):
        for c, i in enumerate(members[:n_cols]):
            tile = Image.open(io.BytesIO(data["image"][i])).convert("RGB").resize((cell, cell))
            img.paste(tile, (c * cell, r * (cell + label) + label))
            if "reward" in data:
                draw.text((c * cell + 2, r * (cell + label)), f"{float(data['reward'][i]):.3f}", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def response_sheet(samples: Path, rewards: Path | None, path: Path, *, groups: int = 8) -> Path:
    """A Markdown page of a text rollout: per prompt group (first `groups`), the question, its ground
    truth and every response with its reward, best first."""
    from stages.shards.reader import ShardSet, open_inputs

    paths = [samples] + ([rewards] if rewards and (rewards / MANIFEST_NAME).is_file() else [])
    src = open_inputs(paths) if len(paths) > 1 else ShardSet(samples)
    cols = ["sample_id", "group_id", "prompt", "prompt_meta", "response_text"]
    data = src.read_shard(0, columns=cols + (["reward"] if len(paths) > 1 else []))
    order: dict[str, list[int]] = {}
    for i, g in enumerate(data["group_id"]):
        order.setdefault(g, []).append(i)
    lines = [f"# Responses of {samples}", ""]
    for group, members in list(order.items())[:groups]:
        first = members[0]
        truth = (data["prompt_meta"][first] or {}).get("ground_truth")
        lines += [f"## {group}: {data['prompt'][first]}", "", f"ground truth: `{truth}`", ""]
        if "reward" in data:
            members = sorted(members, key=lambda i: -float(data["reward"][i]))
        lines += ["| sample | reward | response |", "|---|---|---|"]
        for i in members:
            reward = f"{float(data['reward'][i]):.4f}" if "reward" in data else ""
            text = data["response_text"][i].replace("|", "\\|").replace("\n", "⏎")
            lines.append(f"| {data['sample_id'][i]} | {reward} | {text} |")
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path
