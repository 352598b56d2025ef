"""modded-nanogpt ``.bin`` shards: 256 int32 header (magic, version, count), uint16 tokens."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mobius_fed.data.errors import DataError

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


def write_shard(path: str | os.PathLike[str], tokens: Sequence[int] | np.ndarray) -> Path:
    """Atomically write ``tokens`` (each in [0, 65535]) as a shard at ``path``."""
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"{path}: tokens must be 1-D, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 65536):
        raise DataError(
            f"{path}: token ids must be in [0, 65535] for uint16 shards "
            f"(got min {int(arr.min())}, max {int(arr.max())})"
        )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, arr.size
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(arr.astype("<u2").tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_shard(path: str | os.PathLike[str]) -> np.ndarray:
    """Return the shard's tokens as a read-only uint16 array (memory-mapped)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: shard file not found")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path}: file too short for header ({size} < {HEADER_BYTES} bytes)")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, count = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise DataError(f"{path}: bad magic {magic} (expected {MAGIC})")
    if version != VERSION:
        raise DataError(f"{path}: unsupported version {version} (expected {VERSION})")
    if count < 0:
        raise DataError(f"{path}: negative token count {count}")
    expected = HEADER_BYTES + 2 * count
    if size != expected:
        what = "truncated" if size < expected else "oversized"
        raise DataError(
            f"{path}: {what}: {size} bytes, header says {count} tokens ({expected} bytes)"
        )
    if count == 0:
        empty = np.zeros(0, dtype=np.uint16)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
