"""Shard sets as Hugging Face `datasets` reads them, and sets in the layout of schema version 1.

`load_dataset(SET)`, `load_dataset("parquet", data_dir=SET)`, `load_dataset("parquet",
data_files=SET/*.parquet)` and `Dataset.from_parquet` must give every tensor column the manifest's per-row shape with the stored bits, and images as PIL images (a list per row for an
image_list column). Version-1 sets (fixed_shape_tensor columns, plain binary images, VLM images
packed into one blob) are built here with pyarrow directly and must still read in omnirl.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from test_shards import DTYPES, SHAPES, bits, make_tensor, mp4_bytes, png_bytes, write_set

from stages.shards import Column, ShardSet, ShardSetWriter
from stages.shards.manifest import MANIFEST_NAME
from stages.shards.schema import TENSOR_DTYPES, tensor_to_storage

datasets = pytest.importorskip("datasets")


def jpeg_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


HOW = ["directory", "data_dir", "data_files", "from_parquet"]


def load(path: Path, how: str, cache: Path):
    """The shard set as `datasets` loads it: the directory (it picks the Parquet files by extension),
    the parquet builder on the directory (it takes the `train-*` shards as the train split, not the
    manifest) or on the shard glob, or `Dataset.from_parquet` on it (its cache in `cache`)."""
    if how == "directory":
        return datasets.load_dataset(str(path), split="train", cache_dir=str(cache))
    if how == "data_dir":
        return datasets.load_dataset("parquet", data_dir=str(path), split="train", cache_dir=str(cache))
    if how == "data_files":
        return datasets.load_dataset(
            "parquet", data_files=f"{path}/*.parquet", split="train", cache_dir=str(cache)
        )
    return datasets.Dataset.from_parquet(f"{path}/*.parquet", cache_dir=str(cache))


def storage_bits(t: torch.Tensor) -> np.ndarray:
    """What `datasets` should hold for a tensor: its stored bits (bf16 as uint16, bool as uint8)."""
    arr = tensor_to_storage(t.contiguous())
    return arr.view(np.uint8) if arr.dtype == np.bool_ else arr


def feature_shape(feature) -> tuple[tuple[int, ...], str]:
    """The fixed per-row shape and value dtype a `datasets` feature announces (nested fixed-length lists)."""
    shape = []
    while isinstance(feature, datasets.List):
        assert feature.length > 0, feature
        shape.append(feature.length)
        feature = feature.feature
    assert isinstance(feature, datasets.Value), feature
    return tuple(shape), feature.dtype


def arrow_values(ds, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A column's values as `datasets` holds them in Arrow, as a [rows, *shape] array."""
    values = ds.with_format("arrow")[name]
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    for _ in shape:
        values = values.flatten()
    return values.to_numpy(zero_copy_only=False).reshape(len(ds), *shape)


def assert_loads_like_manifest(path: Path, how: str, cache: Path) -> None:
    """Every tensor column of the set: the feature's shape is the manifest's, the numpy column is
    [rows, *shape] in the storage dtype and holds the bits omnirl reads; ids and images agree."""
    shard_set = ShardSet(path)
    want = shard_set.read_all()
    ds = load(path, how, cache)
    assert ds.num_rows == shard_set.num_rows and ds.column_names == list(shard_set.columns)
    as_numpy, as_torch = ds.with_format("numpy"), ds.with_format("torch")
    for name, col in shard_set.columns.items():
        if col.kind != "tensor":
            continue
        expected = storage_bits(want[name])
        assert feature_shape(ds.features[name]) == (col.shape, expected.dtype.name), name
        # its numpy and torch formats stack rows to [rows, *shape] (casting to float32/int64 by default)
        assert as_numpy[:][name].shape == as_torch[:][name].shape == (shard_set.num_rows, *col.shape), name
        got = arrow_values(ds, name, col.shape)
        assert got.dtype == expected.dtype and np.array_equal(got.view(np.uint8), expected.view(np.uint8)), (
            name
        )
    if "sample_id" in want:
        assert ds["sample_id"] == want["sample_id"]
    if "image" in want:
        assert isinstance(ds.features["image"], datasets.Image)
        for pil, data in zip(ds["image"], want["image"]):
            assert np.array_equal(np.asarray(pil), np.asarray(Image.open(io.BytesIO(data))))
    if "video" in want:
        # declared Video(decode=False): rows are the MP4 files as stored, loadable without torchcodec
        assert ds.features["video"] == datasets.Video(decode=False)
        assert [row["bytes"] for row in ds["video"]] == want["video"]


