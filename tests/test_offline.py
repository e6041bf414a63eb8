"""Offline training straight off files: a Pick-a-Pic-style table → pairs → VAE latents → Diffusion-DPO."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import fails, ins, run
from PIL import Image

from stages.shards.reader import ShardSet, open_inputs


def _png(array: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array.numpy()).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pickapic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six pairs (flat image preferred over noise, in both column orders) and one tie."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for k in range(7):
        flat = torch.full((32, 32, 3), 40 + 30 * k, dtype=torch.uint8)
        noise = torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8)
        first_flat = k % 2 == 0
        rows.append(
            {
                "caption": f"a plain square number {k}",
                "jpg_0": _png(flat if first_flat else noise),
                "jpg_1": _png(noise if first_flat else flat),
                "label_0": 0.5 if k == 6 else (1.0 if first_flat else 0.0),
            }
        )
    path = tmp_path_factory.mktemp("offline") / "pickapic.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_pairs_converter_orders_preferred_first_and_skips_ties(pickapic: Path, tmp_path: Path) -> None:
    out = run("pairs", "--pairs", str(pickapic), "--num-shards", "2", "--out", str(tmp_path / "pairs"))
    assert out["pairs"] == 6 and out["ties_skipped"] == 1
    data = ShardSet(tmp_path / "pairs").read_all()
    rollout = data["sample_id"][0][:8]  # the pair set's rollout id prefixes every id
    assert data["sample_id"][:4] == [
        f"{rollout}-{x}" for x in ("p0000000-w", "p0000000-l", "p0000001-w", "p0000001-l")
    ]
    assert data["group_id"][:4] == [f"{rollout}-p0000000"] * 2 + [f"{rollout}-p0000001"] * 2
    assert data["reward"].tolist() == [1.0, 0.0] * 6
    for i in range(0, 12, 2):  # the preferred image is always the flat one
        colours = [
            np.unique(np.asarray(Image.open(io.BytesIO(data["image"][j]))).reshape(-1, 3), axis=0)
            for j in (i, i + 1)
        ]
        assert len(colours[0]) == 1 and len(colours[1]) > 100


@pytest.mark.parametrize(
    ("column", "value"), [("label_0", "left"), ("label_0", 0.7), ("chosen_score", "high")]
)
def test_non_numeric_or_unknown_labels_are_one_line(tmp_path: Path, column: str, value: object) -> None:
    image = _png(torch.zeros(8, 8, 3, dtype=torch.uint8))
    if column == "label_0":
        row = {"caption": "x", "jpg_0": image, "jpg_1": image, "label_0": value}
    else:
        row = {
            "prompt": "x",
            "chosen": image,
            "rejected": image,
            "chosen_score": value,
            "rejected_score": 1.0,
        }
    table = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist([row]), table)
    fails(["pairs", "--pairs", str(table), "--out", str(tmp_path / "out")], f"{table}: row 0", column)
    assert not (tmp_path / "out").exists()


def test_offline_dpo_raises_the_implicit_preference_margin(
    pickapic: Path, tiny_sd3: Path, tmp_path: Path
) -> None:
    from stages.models.diffusion import FlowPolicy
    from stages.update.family_losses import fm_error

    p = {n: tmp_path / n for n in ("pairs", "latents", "policy")}
    run("pairs", "--pairs", str(pickapic), "--out", str(p["pairs"]))
    run(
        "encode",
        "--model",
        str(tiny_sd3),
        "--in",
        str(p["pairs"]),
        "--resolution",
        "32",
        "--out",
        str(p["latents"]),
    )
    latents = ShardSet(p["latents"]).read_all()["final_latent"]
    assert latents.shape == (12, 16, 8, 8)
    first = Image.open(io.BytesIO(ShardSet(p["pairs"]).read_all()["image"][0])).convert("RGB")
    torch.testing.assert_close(
        latents[:1], FlowPolicy.load(tiny_sd3).encode_images([first], 32)
    )  # row order kept
    run(
        "update",
        "--model",
        str(tiny_sd3),
        *ins(p["pairs"], p["latents"]),
        "--algo",
        "dpo",
        "--dpo-beta",
        "100",
        "--lr",
        "3e-3",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--micro-batch",
        "4",
        "--inner-epochs",
        "4",
        "--out",
        str(p["policy"]),
    )
    metrics = [json.loads(x) for x in (p["policy"] / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["actor/dpo_loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
    assert metrics[-1]["actor/rewards/margins"] > 0 and metrics[-1]["actor/dpo_loss"] < 0.6931
    data = open_inputs([p["pairs"], p["latents"]]).read_all(columns=["prompt", "final_latent"])
    x0 = data["final_latent"]
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7))
    t = torch.tensor(0.5)
    x_t = (1 - t) * x0 + t * eps

    def errors(adapter: Path | None) -> torch.Tensor:
        pol = FlowPolicy.load(tiny_sd3, adapter=adapter)
        with torch.no_grad():
            return fm_error(pol.velocity(x_t, t, pol.encode(list(data["prompt"]), None, False), 1.0), eps, x0)

    base, tuned = errors(None), errors(p["policy"])
    margin = ((tuned[0::2] - base[0::2]) - (tuned[1::2] - base[1::2])).mean()
    assert float(margin) < 0  # preferred latents became relatively easier to denoise than rejected ones
