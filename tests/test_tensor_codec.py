"""The tensor wire form of rollout protocol v1: exact round trips, little-endian bytes, strict checks."""

from __future__ import annotations

import base64
import struct

import pytest
import torch

from stages.sample.tensor_codec import DTYPES, CodecError, decode_tensor, encode_tensor


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _bits(t: torch.Tensor) -> list[int]:
    """The tensor's bytes (any dtype, any shape, empty included)."""
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.reshape(-1))
    return flat.view(torch.uint8).tolist() if t.numel() else []


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3, 4), (1, 2, 1, 3)])
def test_every_dtype_and_shape_round_trips_bit_for_bit(name: str, shape: tuple[int, ...]) -> None:
    tensor = _sample(DTYPES[name][0], shape)
    obj = encode_tensor(tensor)
    assert obj["dtype"] == name and obj["shape"] == list(shape) and obj["encoding"] == "base64"
    back = decode_tensor(obj, "t", shape=list(shape), dtype=name)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    # bitwise equal (NaN-free here, but compare the raw bytes to be strict, bf16 included)
    assert _bits(back) == _bits(tensor)


def test_bytes_are_little_endian_c_order() -> None:
    t = torch.tensor([[1.0, -2.5], [3.0, 0.25]], dtype=torch.float32).t()  # not contiguous
    raw = base64.b64decode(encode_tensor(t)["data"])
    assert raw == struct.pack("<4f", 1.0, 3.0, -2.5, 0.25)
    bf = encode_tensor(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    assert base64.b64decode(bf["data"]) == struct.pack("<2H", 0x3F80, 0xC000)  # raw bf16 words
    i = encode_tensor(torch.tensor([1, -2], dtype=torch.int64))
    assert base64.b64decode(i["data"]) == struct.pack("<2q", 1, -2)


def test_non_finite_values_are_refused_unless_allowed() -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            obj = encode_tensor(torch.tensor([0.0, bad], dtype=dtype))
            with pytest.raises(CodecError, match="latents: holds NaN"):
                decode_tensor(obj, "latents")
            assert not torch.isfinite(decode_tensor(obj, "x", allow_nonfinite=True)).all()


def test_malformed_objects_are_refused_naming_the_tensor() -> None:
    good = encode_tensor(torch.zeros(2, 3))
    cases = {
        "not a tensor object": [1, 2],
        "dtype 'complex64'": {**good, "dtype": "complex64"},
        "shape": {**good, "shape": [2, -3]},
        "bytes for shape": {**good, "shape": [2, 4]},
        "not valid base64": {**good, "data": "@@@"},
        "encoding": {**good, "encoding": "hex"},
        "more than": {**good, "shape": [2**20, 2**20]},
        "not a base64 string": {**good, "data": None},
    }
    for message, obj in cases.items():
        with pytest.raises(CodecError, match=message) as info:
            decode_tensor(obj, "final_latent")
        assert str(info.value).startswith("final_latent:")
    with pytest.raises(CodecError, match=r"shape \[2, 3\], expected \[2, '\*', 4\]"):
        decode_tensor(good, "x", shape=[2, None, 4])
    with pytest.raises(CodecError, match="dtype float32, expected float16"):
        decode_tensor(good, "x", dtype="float16")
    assert decode_tensor(good, "x", shape=[None, 3]).shape == (2, 3)


def test_a_dtype_without_wire_form_is_refused() -> None:
    with pytest.raises(CodecError, match="no wire form"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))
