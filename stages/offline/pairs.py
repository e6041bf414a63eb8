"""Preference pairs: a table of (prompt, preferred image, rejected image) → a shard set of groups of two.

Each pair becomes two rows sharing a `group_id`, with `reward` 1 (preferred) and 0 (rejected), so the
pair is an ordinary size-2 group: `update --algo dpo` pairs the best and worst of every group.

Accepted tables (Parquet or JSONL; an image is encoded bytes or a path relative to the table):
- generic: `prompt` (or `caption`), `chosen`, `rejected`, optional `chosen_score`, `rejected_score`;
- Pick-a-Pic v2: `caption`, `jpg_0`, `jpg_1`, `label_0` (1: image 0 preferred, 0: image 1, 0.5: a tie,
  skipped as Diffusion-DPO does).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from stages.errors import UserInputError
from stages.offline.config import PairsConfig
from stages.outputs import check_format, resolve_num_shards, run_config
from stages.tables import image_bytes, read_rows


@dataclass
class Pair:
    prompt: str
    chosen: bytes
    rejected: bytes
    scores: tuple[float, float] | None = None


def _number(row: dict, key: str, where: str) -> float:
    """A finite number from column `key`; anything else is a one-line error naming the row."""
    try:
        value = float(row[key])
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise UserInputError(f"{where}: column '{key}' is {row[key]!r}, not a finite number")
    return value


def read_pairs(path: str | Path) -> tuple[list[Pair], int]:
    """Pairs of a table (generic or Pick-a-Pic), and how many ties were skipped."""
    path = Path(path)
    rows = read_rows(path, "--pairs")
    pairs, ties = [], 0
    for i, row in enumerate(rows):
        where = f"{path}: row {i}"
        prompt = row.get("prompt", row.get("caption"))
        if not isinstance(prompt, str):
            raise UserInputError(f"{where}: no 'prompt' (or 'caption') text")
        if "chosen" in row and "rejected" in row:
            scores = None
            if row.get("chosen_score") is not None and row.get("rejected_score") is not None:
                scores = (_number(row, "chosen_score", where), _number(row, "rejected_score", where))
            pairs.append(
                Pair(
                    prompt,
                    image_bytes(row["chosen"], path.parent, where),
                    image_bytes(row["rejected"], path.parent, where),
                    scores,
                )
            )
        elif {"jpg_0", "jpg_1", "label_0"} <= row.keys():
            label = _number(row, "label_0", where)
            if label not in (0.0, 0.5, 1.0):
                raise UserInputError(
                    f"{where}: label_0 is {label}; Pick-a-Pic labels are 1 (jpg_0 preferred), 0 or 0.5 (a tie)"
                )
            if label == 0.5:
                ties += 1
                continue
            first, second = (
                image_bytes(row["jpg_0"], path.parent, where),
                image_bytes(row["jpg_1"], path.parent, where),
            )
            pairs.append(Pair(prompt, first, second) if label == 1.0 else Pair(prompt, second, first))
        else:
            raise UserInputError(
                f"{where}: expected columns chosen/rejected or Pick-a-Pic's jpg_0/jpg_1/label_0"
            )
    if not pairs:
        raise UserInputError(f"--pairs {path}: no usable pair (all rows were ties?)")
    return pairs, ties


def pairs_batch(pairs: list[Pair], offset: int = 0) -> dict[str, Any]:
    """Rows of the pairs shard set: for pair k, `p<k>-w` (reward 1) then `p<k>-l` (reward 0).

    Ids are local to the table; `stages.sample.stage.in_rollout` prefixes them with the set's rollout id.
    """
    batch: dict[str, Any] = {
        "sample_id": [],
        "group_id": [],
        "prompt": [],
        "negative_prompt": [],
        "prompt_meta": [],
        "image": [],
        "reward": [],
    }
    scored = all(p.scores is not None for p in pairs)
    scores = []
    for k, pair in enumerate(pairs, start=offset):
        group = f"p{k:07d}"
        for tag, image, reward, score in (("w", pair.chosen, 1.0, 0), ("l", pair.rejected, 0.0, 1)):
            batch["sample_id"].append(f"{group}-{tag}")
            batch["group_id"].append(group)
            batch["prompt"].append(pair.prompt)
            batch["negative_prompt"].append("")
            batch["prompt_meta"].append({})
            batch["image"].append(image)
            batch["reward"].append(reward)
            if scored:
                scores.append(pair.scores[score])
    batch["reward"] = torch.tensor(batch["reward"], dtype=torch.float32)
    if scored:
        batch["reward.score"] = torch.tensor(scores, dtype=torch.float32)
    return batch


def run_pairs(c: PairsConfig, display: Any) -> dict[str, Any]:
    """The preference table `c.table` as a shard set at `c.out` (`pairs_batch`'s rows, ties skipped),
    advancing the progress `display` per pair written; a finished `c.out` is left as it is. Returns the
    result: out, pairs, ties_skipped, rows."""
    from stages.sample.stage import in_rollout, rollout_id
    from stages.shards.reader import slice_batch
    from stages.shards.writer import ShardSetWriter

    task = display.add_task("pairs", total=None, rate="")
    found, ties = read_pairs(c.table)
    shards = min(resolve_num_shards(asdict(c), len(found), 2), len(found))
    writer = ShardSetWriter(
        c.out,
        num_shards=shards,
        format=check_format(c.fmt),
        command="pairs",
        config=run_config(asdict(c)),
        parents=[c.table],
        kinds={"image": "image", "prompt_meta": "json"},
        overwrite=c.overwrite,
    )
    display.update(task, total=len(found))
    if not writer.complete:
        batch = in_rollout(pairs_batch(found), rollout_id(writer))
        for s in range(shards):
            lo, hi = s * len(found) // shards, (s + 1) * len(found) // shards
            if not writer.shard_done(s):
                writer.write_shard(s, slice_batch(batch, 2 * lo, 2 * hi))
            display.advance(task, hi - lo)
        writer.finalize(extra={"modality": "image"})
    return {"out": str(c.out), "pairs": len(found), "ties_skipped": ties, "rows": 2 * len(found)}
