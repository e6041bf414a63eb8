"""Synthetic edits of the shapes world (recipes/tasks/shapes.py): a source image, an instruction, and
what the result must show, so an editing model can be pretrained on pairs and scored without a model.

Two kinds of edit (``--kinds``), each row's source drawn on the shapes world's background:

| kind | source | instruction | the result (``include``, GenEval metadata) |
|---|---|---|---|
| recolor | one shape of colour A | make the A circle B | the shape, same place, colour B |
| move | a circle and a square right of it | move the square to the left of the circle | square left of the circle |

A row holds ``prompt`` (the instruction), ``image`` (its source, a PNG path relative to the table),
``tag`` (the kind), ``include`` (the result's GenEval clauses: ``geneval_shapes`` /
``geneval_shapes_strict`` score the edit) and ``edit_boxes`` (the boxes the edit may change, in fractions of
the side: the shape's place, before and after a move; ``edit_preservation`` compares the rest with the
source). With ``--targets`` the folder also holds each row's ground-truth result (``file_name``), the
layout `omnirl pretrain --data` reads as edit pairs. Row i depends only on (seed, i).

Command line: ``python recipes/tasks/shape_edits.py --out DIR/edits.jsonl --num-prompts N --seed S``
(``--kinds recolor`` narrows the kinds, ``--shapes circle`` the recoloured shapes, ``--targets`` adds
the results). Sources go to DIR/sources/00000.png ..., results to DIR/00000.png ...
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from shapes import BACKGROUND_LEVELS, RENDER_MARGIN, Box, _apart, _find_box, draw  # this script's folder

from stages.score.geneval import relative_position
from stages.score.geneval_shapes import PALETTE, SHAPES

KINDS = ("recolor", "move")


def _fractions(box: Box, size: int) -> list[float]:
    return [round(v / size, 6) for v in box]


def make_edit(
    index: int, *, seed: int, size: int, kinds: tuple[str, ...], shapes: tuple[str, ...]
) -> dict[str, Any]:
    """Row `index` for `seed`: the row (module docstring) with its `source` and `target` images (PIL)."""
    rng = random.Random(f"shape-edits:{seed}:{index}")
    kind = rng.choice(kinds)
    level = rng.randint(*BACKGROUND_LEVELS)
    if kind == "recolor":
        shape = rng.choice(shapes)
        before, after = rng.sample(sorted(PALETTE), 2)
        box = _find_box(rng, size, [], None, [])
        assert box is not None  # one shape on an empty image always fits
        source, target = draw([(shape, before, box)], size, level), draw([(shape, after, box)], size, level)
        return {
            "prompt": f"make the {before} {shape} {after}",
            "tag": kind,
            "include": [{"class": shape, "count": 1, "color": after}],
            "edit_boxes": [_fractions(box, size)],
            "source": source,
            "target": target,
        }
    gap = max(2, size // 32)
    for _ in range(1000):  # a square right of a circle whose mirror image about the circle's centre fits
        circle_colour, square_colour = rng.sample(sorted(PALETTE), 2)
        circle = _find_box(rng, size, [], None, [])
        square = _find_box(rng, size, [circle], "right of", [circle])
        if circle is None or square is None:
            continue
        middle = circle[0] + circle[2]
        moved = (middle - square[2], square[1], middle - square[0], square[3])
        if (
            moved[0] >= 0
            and _apart(moved, [circle], gap)
            and "left of" in relative_position(moved, circle, RENDER_MARGIN)
        ):
            break
    else:
        raise ValueError(f"could not lay out a move on a {size}×{size} image; use a larger --size")
    source = draw([("circle", circle_colour, circle), ("square", square_colour, square)], size, level)
    target = draw([("circle", circle_colour, circle), ("square", square_colour, moved)], size, level)
    return {
        "prompt": "move the square to the left of the circle",
        "tag": kind,
        "include": [
            {"class": "circle", "count": 1},
            {"class": "square", "count": 1, "position": ["left of", 0]},
        ],
        "edit_boxes": [_fractions(square, size), _fractions(moved, size)],
        "source": source,
        "target": target,
    }


def write_edits(
    out: Path, n: int, seed: int, *, size: int = 64, kinds=KINDS, shapes=SHAPES, targets: bool = False
) -> None:
    """Write `n` rows as JSONL at `out`, their sources in out's folder/sources (and results beside)."""
    folder = out.parent
    (folder / "sources").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        row = make_edit(i, seed=seed, size=size, kinds=tuple(kinds), shapes=tuple(shapes))
        row.pop("source").save(folder / "sources" / f"{i:05d}.png")
        target = row.pop("target")
        row["image"] = f"sources/{i:05d}.png"
        if targets:
            target.save(folder / f"{i:05d}.png")
            row["file_name"] = f"{i:05d}.png"
        lines.append(json.dumps(row) + "\n")
    out.write_text("".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="prompt table to write (.jsonl)")
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated edit kinds")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes to recolour")
    parser.add_argument("--size", type=int, default=64, help="side of the images in pixels")
    parser.add_argument("--targets", action="store_true", help="also write each row's result (pretraining)")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if args.out.suffix != ".jsonl" or args.num_prompts < 1:
        parser.error("--out must be a .jsonl file and --num-prompts at least 1")
    if not kinds or set(kinds) - set(KINDS) or not shapes or set(shapes) - set(SHAPES):
        parser.error(f"--kinds from {', '.join(KINDS)}; --shapes from {', '.join(SHAPES)}")
    write_edits(
        args.out,
        args.num_prompts,
        args.seed,
        size=args.size,
        kinds=kinds,
        shapes=shapes,
        targets=args.targets,
    )
    print(f"wrote {args.num_prompts} edits to {args.out}" + (" with their results" if args.targets else ""))


if __name__ == "__main__":
    main()
