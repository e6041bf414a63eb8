"""Parquet encoding of one shard, and zero-copy decoding into torch.

The layout (schema version 2) is one Hugging Face `datasets` maps as it is, so `load_dataset(SET)`
or `Dataset.from_parquet("SET/*.parquet")` gives each column its shape and decodes the images:

- tensor columns with per-row shape () are primitive columns; others are fixed-size lists nested
  once per dimension with non-nullable elements (`datasets`: List(List(Value, length=W), length=H),
  [N, *shape] in its numpy/torch formats). bf16 is stored as uint16 bits and bool as uint8, with the
  logical dtype in the field metadata (`omnirl.dtype`) and in the manifest;
- image and video columns are `{bytes, path}` structs (its `Image` / `Video` features, path null), an
  image_list column a list of them per row, a video_list column a list of lists of them (videos of
  frames, List(List(Image))); the schema metadata key `huggingface` names their `datasets` features,
  which is how it knows these are images and videos. Videos are declared `Video(decode=False)`, so
  rows load as `{bytes, path}` without torchcodec (`cast_column("video", Video())` decodes them where
  torchcodec is installed). A video field's metadata also holds its frame shape (`omnirl.shape`:
  frames, height, width) and `omnirl.fps`. An audio_list column is a list of the same structs with no
  feature named (`datasets` reads them as dicts; its Audio feature would decode them with torchcodec).

Schema version 1 shards (tensors as `arrow.fixed_shape_tensor`, images as plain binary) are still
read. Tensor columns have no dictionary encoding and no statistics (neither pays on tensors).
Float tensors and encoded images/videos are stored uncompressed: float mantissas shrink <10% under
zstd at half the write speed, PNG/MP4 not at all. Everything else is zstd, bf16 tensors included:
Parquet has no 16-bit type and stores their uint16 bits as 4-byte INT32, whose two zero bytes zstd
removes (measured on N(0, 1) values: 47% of the fp32 column's bytes, 100% uncompressed). Row groups hold about
`ROW_GROUP_BYTES` of uncompressed data; the page index is written.

Decoded tensors of a one-row-group shard are views of Arrow buffers (read-only memory):
`clone()` before in-place ops.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from stages.errors import CorruptShardError
from stages.shards.schema import (
    FILE_LIST_KINDS,
    TENSOR_DTYPES,
    Batch,
    Column,
    as_cpu_tensor,
    batch_num_rows,
    json_text,
    storage_to_tensor,
    tensor_to_storage,
)

SUFFIX = "parquet"
ROW_GROUP_BYTES = 64 << 20
ZSTD_LEVEL = 3
_FLOATS = ("float64", "float32", "float16", "bfloat16")
_pool: ThreadPoolExecutor | None = None

_ARROW_STORAGE = {
    "float64": pa.float64(),
    "float32": pa.float32(),
    "float16": pa.float16(),
    "bfloat16": pa.uint16(),
    "int64": pa.int64(),
    "int32": pa.int32(),
    "int16": pa.int16(),
    "int8": pa.int8(),
    "uint8": pa.uint8(),
    "bool": pa.uint8(),
}
# `datasets`' Image storage: the encoded file, or a path to it (always null here).
ENCODED_FILE = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])
_IMAGE_KINDS = ("image", "image_list", "video_list")
# Columns stored as {bytes, path} structs, and the list levels above the structs.
_STRUCT_DEPTH = {"image": 0, "video": 0, "image_list": 1, "audio_list": 1, "video_list": 2}
_STRUCT_KINDS = tuple(_STRUCT_DEPTH)


def _numpy_storage(col: Column) -> np.dtype:
    """numpy dtype of the Arrow values: bool is kept as uint8 so it maps to memory 1:1."""
    return np.dtype(np.uint8) if col.dtype == "bool" else TENSOR_DTYPES[col.dtype].storage


def arrow_type(col: Column) -> pa.DataType:
    """Arrow type of a column as stored in Parquet."""
    if col.kind == "tensor":
        out = _ARROW_STORAGE[col.dtype]
        for size in reversed(col.shape):
            out = pa.list_(pa.field("element", out, nullable=False), size)
        return out
    if col.kind in ("string", "json"):
        return pa.large_string()
    if col.kind in ("image", "video"):
        return ENCODED_FILE
    if col.kind in FILE_LIST_KINDS:
        return pa.list_(ENCODED_FILE)
    if col.kind == "video_list":
        return pa.list_(pa.list_(ENCODED_FILE))
    return pa.large_binary()


def datasets_features(columns: list[Column]) -> dict:
    """The `datasets` features (`Features.to_dict()` form) of the image and video columns, which their
    Arrow type alone does not announce; `datasets` infers every other column from its type. Written in
    forms that every `datasets` from 3.2 on parses (`Sequence`, which it reads as `List`; `Video`)."""
    out: dict = {}
    for c in columns:
        if c.kind == "video":
            out[c.name] = {"decode": False, "_type": "Video"}
        elif c.kind in _IMAGE_KINDS:
            feature: dict = {"_type": "Image"}
            for _ in range(_STRUCT_DEPTH[c.kind]):
                feature = {"feature": feature, "_type": "Sequence"}
            out[c.name] = feature
    return out


def _field(col: Column) -> pa.Field:
    meta = {"omnirl.kind": col.kind}
    if col.kind == "tensor":
        meta["omnirl.dtype"] = col.dtype
    if col.kind in ("tensor", "video"):
        meta["omnirl.shape"] = json.dumps(list(col.shape))
    if col.fps is not None:
        meta["omnirl.fps"] = repr(col.fps)
    # `datasets` applies a feature from the schema metadata only to a field equal to the one it would
    # write itself, and it writes nullable fields.
    nullable = col.kind in _STRUCT_KINDS
    return pa.field(col.name, arrow_type(col), nullable=nullable, metadata=meta)


def _encoded_files(values) -> pa.Array | pa.ChunkedArray:
    """`{bytes, path: null}` structs of encoded files (chunked where the bytes pass 2 GiB)."""
    data = pa.array([bytes(v) if isinstance(v, memoryview) else v for v in values], type=pa.binary())
    chunks = [
        pa.StructArray.from_arrays([c, pa.nulls(len(c), pa.string())], fields=list(ENCODED_FILE))
        for c in (data.chunks if isinstance(data, pa.ChunkedArray) else [data])
    ]
    return chunks[0] if len(chunks) == 1 else pa.chunked_array(chunks, ENCODED_FILE)


def _to_arrow(col: Column, value) -> pa.Array | pa.ChunkedArray:
    if col.kind == "tensor":
        arr = tensor_to_storage(as_cpu_tensor(col.name, value)).view(_numpy_storage(col))
        out = pa.array(arr.reshape(-1), type=_ARROW_STORAGE[col.dtype])
        for size in reversed(col.shape):
            out = pa.FixedSizeListArray.from_arrays(
                out, type=pa.list_(pa.field("element", out.type, nullable=False), size)
            )
        return out
    if col.kind == "string":
        return pa.array(value, type=pa.large_string())
    if col.kind == "json":
        return pa.array([json_text(col.name, i, v) for i, v in enumerate(value)], type=pa.large_string())
    if col.kind in ("image", "video"):
        return _encoded_files(value)
    if col.kind in FILE_LIST_KINDS:
        rows = [[{"bytes": bytes(b), "path": None} for b in row] for row in value]
        return pa.array(rows, type=arrow_type(col))
    if col.kind == "video_list":
        rows = [[[{"bytes": bytes(b), "path": None} for b in video] for video in row] for row in value]
        return pa.array(rows, type=arrow_type(col))
    return pa.array([bytes(v) if isinstance(v, memoryview) else v for v in value], type=pa.large_binary())


def _leaves(col: Column) -> list[str]:
    """The Parquet leaf column paths of a column (what compression and encodings are set on)."""
    if col.kind == "tensor":
        return [col.name + ".list.element" * len(col.shape)]
    if col.kind in _STRUCT_KINDS:
        prefix = col.name + ".list.element" * _STRUCT_DEPTH[col.kind]
        return [f"{prefix}.bytes", f"{prefix}.path"]
    return [col.name]


def _compression(col: Column) -> str:
    if col.kind in _STRUCT_KINDS or (
        col.kind == "tensor" and col.dtype in _FLOATS and col.dtype != "bfloat16"
    ):
        return "none"
    return "zstd"


def encode(batch: Batch, columns: list[Column], sink, shard_index: int) -> int:
    """Write one shard to the file object `sink`; returns its row count."""
    n = batch_num_rows(batch)
    features = datasets_features(columns)
    metadata = {"huggingface": json.dumps({"info": {"features": features}})} if features else None
    schema = pa.schema([_field(c) for c in columns], metadata=metadata)
    table = pa.Table.from_arrays([_to_arrow(c, batch[c.name]) for c in columns], schema=schema)
    per_row = table.nbytes / n if n else 1
    text = [c.name for c in columns if c.kind in ("string", "json")]
    compression = {leaf: _compression(c) for c in columns for leaf in _leaves(c)}
    pq.write_table(
        table,
        sink,
        row_group_size=max(1, int(ROW_GROUP_BYTES // max(per_row, 1))),
        compression=compression,
        compression_level={leaf: ZSTD_LEVEL for leaf, codec in compression.items() if codec == "zstd"}
        or None,
        use_dictionary=text,
        write_statistics=text + [c.name for c in columns if c.kind == "tensor" and not c.shape],
        write_page_index=True,
        store_schema=True,
    )
    return n


def _tensor(col: Column, chunk: pa.Array, where: str) -> torch.Tensor:
    if isinstance(chunk, pa.FixedShapeTensorArray):  # schema version 1
        arr = chunk.to_numpy_ndarray()
    elif chunk.type != arrow_type(col):
        raise CorruptShardError(
            f"{where}: column '{col.name}' is {chunk.type}, the manifest says {col.dtype}{list(col.shape)}"
        )
    else:
        flat = chunk
        for _ in col.shape:
            flat = flat.flatten()
        arr = flat.to_numpy(zero_copy_only=True).reshape(len(chunk), *col.shape)
    if arr.dtype != _numpy_storage(col) or tuple(arr.shape[1:]) != col.shape:
        raise CorruptShardError(
            f"{where}: column '{col.name}' holds {arr.dtype}{list(arr.shape[1:])}, "
            f"the manifest says {col.dtype}{list(col.shape)}"
        )
    return storage_to_tensor(arr, col.dtype)


def _file_bytes(col: Column, chunk: pa.Array, where: str) -> list[bytes]:
    """The encoded files of an image or video column (a struct column, or plain binary before)."""
    if pa.types.is_struct(chunk.type):
        chunk = chunk.flatten()[chunk.type.get_field_index("bytes")]
    if chunk.null_count:
        raise CorruptShardError(f"{where}: column '{col.name}' has a row without file bytes")
    return chunk.to_pylist()


def table_to_batch(table: pa.Table, columns: list[Column], where: str) -> Batch:
    """Convert one row group's table to a batch; tensor columns are zero-copy views."""
    out: Batch = {}
    for col in columns:
        chunked = table.column(col.name)
        chunk = chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()
        if col.kind == "tensor":
            out[col.name] = _tensor(col, chunk, where)
        elif col.kind == "json":
            out[col.name] = [json.loads(s) for s in chunk.to_pylist()]
        elif col.kind in ("image", "video"):
            out[col.name] = _file_bytes(col, chunk, where)
        elif col.kind in FILE_LIST_KINDS:
            if chunk.null_count:
                raise CorruptShardError(f"{where}: column '{col.name}' has a null row")
            files = iter(_file_bytes(col, chunk.flatten(), where))
            out[col.name] = [[next(files) for _ in range(n)] for n in chunk.value_lengths().to_pylist()]
        elif col.kind == "video_list":
            videos = chunk.flatten()
            if chunk.null_count or videos.null_count:
                raise CorruptShardError(f"{where}: column '{col.name}' has a null row or video")
            files = iter(_file_bytes(col, videos.flatten(), where))
            frames = iter(videos.value_lengths().to_pylist())
            out[col.name] = [
                [[next(files) for _ in range(next(frames))] for _ in range(n)]
                for n in chunk.value_lengths().to_pylist()
            ]
        else:
            out[col.name] = chunk.to_pylist()
    return out


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 1)), thread_name_prefix="omnirl-parquet")
    return _pool


