"""Tensor <-> ``ring_pb2.Tensor`` codec and frame validation for ring links.

Encode: cast to the wire dtype on CPU (no copy if already so), then exactly one copy of
the raw little-endian bytes into a ``bytes`` object (protobuf accepts nothing else); the
protobuf setter and serialization copy again, which Python protobuf cannot avoid.

Decode: every check (dtype, shape, byte length, CRC-32) runs before a tensor exists.
``msg.data`` on the upb protobuf backend returns a fresh ``bytes`` copy of the field on
each access; :func:`decode_tensor` reads it once and wraps that object with
``torch.frombuffer`` without copying. For fp32 wire and fp32 output the result aliases
that private ``bytes`` object (nobody else holds it, so in-place ops on the result are
harmless); bf16/fp16 are widened into a new tensor by ``.to(out_dtype)``.
"""

from __future__ import annotations

import sys
import warnings
import zlib

import torch

from mobius_fed.proto import ring_pb2

WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
WIRE_TO_ENUM: dict[str, int] = {
    "fp32": ring_pb2.FLOAT32,
    "bf16": ring_pb2.BFLOAT16,
    "fp16": ring_pb2.FLOAT16,
}
ENUM_TO_WIRE: dict[int, str] = {v: k for k, v in WIRE_TO_ENUM.items()}
_SWAP_VIEW = {2: torch.int16, 4: torch.int32}

# torch.frombuffer warns once per process (TORCH_WARN_ONCE) that a bytes buffer is not
# writable. The bytes object decode_tensor wraps is a private copy made by the protobuf
# accessor, so aliasing it is deliberate: spend that one warning here, silenced, at import
# (under the import lock, so no thread races on the warning filters). Side effect: other
# code in this process will not see that warning either.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0\0\0\0", dtype=torch.uint8)


class FrameError(ValueError):
    """A received frame or tensor failed validation; the frame must be dropped."""


def _wire_name(wire: str) -> str:
    if wire not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {wire!r}; expected one of {sorted(WIRE_DTYPES)}")
    return wire


def _fill_tensor(dst: ring_pb2.Tensor, t: torch.Tensor, wire: str) -> None:
    dtype = WIRE_DTYPES[_wire_name(wire)]
    t = t.detach().to(device="cpu", dtype=dtype).contiguous()
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        t = t.view(_SWAP_VIEW[t.element_size()]).numpy().byteswap()
        t = torch.from_numpy(t)
    dst.dtype = WIRE_TO_ENUM[wire]
    dst.shape[:] = list(t.shape)
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""  # the one copy
    dst.data = data
    dst.crc32 = zlib.crc32(data)


def encode_tensor(t: torch.Tensor, wire: str) -> ring_pb2.Tensor:
    """Encode ``t`` as a wire tensor of dtype ``wire`` ("fp32", "bf16" or "fp16")."""
    msg = ring_pb2.Tensor()
    _fill_tensor(msg, t, wire)
    return msg


def decode_tensor(
    msg: ring_pb2.Tensor,
    *,
    expected_shape: tuple[int, ...],
    expected_dtype: str,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Validate and decode a wire tensor; raise :class:`FrameError` on any mismatch."""
    _wire_name(expected_dtype)
    wire = ENUM_TO_WIRE.get(msg.dtype)
    if wire is None:
        raise FrameError(f"tensor rejected: unknown dtype enum {msg.dtype}")
    if wire != expected_dtype:
        raise FrameError(f"tensor rejected: dtype {wire} (expected {expected_dtype})")
    shape = tuple(msg.shape)
    if shape != tuple(expected_shape):
        raise FrameError(f"tensor rejected: shape {shape} (expected {tuple(expected_shape)})")
    dtype = WIRE_DTYPES[wire]
    numel = 1
    for n in shape:
        numel *= n
    data = msg.data  # upb returns a fresh bytes copy per access: read it once
    want = numel * dtype.itemsize
    if len(data) != want:
        raise FrameError(f"tensor rejected: {len(data)} data bytes (expected {want})")
    crc = zlib.crc32(data)
    if crc != msg.crc32:
        raise FrameError(f"tensor rejected: crc32 {crc:#010x} (expected {msg.crc32:#010x})")
    if numel == 0:
        return torch.empty(shape, dtype=out_dtype)
    t = torch.frombuffer(data, dtype=dtype)  # zero-copy view of `data`
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        t = torch.from_numpy(t.view(_SWAP_VIEW[dtype.itemsize]).numpy().byteswap()).view(dtype)
    t = t.view(shape).to(out_dtype)
    # A finite sum proves every element finite (NaN and ±Inf propagate) at ~1/50 the cost
    # of isfinite(t).all(); only a non-finite sum (or an overflow) needs the full check.
    if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
        raise FrameError("tensor rejected: non-finite values (NaN or Inf)")
    return t


def _direction_name(value: int) -> str:
    try:
        return ring_pb2.Direction.Name(value)
    except ValueError:
        return str(value)


def validate_frame(
    frame: ring_pb2.Frame,
    *,
    run_id: str,
    step: int,
    origin: int,
    tick: int,
    micro: int,
    direction: int,
) -> None:
    """Check a frame's header; :class:`FrameError` names the first wrong field."""
    for field, want in (
        ("run_id", run_id),
        ("step", step),
        ("origin", origin),
        ("tick", tick),
        ("micro", micro),
    ):
        got = getattr(frame, field)
        if got != want:
            raise FrameError(f"frame rejected: {field} {got!r} (expected {want!r})")
    if frame.direction != direction:
        raise FrameError(
            f"frame rejected: direction {_direction_name(frame.direction)} "
            f"(expected {_direction_name(direction)})"
        )
    if not frame.HasField("tensor"):
        raise FrameError("frame rejected: no tensor")


def make_frame(
    *,
    run_id: str,
    step: int,
    origin: int,
    tick: int,
    micro: int,
    direction: int,
    tensor: torch.Tensor,
    wire: str = "fp32",
) -> ring_pb2.Frame:
    """Build a frame, encoding ``tensor`` straight into it (no extra message copy)."""
    frame = ring_pb2.Frame(
        run_id=run_id, step=step, origin=origin, tick=tick, micro=micro, direction=direction
    )
    _fill_tensor(frame.tensor, tensor, wire)
    return frame
