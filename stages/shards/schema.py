"""Column kinds, logical tensor dtypes and schema inference for in-memory batches.

A batch is a dict of equally long columns: a tensor column is a `torch.Tensor` [N, *shape]; a
string column a `list[str]`; a json column a list of JSON-serialisable values; binary, image and
video columns are lists of already-encoded bytes (raw / PNG or JPEG / MP4); an image_list column
holds a list of encoded image files per row (`list[list[bytes]]`, possibly empty), an audio_list
column likewise a list of encoded audio files (WAV, FLAC, MP3, ...); a video_list column a list of
videos per row, each a non-empty list of encoded frame images (`list[list[list[bytes]]]`).

A video column's rows share one geometry, read from each MP4's index when the column is written
(`stages.media.video.probe_mp4`): its `shape` is (frames, height, width) and its `fps` the frame rate.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stages.errors import UserInputError

Batch = dict[str, Any]

KINDS = ("tensor", "string", "json", "binary", "image", "video", "image_list", "audio_list", "video_list")
BYTES_KINDS = ("binary", "image", "video")
FILE_LIST_KINDS = ("image_list", "audio_list")  # a list of encoded files per row
_BYTES = (bytes, bytearray, memoryview)


@dataclass(frozen=True)
class TensorDType:
    """A logical tensor dtype, its torch dtype and the numpy dtype its bits are stored as.

    Arrow and npy have no bfloat16, so bf16 is stored as its uint16 bit pattern.
    """

    name: str
    torch: torch.dtype
    storage: np.dtype


TENSOR_DTYPES: dict[str, TensorDType] = {
    d.name: d
    for d in (
        TensorDType("float64", torch.float64, np.dtype(np.float64)),
        TensorDType("float32", torch.float32, np.dtype(np.float32)),
        TensorDType("float16", torch.float16, np.dtype(np.float16)),
        TensorDType("bfloat16", torch.bfloat16, np.dtype(np.uint16)),
        TensorDType("int64", torch.int64, np.dtype(np.int64)),
        TensorDType("int32", torch.int32, np.dtype(np.int32)),
        TensorDType("int16", torch.int16, np.dtype(np.int16)),
        TensorDType("int8", torch.int8, np.dtype(np.int8)),
        TensorDType("uint8", torch.uint8, np.dtype(np.uint8)),
        TensorDType("bool", torch.bool, np.dtype(np.bool_)),
    )
}
_BY_TORCH = {d.torch: d for d in TENSOR_DTYPES.values()}


@dataclass(frozen=True)
class Column:
    """One column of a shard set: its kind, for tensors the logical dtype and per-row shape, for videos
    the per-row (frames, height, width) and the frame rate.

    `shape` is the shape of ONE row; () is a scalar per row.
    """

    name: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    fps: float | None = None

    def to_json(self) -> dict:
        """Plain-JSON form stored in the manifest and in shard completion records."""
        out = {"name": self.name, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape)}
        if self.fps is not None:
            out["fps"] = self.fps
        return out

    @classmethod
    def from_json(cls, d: dict) -> Column:
        """Inverse of `to_json`; raises ValueError/KeyError/TypeError on malformed input."""
        fps = d.get("fps")
        col = cls(
            str(d["name"]),
            str(d["kind"]),
            d.get("dtype"),
            tuple(int(s) for s in d.get("shape", ())),
            None if fps is None else float(fps),
        )
        if col.kind not in KINDS:
            raise ValueError(f"unknown column kind {col.kind!r}")
        if (col.kind == "tensor") != (col.dtype in TENSOR_DTYPES):
            raise ValueError(f"column {col.name!r}: kind {col.kind!r} with dtype {col.dtype!r}")
        if col.fps is not None and col.kind != "video":
            raise ValueError(f"column {col.name!r}: only a video column has an fps")
        return col

    @property
    def tensor_dtype(self) -> TensorDType:
        """The logical dtype of a tensor column."""
        return TENSOR_DTYPES[self.dtype]  # type: ignore[index]


def validate_column_name(name: object) -> str:
    """Column names end up in tar member names and Parquet paths: no '/', NUL or leading '__'."""
    if not isinstance(name, str) or not name or "/" in name or "\x00" in name or name.startswith("__"):
        raise UserInputError(
            f"column name {name!r} is not allowed: use a non-empty string without '/' that does not start with '__'"
        )
    return name


def as_cpu_tensor(name: str, value: Any) -> torch.Tensor:
    """A tensor column as a contiguous CPU tensor [N, *shape] (numpy arrays are accepted too)."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    t = value.detach()
    if t.dim() == 0:
        raise UserInputError(
            f"column '{name}': a tensor column needs a leading row dimension, got a 0-d tensor"
        )
    if t.dtype not in _BY_TORCH:
        raise UserInputError(
            f"column '{name}': tensor dtype {t.dtype} is not supported; use one of {', '.join(TENSOR_DTYPES)}"
        )
    return t.cpu().contiguous()


def tensor_to_storage(t: torch.Tensor) -> np.ndarray:
    """The storage-dtype numpy view [N, *shape] of a contiguous CPU tensor (no copy)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def storage_to_tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch view of a storage-dtype numpy array, reinterpreted as the logical dtype (no copy).

    Arrays decoded from Arrow are read-only: the returned tensor shares that memory, so callers
    must `clone()` before modifying it in place (torch cannot mark a tensor read-only).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(a)
    want = TENSOR_DTYPES[dtype].torch
    if t.dtype == want:
        return t
    if want == torch.bfloat16:
        return t.view(torch.int16).view(torch.bfloat16)
    return t.view(want)


def column_length(name: str, value: Any) -> int:
    """Number of rows in one column value."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            raise UserInputError(f"column '{name}': a tensor column needs a leading row dimension")
        return int(value.shape[0])
    if isinstance(value, (list, tuple)):
        return len(value)
    raise UserInputError(
        f"column '{name}': unsupported value of type {type(value).__name__}; "
        "use a torch.Tensor [N, ...] or a list of str / bytes / JSON values"
    )