def decode(buf: pa.Buffer, columns: list[Column], num_rows: int, where: str) -> Batch:
    """Read the requested columns of one Parquet shard held in `buf`.

    A shard of one row group is returned without copying tensor data. Several row groups are
    decoded in parallel, each copied into its slice of a preallocated [rows, *shape] tensor.
    """
    meta = pq.ParquetFile(pa.BufferReader(buf)).metadata
    if meta.num_rows != num_rows:
        raise CorruptShardError(f"{where}: has {meta.num_rows} rows, the manifest says {num_rows}")
    names = set(meta.schema.to_arrow_schema().names)
    for col in columns:
        if col.name not in names:
            raise CorruptShardError(
                f"{where}: column '{col.name}' listed in the manifest is missing from the file"
            )
    wanted = [c.name for c in columns]

    def read(group: int) -> Batch:
        pf = pq.ParquetFile(pa.BufferReader(buf), metadata=meta)
        return table_to_batch(pf.read_row_group(group, columns=wanted, use_threads=False), columns, where)

    if meta.num_row_groups == 1:
        return read(0)
    # numpy, not torch.empty: numpy asks for transparent huge pages, which makes first touch ~5x faster
    out: Batch = {
        c.name: storage_to_tensor(np.empty((num_rows, *c.shape), dtype=_numpy_storage(c)), c.dtype)
        for c in columns
        if c.kind == "tensor"
    }
    starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])

    def read_into(group: int) -> Batch:
        part = read(group)
        for name, t in out.items():
            t[starts[group] : starts[group + 1]].copy_(part.pop(name))
        return part

    parts = list(_executor().map(read_into, range(meta.num_row_groups)))
    for col in columns:
        if col.kind != "tensor":
            out[col.name] = [v for p in parts for v in p[col.name]]
    return {c.name: out[c.name] for c in columns}
