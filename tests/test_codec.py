"""Tensor codec round trips, every rejection, and the decode copy story."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from mobius_fed.proto import ring_pb2
from mobius_fed.transport.codec import (
    CHUNK_BYTES,
    WIRE_DTYPES,
    FrameError,
    TensorAssembler,
    chunk_count,
    decode_tensor,
    encode_frames,
    encode_tensor,
    make_frame,
    parse_frame,
    validate_frame,
)

SHAPE = (2, 3, 5)


def _x() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * 3


def test_fp32_roundtrip_is_bitwise_exact() -> None:
    x = _x()
    y = decode_tensor(encode_tensor(x, "fp32"), expected_shape=SHAPE, expected_dtype="fp32")
    assert y.dtype == torch.float32 and y.shape == SHAPE
    assert torch.equal(x.view(torch.int32), y.view(torch.int32))


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_half_roundtrip_equals_torch_cast(wire: str) -> None:
    x = _x()
    msg = encode_tensor(x, wire)
    assert len(msg.data) == x.numel() * 2
    y = decode_tensor(msg, expected_shape=SHAPE, expected_dtype=wire)
    assert y.dtype == torch.float32
    assert torch.equal(y, x.to(WIRE_DTYPES[wire]).float())
    z = decode_tensor(msg, expected_shape=SHAPE, expected_dtype=wire, out_dtype=WIRE_DTYPES[wire])
    assert torch.equal(z, x.to(WIRE_DTYPES[wire]))


def test_encode_accepts_noncontiguous_and_grad_tensors() -> None:
    x = _x().requires_grad_()
    t = x.transpose(0, 2)
    y = decode_tensor(
        encode_tensor(t, "fp32"), expected_shape=tuple(t.shape), expected_dtype="fp32"
    )
    assert torch.equal(y, t.detach())


def test_empty_tensor_roundtrip() -> None:
    y = decode_tensor(
        encode_tensor(torch.empty(0, 4), "bf16"), expected_shape=(0, 4), expected_dtype="bf16"
    )
    assert y.shape == (0, 4)


def _decode(msg: ring_pb2.Tensor) -> torch.Tensor:
    return decode_tensor(msg, expected_shape=SHAPE, expected_dtype="fp32")


def test_reject_wrong_dtype() -> None:
    with pytest.raises(FrameError, match=r"dtype bf16 \(expected fp32\)"):
        _decode(encode_tensor(_x(), "bf16"))


def test_reject_unknown_dtype_enum() -> None:
    msg = encode_tensor(_x(), "fp32")
    msg.dtype = 42  # proto3 open enum: unknown values survive parsing
    msg = ring_pb2.Tensor.FromString(msg.SerializeToString())
    with pytest.raises(FrameError, match="unknown dtype enum 42"):
        _decode(msg)
    msg.dtype = ring_pb2.DTYPE_UNSPECIFIED
    with pytest.raises(FrameError, match="unknown dtype enum 0"):
        _decode(msg)


def test_reject_wrong_shape() -> None:
    with pytest.raises(FrameError, match=r"shape \(2, 15\) \(expected \(2, 3, 5\)\)"):
        _decode(encode_tensor(_x().reshape(2, 15), "fp32"))


def test_reject_wrong_byte_length() -> None:
    msg = encode_tensor(_x(), "fp32")
    msg.data = msg.data[:-4]
    with pytest.raises(FrameError, match=r"116 data bytes \(expected 120\)"):
        _decode(msg)


def test_reject_bad_crc() -> None:
    msg = encode_tensor(_x(), "fp32")
    data = bytearray(msg.data)
    data[7] ^= 0x01
    msg.data = bytes(data)
    with pytest.raises(FrameError, match="crc32"):
        _decode(msg)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16"])
def test_reject_non_finite(bad: float, wire: str) -> None:
    x = _x()
    x[1, 2, 3] = bad
    with pytest.raises(FrameError, match="non-finite"):
        decode_tensor(encode_tensor(x, wire), expected_shape=SHAPE, expected_dtype=wire)


def test_fp16_overflow_is_rejected_as_non_finite() -> None:
    x = torch.full(SHAPE, 1e6)  # > fp16 max: the cast makes inf, the receiver refuses it
    with pytest.raises(FrameError, match="non-finite"):
        decode_tensor(encode_tensor(x, "fp16"), expected_shape=SHAPE, expected_dtype="fp16")


def test_unknown_wire_name_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown wire dtype"):
        encode_tensor(_x(), "int8")


class _FixedBuffer:
    """Duck-typed ring_pb2.Tensor whose ``data`` is one fixed bytes object."""

    def __init__(self, msg: ring_pb2.Tensor) -> None:
        self.dtype, self.shape, self.crc32 = msg.dtype, list(msg.shape), msg.crc32
        self.data = msg.data


def test_fp32_decode_is_zero_copy() -> None:
    # Copy story: the upb accessor `msg.data` makes a fresh bytes object per access
    # (asserted below); decode reads it once and torch.frombuffer wraps it without a copy.
    msg = encode_tensor(_x(), "fp32")
    assert msg.data is not msg.data
    fixed = _FixedBuffer(msg)
    addr = np.frombuffer(fixed.data, dtype=np.uint8).ctypes.data
    y = decode_tensor(fixed, expected_shape=SHAPE, expected_dtype="fp32")  # type: ignore[arg-type]
    assert y.data_ptr() == addr
    assert torch.equal(y, _x())


def test_half_decode_widens_into_new_tensor() -> None:
    fixed = _FixedBuffer(encode_tensor(_x(), "bf16"))
    addr = np.frombuffer(fixed.data, dtype=np.uint8).ctypes.data
    y = decode_tensor(fixed, expected_shape=SHAPE, expected_dtype="bf16")  # type: ignore[arg-type]
    assert not (addr <= y.data_ptr() < addr + len(fixed.data))


HEADER = {
    "run_id": "run-a",
    "step": 6,
    "origin": 2,
    "tick": 9,
    "micro": 1,
    "direction": ring_pb2.FORWARD,
}


def _frame(**over: object) -> ring_pb2.Frame:
    return make_frame(**{**HEADER, **over}, tensor=_x(), wire="bf16")  # type: ignore[arg-type]


def test_make_and_validate_frame_roundtrip() -> None:
    frame = ring_pb2.Frame.FromString(_frame().SerializeToString())
    validate_frame(frame, **HEADER)  # type: ignore[arg-type]
    y = decode_tensor(frame.tensor, expected_shape=SHAPE, expected_dtype="bf16")
    assert torch.equal(y, _x().bfloat16().float())


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("run_id", "run-b", "run_id 'run-b' (expected 'run-a')"),
        ("step", 7, "step 7 (expected 6)"),
        ("origin", 0, "origin 0 (expected 2)"),
        ("tick", 10, "tick 10 (expected 9)"),
        ("micro", 0, "micro 0 (expected 1)"),
        ("direction", ring_pb2.BACKWARD, "direction BACKWARD (expected FORWARD)"),
    ],
)
def test_validate_frame_rejects(field: str, bad: object, message: str) -> None:
    with pytest.raises(
        FrameError, match="frame rejected: " + message.replace("(", r"\(").replace(")", r"\)")
    ):
        validate_frame(_frame(**{field: bad}), **HEADER)  # type: ignore[arg-type]


def test_validate_frame_rejects_missing_tensor() -> None:
    frame = ring_pb2.Frame(**HEADER)  # type: ignore[arg-type]
    with pytest.raises(FrameError, match="no tensor"):
        validate_frame(frame, **HEADER)  # type: ignore[arg-type]


# ------------------------------------------------------------------ chunked wire bytes


def _pieces(x: torch.Tensor, wire: str = "fp32", chunk_bytes: int = 40) -> list[ring_pb2.Frame]:
    return [
        ring_pb2.Frame.FromString(b)
        for b in encode_frames(**HEADER, tensor=x, wire=wire, chunk_bytes=chunk_bytes)  # type: ignore[arg-type]
    ]


def test_single_frame_bytes_parse_to_make_frame() -> None:
    for wire in WIRE_DTYPES:
        (raw,) = encode_frames(**HEADER, tensor=_x(), wire=wire)  # type: ignore[arg-type]
        assert ring_pb2.Frame.FromString(raw) == make_frame(**HEADER, tensor=_x(), wire=wire)  # type: ignore[arg-type]


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16"])
def test_pieces_reassemble_bitwise(wire: str) -> None:
    x = _x()  # 30 elements; 40-byte pieces: 10 (fp32) or 20 (half) elements each
    pieces = _pieces(x, wire)
    per = 40 // WIRE_DTYPES[wire].itemsize
    assert len(pieces) == chunk_count(30, WIRE_DTYPES[wire].itemsize, 40) == -(-30 // per)
    for k, p in enumerate(pieces):
        assert (p.chunk, p.chunks, p.tensor.offset) == (k, len(pieces), k * per)
        assert tuple(p.tensor.shape) == SHAPE and p.phase == ring_pb2.TRAIN
        piece = x.reshape(-1)[k * per : (k + 1) * per]  # each piece is what make_frame makes
        ref = make_frame(**HEADER, tensor=piece, wire=wire).tensor  # type: ignore[arg-type]
        assert (p.tensor.data, p.tensor.crc32) == (ref.data, ref.crc32)
    asm = TensorAssembler(SHAPE, wire)
    out = [asm.add("k", p) for p in pieces]
    assert out[:-1] == [None] * (len(pieces) - 1) and asm.pending == 0
    assert out[-1] is not None and out[-1].dtype == torch.float32 and out[-1].shape == SHAPE
    assert torch.equal(out[-1], x.to(WIRE_DTYPES[wire]).float())


def test_relay_validates_without_keeping() -> None:
    asm = TensorAssembler(SHAPE, "fp32")
    assert [asm.add("k", p, keep=False) for p in _pieces(_x())] == [None] * 3
    bad = _x()
    bad[1, 2, 3] = float("inf")
    with pytest.raises(FrameError, match="non-finite"):
        for p in _pieces(bad):
            asm.add("k", p, keep=False)


def test_interleaved_keys_and_pending_limit() -> None:
    asm = TensorAssembler(SHAPE, "fp32", max_pending=2)
    a, b, c = _pieces(_x()), _pieces(_x() * 2), _pieces(_x() * 3)
    asm.add("a", a[0])
    asm.add("b", b[0])
    with pytest.raises(FrameError, match="at most 2"):
        asm.add("c", c[0])
    asm.add("a", a[1])
    asm.add("b", b[1])
    assert torch.equal(asm.add("b", b[2]), _x() * 2)  # type: ignore[arg-type]
    assert torch.equal(asm.add("a", a[2]), _x())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: [p[1]], "chunk 1 of 3 for k out of order"),
        (lambda p: [p[0], p[0]], "duplicate chunk 0 of 3"),
        (lambda p: [p[0], p[2]], r"expected chunk 1: missing"),
        (lambda p: [p[0], _set(p[1], chunks=4)], r"chunks 4 for k \(expected 3"),
        (lambda p: [_set(p[0], chunks=0)], "chunks 0"),
        (lambda p: [_set(p[0], chunk=3)], "chunk 3 of chunks 3"),
        (lambda p: [_set(p[0], chunks=31)], "chunks 31 for k"),
        (lambda p: [p[0], _off(p[1], 9)], r"offset 9 in chunk 1 of 3 for k \(expected 10\)"),
        (lambda p: [_off(p[0], 1)], r"offset 1 in chunk 0 of 3"),
        (lambda p: [p[0], p[1], _cut(p[2], 4)], r"36 data bytes in chunk 2 of 3 for k"),
        (lambda p: [p[0], _cut(p[1], 2)], r"38 data bytes in chunk 1 of 3"),
        (lambda p: [_cut(p[0], 40)], r"0 data bytes in chunk 0 of 3"),
        (lambda p: [_crc(p[0])], "crc32"),
    ],
)
def test_bad_pieces_are_rejected(mutate, message: str) -> None:
    asm = TensorAssembler(SHAPE, "fp32")
    frames = mutate(_pieces(_x()))
    with pytest.raises(FrameError, match=message):
        for f in frames:
            asm.add("k", f)
    assert asm.pending == 0, "a rejected tensor's partial state is dropped"


def test_single_frame_with_offset_is_rejected() -> None:
    (f,) = _pieces(_x(), chunk_bytes=CHUNK_BYTES)
    with pytest.raises(FrameError, match=r"offset 3 \(expected 0\)"):
        TensorAssembler(SHAPE, "fp32").add("k", _off(f, 3))


def _set(f: ring_pb2.Frame, **fields: int) -> ring_pb2.Frame:
    f = ring_pb2.Frame.FromString(f.SerializeToString())
    for k, v in fields.items():
        setattr(f, k, v)
    return f


def _off(f: ring_pb2.Frame, offset: int) -> ring_pb2.Frame:
    f = _set(f)
    f.tensor.offset = offset
    return f


def _cut(f: ring_pb2.Frame, n: int) -> ring_pb2.Frame:
    f = _set(f)
    f.tensor.data = f.tensor.data[:-n] if n < len(f.tensor.data) else b""
    f.tensor.crc32 = zlib.crc32(f.tensor.data)
    return f


def _crc(f: ring_pb2.Frame) -> ring_pb2.Frame:
    f = _set(f)
    f.tensor.crc32 ^= 1
    return f


def test_parse_frame_keeps_data_in_place() -> None:
    for f in [*_pieces(_x()), make_frame(**HEADER, tensor=_x()), ring_pb2.Frame(**HEADER)]:  # type: ignore[arg-type]
        raw = f.SerializeToString()
        head, data = parse_frame(raw)
        assert head.tensor.data == b"" and head.HasField("tensor") == f.HasField("tensor")
        if data is None:
            assert not f.HasField("tensor")
            continue
        assert data.obj is raw and bytes(data) == f.tensor.data  # a view, no copy
        head.tensor.data = bytes(data)
        assert head == f
    (raw,) = encode_frames(**HEADER, tensor=torch.empty(0, 3))  # type: ignore[arg-type]
    head, data = parse_frame(raw)
    assert data is not None and len(data) == 0 and tuple(head.tensor.shape) == (0, 3)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (make_frame(**HEADER, tensor=_x()).SerializeToString()[:-3], "truncated"),  # type: ignore[arg-type]
        (b"\xff" * 12, "not a Frame message"),
        (b"\x0b", "wire type 3"),
        (b"\x0a\x02\xff\xfe", "not a Frame message"),  # run_id: invalid UTF-8
        (b"\x3a\x00\x3a\x00", "field tensor appears twice"),
        (b"\x3a\x04\x1a\x00\x1a\x00", "field tensor.data appears twice"),
        (b"\x3a\x03\x08\x01", "truncated"),  # tensor longer than the frame
    ],
)
def test_parse_frame_rejects_malformed(raw: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        parse_frame(raw)
