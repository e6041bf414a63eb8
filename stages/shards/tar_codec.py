"""WebDataset (tar) encoding of one shard, and a fast reader for it.

Each row is a sample with key `<shard:05d>_<row:09d>` (no dots); each column is one member
`<key>.<column>.<ext>`: tensors as `.npy` (bf16 as uint16 bits, no pickle), strings `.txt`, JSON
`.json`, images `.png`, videos `.mp4`, other bytes `.bin`; an image_list (audio_list) row is one
member per image (clip), `<key>.<column>.<i>.<ext>` (ext from the file's magic bytes, none for an
empty list), a video_list row one member per frame, `<key>.<column>.<i>.<j>.<ext>` (video i, frame
j), so a row needs at least one member of another column. Headers are deterministic (mtime 0,
uid 0), so equal batches give byte-identical tars. The reader walks the tar headers once and
copies each row's npy payload straight into a preallocated [N, *shape] tensor.
"""

from __future__ import annotations

import io
import json
import math
import tarfile

import numpy as np
import pyarrow as pa

from stages.errors import CorruptShardError, UserInputError
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

SUFFIX = "tar"
EXTENSIONS = {
    "tensor": "npy",
    "string": "txt",
    "json": "json",
    "image": "png",
    "video": "mp4",
    "binary": "bin",
}
_IMAGE_MAGIC = ((b"\x89PNG", "png"), (b"\xff\xd8", "jpg"), (b"GIF8", "gif"), (b"BM", "bmp"))
_AUDIO_MAGIC = ((b"RIFF", "wav"), (b"fLaC", "flac"), (b"OggS", "ogg"), (b"ID3", "mp3"), (b"\xff\xfb", "mp3"))
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE


def sample_key(shard_index: int, row: int) -> str:
    """The WebDataset `__key__` of a row."""
    return f"{shard_index:05d}_{row:09d}"


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The exact header `numpy.save` writes (format 1.0) for a C-ordered array."""
    buf = io.BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, d)
    return buf.getvalue()


def _member_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def image_extension(data: bytes) -> str:
    """The usual file extension of an encoded image, from its magic bytes ("img" when unknown)."""
    head = bytes(data[:12])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return next((ext for magic, ext in _IMAGE_MAGIC if head.startswith(magic)), "img")


def file_extension(kind: str, data: bytes) -> str:
    """The extension of one file of an image_list / video_list / audio_list row ("img" / "audio" when
    unknown)."""
    if kind != "audio_list":
        return image_extension(data)
    return next((ext for magic, ext in _AUDIO_MAGIC if bytes(data[:4]).startswith(magic)), "audio")


def _row_payloads(col: Column, value) -> tuple[bytes, list]:
    """(prefix shared by every row, per-row payload buffers) for one column."""
    if col.kind == "tensor":
        arr = tensor_to_storage(as_cpu_tensor(col.name, value))
        rows = arr.reshape(len(arr), math.prod(col.shape)).view(np.uint8)
        return npy_header(arr.dtype, col.shape), [memoryview(row) for row in rows]
    if col.kind == "string":
        return b"", [s.encode("utf-8") for s in value]
    if col.kind == "json":
        return b"", [json_text(col.name, i, v).encode("utf-8") for i, v in enumerate(value)]
    return b"", list(value)


_LIST_KINDS = (*FILE_LIST_KINDS, "video_list")


def _numbered(col: Column, row: list) -> list[tuple[str, bytes]]:
    """A list row's files with their member numbers: `i` per image (clip), `i.j` per frame j of video i."""
    if col.kind in FILE_LIST_KINDS:
        return [(str(i), data) for i, data in enumerate(row)]
    return [(f"{i}.{j}", data) for i, video in enumerate(row) for j, data in enumerate(video)]


def encode(batch: Batch, columns: list[Column], sink, shard_index: int) -> int:
    """Write one shard as a tar to the file object `sink`; returns its row count."""
    n = batch_num_rows(batch)
    payloads = [(c, *_row_payloads(c, batch[c.name])) for c in columns]
    for r in range(n):
        key = sample_key(shard_index, r)
        members = [
            (f"{key}.{col.name}.{i}.{file_extension(col.kind, data)}", b"", data)
            if col.kind in _LIST_KINDS
            else (f"{key}.{col.name}.{EXTENSIONS[col.kind]}", prefix, data)
            for col, prefix, rows in payloads
            for i, data in (_numbered(col, rows[r]) if col.kind in _LIST_KINDS else [(0, rows[r])])
        ]
        if not members:
            raise UserInputError(
                f"row {r} of shard {shard_index} has only empty image lists, which a WebDataset tar cannot "
                "hold; add a column such as sample_id"
            )
        for name, prefix, data in members:
            size = len(prefix) + memoryview(data).nbytes
            sink.write(_member_header(name, size) + prefix)
            sink.write(data)
            if size % _BLOCK:
                sink.write(bytes(_BLOCK - size % _BLOCK))
    total = sink.tell() + 2 * _BLOCK
    sink.write(bytes(2 * _BLOCK + (-total) % _RECORD))
    return n


