"""Synthetic GenEval shapes task: captions with GenEval metadata, and their ground-truth images.

The world: flat circles, squares and upright triangles in six hues 60° apart (red, yellow, green,
cyan, blue, purple; `stages.score.geneval_shapes.PALETTE`) on a light-grey-to-white background.
Captions follow GenEval's six task families and templates, and each row carries GenEval's metadata
(``tag``, ``include`` clauses ``{class, count, color?, position?}``, ``exclude``), so the rewards
``geneval_shapes`` / ``geneval_shapes_strict`` score a sample of it without a detector model:

| tag | caption | include (exclude) |
|---|---|---|
| single_object | a photo of a circle | circle×1 |
| two_object | a photo of a circle and a square | circle×1, square×1 |
| counting | a photo of three triangles | triangle×3 (triangle×4) |
| colors | a photo of a red circle | red circle×1 |
| position | a photo of a circle left of a square | square×1, circle×1 "left of" clause 0 |
| color_attr | a photo of a red circle and a blue square | red circle×1, blue square×1 |

Counting asks for 1–4 objects; two-object prompts name two different shapes (the same shape twice
would be a count of two), colour pairs are distinct. Row i depends only on (seed, i), so the first k
rows never depend on how many are written.

`render(meta, size, seed)` draws an image that satisfies a row's metadata: each clause's shapes with
its colour (a random palette colour where none is asked), side 16–25% of the image, at least
size/32 px apart, and position clauses placed so GenEval's relation holds even at twice its margin
(0.2 instead of 0.1), which keeps it true for the detector's slightly different boxes.

Command line: ``python recipes/tasks/shapes.py --out prompts.jsonl --num-prompts N --seed S``
(``--tags counting,colors`` narrows the families, ``--shapes circle`` the shapes named; ``--images
DIR`` also writes row i's ground truth, rendered with seed i, as ``DIR/00000.png`` ...). The JSONL is
what ``omnirl sample --prompts`` reads: ``prompt`` is the caption, the other fields become each
sample's ``prompt_meta``.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from stages.score.geneval import RELATIONS, parse_clauses, relative_position
from stages.score.geneval_shapes import PALETTE, SHAPES

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
MAX_COUNT = 4
SATURATION, VALUE = 0.8, 0.9
MIN_SIDE, MAX_SIDE = 0.16, 0.25
RENDER_MARGIN = 0.2
BACKGROUND_LEVELS = (232, 255)


def color_rgb(name: str) -> tuple[int, int, int]:
    """RGB of palette colour `name` (its hue at saturation 0.8, value 0.9)."""
    r, g, b = colorsys.hsv_to_rgb(PALETTE[name] / 360.0, SATURATION, VALUE)
    return round(r * 255), round(g * 255), round(b * 255)


def _plural(shape: str, count: int) -> str:
    return shape if count == 1 else f"{shape}s"


# Families that name two different shapes.
TWO_SHAPE_TAGS = ("two_object", "position", "color_attr")


def _two_shapes_needed(tag: str) -> ValueError:
    return ValueError(f"tag {tag!r} names two different shapes; give at least two --shapes")


def make_row(
    index: int, *, seed: int, tags: Sequence[str] = TAGS, shapes: Sequence[str] = SHAPES
) -> dict[str, Any]:
    """Row `index` for `seed`: ``prompt``, ``tag``, ``include`` and, for counting, ``exclude``; the
    shapes named are drawn from `shapes` (all three by default, which draws the same rows as before
    `shapes` existed)."""
    rng = random.Random(f"shapes:{seed}:{index}")
    tag = rng.choice(list(tags))
    if tag in TWO_SHAPE_TAGS and len(shapes) < 2:
        raise _two_shapes_needed(tag)
    first, *rest = rng.sample(list(shapes), min(2, len(shapes)))
    second = rest[0] if rest else first
    color_a, color_b = rng.sample(sorted(PALETTE), 2)
    row: dict[str, Any]
    if tag == "single_object":
        row = {"prompt": f"a photo of a {first}", "include": [{"class": first, "count": 1}]}
    elif tag == "two_object":
        row = {
            "prompt": f"a photo of a {first} and a {second}",
            "include": [{"class": first, "count": 1}, {"class": second, "count": 1}],
        }
    elif tag == "counting":
        count = rng.randint(1, MAX_COUNT)
        row = {
            "prompt": f"a photo of {NUMBER_WORDS[count]} {_plural(first, count)}",
            "include": [{"class": first, "count": count}],
            "exclude": [{"class": first, "count": count + 1}],
        }
    elif tag == "colors":
        row = {
            "prompt": f"a photo of a {color_a} {first}",
            "include": [{"class": first, "count": 1, "color": color_a}],
        }
    elif tag == "position":
        relation = rng.choice(RELATIONS)
        row = {
            "prompt": f"a photo of a {first} {relation} a {second}",
            "include": [
                {"class": second, "count": 1},
                {"class": first, "count": 1, "position": [relation, 0]},
            ],
        }
    elif tag == "color_attr":
        row = {
            "prompt": f"a photo of a {color_a} {first} and a {color_b} {second}",
            "include": [
                {"class": first, "count": 1, "color": color_a},
                {"class": second, "count": 1, "color": color_b},
            ],
        }
    else:
        raise ValueError(f"unknown tag {tag!r}; choose from {', '.join(TAGS)}")
    return {"prompt": row.pop("prompt"), "tag": tag, **row}


def make_prompts(
    n: int, seed: int, tags: Sequence[str] | None = None, shapes: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """`n` rows (see `make_row`), tags drawn uniformly from `tags` (all six GenEval families by default),
    shapes from `shapes` (all three by default; the two-shape families need two)."""
    if n < 1:
        raise ValueError(f"the number of prompts must be ≥ 1, got {n}")
    chosen = tuple(tags) if tags else TAGS
    unknown = sorted(set(chosen) - set(TAGS))
    if unknown:
        raise ValueError(f"unknown tag {unknown[0]!r}; choose from {', '.join(TAGS)}")
    kinds = tuple(dict.fromkeys(shapes)) if shapes else SHAPES
    strange = sorted(set(kinds) - set(SHAPES))
    if strange:
        raise ValueError(f"unknown shape {strange[0]!r}; choose from {', '.join(SHAPES)}")
    paired = sorted(set(chosen) & set(TWO_SHAPE_TAGS))
    if len(kinds) < 2 and paired:
        raise _two_shapes_needed(paired[0])
    return [make_row(i, seed=seed, tags=chosen, shapes=kinds) for i in range(n)]


Box = tuple[int, int, int, int]


def _apart(box: Box, others: Sequence[Box], gap: int) -> bool:
    """Whether `box` keeps `gap` free pixels to every box of `others` along x or y (boxes end exclusive)."""
    x0, y0, x1, y1 = box
    return all(x0 >= b[2] + gap or b[0] >= x1 + gap or y0 >= b[3] + gap or b[1] >= y1 + gap for b in others)


def _find_box(
    rng: random.Random, size: int, placed: Sequence[Box], relation: str | None, targets: Sequence[Box]
) -> Box | None:
    """A random square box apart from `placed` and `relation` of every box of `targets` (200 tries)."""
    gap = max(2, size // 32)
    low, high = max(3, round(MIN_SIDE * size)), max(3, round(MAX_SIDE * size))
    for _ in range(200):
        side = rng.randint(low, high)
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        box = (x, y, x + side, y + side)
        if _apart(box, placed, gap) and (
            relation is None or all(relation in relative_position(box, t, RENDER_MARGIN) for t in targets)
        ):
            return box
    return None


def _try_layout(rng: random.Random, meta: Mapping[str, Any], size: int) -> list[tuple[str, str, Box]] | None:
    """(shape, colour, box) of every object `meta`'s include clauses ask for, or None when stuck."""
    include, _ = parse_clauses(meta)
    placed: list[tuple[str, str, Box]] = []
    groups: list[list[Box]] = []
    for clause in include:
        relation, targets = None, []
        if clause.position is not None:
            relation, target = clause.position
            targets = groups[target]
        group: list[Box] = []
        for _ in range(clause.count):
            box = _find_box(rng, size, [b for _, _, b in placed], relation, targets)
            if box is None:
                return None
            placed.append((clause.label, clause.color or rng.choice(sorted(PALETTE)), box))
            group.append(box)
        groups.append(group)
    return placed


