"""Tensor <-> ``ring_pb2.Tensor`` codec and frame validation for ring links (the wire format
and its checks: docs/architecture.md §7).

Encode: :func:`encode_tensor`/:func:`make_frame` cast to the wire dtype on CPU (no copy if
already so) and copy the raw little-endian bytes once (protobuf copies again).
:func:`encode_frames`, what a ring link sends, builds each frame's bytes in one ``b"".join``
from the tensor's memory (CRC over a memoryview); each piece parses to what
:func:`make_frame` builds for it.

Decode: everything is checked before a tensor exists (finiteness right after).
:func:`parse_frame` parses with protobuf except the tensor data, a zero-copy view of the
received buffer (a repeated ``tensor`` or ``tensor.data`` is refused: protobuf would merge
them). :class:`TensorAssembler` checks each piece's header order, total, offset and size and
hands out a key's preallocated tensor only after its last piece validated. On upb
``msg.data`` is a fresh ``bytes`` per access: :func:`decode_tensor` reads it once and wraps it
with ``torch.frombuffer`` (fp32 aliases that private copy; bf16/fp16 are widened anew).
"""

from __future__ import annotations

import math
import sys
import warnings
import zlib
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
from google.protobuf.message import DecodeError

from mobius_fed.proto import ring_pb2
from mobius_fed.transport.compress import Codec, CodecError

try:  # ISA-L's CRC-32: the same values as zlib.crc32, ~50x faster (optional: pip install isal)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32

WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
WIRE_TO_ENUM: dict[str, ring_pb2.DType] = {
    "fp32": ring_pb2.FLOAT32,
    "bf16": ring_pb2.BFLOAT16,
    "fp16": ring_pb2.FLOAT16,
}
ENUM_TO_WIRE: dict[int, str] = {v: k for k, v in WIRE_TO_ENUM.items()}
_SWAP_VIEW = {2: torch.int16, 4: torch.int32}

# torch.frombuffer warns once per process that a bytes buffer is not writable. Aliasing the
# private copy decode_tensor wraps is deliberate: spend that one warning here, silenced, at
# import (under the import lock: no thread races on the filters). Nobody else sees it either.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0\0\0\0", dtype=torch.uint8)


class FrameError(ValueError):
    """A received frame or tensor failed validation; the frame must be dropped."""


class NonFiniteError(FrameError):
    """A received tensor holds NaN or ±Inf (a receiver counts it against its sender)."""


def _wire_name(wire: str) -> str:
    if wire not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {wire!r}; expected one of {sorted(WIRE_DTYPES)}")
    return wire


