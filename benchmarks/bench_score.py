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
- `jpeg_compressibility` in-process and remote, where transport is all there is;
- `hpsv2` and `imagereward` in-process ÷ a bare forward of the same loaded modules (the scorer's own
  preprocessing and tokenizer, then the towers, in one pass per batch of 32), on random checkpoints of
  the SMALL shape written in the published layouts (open_clip's for HPS_v2.1_compressed.pt, BLIP's for
  ImageReward.pt).

One torch thread, so the server's concurrent requests cannot borrow cores the in-process side lacks.

    python benchmarks/bench_score.py [--images 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import best_of, parse_args, record
from stages.models.clip import SMALL, build_tiny_clip
from stages.score.registry import get_reward
from stages.score.reward_server import RewardServer, RewardService

BATCH = 32
PICKSCORE_SCALE = 26.0
BERT_WORDS = ("a", "photo", "of", "red", "green", "blue", "yellow", "cyan", "magenta", "circle", "square")
BERT_WORDS += ("triangle", "on", "the", "left")


def _tensor(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) * 0.02


def _blocks(prefix: str, width: int, ff: int, names: dict[str, str], fused: str) -> dict[str, torch.Tensor]:
    """One pre-norm transformer block: LayerNorms, the fused qkv projection `fused`, out projection, MLP."""
    out = {f"{prefix}{names[n]}.weight": torch.ones(width) for n in ("ln1", "ln2")}
    out |= {f"{prefix}{names[n]}.bias": torch.zeros(width) for n in ("ln1", "ln2")}
    shapes = {"out": (width, width), "fc1": (ff, width), "fc2": (width, ff)}
    for name, shape in shapes.items():
        out[f"{prefix}{names[name]}.weight"], out[f"{prefix}{names[name]}.bias"] = (
            _tensor(*shape),
            _tensor(shape[0]),
        )
    if fused.endswith("_"):  # open_clip: in_proj_weight / in_proj_bias
        out[f"{prefix}{fused}weight"], out[f"{prefix}{fused}bias"] = (
            _tensor(3 * width, width),
            _tensor(3 * width),
        )
    else:
        out[f"{prefix}{fused}.weight"], out[f"{prefix}{fused}.bias"] = (
            _tensor(3 * width, width),
            _tensor(3 * width),
        )
    return out


def hps_checkpoint(path: Path, vocab: int) -> None:
    """A random open_clip CLIP of the SMALL shape, saved as HPS_v2.1_compressed.pt is ({"state_dict": ...})."""
    w, ff, grid = SMALL["width"], SMALL["ff"], SMALL["image_size"] // SMALL["patch"]
    names = {"ln1": "ln_1", "ln2": "ln_2", "out": "attn.out_proj", "fc1": "mlp.c_fc", "fc2": "mlp.c_proj"}
    state = {
        "visual.class_embedding": _tensor(w),
        "visual.positional_embedding": _tensor(grid * grid + 1, w),
        "visual.conv1.weight": _tensor(w, 3, SMALL["patch"], SMALL["patch"]),
        "visual.proj": _tensor(w, SMALL["projection"]),
        "token_embedding.weight": _tensor(vocab, w),
        "positional_embedding": _tensor(77, w),
        "text_projection": _tensor(w, SMALL["projection"]),
        "logit_scale": torch.tensor(4.6052),
    }
    for norm in ("visual.ln_pre", "visual.ln_post", "ln_final"):
        state[f"{norm}.weight"], state[f"{norm}.bias"] = torch.ones(w), torch.zeros(w)
    for i in range(SMALL["layers"]):
        for tower in ("visual.transformer", "transformer"):
            state |= _blocks(f"{tower}.resblocks.{i}.", w, ff, names, "attn.in_proj_")
    torch.save({"state_dict": state}, path)


def imagereward_checkpoint(path: Path, vocab: int) -> None:
    """A random ImageReward of the SMALL shape (BLIP ViT and cross-attending BERT), saved as ImageReward.pt is."""
    w, ff, grid = SMALL["width"], SMALL["ff"], SMALL["image_size"] // SMALL["patch"]
    vit, bert = "blip.visual_encoder.", "blip.text_encoder."
    names = {"ln1": "norm1", "ln2": "norm2", "out": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    state = {
        f"{vit}cls_token": _tensor(1, 1, w),
        f"{vit}pos_embed": _tensor(1, grid * grid + 1, w),
        f"{vit}patch_embed.proj.weight": _tensor(w, 3, SMALL["patch"], SMALL["patch"]),
        f"{vit}patch_embed.proj.bias": _tensor(w),
        f"{vit}norm.weight": torch.ones(w),
        f"{vit}norm.bias": torch.zeros(w),
        f"{bert}embeddings.word_embeddings.weight": _tensor(vocab, w),
        f"{bert}embeddings.position_embeddings.weight": _tensor(40, w),
        f"{bert}embeddings.LayerNorm.weight": torch.ones(w),
        f"{bert}embeddings.LayerNorm.bias": torch.zeros(w),
    }
    for i in range(SMALL["layers"]):
        state |= _blocks(f"{vit}blocks.{i}.", w, ff, names, "attn.qkv")
        layer = f"{bert}encoder.layer.{i}."
        linears = {"intermediate.dense": (ff, w), "output.dense": (w, ff)}
        for attention in ("attention", "crossattention"):
            for name in ("self.query", "self.key", "self.value", "output.dense"):
                linears[f"{attention}.{name}"] = (w, w)
        for name, shape in linears.items():
            state[f"{layer}{name}.weight"], state[f"{layer}{name}.bias"] = _tensor(*shape), _tensor(shape[0])
        for norm in ("attention.output.LayerNorm", "crossattention.output.LayerNorm", "output.LayerNorm"):
            state[f"{layer}{norm}.weight"], state[f"{layer}{norm}.bias"] = torch.ones(w), torch.zeros(w)
    widths = (w, 1024, 128, 64, 16, 1)
    for index, (a, b) in zip((0, 2, 4, 6, 7), pairwise(widths)):
        state[f"mlp.layers.{index}.weight"], state[f"mlp.layers.{index}.bias"] = (
            torch.randn(b, a) / a**0.5,
            _tensor(b),
        )
    torch.save(state, path)


@torch.inference_mode()
def bare_hps(scorer: object, images: list, prompts: list) -> torch.Tensor:
    """HPS by hand on the scorer's loaded model: letterbox + tokenize + CLIPModel forward, cosine, per batch."""
    from stages.score.hps import clean_prompt, letterbox_pixels

    model, tokenizer, _ = scorer.load()
    out = []
    for start in range(0, len(images), BATCH):
        pixels = torch.stack(
            [letterbox_pixels(im, SMALL["image_size"]) for im in images[start : start + BATCH]]
        )
        text = [clean_prompt(p) for p in prompts[start : start + BATCH]]
        tokens = tokenizer(text, padding=True, truncation=True, max_length=77, return_tensors="pt")
        output = model(pixel_values=pixels, **tokens)
        image = torch.nn.functional.normalize(output.image_embeds, dim=-1)
        out.append((image * torch.nn.functional.normalize(output.text_embeds, dim=-1)).sum(-1))
    return torch.cat(out)


@torch.inference_mode()
def bare_imagereward(scorer: object, images: list, prompts: list) -> torch.Tensor:
    """ImageReward by hand on the scorer's loaded modules: resize/crop + tokenize + ViT + BERT + MLP."""
    from stages.score.imagereward import IMAGEREWARD_MEAN, IMAGEREWARD_STD, resize_crop_pixels

    vision, text, mlp, tokenizer, _ = scorer.load()
    out = []
    for start in range(0, len(images), BATCH):
        pixels = torch.stack(
            [resize_crop_pixels(im, SMALL["image_size"]) for im in images[start : start + BATCH]]
        )
        tokens = tokenizer(
            prompts[start : start + BATCH],
            padding="max_length",
            truncation=True,
            max_length=35,
            return_tensors="pt",
        )
        image = vision(pixel_values=pixels).last_hidden_state
        hidden = text(**tokens, encoder_hidden_states=image).last_hidden_state
        out.append((mlp(hidden[:, 0]).squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD)
    return torch.cat(out)


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
    args = parse_args(parser, smoke={"images": 2, "repeats": 1})
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

        from transformers import BertTokenizer

        from stages.models.tokenizers import build_clip_tokenizer

        clip_tokenizer, bert_tokenizer = (
            build_clip_tokenizer(),
            BertTokenizer(
                vocab={
                    t: i for i, t in enumerate(("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BERT_WORDS))
                }
            ),
        )
        clip_tokenizer.save_pretrained(Path(tmp) / "clip-tokenizer")
        bert_tokenizer.save_pretrained(Path(tmp) / "bert")
        hps_checkpoint(Path(tmp) / "hps.pt", len(clip_tokenizer))
        imagereward_checkpoint(Path(tmp) / "imagereward.pt", len(bert_tokenizer))
        heads = str(SMALL["heads"])
        models = {
            "hpsv2": (
                get_reward(
                    "hpsv2",
                    {
                        "model": str(Path(tmp) / "hps.pt"),
                        "tokenizer": str(Path(tmp) / "clip-tokenizer"),
                        "vision_heads": heads,
                        "text_heads": heads,
                    },
                ),
                bare_hps,
            ),
            "imagereward": (
                get_reward(
                    "imagereward",
                    {
                        "model": str(Path(tmp) / "imagereward.pt"),
                        "tokenizer": str(Path(tmp) / "bert"),
                        "vision_heads": heads,
                        "text_heads": heads,
                    },
                ),
                bare_imagereward,
            ),
        }
        for scorer, by_hand in models.values():
            torch.testing.assert_close(
                torch.tensor(scorer(images, prompts, meta)),
                by_hand(scorer, images, prompts),
                rtol=1e-4,
                atol=1e-5,
            )

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
            timed = {
                "pickscore": lambda: pick(images, prompts, meta),
                "bare": lambda: bare_scores(model, processor, images, prompts),
                "remote_pickscore": lambda: remote_pick(images, prompts, meta),
                "jpeg": lambda: jpeg(images, prompts, meta),
                "remote_jpeg": lambda: remote_jpeg(images, prompts, meta),
            }
            for key, (scorer, by_hand) in models.items():
                timed[key] = lambda scorer=scorer: scorer(images, prompts, meta)
                timed[f"bare_{key}"] = lambda scorer=scorer, by_hand=by_hand: by_hand(scorer, images, prompts)
            times = {}
            for _ in range(args.repeats):  # interleaved, best of each
                for name, fn in timed.items():
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
        **{f"{name}_over_bare": times[name] / times[f"bare_{name}"] for name in ("hpsv2", "imagereward")},
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
        *(
            {
                "reward": f"{name} (SMALL towers, 224 px)",
                "in-process img/s": n / times[name],
                "bare forward img/s": n / times[f"bare_{name}"],
                "in-process ÷ bare (≤ 1.10)": metrics[f"{name}_over_bare"],
                "remote img/s": "",
                "remote ÷ in-process": "",
            }
            for name in ("hpsv2", "imagereward")
        ),
        {
            "reward": "jpeg_compressibility (256 px)",
            "in-process img/s": n / times["jpeg"],
            "bare forward img/s": "",
            "in-process ÷ bare (≤ 1.10)": "",
            "remote img/s": n / times["remote_jpeg"],
            "remote ÷ in-process": metrics["remote_over_inprocess_jpeg"],
        },
    ]
    for row in table:
        print(row)
    if not args.no_record:
        path = record(
            "score",
            metrics,
            table,
            description="Scoring speed: in-process reward ÷ a bare processor + forward of the same CLIP (same "
            "numbers checked first), and through `serve-reward` on loopback ÷ in-process; best of interleaved "
            "repeats.",
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
