"""Shard sets: schema inference, bit-exact round trips in both formats, on-disk layout."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from stages.errors import UserInputError
from stages.media.video import encode_mp4
from stages.shards import (
    Column,
    ShardSet,
    ShardSetWriter,
    batch_num_rows,
    concat_batches,
    config_hash,
    infer_columns,
    parquet_codec,
    slice_batch,
    tar_codec,
)
from stages.shards.manifest import MANIFEST_NAME, read_manifest

FORMATS = ("parquet", "webdataset")
DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
SHAPES = ((), (3,), (2, 3, 2, 2))
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a tensor, so NaN payloads and -0.0 compare exactly."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], rows: int, seed: int) -> torch.Tensor:
    """Random values of `dtype`, with NaN, ±inf and -0.0 planted in float tensors."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(rows, *shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = (torch.randn(rows, *shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
        flat = t.view(-1)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
        flat[: min(4, flat.numel())] = specials[: min(4, flat.numel())]
        return t
    info = torch.iinfo(dtype)
    t = torch.randint(info.min, info.max, (rows, *shape), generator=g, dtype=torch.int64).to(dtype)
    t.view(-1)[0] = info.min
    t.view(-1)[-1] = info.max
    return t


def png_bytes(seed: int, size: int = 8) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def mp4_bytes(seed: int, frames: int = 2, size: int = 8, fps: float = 16) -> bytes:
    """A real MP4 of `frames` random `size`×`size` frames (a video column's rows are probed on write)."""
    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(frames)]
    return encode_mp4(pictures, fps)


def mixed_batch(rows: int, seed: int) -> dict:
    """One of every column kind, with awkward values."""
    texts = ["", "plain", "héllo wörld", "日本語のテキスト", "emoji 🚀✨", "line\nbreak\ttab", "a.b.c"]
    metas = [
        {"text": "OCR target ✓", "n": 1},
        [1, 2.5, None],
        None,
        "s",
        3,
        {"nested": {"k": [True, False]}},
        [],
    ]
    return {
        "sample_id": [f"s{seed}-{r}" for r in range(rows)],
        "prompt": [texts[(r + seed) % len(texts)] for r in range(rows)],
        "prompt_meta": [metas[(r + seed) % len(metas)] for r in range(rows)],
        "blob": [bytes([r % 256, 0, 255]) * r for r in range(rows)],
        "image": [png_bytes(seed * 100 + r) for r in range(rows)],
        "video": [mp4_bytes(seed * 100 + r) for r in range(rows)],
        "reward.ocr": make_tensor(torch.float32, (), rows, seed),
        "latents": make_tensor(torch.bfloat16, (2, 2, 4, 4), rows, seed + 1),
        "log_probs": make_tensor(torch.float32, (3,), rows, seed + 2),
    }


KINDS = {"image": "image", "video": "video"}


def write_set(path, shards: list[dict], fmt: str, kinds: dict | None = None, **kw) -> ShardSetWriter:
    w = ShardSetWriter(
        path, num_shards=len(shards), format=fmt, command="test", config={"t": 1}, kinds=kinds, **kw
    )
    for i, b in enumerate(shards):
        w.write_shard(i, b)
    w.finalize()
    return w


def assert_batches_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), name
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(bits(g), bits(w)), name
        else:
            assert g == [bytes(v) if isinstance(v, (bytearray, memoryview)) else v for v in w], name


# ----------------------------------------------------------------------------- schema


def test_infer_columns_kinds_and_shapes() -> None:
    batch = {
        "x": torch.zeros(2, 3, 4, dtype=torch.bfloat16),
        "s": torch.zeros(2, dtype=torch.int64),
        "t": ["a", "b"],
        "j": [{"a": 1}, None],
        "b": [b"x", b"y"],
        "img": [b"x", b"y"],
        "raw_json": [b'{"a": 1}', b"[2]"],
    }
    cols = infer_columns(batch, {"img": "image", "raw_json": "json"})
    assert cols == [
        Column("x", "tensor", "bfloat16", (3, 4)),
        Column("s", "tensor", "int64", ()),
        Column("t", "string"),
        Column("j", "json"),
        Column("b", "binary"),
        Column("img", "image"),
        Column("raw_json", "json"),
    ]
    assert [Column.from_json(c.to_json()) for c in cols] == cols


