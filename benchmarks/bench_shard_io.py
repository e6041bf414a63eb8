"""Shard-set I/O against raw file I/O of the same bytes.

Writes a trajectory-shaped shard set (latents float32 [K+1, C, H, W] per row, per-step
log-probs/timesteps/sigmas, a PNG, ids and prompts) with ShardSetWriter and reads it back with
ShardSet, and in the same run writes the same bytes sequentially to plain files (with fsync) and
reads them back into preallocated arrays. Ratios are omnirl throughput / raw throughput (target
>= 0.5), best of `--repeats` interleaved runs each:

- write: both sides fsync every file; omnirl also hashes (sha256) while writing.
- read (warm): files in the page cache (each repeat reads everything once untimed first), sha256
  verification on. The raw side is then a memcpy (~10 GB/s here), so this ratio is capped by
  single-core sha256 speed (~1.7 GB/s with SHA-NI) / memcpy speed, about 0.17.
- read (cold): the files' pages are dropped (posix_fadvise DONTNEED) before every read.
- read (no verify): warm, `ShardSet(verify=False)`: the cost of decoding alone.

    python benchmarks/bench_shard_io.py [--rows 512] [--num-shards 4] [--formats parquet webdataset]
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import best_of, parse_args, record
from stages.shards import ShardSet, ShardSetWriter, slice_batch
from stages.shards.atomic import fsync_dir


def make_batch(rows: int, steps: int, latent_shape: tuple[int, ...], seed: int = 0) -> dict:
    """A diffusion-rollout batch: `rows` samples with `steps` stored SDE steps."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    pngs = []
    for _ in range(8):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    return {
        "sample_id": [f"it0-p{r // 16:05d}-s{r % 16:02d}" for r in range(rows)],
        "prompt": [
            f"a photo of sign that says 'omnirl {r}' on a sunny street, high detail" for r in range(rows)
        ],
        "seed": torch.arange(rows, dtype=torch.int64),
        "image": [pngs[r % len(pngs)] for r in range(rows)],
        "timesteps": torch.rand(rows, steps, generator=g),
        "sigmas": torch.rand(rows, steps + 1, generator=g),
        "latents": torch.randn(rows, steps + 1, *latent_shape, generator=g),
        "log_probs": torch.randn(rows, steps, generator=g),
        "reward": torch.rand(rows, generator=g),
    }


