"""Scoring speed: a model-based reward in-process ÷ a bare forward of the same model, and through
`serve-reward` on loopback ÷ in-process.

A random CLIP of the `SMALL` shape (ViT-B/32 layout at a quarter width, 224 px) is built offline; N
decoded 256 px images and their prompts are scored by

- `pickscore` in-process (`registry.get_reward`, batch 32): CLIP image and text embeddings, the cosine
  times exp(logit_scale)/26;
- a bare forward of the same model: `CLIPProcessor(text, images)` + `CLIPModel(...)` per batch of 32
  under inference mode, the diagonal of `logits_per_image` / 26 (target: reward ÷ bare ≤ 1.10);
- the same reward served by `RewardServer` on 127.0.0.1 and called as `remote:URL/pickscore` (PNG
  encoding, HTTP and JSON included), for the record;
- `jpeg_compressibility` in-process and remote, where transport is all there is.

One torch thread, so the server's concurrent requests cannot borrow cores the in-process side lacks.

    python benchmarks/bench_score.py [--images 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import best_of, record
from stages.models.clip import SMALL, build_tiny_clip
from stages.score.registry import get_reward
from stages.score.reward_server import RewardServer, RewardService

BATCH = 32
PICKSCORE_SCALE = 26.0


def images_and_prompts(n: int) -> tuple[list[Image.Image], list[str]]:
    """`n` smooth random 256 px images (what a sampler returns, not white noise) and prompts."""
    rng = np.random.default_rng(0)
    images = []
    for _ in range(n):
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        images.append(Image.fromarray(small).resize((256, 256), Image.Resampling.BILINEAR))
    colours = ("red", "green", "blue", "yellow", "cyan", "magenta")
    shapes = ("circle", "square", "triangle")
    prompts = [f"a photo of a {colours[i % 6]} {shapes[i % 3]} on the left" for i in range(n)]
    return images, prompts


def bare(folder: Path) -> tuple[object, object]:
    """The model and processor a hand-written scoring loop would load."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(folder, local_files_only=True).eval()
    return model, CLIPProcessor.from_pretrained(folder, local_files_only=True)


@torch.inference_mode()
def bare_scores(model: object, processor: object, images: list, prompts: list) -> torch.Tensor:
    """PickScore by hand: processor + CLIPModel forward, diag(logits_per_image) / 26, per batch."""
    length = model.config.text_config.max_position_embeddings
    out = []
    for start in range(0, len(images), BATCH):
        inputs = processor(
            text=prompts[start : start + BATCH],
            images=images[start : start + BATCH],
            padding=True,
            truncation=True,
            max_length=length,
            return_tensors="pt",
        )
        logits = model(**inputs).logits_per_image
        out.append(logits.diagonal() / PICKSCORE_SCALE)
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread for every side, the server's requests included
    images, prompts = images_and_prompts(args.images)
    meta = [{} for _ in images]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "clip"
        build_tiny_clip(folder, seed=0, size=SMALL)
        reward_args = {"model": str(folder), "batch_size": str(BATCH)}
        pick = get_reward("pickscore", reward_args)
        model, processor = bare(folder)
        ours = torch.tensor(pick(images, prompts, meta))
        hand = bare_scores(model, processor, images, prompts)
        torch.testing.assert_close(ours, hand, rtol=1e-4, atol=1e-5)  # the same numbers, then time them

        service = RewardService(
            [("pickscore", 1.0), ("jpeg_compressibility", 1.0)], {"pickscore": reward_args}
        )
        server = RewardServer(service)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            remote_pick = get_reward(f"remote:{server.url}/pickscore")
            remote_jpeg = get_reward(f"remote:{server.url}/jpeg_compressibility")
            jpeg = get_reward("jpeg_compressibility")
            torch.testing.assert_close(torch.tensor(remote_pick(images, prompts, meta)), ours)
            times = {}
            for _ in range(args.repeats):  # interleaved, best of each
                for name, fn in (
                    ("pickscore", lambda: pick(images, prompts, meta)),
                    ("bare", lambda: bare_scores(model, processor, images, prompts)),
                    ("remote_pickscore", lambda: remote_pick(images, prompts, meta)),
                    ("jpeg", lambda: jpeg(images, prompts, meta)),
                    ("remote_jpeg", lambda: remote_jpeg(images, prompts, meta)),
                ):
                    times[name] = min(times.get(name, float("inf")), best_of(fn, 1))
        finally:
            server.shutdown()
            server.server_close()
    n = args.images
    metrics = {
        "images": n,
        "pickscore_s": times["pickscore"],
        "bare_s": times["bare"],
        "pickscore_over_bare": times["pickscore"] / times["bare"],
        "remote_over_inprocess_pickscore": times["remote_pickscore"] / times["pickscore"],
        "remote_over_inprocess_jpeg": times["remote_jpeg"] / times["jpeg"],
    }
    table = [
        {
            "reward": "pickscore (SMALL CLIP, 224 px)",
            "in-process img/s": n / times["pickscore"],
            "bare forward img/s": n / times["bare"],
            "in-process ÷ bare (≤ 1.10)": metrics["pickscore_over_bare"],
            "remote img/s": n / times["remote_pickscore"],
            "remote ÷ in-process": metrics["remote_over_inprocess_pickscore"],
        },
        {
            "reward": "jpeg_compressibility (256 px)",
            "in-process img/s": n / times["jpeg"],
            "bare forward img/s": "",
            "in-process ÷ bare (≤ 1.10)": "",
            "remote img/s": n / times["remote_jpeg"],
            "remote ÷ in-process": metrics["remote_over_inprocess_jpeg"],
        },
    ]
    path = record(
        "score",
        metrics,
        table,
        description="Scoring speed: in-process reward ÷ a bare processor + forward of the same CLIP (same "
        "numbers checked first), and through `serve-reward` on loopback ÷ in-process; best of interleaved repeats.",
    )
    for row in table:
        print(row)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