@pytest.mark.parametrize(
    ("batch", "kinds", "needle"),
    [
        ({"a": torch.zeros(2), "b": ["x"]}, None, "'b' has 1 rows"),
        ({"a": torch.zeros(2, dtype=torch.complex64)}, None, "complex64"),
        ({"a": [b"x", "y"]}, None, "mixes bytes"),
        ({"a": []}, None, "pass kinds"),
        ({"a": ["x"]}, {"a": "image"}, "declared image"),
        ({"a": ["x"]}, {"a": "tensor"}, "declared tensor"),
        ({"a": torch.zeros(1)}, {"a": "string"}, "declared string"),
        ({"a": ["x"]}, {"a": "audio"}, "unknown kind"),
        ({"a/b": ["x"]}, None, "not allowed"),
        ({"__key__": ["x"]}, None, "not allowed"),
        ({"a": torch.tensor(1.0)}, None, "leading row dimension"),
        ({"a": "abc"}, None, "unsupported value"),
        ({}, None, "no columns"),
    ],
)
def test_infer_columns_rejects(batch: dict, kinds: dict | None, needle: str) -> None:
    with pytest.raises(UserInputError, match=needle):
        infer_columns(batch, kinds)


def test_batch_helpers() -> None:
    a = {"x": torch.arange(4), "s": list("abcd")}
    b = {"x": torch.arange(4, 6), "s": list("ef")}
    assert batch_num_rows(a) == 4
    cat = concat_batches([a, b])
    assert torch.equal(cat["x"], torch.arange(6)) and cat["s"] == list("abcdef")
    part = slice_batch(cat, 1, 3)
    assert torch.equal(part["x"], torch.tensor([1, 2])) and part["s"] == ["b", "c"]
    assert part["x"].data_ptr() == cat["x"].data_ptr() + cat["x"].element_size()
    assert concat_batches([a]) is a
    with pytest.raises(UserInputError, match="'y'"):
        concat_batches([a, {"x": torch.arange(1), "y": ["z"]}])


def test_config_hash_is_canonical() -> None:
    assert config_hash({"a": 1, "b": {"c": [1, 2], "d": "é"}}) == config_hash(
        {"b": {"d": "é", "c": [1, 2]}, "a": 1}
    )
    assert config_hash({"a": 1}) != config_hash({"a": 2})
    assert len(config_hash({})) == 64


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_every_dtype_and_shape(tmp_path, fmt: str) -> None:
    shards = []
    for s in range(2):
        b = {"sample_id": [f"{s}-{r}" for r in range(5)]}
        for i, dtype in enumerate(DTYPES):
            for j, shape in enumerate(SHAPES):
                b[f"{str(dtype)[6:]}_{len(shape)}d"] = make_tensor(dtype, shape, 5, seed=100 * s + 10 * i + j)
        shards.append(b)
    write_set(tmp_path / "set", shards, fmt)
    s = ShardSet(tmp_path / "set")
    assert s.manifest.format == fmt and s.num_shards == 2 and s.num_rows == 10
    assert s.columns["bfloat16_4d"] == Column("bfloat16_4d", "tensor", "bfloat16", (2, 3, 2, 2))
    assert s.columns["bool_0d"] == Column("bool_0d", "tensor", "bool", ())
    for i in range(2):
        assert_batches_equal(s.read_shard(i), shards[i])
    assert_batches_equal(s.read_all(), concat_batches(shards))


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_strings_json_bytes_images(tmp_path, fmt: str) -> None:
    shards = [mixed_batch(7, seed) for seed in range(3)]
    write_set(tmp_path / "set", shards, fmt, kinds=KINDS)
    s = ShardSet(tmp_path / "set")
    assert s.columns["image"].kind == "image" and s.columns["prompt_meta"].kind == "json"
    for i, batch in enumerate(s):
        assert_batches_equal(batch, shards[i])
    got = s.read_shard(1, ["image"])["image"][3]
    decoded = np.asarray(Image.open(io.BytesIO(got)))
    assert np.array_equal(decoded, np.asarray(Image.open(io.BytesIO(png_bytes(103)))))


