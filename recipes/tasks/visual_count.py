"""Visual counting: how many dots or squares of one colour does a small drawn image show?

Each prompt is one image (white background, k ∈ 1…9 non-overlapping discs or squares of one colour,
drawn with PIL) and the question "How many <colour> <shapes> are in the image? Answer with one
digit."; the ground truth is the digit k. The images are drawn here from a seed, so the task needs no
download and the same seed always writes the same Parquet bytes (verl's layout: `data_source`,
`prompt`, `images`, `ability`, `reward_model`, `extra_info`).

The reward (`compute_score`, verl's signature; `reward` is the same rule as an omnirl text scorer,
usable as ``--reward recipes/tasks/visual_count.py:reward``) is dense on purpose. The random-init
tiny Qwen2.5-VL samples almost uniformly from its 3291-token vocabulary, in which the ten digits are
single one-character tokens: a bare right answer (the digit, then end of turn) comes about twice in
10⁷ samples, so an exact-match reward would be 0 in every group and GRPO would get no signal.
Instead every response character earns credit: with c the characters of the stripped response,

    score = 0.4·(share of c that are ASCII digits) + 0.4·(share of c equal to the answer digit)
            + 0.2·[response is exactly the answer]

A digit anywhere in a response already scores, and a batch of ~1000 four-token responses holds about
a dozen of them, enough for GRPO to raise the digit share within a few iterations; more of the
response being digits scores more, the right digit more again, and only the bare right digit scores
1. It is 0 for an empty response and lies in [0, 1].

Command line: ``python recipes/tasks/visual_count.py --out FILE --num-prompts N --seed S``.
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path
from typing import Any

from stages.score.text_rewards import verl_compute_score

DATA_SOURCE = "omnirl/visual_count"
ABILITY = "counting"
DIGITS = "0123456789"
MAX_COUNT = 9
FORMAT_WEIGHT = 0.4
MATCH_WEIGHT = 0.4
EXACT_WEIGHT = 0.2

# Colours far apart in RGB, so a name picks out one hue even after the image processor's resize.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 200, 20),
    "purple": (140, 40, 170),
    "black": (10, 10, 10),
}
SHAPES = ("dots", "squares")
QUESTION = "<image>How many {colour} {shape} are in the image? Answer with one digit."


def _layout(rng: random.Random, count: int, size: int, radius: int) -> list[tuple[int, int]]:
    """`count` centres whose x or y differ by ≥ 2·radius + 2 px (shapes never touch), inside a `size`² canvas."""
    margin, gap = radius + 1, 2 * radius + 2
    while True:
        centres: list[tuple[int, int]] = []
        for _ in range(200 * count):
            x, y = rng.randint(margin, size - 1 - margin), rng.randint(margin, size - 1 - margin)
            if all(max(abs(x - a), abs(y - b)) >= gap for a, b in centres):
                centres.append((x, y))
                if len(centres) == count:
                    return centres


def draw(count: int, colour: str, shape: str, *, size: int, rng: random.Random) -> bytes:
    """PNG bytes of a `size`² white image with `count` `shape`s ("dots" or "squares") of `colour`."""
    from PIL import Image, ImageDraw

    radius = max(2, size // 16)
    image = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(image)
    for x, y in _layout(rng, count, size, radius):
        box = (x - radius, y - radius, x + radius, y + radius)
        if shape == "dots":
            pen.ellipse(box, fill=COLOURS[colour])
        else:
            pen.rectangle(box, fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def make_row(index: int, *, seed: int, size: int, split: str = "train") -> dict[str, Any]:
    """Row `index` of the task for `seed`, in verl's layout; it depends only on (seed, index, size)."""
    rng = random.Random(f"visual_count:{seed}:{index}")
    count = rng.randint(1, MAX_COUNT)
    colour = rng.choice(sorted(COLOURS))
    shape = rng.choice(SHAPES)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": QUESTION.format(colour=colour, shape=shape)}],
        "images": [{"bytes": draw(count, colour, shape, size=size, rng=rng), "path": None}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(count)},
        "extra_info": {"split": split, "index": index},
    }


def build(out: Path, *, num_prompts: int, seed: int, size: int = 56) -> None:
    """Write `num_prompts` rows (image side `size` px, ≥ 28) to the Parquet file `out`.

    The same arguments write the same bytes; the first k rows do not depend on `num_prompts`.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if num_prompts < 1:
        raise ValueError(f"num_prompts must be ≥ 1, got {num_prompts}")
    if size < 28:
        raise ValueError(f"size must be ≥ 28 px (one Qwen2.5-VL image token), got {size}")
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ]
    )
    rows = [make_row(i, seed=seed, size=size) for i in range(num_prompts)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)


def compute_score(
    data_source: str | None, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Dense counting reward in [0, 1] (formula in the module docstring); ground_truth is the digit."""
    answer = str(ground_truth).strip()
    text = solution_str.strip()
    if not text:
        return 0.0
    digits = sum(char in DIGITS for char in text) / len(text)
    matches = sum(char == answer for char in text) / len(text)
    return FORMAT_WEIGHT * digits + MATCH_WEIGHT * matches + EXACT_WEIGHT * float(text == answer)


reward = verl_compute_score(compute_score)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Parquet file to write")
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=56, help="image side in pixels (56: 4 image tokens)")
    args = parser.parse_args(argv)
    try:
        build(args.out, num_prompts=args.num_prompts, seed=args.seed, size=args.size)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {args.num_prompts} prompts to {args.out}")


if __name__ == "__main__":
    main()