@pytest.mark.parametrize("how", HOW)
def test_video_columns_load_as_video_files(tmp_path: Path, how: str) -> None:
    shards = [
        {"sample_id": [f"s{s}-{r}" for r in range(2)], "video": [mp4_bytes(10 * s + r) for r in range(2)]}
        for s in range(2)
    ]
    write_set(tmp_path / "set", shards, "parquet", kinds={"video": "video"})
    assert_loads_like_manifest(tmp_path / "set", how, tmp_path / "cache")


def test_webdataset_video_members_load_as_video_files(tmp_path: Path) -> None:
    batch = {"sample_id": ["a", "b"], "video": [mp4_bytes(1), mp4_bytes(2)]}
    write_set(tmp_path / "set", [batch], "webdataset", kinds={"video": "video"})
    ds = datasets.load_dataset(
        "webdataset", data_files=f"{tmp_path}/set/*.tar", split="train", cache_dir=str(tmp_path / "cache")
    )
    # datasets maps the .mp4 members to its Video feature; without decoding, they are the stored files
    assert isinstance(ds.features["video.mp4"], datasets.Video)
    ds = ds.cast_column("video.mp4", datasets.Video(decode=False))
    assert [row["bytes"] for row in ds["video.mp4"]] == batch["video"]


@pytest.mark.parametrize("how", HOW)
def test_every_dtype_and_shape_loads_with_the_manifests_shape(tmp_path: Path, how: str) -> None:
    shards = []
    for s in range(2):
        batch = {"sample_id": [f"s{s}-{r}" for r in range(3)]}
        for i, dtype in enumerate(DTYPES):
            for shape in SHAPES:
                name = f"{str(dtype).removeprefix('torch.')}_{len(shape)}d"
                batch[name] = make_tensor(dtype, shape, 3, seed=10 * s + i)
        batch["image"] = [png_bytes(10 * s + r) for r in range(3)]
        batch["images"] = [[png_bytes(7), jpeg_bytes(s)], [], [jpeg_bytes(3)]]
        shards.append(batch)
    writer = ShardSetWriter(
        tmp_path / "set",
        num_shards=2,
        command="test",
        config={},
        kinds={"image": "image", "images": "image_list"},
    )
    for i, batch in enumerate(shards):
        writer.write_shard(i, batch)
    writer.finalize()
    assert_loads_like_manifest(tmp_path / "set", how, tmp_path / "cache")
    ds = load(tmp_path / "set", how, tmp_path / "cache")
    assert ds.features["images"] == datasets.List(datasets.Image())
    rows = ds["images"]
    want = [row for batch in shards for row in batch["images"]]
    assert [len(r) for r in rows] == [len(r) for r in want] == [2, 0, 1, 2, 0, 1]
    for got_row, want_row in zip(rows, want):
        for pil, data in zip(got_row, want_row):
            assert isinstance(pil, Image.Image)
            assert np.array_equal(np.asarray(pil), np.asarray(Image.open(io.BytesIO(data))))
    # omnirl's own reader: the same bits back, bf16 and bool included
    got = ShardSet(tmp_path / "set").read_all()
    for name, col in ShardSet(tmp_path / "set").columns.items():
        if col.kind == "tensor":
            want_t = torch.cat([b[name] for b in shards])
            assert got[name].dtype == want_t.dtype and torch.equal(bits(got[name]), bits(want_t)), name
    assert got["images"] == want


@pytest.mark.parametrize("stage", ["samples", "logprobs", "advantages"])
def test_stage_outputs_load_with_the_manifests_shapes(
    staged: dict[str, Path], stage: str, tmp_path: Path
) -> None:
    """A diffusion rollout and the column groups derived from it, as written by the commands."""
    for how in HOW:
        assert_loads_like_manifest(staged[stage], how, tmp_path / how)


# ----------------------------------------------------------------------------- schema version 1


