"""modded-nanogpt ``.bin`` shards: a 256 int32 header, then the tokens.

Header ``[magic, version, count, width]``: version 1 is modded-nanogpt's layout (uint16
tokens, ``width`` unused); version 2 stores the token width in bytes (2 or 4) in
``header[3]``, so vocabularies above 65,536 ids fit in uint32 shards (data §shards).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from mobius_fed.data.errors import DataError

MAGIC = 20240520
VERSION = 1  # uint16 tokens (modded-nanogpt)
VERSION_WIDE = 2  # header[3] = bytes per token (2 or 4)
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
UINT16_LIMIT = 65536
_MAX_COUNT = 2**31 - 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a ``vocab_size`` vocabulary fits, else uint32."""
    return np.dtype("<u2") if vocab_size <= UINT16_LIMIT else np.dtype("<u4")


def _header(count: int, dtype: np.dtype) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    wide = dtype.itemsize == 4
    header[:4] = (MAGIC, VERSION_WIDE, count, 4) if wide else (MAGIC, VERSION, count, 0)
    return header.tobytes()


class ShardWriter:
    """Append tokens to ``path`` in bounded memory; the shard appears (atomically, by
    rename) only at :meth:`close`, so a crash never leaves a half shard under its name.

    ``sha256`` (of the whole file) and ``count`` are known after close.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        dtype: np.dtype | str = "<u2",
        expect: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype not in (np.dtype("<u2"), np.dtype("<u4")):
            raise DataError(f"{self.path}: shard dtype must be uint16 or uint32, not {dtype}")
        self.limit = UINT16_LIMIT if self.dtype.itemsize == 2 else 2**32
        self.count = 0
        self.sha256 = ""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._file.write(_header(0, self.dtype))
        # With the final count known up front (``expect``), the file's hash is built as the
        # tokens are written (header first); close() re-reads the file only if it differs.
        self._expect = expect
        self._digest = hashlib.sha256(_header(expect, self.dtype)) if expect is not None else None

    def write(self, tokens: np.ndarray | Sequence[int]) -> None:
        """Append ``tokens``; ids outside the dtype's range are refused."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"{self.path}: tokens must be 1-D, got shape {arr.shape}")
        if not arr.size:
            return
        if arr.dtype != self.dtype:
            low, high = int(arr.min()), int(arr.max())
            if low < 0 or high >= self.limit:
                raise DataError(
                    f"{self.path}: token ids must be in [0, {self.limit - 1}] for "
                    f"{'uint16' if self.limit == UINT16_LIMIT else 'uint32'} shards "
                    f"(got min {low}, max {high})"
                )
        if self.count + arr.size > _MAX_COUNT:
            raise DataError(f"{self.path}: a shard holds at most {_MAX_COUNT} tokens")
        data = np.ascontiguousarray(arr.astype(self.dtype, copy=False)).data.cast("B")
        self._file.write(data)
        if self._digest is not None:
            self._digest.update(data)
        self.count += int(arr.size)

    def close(self) -> Path:
        """Write the final header, fsync, rename into place; returns the shard's path."""
        f = self._file
        f.seek(0)
        f.write(_header(self.count, self.dtype))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        digest = self._digest
        if digest is None or self.count != self._expect:
            digest = hashlib.sha256()
            with open(self._tmp, "rb") as r:
                for block in iter(lambda: r.read(1 << 22), b""):
                    digest.update(block)
        self.sha256 = digest.hexdigest()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the unfinished file."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def write_shard(
    path: str | os.PathLike[str],
    tokens: Sequence[int] | np.ndarray,
    dtype: np.dtype | str = "<u2",
) -> Path:
    """Atomically write ``tokens`` as a shard at ``path`` (uint16 by default)."""
    arr = np.asarray(tokens)
    with ShardWriter(path, dtype, expect=arr.size) as writer:
        writer.write(arr)
    return writer.path


def read_shard(path: str | os.PathLike[str]) -> np.ndarray:
    """Return the shard's tokens as a read-only uint16/uint32 array (memory-mapped)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: shard file not found")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path}: file too short for header ({size} < {HEADER_BYTES} bytes)")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, count, width = (int(v) for v in header[:4])
    if magic != MAGIC:
        raise DataError(f"{path}: bad magic {magic} (expected {MAGIC})")
    if version == VERSION:
        width = 2
    elif version == VERSION_WIDE:
        if width not in (2, 4):
            raise DataError(f"{path}: bad token width {width} in header (expected 2 or 4)")
    else:
        raise DataError(
            f"{path}: unsupported version {version} (expected {VERSION} or {VERSION_WIDE})"
        )
    if count < 0:
        raise DataError(f"{path}: negative token count {count}")
    expected = HEADER_BYTES + width * count
    if size != expected:
        what = "truncated" if size < expected else "oversized"
        raise DataError(
            f"{path}: {what}: {size} bytes, header says {count} tokens ({expected} bytes)"
        )
    dtype = np.dtype("<u2") if width == 2 else np.dtype("<u4")
    if count == 0:
        empty = np.zeros(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


class TokenStream:
    """Shards read as one stream, without copying: an index of shard start offsets over
    their memory maps. A window may cross a shard boundary, exactly as if the shards were
    concatenated, so batches do not depend on how a split is cut into shards."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        # Plain ndarray views of the maps: slicing an np.memmap costs a Python-level
        # __array_finalize__ per slice; the view keeps the map alive all the same.
        self.arrays = [a.view(np.ndarray) for a in arrays if len(a)]
        lengths = np.array([len(a) for a in self.arrays], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def max(self) -> int:
        return max(int(a.max()) for a in self.arrays)

    def windows(self, offsets: np.ndarray, width: int) -> np.ndarray:
        """int64 ``[len(offsets), width]``: row r is tokens ``[offsets[r], offsets[r]+width)``.

        One slice copy per row from the shard holding it (two or more for a row that
        crosses a boundary), so the cost does not grow with the number of shards."""
        offsets = np.asarray(offsets, dtype=np.int64)
        out = np.empty((len(offsets), width), dtype=np.int64)
        shard = np.searchsorted(self.starts, offsets, side="right") - 1
        local = offsets - self.starts[shard]
        arrays = self.arrays
        for r, (k, lo) in enumerate(zip(shard.tolist(), local.tolist(), strict=True)):
            row = arrays[k][lo : lo + width]
            out[r, : len(row)] = row
            filled = len(row)
            while filled < width:  # the window runs on into the next shard(s)
                k += 1
                row = arrays[k][: width - filled]
                out[r, filled : filled + len(row)] = row
                filled += len(row)
        return out