def _foreign_npy(col: Column, data: bytes, where: str, name: str) -> np.ndarray:
    """Load an npy member whose header differs from ours (another writer), without pickle."""
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as e:
        raise CorruptShardError(f"{where}: member {name} is not a valid .npy ({e})") from e
    storage = TENSOR_DTYPES[col.dtype].storage
    if arr.dtype.newbyteorder("=") != storage.newbyteorder("=") or tuple(arr.shape) != col.shape:
        raise CorruptShardError(
            f"{where}: member {name} holds {arr.dtype}{list(arr.shape)}, the manifest says {col.dtype}{list(col.shape)}"
        )
    return np.ascontiguousarray(arr, dtype=storage)


def _members(buf: pa.Buffer, where: str):
    try:
        with tarfile.open(fileobj=pa.BufferReader(buf), mode="r:") as tf:
            for info in tf:
                if not info.isfile():
                    continue
                if info.offset_data + info.size > buf.size:
                    raise CorruptShardError(
                        f"{where}: truncated tar (member {info.name} ends past the end of the file)"
                    )
                yield info.name, info.offset_data, info.size
    except tarfile.TarError as e:
        raise CorruptShardError(f"{where}: not a readable tar ({e})") from e


def decode(buf: pa.Buffer, columns: list[Column], num_rows: int, where: str) -> Batch:
    """Read the requested columns of one tar shard held in `buf` (rows in member order)."""
    wanted = {c.name: i for i, c in enumerate(columns)}
    lists = [c.kind in _LIST_KINDS for c in columns]
    spans: list[list] = []
    keys: list[str] = []
    for name, offset, size in _members(buf, where):
        key, _, field = name.partition(".")
        column = field.rpartition(".")[0]
        if not keys or keys[-1] != key:
            keys.append(key)
            spans.append([[] if is_list else None for is_list in lists])
        i = wanted.get(column)
        if i is not None and not lists[i]:
            spans[-1][i] = (name, offset, size)
            continue
        column, _, index = column.rpartition(".")
        i = wanted.get(column)
        if i is not None and columns[i].kind in FILE_LIST_KINDS and index.isdigit():
            spans[-1][i].append(((int(index),), offset, size))
            continue
        column, _, video = column.rpartition(".")
        i = wanted.get(column)
        if i is not None and columns[i].kind == "video_list" and video.isdigit() and index.isdigit():
            spans[-1][i].append(((int(video), int(index)), offset, size))
    if len(keys) != num_rows:
        raise CorruptShardError(f"{where}: has {len(keys)} samples, the manifest says {num_rows}")
    out: Batch = {}
    for i, col in enumerate(columns):
        members = [row[i] for row in spans]
        if col.kind in FILE_LIST_KINDS:
            out[col.name] = [_image_list(col, buf, m, where, key) for key, m in zip(keys, members)]
            continue
        if col.kind == "video_list":
            out[col.name] = [_video_list(col, buf, m, where, key) for key, m in zip(keys, members)]
            continue
        missing = [k for k, m in zip(keys, members) if m is None]
        if missing:
            raise CorruptShardError(f"{where}: sample {missing[0]} has no member for column '{col.name}'")
        out[col.name] = _decode_column(col, buf, members, where)
    return out


def _image_list(col: Column, buf: pa.Buffer, members: list, where: str, key: str) -> list[bytes]:
    """One row's images from its `<key>.<column>.<i>.<ext>` members, in index order."""
    members = sorted(members)
    if [i for (i,), _, _ in members] != list(range(len(members))):
        raise CorruptShardError(f"{where}: sample {key} has gaps in the image numbers of column '{col.name}'")
    return [buf.slice(offset, size).to_pybytes() for _, offset, size in members]


def _video_list(col: Column, buf: pa.Buffer, members: list, where: str, key: str) -> list[list[bytes]]:
    """One row's videos from its `<key>.<column>.<i>.<j>.<ext>` members (video i, frame j), in order."""
    videos: list[list[bytes]] = []
    for (i, j), offset, size in sorted(members):
        if i == len(videos) and j == 0:
            videos.append([])
        elif i != len(videos) - 1 or j != len(videos[-1]):
            raise CorruptShardError(
                f"{where}: sample {key} has gaps in the video or frame numbers of column '{col.name}'"
            )
        videos[-1].append(buf.slice(offset, size).to_pybytes())
    return videos


def _decode_column(col: Column, buf: pa.Buffer, members: list, where: str):
    if col.kind == "tensor":
        dt = TENSOR_DTYPES[col.dtype]
        expected = npy_header(dt.storage, col.shape)
        arr = np.empty((len(members), *col.shape), dtype=dt.storage)
        rows = arr.reshape(len(members), math.prod(col.shape)).view(np.uint8)
        row_bytes = rows.shape[1]
        src = np.frombuffer(buf, dtype=np.uint8)
        head = pa.py_buffer(expected)
        for r, (name, offset, size) in enumerate(members):
            if size == len(expected) + row_bytes and buf.slice(offset, len(expected)).equals(head):
                start = offset + len(expected)
                rows[r] = src[start : start + row_bytes]
            else:
                member = buf.slice(offset, size).to_pybytes()
                rows[r] = _foreign_npy(col, member, where, name).reshape(-1).view(np.uint8)
        return storage_to_tensor(arr, col.dtype)
    data = [buf.slice(offset, size).to_pybytes() for _, offset, size in members]
    try:
        if col.kind == "string":
            return [d.decode("utf-8") for d in data]
        if col.kind == "json":
            return [json.loads(d) for d in data]
    except ValueError as e:
        raise CorruptShardError(f"{where}: column '{col.name}' holds invalid {col.kind} data ({e})") from e
    return data