def render(meta: Mapping[str, Any], size: int = 64, seed: int = 0) -> Image.Image:
    """An RGB `size`² image that satisfies GenEval metadata `meta` (classes circle/square/triangle,
    palette colours); the same (meta, size, seed) always draws the same pixels."""
    include, _ = parse_clauses(meta)
    for clause in include:
        if clause.label not in SHAPES or (clause.color is not None and clause.color not in PALETTE):
            raise ValueError(
                f"cannot draw {clause.label!r} in colour {clause.color!r}: shapes are {', '.join(SHAPES)}, "
                f"colours {', '.join(PALETTE)}"
            )
    rng = random.Random(f"shapes-render:{seed}")
    level = rng.randint(*BACKGROUND_LEVELS)
    for _ in range(100):
        layout = _try_layout(rng, meta, size)
        if layout is not None:
            break
    else:
        raise ValueError(f"could not lay out {dict(meta)!r} on a {size}×{size} image; use a larger size")
    return draw(layout, size, level)


def draw(layout: Sequence[tuple[str, str, Box]], size: int, level: int) -> Image.Image:
    """An RGB `size`² image of grey `level` with each (shape, palette colour, box) of `layout` drawn."""
    image = Image.new("RGB", (size, size), (level, level, level))
    pen = ImageDraw.Draw(image)
    for shape, color, (x0, y0, x1, y1) in layout:
        fill = color_rgb(color)
        if shape == "circle":
            pen.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
        elif shape == "square":
            pen.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
        else:
            pen.polygon([((x0 + x1 - 1) / 2, y0), (x0, y1 - 1), (x1 - 1, y1 - 1)], fill=fill)
    return image


def write_prompts(out: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write `rows` as JSONL (one object per line, UTF-8), the format `omnirl sample --prompts` reads."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="prompt file to write (.jsonl)")
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tags", default=",".join(TAGS), help="comma-separated families to draw from")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes prompts name")
    parser.add_argument("--images", type=Path, help="also write each row's ground truth here as PNG")
    parser.add_argument("--size", type=int, default=64, help="side of the --images in pixels")
    args = parser.parse_args(argv)
    if args.out.suffix != ".jsonl":
        parser.error(
            f"--out {args.out}: write a .jsonl file (GenEval's position clauses mix text and numbers)"
        )
    try:
        rows = make_prompts(
            args.num_prompts,
            args.seed,
            [t.strip() for t in args.tags.split(",") if t.strip()],
            [s.strip() for s in args.shapes.split(",") if s.strip()],
        )
        write_prompts(args.out, rows)
        if args.images:
            args.images.mkdir(parents=True, exist_ok=True)
            for i, row in enumerate(rows):
                render(row, args.size, seed=i).save(args.images / f"{i:05d}.png")
    except ValueError as exc:
        parser.error(str(exc))
    print(
        f"wrote {len(rows)} prompts to {args.out}"
        + (f" and their images to {args.images}" if args.images else "")
    )


if __name__ == "__main__":
    main()
