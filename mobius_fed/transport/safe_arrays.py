"""Decode Flower arrays from the wire without trusting them (docs/security.md "Nothing read
from disk or the wire runs code").

Why Flower's decode is not enough: ``np.load(BytesIO(data), allow_pickle=False)`` still opens
``.npz`` archives and allocates from the header's shape before reading a byte, nobody compares
the Array's declared ``dtype``/``shape`` with the ``.npy`` header, and ``param.copy_`` then
silently broadcasts a ``(1,)`` tensor over a matrix and casts float64 to float32.

Here the header is parsed by hand (``ast.literal_eval`` of a dict with exactly ``descr``,
``fortran_order``, ``shape``); only plain numeric dtypes; the payload must be exactly
``prod(shape) * itemsize`` bytes and agree with the declared dtype and shape (and, when
given, the receiver's expected names, shapes, dtypes); values come from ``np.frombuffer``.
"""

from __future__ import annotations

import ast
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

NUMPY_STYPE = "numpy.ndarray"
NPY_MAGIC = b"\x93NUMPY"
MAX_HEADER_BYTES = 65_536
ALLOWED_KINDS = frozenset("biuf" + "c")
"""numpy dtype kinds accepted: bool, signed/unsigned int, float, complex."""

Spec = Mapping[str, tuple[tuple[int, ...], str]]
"""name -> (shape, numpy dtype name such as ``"float32"``)."""


class UnsafeArrayError(ValueError):
    """An array on the wire is malformed, of a forbidden type, or not what was expected."""


def _fail(name: str, why: str) -> UnsafeArrayError:
    return UnsafeArrayError(f"array {name!r}: {why}")


def _same_dtype(dtype: np.dtype, declared: object) -> bool:
    try:
        return np.dtype(str(declared)) == dtype
    except (TypeError, ValueError):
        return False


def parse_npy(
    data: bytes | bytearray | memoryview, name: str = "?"
) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """Validate an ``.npy`` buffer; return ``(dtype, shape, fortran_order, data_offset)``.

    Raises :class:`UnsafeArrayError` for anything but a version 1-3 ``.npy`` of a plain
    numeric dtype whose payload is exactly ``prod(shape) * itemsize`` bytes.
    """
    buf = memoryview(data).cast("B")
    if len(buf) < 10 or bytes(buf[:6]) != NPY_MAGIC:
        head = bytes(buf[:4])
        what = (
            "a zip archive (.npz)"
            if head.startswith(b"PK")
            else ("a pickle" if head[:1] == b"\x80" else "not an .npy buffer")
        )
        raise _fail(name, f"data is {what}; only a plain .npy array is accepted")
    major, minor = buf[6], buf[7]
    if (major, minor) == (1, 0):
        hlen, start = int.from_bytes(buf[8:10], "little"), 10
    elif (major, minor) in ((2, 0), (3, 0)):
        if len(buf) < 12:
            raise _fail(name, "truncated .npy header")
        hlen, start = int.from_bytes(buf[8:12], "little"), 12
    else:
        raise _fail(name, f"unsupported .npy version {major}.{minor}")
    if hlen > MAX_HEADER_BYTES or start + hlen > len(buf):
        raise _fail(name, f".npy header of {hlen} bytes does not fit the {len(buf)}-byte buffer")
    try:
        text = bytes(buf[start : start + hlen]).decode("utf-8" if major == 3 else "latin-1")
        header = ast.literal_eval(text)
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
        raise _fail(name, f"unreadable .npy header ({type(exc).__name__})") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise _fail(name, "the .npy header must be a dict of descr, fortran_order and shape")
    descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    if not isinstance(descr, str):
        raise _fail(name, "structured dtypes are not accepted")
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError):
        raise _fail(name, f"unknown dtype {descr!r}") from None
    if dtype.kind not in ALLOWED_KINDS or dtype.hasobject or dtype.fields or dtype.subdtype:
        raise _fail(name, f"dtype {descr!r} is not a plain numeric dtype")
    if not isinstance(fortran, bool):
        raise _fail(name, "fortran_order must be a bool")
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _fail(name, f"bad shape {shape!r}")
    payload = len(buf) - (start + hlen)
    expected = math.prod(shape) * dtype.itemsize
    if payload != expected:
        raise _fail(
            name,
            f"payload is {payload} bytes but shape {shape} of {dtype.name} needs {expected}",
        )
    return dtype, shape, fortran, start + hlen