def batch_num_rows(batch: Batch) -> int:
    """Rows in a batch; every column must have the same length."""
    n = None
    first = None
    for name, value in batch.items():
        length = column_length(name, value)
        if n is None:
            n, first = length, name
        elif length != n:
            raise UserInputError(
                f"column '{name}' has {length} rows but column '{first}' has {n}; all columns need one row per sample"
            )
    return n or 0


def _infer_list_kind(name: str, items: list | tuple) -> str:
    if not items:
        raise UserInputError(
            f"column '{name}' is empty so its kind cannot be inferred; pass kinds={{'{name}': ...}}"
        )
    if all(isinstance(v, str) for v in items):
        return "string"
    is_bytes = [isinstance(v, _BYTES) for v in items]
    if all(is_bytes):
        return "binary"
    if any(is_bytes):
        raise UserInputError(
            f"column '{name}' mixes bytes with other values; a bytes column must hold only bytes"
        )
    return "json"


def _check_list_kind(name: str, items: list | tuple, kind: str) -> None:
    if kind == "string" and not all(isinstance(v, str) for v in items):
        raise UserInputError(f"column '{name}' is declared string but holds non-str values")
    if kind in BYTES_KINDS and not all(isinstance(v, _BYTES) for v in items):
        raise UserInputError(f"column '{name}' is declared {kind} but holds values that are not bytes")
    if kind in FILE_LIST_KINDS and not all(
        isinstance(v, (list, tuple)) and all(isinstance(b, _BYTES) for b in v) for v in items
    ):
        raise UserInputError(
            f"column '{name}' is declared {kind} but a row is not a list of encoded file bytes"
        )
    if kind == "video_list" and not all(
        isinstance(v, (list, tuple))
        and all(isinstance(f, (list, tuple)) and f and all(isinstance(b, _BYTES) for b in f) for f in v)
        for v in items
    ):
        raise UserInputError(
            f"column '{name}' is declared video_list but a row is not a list of videos, "
            "each a non-empty list of encoded frame images"
        )
    if kind == "tensor":
        raise UserInputError(
            f"column '{name}' is declared tensor but is a list; pass a torch.Tensor [N, ...]"
        )


def infer_columns(batch: Batch, kinds: dict[str, str] | None = None) -> list[Column]:
    """The schema of a batch, in column order; `kinds` overrides inference per column.

    Tensor -> tensor; all-str list -> string; all-bytes list -> binary (or image/video/json via
    `kinds`); any other list (dicts, lists, numbers, None) -> json; a list of lists of image bytes
    is image_list (and one level deeper video_list) only when declared. Bytes in a json column are
    taken as UTF-8 JSON text.
    """
    kinds = kinds or {}
    if not batch:
        raise UserInputError("the batch has no columns; a shard needs at least one column")
    for name, kind in kinds.items():
        if kind not in KINDS:
            raise UserInputError(f"column '{name}': unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    batch_num_rows(batch)
    columns = []
    for name, value in batch.items():
        validate_column_name(name)
        kind = kinds.get(name)
        if isinstance(value, (torch.Tensor, np.ndarray)):
            if kind not in (None, "tensor"):
                raise UserInputError(f"column '{name}' is declared {kind} but is a tensor")
            t = as_cpu_tensor(name, value)
            columns.append(Column(name, "tensor", _BY_TORCH[t.dtype].name, tuple(t.shape[1:])))
            continue
        if kind is None:
            kind = _infer_list_kind(name, value)
        else:
            _check_list_kind(name, value, kind)
        columns.append(_video_column(name, value) if kind == "video" else Column(name, kind))
    return columns


def _video_column(name: str, rows: list | tuple) -> Column:
    """A video column with the geometry and frame rate every row's MP4 index gives (all equal)."""
    from stages.media.video import MediaDecodeError, probe_mp4

    first = None
    for i, data in enumerate(rows):
        try:
            info = probe_mp4(bytes(data))
        except MediaDecodeError as exc:
            raise UserInputError(f"column '{name}' row {i}: {exc}") from None
        geometry = ((info.frames, info.height, info.width), info.fps)
        if first is None:
            first = geometry
        elif geometry != first:
            (f0, h0, w0), fps0 = first
            raise UserInputError(
                f"column '{name}' row {i} is {info.frames} frames of {info.width}×{info.height} at {info.fps:g} fps, "
                f"row 0 {f0} frames of {w0}×{h0} at {fps0:g} fps; the videos of a column share one geometry"
            )
    shape, fps = first or ((), None)
    return Column(name, "video", shape=shape, fps=fps)


def json_text(name: str, row: int, value: Any) -> str:
    """The JSON text stored for one json-column value (bytes are taken as UTF-8 JSON text)."""
    try:
        if isinstance(value, (bytes, bytearray, memoryview)):
            text = bytes(value).decode("utf-8")
            json.loads(text)
            return text
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise UserInputError(f"column '{name}' row {row}: value is not JSON-serialisable ({e})") from e
