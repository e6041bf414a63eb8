"""Omni counting: the answer is one digit k ∈ 1…9, asked in text, in an image or in a sound.

Rows cycle through three input modes, so every batch mixes them: a text-only sum ("What is 3 + 4?
Answer with one digit.", k = the sum), an image of k shapes (`visual_count.draw`, 64 px: 4 image
tokens of the Qwen3-Omni thinker) and a sound of k beeps (440 Hz, 0.1 s on, 0.1 s off, 16 kHz float32
WAV in the `audios` column, placeholder `<audio>`). The reward is `visual_count`'s dense digit reward
(0.4·digit share + 0.4·right-digit share + 0.2·exact), so the random tiny thinker already gets a
learning signal; verl's layout, the same seed always writes the same bytes.

Command line: ``python recipes/tasks/omni_count.py --out FILE --num-prompts N --seed S``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from visual_count import COLOURS, SHAPES, compute_score, draw

from stages.sample.vlm_audio import wav_bytes
from stages.score.text_rewards import verl_compute_score

DATA_SOURCE = "omnirl/omni_count"
MODES = ("text", "image", "audio")
RATE = 16_000
IMAGE_SIZE = 64


def beeps(count: int) -> bytes:
    """A WAV file of `count` 440 Hz beeps, each 0.1 s followed by 0.1 s of silence."""
    t = np.arange(int(0.1 * RATE)) / RATE
    beep = 0.5 * np.sin(2 * np.pi * 440 * t)
    wave = np.concatenate([np.concatenate([beep, np.zeros_like(beep)]) for _ in range(count)])
    return wav_bytes(wave.astype(np.float32), RATE)


def make_row(index: int, *, seed: int) -> dict[str, Any]:
    """Row `index` for `seed` (mode `MODES[index % 3]`), in verl's layout with `images` and `audios`."""
    rng = random.Random(f"omni_count:{seed}:{index}")
    count = rng.randint(1, 9)
    mode = MODES[index % len(MODES)]
    images, audios = [], []
    if mode == "text":
        first = rng.randint(0, count)
        question = f"What is {first} + {count - first}? Answer with one digit."
    elif mode == "image":
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        images = [{"bytes": draw(count, colour, shape, size=IMAGE_SIZE, rng=rng), "path": None}]
        question = f"<image>How many {colour} {shape} are in the image? Answer with one digit."
    else:
        audios = [{"bytes": beeps(count), "path": None}]
        question = "<audio>How many beeps do you hear? Answer with one digit."
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "images": images,
        "audios": audios,
        "ability": mode,
        "reward_model": {"style": "rule", "ground_truth": str(count)},
        "extra_info": {"split": "train", "index": index},
    }


def build(out: Path, *, num_prompts: int, seed: int) -> None:
    """Write `num_prompts` rows to the Parquet file `out` (same arguments, same bytes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if num_prompts < 1:
        raise ValueError(f"num_prompts must be ≥ 1, got {num_prompts}")
    files = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("images", files),
            ("audios", files),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ]
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [make_row(i, seed=seed) for i in range(num_prompts)]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)


reward = verl_compute_score(compute_score)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Parquet file to write")
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        build(args.out, num_prompts=args.num_prompts, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {args.num_prompts} prompts to {args.out}")


if __name__ == "__main__":
    main()