@pytest.mark.parametrize("fmt", FORMATS)
def test_column_subset_and_order(tmp_path, fmt: str) -> None:
    shards = [mixed_batch(4, 0)]
    write_set(tmp_path / "set", shards, fmt, kinds=KINDS)
    got = ShardSet(tmp_path / "set").read_shard(0, ["log_probs", "sample_id"])
    assert list(got) == ["log_probs", "sample_id"]
    assert torch.equal(bits(got["log_probs"]), bits(shards[0]["log_probs"]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_shard_round_trip(tmp_path, fmt: str) -> None:
    full = {"sample_id": ["a", "b"], "x": torch.ones(2, 3), "m": [{"a": 1}, {"b": 2}]}
    empty = {"sample_id": [], "x": torch.ones(0, 3), "m": []}
    write_set(tmp_path / "set", [full, empty], fmt, kinds={"sample_id": "string", "m": "json"})
    s = ShardSet(tmp_path / "set")
    got = s.read_shard(1)
    assert got["sample_id"] == [] and got["m"] == [] and got["x"].shape == (0, 3)
    assert s.num_rows == 2


def test_numpy_and_non_contiguous_tensors_are_accepted(tmp_path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    batch = {"t": base.t(), "n": np.arange(6, dtype=np.int16)}
    write_set(tmp_path / "set", [batch], "parquet")
    got = ShardSet(tmp_path / "set").read_shard(0)
    assert torch.equal(got["t"], base.t().contiguous())
    assert torch.equal(got["n"], torch.arange(6, dtype=torch.int16))


# ----------------------------------------------------------------------------- parquet layout


def test_parquet_layout(tmp_path) -> None:
    write_set(tmp_path / "set", [mixed_batch(6, 0)], "parquet", kinds=KINDS)
    pf = pq.ParquetFile(tmp_path / "set" / "train-00000-of-00001.parquet")
    schema = pf.schema_arrow
    lat = schema.field("latents")
    # one fixed-size list per dimension, non-nullable down to the uint16 bits of the bf16 values
    t, sizes = lat.type, []
    while pa.types.is_fixed_size_list(t):
        sizes.append(t.list_size)
        assert not t.value_field.nullable
        t = t.value_type
    assert sizes == [2, 2, 4, 4] and t == pa.uint16()
    assert lat.metadata[b"omnirl.dtype"] == b"bfloat16" and lat.metadata[b"omnirl.shape"] == b"[2, 2, 4, 4]"
    assert schema.field("reward.ocr").type == pa.float32()
    assert schema.field("prompt_meta").metadata[b"omnirl.kind"] == b"json"
    encoded_file = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    assert schema.field("image").type == encoded_file and schema.field("video").type == encoded_file
    video = schema.field("video").metadata
    assert video[b"omnirl.shape"] == b"[2, 8, 8]" and float(video[b"omnirl.fps"]) == 16.0
    features = json.loads(schema.metadata[b"huggingface"])["info"]["features"]
    # the rest datasets infers from the types
    assert features == {"image": {"_type": "Image"}, "video": {"decode": False, "_type": "Video"}}
    rg = pf.metadata.row_group(0)
    chunks = {rg.column(i).path_in_schema: rg.column(i) for i in range(rg.num_columns)}
    latents = "latents" + ".list.element" * 4
    for path in (latents, "log_probs.list.element", "reward.ocr"):
        assert not chunks[path].has_dictionary_page, path
        assert chunks[path].has_offset_index, path
    assert chunks["prompt"].has_dictionary_page
    assert chunks["prompt"].compression == "ZSTD"
    # bf16 bits sit in Parquet's 4-byte INT32: zstd takes out the zero half; other floats stay raw
    assert chunks[latents].compression == "ZSTD"
    assert chunks[latents].total_compressed_size < 0.7 * chunks[latents].total_uncompressed_size
    for path in ("log_probs.list.element", "image.bytes", "video.bytes"):
        assert chunks[path].compression == "UNCOMPRESSED", path


def test_parquet_read_is_zero_copy(tmp_path) -> None:
    batch = {
        "x": make_tensor(torch.float32, (2, 3), 4, 0),
        "h": make_tensor(torch.bfloat16, (5,), 4, 1),
        "b": make_tensor(torch.bool, (), 4, 2),
        "s": make_tensor(torch.int64, (), 4, 3),
    }
    cols = infer_columns(batch)
    sink = pa.BufferOutputStream()
    parquet_codec.encode(batch, cols, sink, 0)
    table = pq.read_table(pa.BufferReader(sink.getvalue()))
    got = parquet_codec.table_to_batch(table, cols, "mem")
    for name in ("x", "h"):
        values = table.column(name).chunk(0)
        while pa.types.is_fixed_size_list(values.type):
            values = values.values
        assert (
            got[name].data_ptr() == values.buffers()[1].address + values.offset * values.type.bit_width // 8
        ), name
    for name in ("b", "s"):
        arr = table.column(name).chunk(0)
        assert got[name].data_ptr() == arr.buffers()[1].address, name
    for name, t in batch.items():
        assert torch.equal(bits(got[name]), bits(t)), name


def test_parquet_many_row_groups(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(parquet_codec, "ROW_GROUP_BYTES", 1000)
    batch = mixed_batch(9, 4)
    write_set(tmp_path / "set", [batch], "parquet", kinds=KINDS)
    assert pq.ParquetFile(tmp_path / "set" / "train-00000-of-00001.parquet").num_row_groups > 2
    assert_batches_equal(ShardSet(tmp_path / "set").read_shard(0), batch)


# ----------------------------------------------------------------------------- webdataset layout


def test_webdataset_layout_and_real_library(tmp_path) -> None:
    import webdataset as wds

    batch = mixed_batch(5, 2)
    write_set(tmp_path / "set", [batch], "webdataset", kinds=KINDS)
    path = tmp_path / "set" / "train-00000-of-00001.tar"
    with tarfile.open(path) as tf:
        names = tf.getnames()
    assert names[:3] == [
        "00000_000000000.sample_id.txt",
        "00000_000000000.prompt.txt",
        "00000_000000000.prompt_meta.json",
    ]
    assert "00000_000000004.latents.npy" in names and "00000_000000001.image.png" in names
    assert "00000_000000000.video.mp4" in names and "00000_000000000.blob.bin" in names

    samples = list(wds.WebDataset(str(path), shardshuffle=False))
    assert len(samples) == 5
    for r, sample in enumerate(samples):
        assert "." not in sample["__key__"]
        assert sample["sample_id.txt"].decode() == batch["sample_id"][r]
        assert json.loads(sample["prompt_meta.json"]) == batch["prompt_meta"][r]
        assert sample["image.png"] == batch["image"][r]
        lat = np.load(io.BytesIO(sample["latents.npy"]), allow_pickle=False)
        assert lat.dtype == np.uint16 and lat.shape == (2, 2, 4, 4)
        assert torch.equal(torch.from_numpy(lat.astype(np.int32)).to(torch.int16), bits(batch["latents"][r]))
        assert np.load(io.BytesIO(sample["reward.ocr.npy"]), allow_pickle=False).shape == ()

    decoded = list(wds.WebDataset(str(path), shardshuffle=False).decode())
    assert [d["prompt.txt"] for d in decoded] == batch["prompt"]
    # webdataset treats a decoder result of None as "not decoded", so JSON null stays bytes
    for d, meta in zip(decoded, batch["prompt_meta"]):
        assert d["prompt_meta.json"] == (b"null" if meta is None else meta)


@pytest.mark.parametrize("fmt", FORMATS)
def test_image_lists_round_trip(tmp_path, fmt: str) -> None:
    jpeg = io.BytesIO()
    Image.new("RGB", (5, 3), (10, 200, 30)).save(jpeg, format="JPEG")
    rows = [[png_bytes(1), jpeg.getvalue()], [], [png_bytes(2)]]
    batch = {"sample_id": ["a", "b", "c"], "images": rows}
    write_set(tmp_path / "set", [batch], fmt, kinds={"images": "image_list"})
    shard_set = ShardSet(tmp_path / "set")
    assert shard_set.columns["images"] == Column("images", "image_list")
    assert shard_set.read_shard(0, ["images"]) == {"images": rows}
    if fmt == "webdataset":
        with tarfile.open(tmp_path / "set" / "train-00000-of-00001.tar") as tf:
            names = [m.name for m in tf.getmembers() if ".images." in m.name]
        assert names == [
            "00000_000000000.images.0.png",
            "00000_000000000.images.1.jpg",
            "00000_000000002.images.0.png",
        ]
        with pytest.raises(UserInputError, match="row 1 of shard 0 has only empty image lists"):
            write_set(tmp_path / "only", [{"images": rows}], fmt, kinds={"images": "image_list"})
    with pytest.raises(UserInputError, match="declared image_list but a row is not a list"):
        write_set(tmp_path / "bad", [{"images": [b"x"]}], fmt, kinds={"images": "image_list"})


@pytest.mark.parametrize("fmt", FORMATS)
def test_video_lists_round_trip(tmp_path, fmt: str) -> None:
    """Videos as lists of frame files, several per row or none, come back byte for byte; Parquet reads
    as `datasets` List(List(Image)) with the frames decoded."""
    rows = [[[png_bytes(1), png_bytes(2)], [png_bytes(3)]], [], [[png_bytes(4), png_bytes(5), png_bytes(6)]]]
    batch = {"sample_id": ["a", "b", "c"], "videos": rows}
    write_set(tmp_path / "set", [batch], fmt, kinds={"videos": "video_list"})
    shard_set = ShardSet(tmp_path / "set")
    assert shard_set.columns["videos"] == Column("videos", "video_list")
    assert shard_set.read_shard(0, ["videos"]) == {"videos": rows}
    if fmt == "webdataset":
        with tarfile.open(tmp_path / "set" / "train-00000-of-00001.tar") as tf:
            names = [m.name for m in tf.getmembers() if ".videos." in m.name]
        assert names[:3] == [
            "00000_000000000.videos.0.0.png",
            "00000_000000000.videos.0.1.png",
            "00000_000000000.videos.1.0.png",
        ]
    else:
        import datasets

        ds = datasets.Dataset.from_parquet(str(tmp_path / "set" / "*.parquet"), cache_dir=str(tmp_path / "c"))
        assert ds.features["videos"] == datasets.List(datasets.List(datasets.Image()))
        decoded = ds["videos"]
        assert [[len(v) for v in row] for row in decoded] == [[2, 1], [], [3]]
        first = decoded[0][0][1]
        assert np.array_equal(np.asarray(first), np.asarray(Image.open(io.BytesIO(png_bytes(2)))))
    for bad in ([[b"x"]], [[[]]]):
        with pytest.raises(UserInputError, match="declared video_list but a row is not a list of videos"):
            write_set(tmp_path / "bad", [{"videos": bad}], fmt, kinds={"videos": "video_list"})


def test_webdataset_reads_members_written_by_numpy_save(tmp_path) -> None:
    """A tar whose .npy members come from numpy.save (big-endian here) still decodes."""
    col = Column("x", "tensor", "float32", (2,))
    want = np.array([[1.5, -2.0], [3.25, 4.0]], dtype=np.float32)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        for r in range(2):
            data = io.BytesIO()
            np.save(data, want[r].astype(">f4"))
            info = tarfile.TarInfo(f"k{r}.x.npy")
            info.size = len(data.getvalue())
            tf.addfile(info, io.BytesIO(data.getvalue()))
    got = tar_codec.decode(pa.py_buffer(out.getvalue()), [col], 2, "mem.tar")
    assert torch.equal(got["x"], torch.from_numpy(want))


# ----------------------------------------------------------------------------- manifest


@pytest.mark.parametrize("fmt", FORMATS)
def test_manifest_contents(tmp_path, fmt: str) -> None:
    shards = [mixed_batch(3, 0), mixed_batch(4, 1)]
    write_set(tmp_path / "set", shards, fmt, kinds=KINDS, policy={"adapter": "run/it0/policy", "version": 3})
    m = read_manifest(tmp_path / "set")
    raw = json.loads((tmp_path / "set" / MANIFEST_NAME).read_text())
    assert raw["format"] == fmt and raw["schema_version"] == 2 and raw["command"] == "test"
    assert raw["config"] == {"t": 1} and raw["config_hash"] == config_hash({"t": 1})
    assert raw["policy"] == {"adapter": "run/it0/policy", "version": 3}
    assert m.num_rows == 7 and [s.rows for s in m.shards] == [3, 4]
    ext = "parquet" if fmt == "parquet" else "tar"
    assert [s.file for s in m.shards] == [f"train-00000-of-00002.{ext}", f"train-00001-of-00002.{ext}"]
    for s in m.shards:
        data = (tmp_path / "set" / s.file).read_bytes()
        assert s.bytes == len(data)
        assert s.sha256 == hashlib.sha256(data).hexdigest()
    assert raw["columns"][-2] == {
        "name": "latents",
        "kind": "tensor",
        "dtype": "bfloat16",
        "shape": [2, 2, 4, 4],
    }
    assert sorted(p.name for p in (tmp_path / "set").iterdir()) == sorted(
        [MANIFEST_NAME] + [s.file for s in m.shards]
    )


def test_read_manifest_errors(tmp_path) -> None:
    with pytest.raises(UserInputError, match="does not exist"):
        ShardSet(tmp_path / "nope")
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(UserInputError, match="not a finished output"):
        ShardSet(tmp_path / "unfinished")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(UserInputError, match="corrupt"):
        ShardSet(tmp_path / "bad")
    (tmp_path / "bad" / MANIFEST_NAME).write_text(json.dumps({"format": "parquet"}))
    with pytest.raises(UserInputError, match="corrupt"):
        ShardSet(tmp_path / "bad")