def shard_slices(rows: int, num_shards: int) -> list[tuple[int, int]]:
    bounds = [rows * i // num_shards for i in range(num_shards + 1)]
    return list(itertools.pairwise(bounds))


def raw_parts(batch: dict) -> list:
    """The batch's bytes as buffers: tensor memory, PNG bytes, UTF-8 strings."""
    parts = []
    for v in batch.values():
        if isinstance(v, torch.Tensor):
            parts.append(memoryview(v.contiguous().numpy()).cast("B"))
        elif isinstance(v[0], bytes):
            parts.append(b"".join(v))
        else:
            parts.append("\n".join(v).encode())
    return parts


def raw_write(dir_: Path, shards: list[dict]) -> None:
    for i, shard in enumerate(shards):
        with open(dir_ / f"raw-{i:05d}.bin", "wb") as f:
            for p in raw_parts(shard):
                f.write(p)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(dir_)


def raw_read(dir_: Path, shards: list[dict]) -> list[dict]:
    out = []
    for i, shard in enumerate(shards):
        batch = {}
        with open(dir_ / f"raw-{i:05d}.bin", "rb", buffering=0) as f:
            for name, v in shard.items():
                if isinstance(v, torch.Tensor):
                    t = torch.from_numpy(np.empty(v.shape, dtype=v.numpy().dtype))
                    f.readinto(memoryview(t.numpy()).cast("B"))
                    batch[name] = t
                else:
                    batch[name] = f.read(len(raw_parts({name: v})[0]))
        out.append(batch)
    return out


def omnirl_write(dir_: Path, shards: list[dict], fmt: str) -> None:
    if dir_.exists():
        shutil.rmtree(dir_)
    w = ShardSetWriter(dir_, num_shards=len(shards), format=fmt, command="bench", config={"bench": 1})
    for i, shard in enumerate(shards):
        w.write_shard(i, shard)
    w.finalize()


def omnirl_read(dir_: Path, verify: bool = True) -> list[dict]:
    s = ShardSet(dir_, verify=verify)
    return [s.read_shard(i) for i in range(s.num_shards)]


def drop_page_cache(dir_: Path) -> None:
    """Evict a directory's (clean, fsynced) file pages so the next read comes from the disk."""
    for p in dir_.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--num-shards", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="stored SDE steps K (latents hold K+1)")
    ap.add_argument("--latent-shape", type=int, nargs=3, default=(16, 64, 64))
    ap.add_argument("--formats", nargs="+", default=["parquet", "webdataset"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    args = parse_args(
        ap, smoke={"rows": 8, "num_shards": 2, "steps": 1, "latent_shape": (4, 8, 8), "repeats": 1}
    )

    batch = make_batch(args.rows, args.steps, tuple(args.latent_shape))
    shards = [slice_batch(batch, a, b) for a, b in shard_slices(args.rows, args.num_shards)]
    nbytes = sum(memoryview(p).nbytes for s in shards for p in raw_parts(s))
    mb = nbytes / 1e6
    rows: list[dict] = []
    metrics: dict = {"rows": args.rows, "num_shards": args.num_shards, "logical_mb": round(mb, 1)}
    metrics["load_average_before"] = os.getloadavg()[0]
    times: dict[str, list[float]] = {}

    def timed(key: str, fn) -> None:
        if key.endswith("cold") and not hasattr(os, "posix_fadvise"):
            return
        if key.endswith("cold"):
            drop_page_cache(raw_dir if key.startswith("raw") else tmp / key.split()[0])
        times.setdefault(key, []).append(best_of(fn, 1))

    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="omnirl-bench-") as tmp_name:
        tmp = Path(tmp_name)
        raw_dir = tmp / "raw"
        raw_dir.mkdir()
        # interleaved, so a burst of load from other processes hits raw and omnirl alike; the
        # untimed first read of each repeat keeps "warm" from measuring first-touch effects of
        # freshly written pages and fresh process memory
        for _ in range(args.repeats):
            timed("raw write", lambda: raw_write(raw_dir, shards))
            for fmt in args.formats:
                timed(f"{fmt} write", lambda fmt=fmt: omnirl_write(tmp / fmt, shards, fmt))
            raw_read(raw_dir, shards)
            for fmt in args.formats:
                omnirl_read(tmp / fmt, verify=False)
            timed("raw read", lambda: raw_read(raw_dir, shards))
            for fmt in args.formats:
                timed(f"{fmt} read", lambda fmt=fmt: omnirl_read(tmp / fmt))
                timed(f"{fmt} read noverify", lambda fmt=fmt: omnirl_read(tmp / fmt, verify=False))
            timed("raw read cold", lambda: raw_read(raw_dir, shards))
            for fmt in args.formats:
                timed(f"{fmt} read cold", lambda fmt=fmt: omnirl_read(tmp / fmt))
        best = {k: min(v) for k, v in times.items()}
        for fmt in args.formats:
            m = {
                "write_ratio": best["raw write"] / best[f"{fmt} write"],
                "read_ratio": best["raw read"] / best[f"{fmt} read"],
                "read_ratio_cold": best.get("raw read cold", 0) / best.get(f"{fmt} read cold", 1),
                "read_ratio_noverify": best["raw read"] / best[f"{fmt} read noverify"],
                "omnirl_write_MBps": mb / best[f"{fmt} write"],
                "raw_write_MBps": mb / best["raw write"],
                "omnirl_read_MBps": mb / best[f"{fmt} read"],
                "raw_read_MBps": mb / best["raw read"],
                "omnirl_read_cold_MBps": mb / best.get(f"{fmt} read cold", float("inf")),
                "raw_read_cold_MBps": mb / best.get("raw read cold", float("inf")),
                "disk_MB": sum(p.stat().st_size for p in (tmp / fmt).glob("train-*")) / 1e6,
            }
            metrics[fmt] = m
            rows.append(
                {"format": fmt, **{k: round(v, 2) if "ratio" in k else round(v) for k, v in m.items()}}
            )
            print(fmt, {k: round(v, 3) for k, v in m.items()}, flush=True)
    metrics["load_average_after"] = os.getloadavg()[0]
    if not args.no_record:
        path = record(
            "shard_io",
            metrics,
            rows,
            description=(
                "ShardSetWriter/ShardSet vs raw fsync'd write / read of the same bytes "
                f"({args.rows} rows, {mb:.0f} MB logical, {args.num_shards} shards, best of {args.repeats}; "
                f"load average {metrics['load_average_before']:.1f} on {os.cpu_count()} CPUs). "
                "Reads verify sha256 unless noted; warm = page cache (raw side is a memcpy, so sha256 caps "
                "the warm ratio near 0.17), cold = pages dropped first."
            ),
        )
        print("recorded", path)


if __name__ == "__main__":
    main()
