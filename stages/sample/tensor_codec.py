"""Tensors as JSON: ``{"dtype", "shape", "encoding": "base64", "data"}``, never pickle.

``data`` holds the tensor's C-order bytes, little-endian, base64-encoded; bfloat16 travels as its raw
2-byte words. In a msgpack body (`stages.web.pack_binary`) the same object has ``"encoding": "raw"``
and the bytes themselves, a third smaller and without the base64 work. Decoding checks everything a peer could get wrong or forge: the dtype is one of `DTYPES`,
the shape a list of non-negative ints within `max_elements`, the byte count equal to
shape × item size, and (unless allowed) every float value finite. A bad tensor raises `CodecError`
naming it, which a server answers with 400 and a client reports as a protocol error.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

ENCODING = "base64"
RAW = "raw"  # the bytes themselves, in a binary (msgpack) body
# wire name → (torch dtype, little-endian numpy dtype of the bytes)
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "<f4"),
    "float64": (torch.float64, "<f8"),
    "float16": (torch.float16, "<f2"),
    "bfloat16": (torch.bfloat16, "<u2"),  # the raw words, reinterpreted on the torch side
    "int64": (torch.int64, "<i8"),
    "int32": (torch.int32, "<i4"),
    "int16": (torch.int16, "<i2"),
    "int8": (torch.int8, "i1"),
    "uint8": (torch.uint8, "u1"),
    "bool": (torch.bool, "?"),
}
_NAMES = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}
MAX_ELEMENTS = 2**31  # no tensor of the protocol comes near; a larger claimed shape is refused unread


class CodecError(ValueError):
    """A tensor object that does not decode (its name and what is wrong, one line)."""


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """`tensor` (any device, a dtype of `DTYPES`) as a JSON-able object."""
    if tensor.dtype not in _NAMES:
        raise CodecError(f"dtype {tensor.dtype} has no wire form; use one of {', '.join(DTYPES)}")
    name = _NAMES[tensor.dtype]
    flat = tensor.detach().cpu().contiguous()
    if name == "bfloat16":
        flat = flat.view(torch.int16)
    array = flat.numpy().astype(DTYPES[name][1].replace("u2", "i2"), copy=False)
    return {
        "dtype": name,
        "shape": list(tensor.shape),
        "encoding": ENCODING,
        "data": base64.b64encode(array.tobytes()).decode("ascii"),
    }


def decode_tensor(
    obj: Any,
    name: str,
    *,
    shape: Sequence[int | None] | None = None,
    dtype: str | None = None,
    allow_nonfinite: bool = False,
    max_elements: int = MAX_ELEMENTS,
) -> torch.Tensor:
    """The tensor an `encode_tensor` object holds, checked; `name` names it in a `CodecError`.

    shape: the expected shape (None entries match any size); dtype: the expected wire dtype.
    """
    if not isinstance(obj, dict):
        raise CodecError(f"{name}: not a tensor object {{dtype, shape, encoding, data}}")
    wire, dims, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    encoding = obj.get("encoding", ENCODING)
    if encoding not in (ENCODING, RAW):
        raise CodecError(f"{name}: encoding {encoding!r}, expected {ENCODING!r} or {RAW!r}")
    if wire not in DTYPES:
        raise CodecError(f"{name}: dtype {wire!r} is not one of {', '.join(DTYPES)}")
    if dtype is not None and wire != dtype:
        raise CodecError(f"{name}: dtype {wire}, expected {dtype}")
    if (
        not isinstance(dims, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims)
        or len(dims) > 16
    ):
        raise CodecError(f"{name}: shape {dims!r} is not a list of non-negative integers")
    if shape is not None and (
        len(dims) != len(shape) or any(e is not None and d != e for d, e in zip(dims, shape))
    ):
        expected = ["*" if e is None else e for e in shape]
        raise CodecError(f"{name}: shape {dims}, expected {expected}")
    count = math.prod(dims)
    if count > max_elements:
        raise CodecError(f"{name}: shape {dims} holds {count} values, more than {max_elements}")
    if encoding == RAW:
        if not isinstance(data, bytes):
            raise CodecError(f"{name}: data of a raw tensor is not bytes")
        raw = data
    elif not isinstance(data, str):
        raise CodecError(f"{name}: data is not a base64 string")
    else:
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise CodecError(f"{name}: data is not valid base64") from None
    layout = DTYPES[wire][1]
    itemsize = np.dtype(layout).itemsize
    if len(raw) != count * itemsize:
        raise CodecError(f"{name}: {len(raw)} bytes for shape {dims} of {wire} ({count * itemsize} expected)")
    array = np.frombuffer(raw, dtype=layout).astype(layout[1:] if layout[0] == "<" else layout)
    if wire == "bfloat16":
        tensor = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array.copy())
    tensor = tensor.reshape(dims)
    if not allow_nonfinite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise CodecError(f"{name}: holds NaN or ±inf values")
    return tensor