def array_to_numpy(array: Any, name: str = "?") -> np.ndarray:
    """A Flower Array as a fresh, writable, native-endian ndarray, checked end to end."""
    for field in ("dtype", "shape", "stype", "data"):
        if not hasattr(array, field):
            raise _fail(name, f"not a Flower Array (no {field})")
    if array.stype != NUMPY_STYPE:
        raise _fail(name, f"serialization {array.stype!r} is not {NUMPY_STYPE!r}")
    if not isinstance(array.data, bytes | bytearray | memoryview):
        raise _fail(name, "data is not bytes")
    dtype, shape, fortran, offset = parse_npy(array.data, name)
    declared = tuple(array.shape)
    if shape != declared:
        raise _fail(name, f".npy header shape {shape} differs from the declared shape {declared}")
    if not _same_dtype(dtype, array.dtype):
        raise _fail(name, f".npy header dtype {dtype.str} differs from the declared {array.dtype}")
    flat = np.frombuffer(array.data, dtype=dtype, offset=offset, count=math.prod(shape))
    out = flat.reshape(shape, order="F" if fortran else "C")
    native = dtype.newbyteorder("=")
    return np.ascontiguousarray(out, dtype=native).copy()


def validate_array_record(
    record: Any, *, expected: Spec | None = None, max_total_bytes: int | None = None
) -> None:
    """Check every Array of a Flower ArrayRecord without decoding it.

    ``expected`` (from :func:`spec_of`) also pins the exact set of names, and each
    array's shape and dtype. ``max_total_bytes`` bounds the sum of the payloads.
    """
    if not isinstance(record, Mapping):
        raise UnsafeArrayError(f"not an ArrayRecord: {type(record).__name__}")
    if expected is not None:
        missing = sorted(set(expected) - set(record))
        extra = sorted(set(record) - set(expected))
        if missing or extra:
            raise UnsafeArrayError(
                f"ArrayRecord names differ from the expected ones: missing {missing[:5]}, "
                f"unexpected {extra[:5]}"
            )
    total = 0
    for name, array in record.items():
        if not isinstance(name, str):
            raise UnsafeArrayError(f"ArrayRecord key {name!r} is not a string")
        if (stype := getattr(array, "stype", None)) != NUMPY_STYPE:
            raise _fail(name, f"serialization {stype!r} is not {NUMPY_STYPE!r}")
        dtype, shape, _, _ = parse_npy(array.data, name)
        if shape != tuple(array.shape) or not _same_dtype(dtype, array.dtype):
            raise _fail(
                name,
                f".npy header ({dtype.name}, {shape}) differs from the declared "
                f"({array.dtype}, {tuple(array.shape)})",
            )
        if expected is not None:
            want_shape, want_dtype = expected[name]
            if shape != tuple(want_shape) or dtype.name != want_dtype:
                raise _fail(
                    name, f"({dtype.name}, {shape}), expected ({want_dtype}, {tuple(want_shape)})"
                )
        total += len(array.data)
        if max_total_bytes is not None and total > max_total_bytes:
            raise UnsafeArrayError(f"ArrayRecord exceeds {max_total_bytes} bytes")


def validate_message_arrays(message: Any, *, max_total_bytes: int | None = None) -> None:
    """Validate every ArrayRecord in a Flower Message's content (format only)."""
    content = getattr(message, "content", None)
    if content is None:
        return
    for key, record in content.items():
        if type(record).__name__ == "ArrayRecord":
            try:
                validate_array_record(record, max_total_bytes=max_total_bytes)
            except UnsafeArrayError as exc:
                raise UnsafeArrayError(f"message record {key!r}: {exc}") from None


def spec_of(state_dict: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The expected names, shapes and numpy dtype names of a torch ``state_dict``."""
    import torch

    spec = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: not a tensor")
        spec[name] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
    return spec


def array_record_to_torch(record: Any, *, expected: Spec | None = None) -> OrderedDict[str, Any]:
    """The safe replacement of ``ArrayRecord.to_torch_state_dict()``."""
    import torch

    validate_array_record(record, expected=expected)
    return OrderedDict(
        (name, torch.from_numpy(array_to_numpy(a, name))) for name, a in record.items()
    )