def _wire_tensor(t: torch.Tensor, wire: str) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor of the wire dtype in little-endian memory order."""
    dtype = WIRE_DTYPES[_wire_name(wire)]
    t = t.detach().to(device="cpu", dtype=dtype).contiguous()
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        swapped = t.view(_SWAP_VIEW[t.element_size()]).numpy().byteswap()
        t = torch.from_numpy(swapped).view(dtype)
    return t


def _fill_tensor(dst: ring_pb2.Tensor, t: torch.Tensor, wire: str) -> None:
    t = _wire_tensor(t, wire)
    dst.dtype = WIRE_TO_ENUM[wire]
    dst.shape[:] = list(t.shape)
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""  # the one copy
    dst.data = data
    dst.crc32 = _crc32(data)


def encode_tensor(t: torch.Tensor, wire: str) -> ring_pb2.Tensor:
    """Encode ``t`` as a wire tensor of dtype ``wire`` ("fp32", "bf16" or "fp16")."""
    msg = ring_pb2.Tensor()
    _fill_tensor(msg, t, wire)
    return msg


def _check_meta(
    msg: ring_pb2.Tensor, expected_shape: tuple[int, ...], expected_dtype: str
) -> tuple[torch.dtype, tuple[int, ...], int]:
    """Check dtype and (full) shape; return (wire torch dtype, shape, numel)."""
    _wire_name(expected_dtype)
    wire = ENUM_TO_WIRE.get(msg.dtype)
    if wire is None:
        raise FrameError(f"tensor rejected: unknown dtype enum {msg.dtype}")
    if wire != expected_dtype:
        raise FrameError(f"tensor rejected: dtype {wire} (expected {expected_dtype})")
    shape = tuple(msg.shape)
    if shape != tuple(expected_shape):
        raise FrameError(f"tensor rejected: shape {shape} (expected {tuple(expected_shape)})")
    return WIRE_DTYPES[wire], shape, math.prod(shape)


def _check_crc(data: bytes | memoryview, msg: ring_pb2.Tensor) -> None:
    crc = _crc32(data)
    if crc != msg.crc32:
        raise FrameError(f"tensor rejected: crc32 {crc:#010x} (expected {msg.crc32:#010x})")


def _from_wire(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    t = torch.frombuffer(data, dtype=dtype)  # zero-copy view of `data`
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        t = torch.from_numpy(t.view(_SWAP_VIEW[dtype.itemsize]).numpy().byteswap()).view(dtype)
    return t


def _check_finite(t: torch.Tensor) -> None:
    # A finite sum proves every element finite (NaN and ±Inf propagate) at ~1/50 the cost
    # of isfinite(t).all(); only a non-finite sum (or an overflow) needs the full check.
    # Half pieces are summed in fp32 so that large-but-finite values rarely overflow.
    total = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
    if not bool(torch.isfinite(total)) and not bool(torch.isfinite(t).all()):
        raise NonFiniteError("tensor rejected: non-finite values (NaN or Inf)")


def decode_tensor(
    msg: ring_pb2.Tensor,
    *,
    expected_shape: tuple[int, ...],
    expected_dtype: str,
    out_dtype: torch.dtype = torch.float32,
    data: bytes | memoryview | None = None,
) -> torch.Tensor:
    """Validate and decode a wire tensor; raise :class:`FrameError` on any mismatch.

    ``data``: the tensor's bytes when they were kept out of ``msg`` (:func:`parse_frame`);
    the result may then alias that buffer (fp32).
    """
    dtype, shape, numel = _check_meta(msg, expected_shape, expected_dtype)
    if data is None:
        data = msg.data  # upb returns a fresh bytes copy per access: read it once
    want = numel * dtype.itemsize
    if len(data) != want:
        raise FrameError(f"tensor rejected: {len(data)} data bytes (expected {want})")
    _check_crc(data, msg)
    if numel == 0:
        return torch.empty(shape, dtype=out_dtype)
    t = _from_wire(data, dtype).view(shape).to(out_dtype)
    _check_finite(t)
    return t


def direction_name(value: int) -> str:
    """A frame direction's name (FORWARD, BACKWARD, …), or its number when unknown."""
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
    expected = dict(run_id=run_id, step=step, origin=origin, tick=tick, micro=micro)
    for field, want in expected.items():
        got = getattr(frame, field)
        if got != want:
            raise FrameError(f"frame rejected: {field} {got!r} (expected {want!r})")
    if frame.direction != direction:
        raise FrameError(
            f"frame rejected: direction {direction_name(frame.direction)} "
            f"(expected {direction_name(direction)})"
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
        run_id=run_id,
        step=step,
        origin=origin,
        tick=tick,
        micro=micro,
        direction=cast(ring_pb2.Direction, direction),
        chunks=1,
    )
    _fill_tensor(frame.tensor, tensor, wire)
    return frame


# ------------------------------------------------------------------ chunked wire bytes

CHUNK_BYTES = 1 << 20
"""Default largest tensor payload per frame: bigger tensors travel as several pieces."""

HEADER_SLACK = 64 << 10
"""Room for a frame's header fields (run id, key, shape, CRC, framing) next to its piece."""


def max_message_bytes(chunk_bytes: int = CHUNK_BYTES) -> int:
    """The largest ring message a link accepts: one piece of ``chunk_bytes`` plus headers."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    return chunk_bytes + HEADER_SLACK


MAX_PENDING = 16
"""Most tensors one stream may have partially received at once (a sender interleaves at
most a few: its step executor and its relays)."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_TENSOR_FIELD = b"\x3a"  # Frame.tensor: field 7, length-delimited
_DATA_FIELD = b"\x1a"  # Tensor.data: field 3, length-delimited
_CRC_FIELD = b"\x20"  # Tensor.crc32: field 4, varint