def write_v1_set(path: Path, batch: dict, kinds: dict[str, str]) -> None:
    """One shard in the layout omnirl wrote before schema version 2, with its manifest."""
    fields, arrays, columns = [], [], []
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            storage = tensor_to_storage(value.contiguous())
            storage = storage.view(np.uint8) if storage.dtype == np.bool_ else storage
            flat = pa.array(storage.reshape(-1))
            shape = tuple(value.shape[1:])
            if shape:
                tensor_type = pa.fixed_shape_tensor(flat.type, list(shape))
                storage_array = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(shape)))
                flat = pa.ExtensionArray.from_storage(tensor_type, storage_array)
            col = Column(name, "tensor", dtype, shape)
        elif kinds.get(name) in ("image", "binary"):
            flat, col = pa.array(value, type=pa.large_binary()), Column(name, kinds[name])
        elif kinds.get(name) == "json":
            flat, col = pa.array([json.dumps(v) for v in value], type=pa.large_string()), Column(name, "json")
        else:
            flat, col = pa.array(value, type=pa.large_string()), Column(name, "string")
        meta = {"omnirl.kind": col.kind}
        if col.kind == "tensor":
            meta |= {"omnirl.dtype": col.dtype, "omnirl.shape": json.dumps(list(col.shape))}
        fields.append(pa.field(name, flat.type, nullable=False, metadata=meta))
        arrays.append(flat)
        columns.append(col)
    path.mkdir(parents=True)
    shard = path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_arrays(arrays, schema=pa.schema(fields)), shard, store_schema=True)
    data = shard.read_bytes()
    rows = len(next(iter(batch.values())))
    manifest = {
        "format": "parquet",
        "schema_version": 1,
        "command": "sample",
        "config": {},
        "config_hash": "0" * 64,
        "parents": [],
        "policy": None,
        "shards": [
            {"file": shard.name, "rows": rows, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        ],
        "columns": [c.to_json() for c in columns],
        "num_rows": rows,
        "created": "2025-01-01T00:00:00+00:00",
        "extra": {"modality": "text"},
    }
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


def pack_v1(images: list[bytes]) -> bytes:
    """A version-1 VLM images blob: magic, count (u32), lengths (u64 each), the files."""
    return b"OMNIIMG1" + struct.pack(f"<I{len(images)}Q", len(images), *map(len, images)) + b"".join(images)


def test_schema_version_1_sets_still_read(tmp_path: Path) -> None:
    from stages.sample.vlm_stage import row_media

    batch = {
        "sample_id": ["g0-000", "g0-001", "g1-000", "g1-001"],
        "group_id": ["g0", "g0", "g1", "g1"],
        "prompt_meta": [{"ground_truth": "1"}, {"ground_truth": "1"}, None, None],
        "image": [png_bytes(r) for r in range(4)],
        "images": [pack_v1([png_bytes(0), jpeg_bytes(1)]), b"", pack_v1([]), b""],
    }
    for i, dtype in enumerate(TENSOR_DTYPES.values()):
        batch[f"t_{dtype.name}"] = make_tensor(dtype.torch, (2, 3), 4, seed=i)
        batch[f"s_{dtype.name}"] = make_tensor(dtype.torch, (), 4, seed=i + 20)
    write_v1_set(tmp_path / "v1", batch, {"image": "image", "images": "binary", "prompt_meta": "json"})
    shard_set = ShardSet(tmp_path / "v1")
    assert shard_set.manifest.schema_version == 1
    got = shard_set.read_all()
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            assert got[name].dtype == value.dtype and torch.equal(bits(got[name]), bits(value)), name
        else:
            assert got[name] == value, name
    shard_set.verify()
    media = row_media(got, "v1")
    assert [m["images"] for m in media] == [[png_bytes(0), jpeg_bytes(1)]] * 2 + [[], []]
    assert [m["videos"] for m in media] == [[]] * 4  # no videos column: no videos


def test_row_media_reads_lists_from_the_first_row_of_each_group() -> None:
    from stages.errors import UserInputError
    from stages.sample.vlm_stage import row_media

    shard = {
        "sample_id": ["g0-000", "g0-001", "g1-000", "g1-001"],
        "group_id": ["g0", "g0", "g1", "g1"],
        "images": [[b"a", b"b"], [], [], []],
        "videos": [[], [], [[b"f0", b"f1"]], []],
        "audios": [[b"w0"], [], [], []],
    }
    assert row_media(shard, "s") == [
        {"images": [b"a", b"b"], "videos": [], "audios": [b"w0"]},
        {"images": [b"a", b"b"], "videos": [], "audios": [b"w0"]},
        {"images": [], "videos": [[b"f0", b"f1"]], "audios": []},
        {"images": [], "videos": [[b"f0", b"f1"]], "audios": []},
    ]
    # schema version 1: a group's later rows hold b"", so one read without its first row is an error
    with pytest.raises(UserInputError, match="sample 'g0-001' comes before the first row of its group"):
        row_media({"sample_id": ["g0-001"], "group_id": ["g0"], "images": [b""]}, "s")