def chunk_count(numel: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """How many frames a tensor of ``numel`` elements travels in."""
    per = max(1, chunk_bytes // itemsize)
    return max(1, -(-numel // per))


def encode_frames(
    *,
    run_id: str,
    step: int,
    origin: int,
    tick: int,
    micro: int,
    direction: int,
    phase: int = ring_pb2.TRAIN,
    tensor: torch.Tensor,
    wire: str = "fp32",
    chunk_bytes: int = CHUNK_BYTES,
    packed: tuple[str, tuple[int, ...]] | None = None,
) -> Iterator[bytes]:
    """Yield the serialized bytes of the frame(s) carrying ``tensor`` in dtype ``wire``.

    One frame if the tensor's wire bytes fit in ``chunk_bytes``, else ``chunks`` frames of
    at most ``chunk_bytes`` each (a whole number of elements, at least one), built lazily:
    the caller hands each to the transport while the next is built.

    ``packed=(codec spec, shape)``: ``tensor`` is a lossy codec's flat ``uint8`` payload
    for a tensor of that shape (sent as dtype PACKED; ``wire`` is ignored).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    t = _packed_payload(tensor) if packed is not None else _wire_tensor(tensor, wire)
    numel, itemsize = t.numel(), t.element_size()
    per = max(1, chunk_bytes // itemsize)
    chunks = chunk_count(numel, itemsize, chunk_bytes)
    mem = t.reshape(-1).view(torch.uint8).numpy().data if numel else memoryview(b"")
    header = ring_pb2.Frame(
        run_id=run_id,
        step=step,
        origin=origin,
        tick=tick,
        micro=micro,
        direction=cast(ring_pb2.Direction, direction),
        phase=cast(ring_pb2.Phase, phase),
        chunks=chunks,
    )
    if packed is not None:
        meta = ring_pb2.Tensor(dtype=ring_pb2.PACKED, shape=list(packed[1]), codec=packed[0])
    else:
        meta = ring_pb2.Tensor(dtype=WIRE_TO_ENUM[wire], shape=list(t.shape))
    for k in range(chunks):
        a, b = k * per, min(numel, (k + 1) * per)
        piece = mem[a * itemsize : b * itemsize]
        header.chunk = k
        meta.offset = a
        head = meta.SerializeToString()
        data_hdr = _DATA_FIELD + _varint(len(piece))
        tail = _CRC_FIELD + _varint(_crc32(piece))  # over the memoryview: no copy
        size = len(head) + len(data_hdr) + len(piece) + len(tail)
        yield b"".join(
            (header.SerializeToString(), _TENSOR_FIELD, _varint(size), head, data_hdr, piece, tail)
        )


def _packed_payload(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach().to(device="cpu").reshape(-1).contiguous()
    if t.dtype != torch.uint8:
        raise ValueError(f"a packed payload must be uint8, got {t.dtype}")
    return t


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FrameError("frame rejected: not a Frame message (truncated or bad varint)")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _split_field(buf: bytes, lo: int, hi: int, field: int, what: str):
    """Walk the fields in ``buf[lo:hi]``; return (the other fields' bytes, span of the one
    length-delimited ``field`` or None). A repeated ``field`` is refused: protobuf would
    merge the copies, which no encoder of ours produces."""
    rest: list[bytes] = []
    span: tuple[int, int] | None = None
    pos = lo
    while pos < hi:
        start = pos
        tag, pos = _read_varint(buf, pos)
        kind = tag & 7
        if kind == 0:
            _, pos = _read_varint(buf, pos)
        elif kind == 1:
            pos += 8
        elif kind == 5:
            pos += 4
        elif kind == 2:
            size, pos = _read_varint(buf, pos)
            if tag >> 3 == field:
                if span is not None:
                    raise FrameError(f"frame rejected: {what} appears twice")
                span = (pos, pos + size)
                pos += size
                if pos > hi:
                    break
                continue  # kept out of the other fields' bytes
            pos += size
        else:
            raise FrameError(f"frame rejected: not a Frame message (wire type {kind})")
        if pos > hi:
            break
        rest.append(buf[start:pos])
    if pos != hi:
        raise FrameError("frame rejected: not a Frame message (truncated field)")
    return b"".join(rest), span


def parse_frame(raw: bytes) -> tuple[ring_pb2.Frame, memoryview | None]:
    """Parse serialized ``Frame`` bytes, leaving the tensor's data in place.

    Returns the frame with every field except ``tensor.data`` (parsed by protobuf itself)
    and a zero-copy view of the data bytes (None when the frame has no tensor). Saves the
    two copies ``Frame.FromString`` + ``.data`` would make of every tensor byte.
    """
    head, tspan = _split_field(raw, 0, len(raw), 7, "field tensor")
    try:
        frame = ring_pb2.Frame.FromString(head)
        if tspan is None:
            return frame, None
        meta, dspan = _split_field(raw, tspan[0], tspan[1], 3, "field tensor.data")
        frame.tensor.SetInParent()
        frame.tensor.MergeFromString(meta)
    except DecodeError as exc:
        raise FrameError(f"frame rejected: not a Frame message ({exc})") from exc
    view = memoryview(raw)
    return frame, (view[dspan[0] : dspan[1]] if dspan else view[0:0])


def _piece_start(part, msg, k: int, n: int, total: int, nbytes: int, size: int, what: str) -> int:
    """Where piece ``k`` of ``n`` of a ``total``-element tensor of ``size``-byte elements
    starts (in elements): where the last ended. Its ``nbytes`` are whole elements, at least
    one, and leave every later piece one or more; the last piece ends at ``total``."""
    start = part.next_offset if part is not None else 0
    if msg.offset != start:
        raise FrameError(
            f"tensor rejected: offset {msg.offset} in chunk {k} of {n} for {what} "
            f"(expected {start})"
        )
    room = total - start - (n - 1 - k)
    count, rest = divmod(nbytes, size)
    if rest or count == 0 or count > room or (k == n - 1 and count != room):
        if size == 1:
            want = f"{room}" if k == n - 1 else f"1..{room}"
            raise FrameError(
                f"tensor rejected: {nbytes} payload bytes in chunk {k} of {n} for {what} "
                f"(expected {want})"
            )
        want = f"{room * size}" if k == n - 1 else f"a multiple of {size}, 1..{room * size}"
        raise FrameError(
            f"tensor rejected: {nbytes} data bytes in chunk {k} of {n} for {what} (expected {want})"
        )
    return start


@dataclass
class _Partial:
    chunks: int
    next_chunk: int = 0
    next_offset: int = 0
    out: torch.Tensor | None = None  # flat, preallocated; None when only validating


class TensorAssembler:
    """Validates the tensor pieces arriving on one stream and reassembles them per key.

    One assembler per stream: pieces of one tensor travel on one stream, in order, but may
    be interleaved with other tensors' pieces. :meth:`add` raises :class:`FrameError` on
    the first thing wrong; the stream must then be dropped (with every partial tensor).
    """

    def __init__(
        self,
        expected_shape: tuple[int, ...],
        expected_dtype: str,
        *,
        out_dtype: torch.dtype = torch.float32,
        max_pending: int = MAX_PENDING,
        codec: Codec | None = None,
    ) -> None:
        self.shape, self.wire = tuple(expected_shape), _wire_name(expected_dtype)
        self.out_dtype, self.max_pending = out_dtype, max_pending
        self.codec = codec if codec is not None and not codec.lossless else None
        self._pending: dict[Hashable, _Partial] = {}

    @property
    def pending(self) -> int:
        """Tensors with some but not all pieces received."""
        return len(self._pending)

    def add(
        self,
        key: Hashable,
        frame: ring_pb2.Frame,
        *,
        keep: bool = True,
        what: str = "",
        data: bytes | memoryview | None = None,
    ) -> torch.Tensor | None:
        """Validate one piece; return the whole tensor once its last piece is in.

        ``keep=False`` (a relay): validate only, nothing is allocated or returned. ``what``
        names the tensor in error messages. ``data``: the piece's bytes when
        :func:`parse_frame` kept them out of ``frame`` (default: ``frame.tensor.data``).
        """
        try:
            return self._add(key, frame, keep, what or str(key), data)
        except FrameError:
            self._pending.pop(key, None)
            raise

    def _add(self, key: Hashable, frame: ring_pb2.Frame, keep: bool, what: str, data):
        part = self._check_order(key, frame.chunk, frame.chunks, what)
        if not frame.HasField("tensor"):
            raise FrameError("frame rejected: no tensor")
        if data is None:
            data = frame.tensor.data  # upb returns a fresh bytes copy per access: read it once
        if self.codec is not None:
            return self._add_packed(key, part, frame, keep, what, data)
        msg = frame.tensor
        if frame.chunks == 1:  # a whole tensor in one frame: the codec's own checks and messages
            if msg.offset != 0:
                raise FrameError(f"tensor rejected: offset {msg.offset} (expected 0)")
            t = decode_tensor(
                msg,
                expected_shape=self.shape,
                expected_dtype=self.wire,
                out_dtype=self.out_dtype,
                data=data,
            )
            return t if keep else None
        return self._add_chunk(key, part, frame, keep, what, data)

    def _check_order(self, key: Hashable, k: int, n: int, what: str) -> _Partial | None:
        """Piece ``k`` of ``n`` must be the next one of its tensor; its partial, if any."""
        part = self._pending.get(key)
        if n == 0:
            raise FrameError(f"frame rejected: chunks 0 for {what} (expected ≥ 1)")
        if k >= n:
            raise FrameError(f"frame rejected: chunk {k} of chunks {n} for {what}")
        if part is None:
            if k != 0:
                raise FrameError(
                    f"frame rejected: chunk {k} of {n} for {what} out of order "
                    f"(expected chunk 0: earlier pieces missing)"
                )
            return None
        if n != part.chunks:
            raise FrameError(
                f"frame rejected: chunks {n} for {what} (expected {part.chunks}, as in its chunk 0)"
            )
        if k < part.next_chunk:
            raise FrameError(
                f"frame rejected: duplicate chunk {k} of {n} for {what} "
                f"(expected chunk {part.next_chunk})"
            )
        if k > part.next_chunk:
            raise FrameError(
                f"frame rejected: chunk {k} of {n} for {what} out of order "
                f"(expected chunk {part.next_chunk}: missing)"
            )
        return part

    def _add_chunk(self, key, part: _Partial | None, frame: ring_pb2.Frame, keep, what, data):
        """One piece of a tensor sent in several frames, copied into its preallocated home."""
        k, n, msg = frame.chunk, frame.chunks, frame.tensor
        dtype, shape, numel = _check_meta(msg, self.shape, self.wire)
        if n > numel:
            raise FrameError(
                f"frame rejected: chunks {n} for {what} (a tensor of {numel} elements)"
            )
        size = dtype.itemsize
        start = _piece_start(part, msg, k, n, numel, len(data), size, what)
        _check_crc(data, msg)
        piece = _from_wire(data, dtype)
        _check_finite(piece)
        if part is None:
            part = self._new_partial(key, what, n, keep, numel, self.out_dtype)
        return self._advance(key, part, k, start, piece, shape)

    def _advance(self, key: Hashable, part: _Partial, k: int, start: int, piece, shape):
        """Piece ``k`` is in: copied to element ``start`` of its home; the whole tensor
        (viewed as ``shape``) after the last piece."""
        if part.out is not None:
            part.out[start : start + piece.numel()].copy_(piece)
        part.next_chunk, part.next_offset = k + 1, start + piece.numel()
        if k < part.chunks - 1:
            return None
        del self._pending[key]
        return part.out.view(shape) if part.out is not None else None

    def _new_partial(
        self, key: Hashable, what: str, chunks: int, keep: bool, numel: int, dtype: torch.dtype
    ) -> _Partial:
        """Room for one more partial tensor (its ``numel`` elements allocated if ``keep``)."""
        if len(self._pending) >= self.max_pending:
            raise FrameError(
                f"frame rejected: {what} would be the {len(self._pending) + 1}th partially "
                f"received tensor on this stream (at most {self.max_pending})"
            )
        out = torch.empty(numel, dtype=dtype) if keep else None
        part = self._pending[key] = _Partial(chunks=chunks, out=out)
        return part

    def _add_packed(self, key, part: _Partial | None, frame: ring_pb2.Frame, keep, what, data):
        """One piece of a codec payload: dtype, codec, shape, byte range and CRC are checked
        per piece; the whole payload is decoded (size, finiteness) once its last piece is
        in."""
        codec, msg = self.codec, frame.tensor
        assert codec is not None
        k, n = frame.chunk, frame.chunks
        if msg.dtype != ring_pb2.PACKED:
            got = ENUM_TO_WIRE.get(msg.dtype, f"enum {msg.dtype}")
            raise FrameError(f"tensor rejected: dtype {got} (expected PACKED {codec.spec})")
        if msg.codec != codec.spec:
            raise FrameError(f"tensor rejected: codec {msg.codec!r} (expected {codec.spec!r})")
        if tuple(msg.shape) != self.shape:
            raise FrameError(f"tensor rejected: shape {tuple(msg.shape)} (expected {self.shape})")
        total = codec.payload_bytes(self.shape)
        if n > total:
            raise FrameError(f"frame rejected: chunks {n} for {what} (a {total}-byte payload)")
        start = _piece_start(part, msg, k, n, total, len(data), 1, what)
        _check_crc(data, msg)
        if part is None:
            part = self._new_partial(key, what, n, keep, total, torch.uint8)
        piece = torch.frombuffer(data, dtype=torch.uint8)
        out = self._advance(key, part, k, start, piece, (total,))
        if out is None:
            return None
        try:
            return codec.decode(out, self.shape).to(self.out_dtype)
        except CodecError as exc:
            kind = NonFiniteError if "non-finite" in str(exc) else FrameError
            raise kind(f"tensor rejected: {exc}") from exc
