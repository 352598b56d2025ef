"""Checkpoint files: safetensors files, never pickle; atomic writes; verified reads.

A checkpoint (format 2) is a plain `safetensors <https://github.com/huggingface/safetensors>`_
file written by the ``safetensors`` library (so any safetensors reader opens it): every tensor,
numpy array and bytes value of the state is one named tensor
(``group.blocks.0.attn.qkv.weight``), and the file's ``__metadata__`` holds ``{"format":
"mobius-fed-checkpoint", "version": "2", "data_sha256": "<hex>", "root": "<JSON>"}``. ``root``
is the state's structure, a JSON value: ``null``/bool/int/str, a finite float, a JSON list (a
Python list), or an object tagged by ``"T"``:

* ``{"T": "float", "v": "nan" | "inf" | "-inf"}``
* ``{"T": "tuple", "v": [...]}``
* ``{"T": "dict", "items": [[key, value], ...]}``: key a JSON str or int (kept as such);
  ``"odict"`` for an ``OrderedDict``, with ``"meta"`` holding a torch ``state_dict``'s
  ``_metadata`` when it has one
* ``{"T": "tensor", "dtype": "bfloat16", "shape": [..], "key": name}`` (torch)
* ``{"T": "ndarray" | "npscalar", "dtype": "<f4", "shape": [..], "key": name}``
* ``{"T": "bytes", "key": name}``
* ``{"T": "ArrayRecord", "items": [[name, ndarray value], ...]}`` (a Flower ArrayRecord)

A value whose dtype safetensors lacks (complex128, a big-endian array) is stored as its raw
bytes (``U8``); the tree's dtype and shape rebuild it. ``data_sha256`` is the SHA-256 of the
tensors' bytes in the order of their names. Files of format 1 (a JSON header, then the
payloads at the byte ranges ``"at": [begin, end]`` of the tree) are still read.

Reading parses JSON and copies bytes into tensors: no code runs, whatever the file holds. Our
own one-pass reader (the library cannot hash while it reads) checks the header's byte ranges as
``safetensors`` does and verifies the sha256 before any value is built (docs/export.md,
"Checkpoints are safetensors files"). Every problem (missing file, hash mismatch, truncation,
corruption, a pickle, a value we cannot store, a failed write) raises :class:`CheckpointError`
naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import re
import secrets
import shutil
import sys
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import SafetensorError, TensorSpec, serialize_file

if TYPE_CHECKING:
    import torch

FORMAT = "mobius-fed-checkpoint"
VERSION = 2  # what save_checkpoint writes; load_checkpoint reads 1 and 2
MAX_HEADER_BYTES = 256 * 1024 * 1024
TMP_MARKER = ".tmp-"
ARRAYS_TAG = "__array_record__"  # a Flower ArrayRecord stored as its torch state_dict

# torch dtypes by name; torch is imported on first use (a coordinator never holds a tensor)
TORCH_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex64",
    "complex128",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)
_NUMPY_KINDS = frozenset("biufc")
# the dtypes safetensors stores natively (others, complex128, go as raw bytes)
_ST_DTYPES = frozenset(TORCH_DTYPE_NAMES) - {"complex128"}
_Buffer = np.ndarray | bytearray  # a value's bytes while it is decoded
_PATH_PART = re.compile(r"\['([^']*)'\]|\[(-?\d+)\]|\.(\w+)")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _is_torch(v: Any, name: str) -> bool:
    """``isinstance(v, torch.<name>)`` without importing torch: no torch, no tensor."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, getattr(torch, name))


class CheckpointError(ValueError):
    """A checkpoint cannot be written, found, verified or read; the message names the file."""


class CheckpointMissing(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist (also a FileNotFoundError)."""


if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("mobius_fed.checkpoint needs a little-endian host")


# --------------------------------------------------------------------------- encoding
def _tensor_name(where: str) -> str:
    """``state['group'][0]['w']`` → ``group.0.w`` (a readable safetensors name)."""
    parts = _PATH_PART.findall(where.removeprefix("state"))
    return ".".join(a or b or c for a, b, c in parts) or "state"


class _Encoder:
    """Walks a state into the JSON tree; every array goes to ``specs`` under a unique name."""

    def __init__(self) -> None:
        self.specs: dict[str, Any] = {}
        self.arrays: dict[str, np.ndarray] = {}  # keeps every pointer alive while writing
        self.metadata: dict[str, str] = {}

    def _put(self, arr: np.ndarray, st_dtype: str | None, shape: list[int], where: str) -> str:
        """Store ``arr`` under a new name; ``st_dtype`` None stores its raw bytes (``U8``)."""
        if st_dtype is None:
            arr = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
            st_dtype, shape = "uint8", [arr.size]
        name = base = _tensor_name(where)
        n = 1
        while name in self.arrays:
            n += 1
            name = f"{base}#{n}"
        self.arrays[name] = arr
        self.specs[name] = TensorSpec(
            dtype=st_dtype, shape=shape, data_ptr=arr.ctypes.data, data_len=arr.nbytes
        )
        return name

    def value(self, v: Any, where: str) -> Any:
        if isinstance(v, np.ndarray | np.generic):  # before float: np.float64 is a float
            return self.ndarray(v, where)
        if v is None or isinstance(v, bool | str):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            if math.isfinite(v):
                return float(v)
            return {"T": "float", "v": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if _is_torch(v, "Tensor"):
            return self.tensor(v, where)
        if isinstance(v, bytes | bytearray):
            key = self._put(np.frombuffer(bytes(v), np.uint8), None, [], where)
            return {"T": "bytes", "key": key}
        if type(v).__name__ == "ArrayRecord" and type(v).__module__.startswith("flwr."):
            return self.array_record(v, where)
        if isinstance(v, dict):
            return self.mapping(v, where)
        if type(v) is tuple or (isinstance(v, tuple) and _is_torch(v, "Size")):
            return {"T": "tuple", "v": [self.value(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if type(v) is list:
            return [self.value(x, f"{where}[{i}]") for i, x in enumerate(v)]
        raise TypeError(f"{where}: cannot store a {type(v).__module__}.{type(v).__qualname__}")

    def mapping(self, v: dict, where: str) -> dict:
        if type(v) not in (dict, OrderedDict):
            raise TypeError(f"{where}: cannot store a {type(v).__qualname__} (dict subclass)")
        items = []
        for k, x in v.items():
            if isinstance(k, bool) or not isinstance(k, str | int):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}, not str or int")
            items.append([k if isinstance(k, str) else int(k), self.value(x, f"{where}[{k!r}]")])
        out: dict[str, Any] = {"T": "odict" if type(v) is OrderedDict else "dict", "items": items}
        meta = getattr(v, "_metadata", None)
        if meta is not None:
            out["meta"] = self.value(meta, f"{where}._metadata")
        return out

    def tensor(self, t: torch.Tensor, where: str) -> dict:
        import torch

        name = str(t.dtype).removeprefix("torch.")
        if name not in TORCH_DTYPE_NAMES:
            raise TypeError(f"{where}: tensor dtype {t.dtype} is not supported")
        if t.is_sparse or t.layout != torch.strided or t.is_quantized:
            raise TypeError(f"{where}: only dense tensors can be stored")
        c = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        node = {"T": "tensor", "dtype": name, "shape": list(c.shape)}
        raw = c.reshape(-1).view(torch.uint8) if c.numel() else torch.empty(0, dtype=torch.uint8)
        st_dtype = name if name in _ST_DTYPES else None
        node["key"] = self._put(raw.numpy(), st_dtype, list(c.shape), where)
        return node

    def ndarray(self, a: np.ndarray | np.generic, where: str) -> dict:
        kind = "npscalar" if isinstance(a, np.generic) else "ndarray"
        arr = np.asarray(a)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        if arr.dtype.kind not in _NUMPY_KINDS or arr.dtype.hasobject or arr.dtype.fields:
            raise TypeError(f"{where}: numpy dtype {arr.dtype} is not supported")
        node = {"T": kind, "dtype": arr.dtype.str, "shape": list(arr.shape)}
        native = arr.dtype.isnative and arr.dtype.name in _ST_DTYPES
        node["key"] = self._put(arr, arr.dtype.name if native else None, list(arr.shape), where)
        return node

    def array_record(self, rec: Any, where: str) -> dict:
        from mobius_fed.transport.safe_arrays import UnsafeArrayError, array_to_numpy

        items = []
        for k, arr in rec.items():
            try:
                items.append([k, self.ndarray(array_to_numpy(arr, k), f"{where}[{k!r}]")])
            except UnsafeArrayError as exc:
                raise TypeError(f"{where}[{k!r}]: {exc}") from None
        return {"T": "ArrayRecord", "items": items}

    def digest(self) -> str:
        """SHA-256 of every stored array's bytes, in the order of their names."""
        h = hashlib.sha256()
        for name in sorted(self.arrays):
            h.update(self.arrays[name].data.cast("B"))
        return h.hexdigest()


def encode(state: Any) -> _Encoder:
    """The encoder holding ``state``'s tensors and, in ``metadata``, its tree and digest;
    TypeError names the key path of a bad value."""
    enc = _Encoder()
    root = enc.value(state, "state")
    enc.metadata = {
        "format": FORMAT,
        "version": str(VERSION),
        "data_sha256": enc.digest(),
        "root": json.dumps(root, separators=(",", ":"), allow_nan=False),
    }
    return enc


# --------------------------------------------------------------------------- writing
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    """A hidden sibling of ``path`` naming its writer (``prune_checkpoints`` clears it)."""
    return path.with_name(f".{path.name}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")


def _oserror(path: Path, exc: OSError) -> CheckpointError:
    code = errno.errorcode.get(exc.errno or 0, "")
    return CheckpointError(
        f"cannot write checkpoint {path}: {exc.strerror or exc}"
        + (f" ({code})" if code else "")
        + "; the previous file (if any) is unchanged"
    )


def _write_error(exc: SafetensorError) -> OSError | TypeError:
    """The OSError (errno named) behind a failed safetensors write, else a TypeError."""
    m = _OS_ERROR.search(str(exc))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code))
    return TypeError(str(exc))


def save_checkpoint(path: Path, state: dict, durable: bool = True) -> Path:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, rename, fsync dir).

    On any failure no temporary file is left and an existing ``path`` is unchanged.
    ``durable=False`` skips the fsyncs: the file survives the process (a crash, a kill)
    but not necessarily the host (a power cut), for snapshots that are cheap to lose.
    """
    path = Path(path)
    # safetensors writes into a temporary file of its own, next to the one it is given:
    # a private directory keeps both, and prune_checkpoints clears it if the writer dies.
    tmp_dir = _tmp_name(path)
    try:
        enc = encode(state)  # TypeError naming a bad value's key path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir.mkdir()
        tmp = tmp_dir / path.name
        try:
            serialize_file(enc.specs, tmp, metadata=enc.metadata)
        except SafetensorError as exc:
            raise _write_error(exc) from None
        if durable:
            _fsync(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise _oserror(path, exc) from exc
    except TypeError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from None
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    if durable:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
            _fsync(path.parent)
    return path


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file and a rename; on an error (a full
    disk…) remove the temporary file, keep what was there and raise naming the path."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise _oserror(path, exc) from exc
    return path


def prune_checkpoints(directory: Path, pattern: str, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest (by name) entries matching ``pattern``; return them.

    Entries are files or directories (a coordinator's ``round-<r>/``); names sort in
    step/round order when they carry zero-padded numbers (``round-000010.ckpt``).
    Leftover temporary files of crashed writers are removed too.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    directory = Path(directory)
    removed = []
    matches = sorted(p for p in directory.glob(pattern) if TMP_MARKER not in p.name)
    leftovers = [p for p in directory.glob(f".*{TMP_MARKER}*") if _writer_gone(p)]
    for p in matches[:-keep] + leftovers:
        with contextlib.suppress(FileNotFoundError):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    return removed


def _writer_gone(tmp: Path) -> bool:
    pid = tmp.name.rsplit(TMP_MARKER, 1)[-1].split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


# --------------------------------------------------------------------------- reading
# bits per element of each dtype a safetensors header may name
_ST_BITS = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 8),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 16),
    **dict.fromkeys(("I32", "U32", "F32"), 32),
    **dict.fromkeys(("I64", "U64", "F64", "C64"), 64),
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


class _Source:
    """A checkpoint read front to back, each piece straight into a buffer of its own (the
    only copy the bytes get); with ``whole_sha256`` the file's SHA-256 is taken on the way."""

    def __init__(
        self, f: io.BufferedIOBase | io.RawIOBase, size: int, path: Path, whole_sha256: bool
    ) -> None:
        self.f, self.size, self.path = f, size, path
        self.sha256 = hashlib.sha256() if whole_sha256 else None

    def read(self, n: int) -> np.ndarray:
        """The next ``n`` bytes (the caller has checked that the file holds them)."""
        buf = np.empty(n, np.uint8)  # uninitialised: readinto fills it
        view, got = buf.data, 0
        while got < n:
            k = self.f.readinto(view[got:])
            if not k:
                raise CheckpointError(f"checkpoint {self.path} changed while being read")
            got += k
        if self.sha256 is not None:
            self.sha256.update(view)
        return buf

    def at_end(self) -> None:
        if self.f.read(1):
            raise CheckpointError(f"checkpoint {self.path} changed while being read")


class _Decoder:
    """Rebuilds a state from its tree; ``payload`` gives a value's bytes (format 2: the
    file's tensors, by name, each read into a buffer of its own; format 1: byte ranges of
    one payload)."""

    def __init__(self, tensors: dict[str, np.ndarray], path: Path) -> None:
        self.tensors, self.path = tensors, path

    def bad(self, where: str, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.path} is corrupted: {where}: {why}")

    def payload(self, v: dict, where: str, nbytes: int | None = None) -> _Buffer:
        """A writable buffer of the value's bytes, owned by the value built on it."""
        data = self.tensors.get(v["key"]) if "key" in v else None
        if data is None:
            raise self.bad(where, f"no tensor named {v.get('key')!r} in the file")
        if nbytes is not None and len(data) != nbytes:
            raise self.bad(where, f"{len(data)} bytes stored, {nbytes} needed")
        return data

    def sized(self, v: dict, where: str, itemsize: int) -> tuple[list[int], _Buffer]:
        """The value's shape, checked, and its bytes (exactly as many as the shape needs)."""
        shape = v.get("shape")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise self.bad(where, f"bad shape {shape!r}")
        return shape, self.payload(v, where, math.prod(shape) * itemsize)

    def value(self, v: Any, where: str) -> Any:
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if isinstance(v, list):
            return [self.value(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if not isinstance(v, dict):
            raise self.bad(where, f"unexpected JSON {type(v).__name__}")
        tag = v.get("T")
        if tag == "float":
            specials = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
            if v.get("v") not in specials:
                raise self.bad(where, f"bad float {v.get('v')!r}")
            return specials[v["v"]]
        if tag == "tuple":
            if not isinstance(v.get("v"), list):
                raise self.bad(where, "bad tuple")
            return tuple(self.value(x, f"{where}[{i}]") for i, x in enumerate(v["v"]))
        if tag in ("dict", "odict"):
            return self.mapping(v, where)
        if tag == "tensor":
            return self.tensor(v, where)
        if tag in ("ndarray", "npscalar"):
            return self.ndarray(v, where)
        if tag == "bytes":
            return bytes(self.payload(v, where))
        if tag == "ArrayRecord":
            return self.array_record(v, where)
        raise self.bad(where, f"unknown value tag {tag!r}")

    def mapping(self, v: dict, where: str) -> dict:
        items = v.get("items")
        if not isinstance(items, list):
            raise self.bad(where, "bad dict")
        out: dict = OrderedDict() if v["T"] == "odict" else {}
        for item in items:
            if not (isinstance(item, list) and len(item) == 2):
                raise self.bad(where, "bad dict item")
            k = item[0]
            if isinstance(k, bool) or not isinstance(k, str | int):
                raise self.bad(where, f"bad key {k!r}")
            out[k] = self.value(item[1], f"{where}[{k!r}]")
        if "meta" in v:
            # Ignored: torch keeps a state dict's metadata as an attribute of the OrderedDict.
            out._metadata = self.value(v["meta"], f"{where}._metadata")  # type: ignore[attr-defined]
        return out

    def tensor(self, v: dict, where: str) -> torch.Tensor:
        import torch

        name = v.get("dtype")
        dtype = getattr(torch, name) if name in TORCH_DTYPE_NAMES else None
        if dtype is None:
            raise self.bad(where, f"unknown tensor dtype {v.get('dtype')!r}")
        shape, data = self.sized(v, where, dtype.itemsize)
        if not math.prod(shape):
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)

    def ndarray(self, v: dict, where: str) -> np.ndarray | np.generic:
        try:
            dtype = np.dtype(v.get("dtype"))
        except (TypeError, ValueError):
            raise self.bad(where, f"unknown numpy dtype {v.get('dtype')!r}") from None
        if dtype.kind not in _NUMPY_KINDS or dtype.hasobject or dtype.fields:
            raise self.bad(where, f"numpy dtype {dtype} is not allowed")
        shape, data = self.sized(v, where, dtype.itemsize)
        arr = np.frombuffer(data, dtype=dtype, count=math.prod(shape)).reshape(shape)
        if v["T"] == "npscalar":
            if shape:
                raise self.bad(where, "a numpy scalar with a shape")
            return arr[()]
        return arr

    def array_record(self, v: dict, where: str) -> Any:
        from flwr.app import Array, ArrayRecord

        items = v.get("items")
        if not isinstance(items, list):
            raise self.bad(where, "bad ArrayRecord")
        arrays = {}
        for item in items:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise self.bad(where, "bad ArrayRecord item")
            arr = self.value(item[1], f"{where}[{item[0]!r}]")
            if not isinstance(arr, np.ndarray):
                raise self.bad(where, f"ArrayRecord item {item[0]!r} is not an array")
            arrays[item[0]] = Array(arr)
        return ArrayRecord(arrays)


class _Format1Decoder(_Decoder):
    """Format 1: every value's bytes are a range ``"at": [begin, end]`` of one payload."""

    def __init__(self, data: memoryview, path: Path) -> None:
        super().__init__({}, path)
        self.data = data

    def payload(self, v: dict, where: str, nbytes: int | None = None) -> _Buffer:
        at = v.get("at")
        if (
            not isinstance(at, list)
            or len(at) != 2
            or not all(type(x) is int for x in at)
            or not 0 <= at[0] <= at[1] <= self.data.nbytes
        ):
            raise self.bad(where, f"byte range {at!r} outside the {self.data.nbytes}-byte payload")
        if nbytes is not None and at[1] - at[0] != nbytes:
            raise self.bad(where, f"{at[1] - at[0]} bytes stored, {nbytes} needed")
        return bytearray(self.data[at[0] : at[1]])


def _header(src: _Source) -> tuple[int, dict]:
    """``(header length, header)``: the JSON both formats start with (after a u64 length)."""
    path, size = src.path, src.size
    if size < 8:
        raise CheckpointError(f"checkpoint {path} is truncated: {size} bytes")
    head = src.read(8).tobytes()
    hlen = int.from_bytes(head, "little")
    # what a file that is not a checkpoint is, when it is a pickle or holds one; else ""
    what = "a pickle" if head[:1] == b"\x80" else ""
    if head.startswith(b"PK\x03\x04"):
        what = "a zip archive (a torch.save file, which holds a pickle)"
    refused = f"checkpoint {path} is {what}: refused, never unpickled" if what else ""
    if hlen > min(MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(
            refused
            or f"checkpoint {path} is truncated or not a checkpoint: header of {hlen} "
            f"bytes, file of {size}"
        )
    try:
        header = json.loads(src.read(hlen).tobytes())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(
            refused or f"checkpoint {path} has an unreadable header: {exc}"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint {path} is not a {FORMAT} file")
    return hlen, header


def _check_digest(path: Path, actual: str, header: dict) -> None:
    if actual != header.get("data_sha256"):
        raise CheckpointError(
            f"checkpoint {path} is corrupted: payload sha256 {actual}, header says "
            f"{header.get('data_sha256')}"
        )


def _check_manifest(path: Path, actual: str, expected: str, size: int | None = None) -> None:
    """Refuse a file whose sha256 is not the manifest's, naming both (and both sizes)."""
    if actual != expected.lower():
        have = None if size is None else path.stat().st_size
        sizes = f" ({have} bytes, expected {size})" if have != size else ""
        raise CheckpointError(
            f"checkpoint {path} does not match its manifest: sha256 {actual}, expected "
            f"{expected}{sizes}"
        )


def _format1(src: _Source, hlen: int, header: dict, verify: bool) -> _Decoder:
    payload = src.read(src.size - 8 - hlen).data
    src.at_end()
    want = header.get("data_len")
    if type(want) is not int or payload.nbytes != want:
        raise CheckpointError(
            f"checkpoint {src.path} is truncated or has trailing bytes: payload of "
            f"{payload.nbytes} bytes, header says {want!r}"
        )
    if verify:
        _check_digest(src.path, hashlib.sha256(payload).hexdigest(), header)
    return _Format1Decoder(payload, src.path)


def _span(name: str, info: Any, path: Path) -> tuple[int, int, str]:
    """``(begin, end, name)`` of one tensor of a safetensors header, checked."""
    info = info if isinstance(info, dict) else {}
    st_dtype, shape, at = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    why = ""
    if not isinstance(st_dtype, str) or st_dtype not in _ST_BITS:
        why = f"dtype {st_dtype!r}"
    elif not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        why = f"shape {shape!r}"
    elif not (isinstance(at, list) and len(at) == 2 and all(type(x) is int for x in at)):
        why = f"data_offsets {at!r}"
    elif at[0] < 0 or (at[1] - at[0]) * 8 != math.prod(shape) * _ST_BITS[st_dtype]:
        why = f"data_offsets {at!r} for a {st_dtype} tensor of shape {shape}"
    if why:
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupted: tensor {name!r}: {why}"
        )
    return at[0], at[1], name


def _layout(header: dict, data_len: int, path: Path) -> list[tuple[int, int, str]]:
    """The tensors' ``(begin, end, name)`` in file order, checked as the safetensors library
    checks a file: known dtypes, sizes that fit the shapes, ranges that tile the data."""
    spans = sorted(_span(k, v, path) for k, v in header.items() if k != "__metadata__")
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise CheckpointError(
                f"checkpoint {path} is truncated or corrupted: tensor {name!r} starts at byte "
                f"{begin} of the data, not {end}"
            )
        end = stop
    if end != data_len:
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupted: the tensors end at byte {end} of "
            f"the data, the file holds {data_len}"
        )
    return spans


def _format2(src: _Source, hlen: int, header: dict, verify: bool) -> tuple[_Decoder, Any]:
    """Every tensor read into its own buffer in file order (no other copy), then the
    payload's sha256 over them, in the order of their names, before any is used."""
    path, meta = src.path, header["__metadata__"]
    spans = _layout(header, src.size - 8 - hlen, path)
    tensors = {name: src.read(end - begin) for begin, end, name in spans}
    src.at_end()
    if verify:
        h = hashlib.sha256()
        for name in sorted(tensors):
            h.update(tensors[name].data)
        _check_digest(path, h.hexdigest(), meta)
    try:
        root = json.loads(meta.get("root", ""))
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupted: unreadable tree: {exc}") from None
    return _Decoder(tensors, path), root


def _read_state(src: _Source, verify_payload: bool, expected_sha256: str | None = None) -> Any:
    """The state a checkpoint holds; with ``expected_sha256`` (and ``src.sha256`` taken)
    the whole file must match it before the state is built."""
    path = src.path
    hlen, header = _header(src)
    meta = header.get("__metadata__") if "format" not in header else header
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        what = "a safetensors file without mobius-fed metadata" if meta is None else ""
        raise CheckpointError(f"checkpoint {path} is {what or f'not a {FORMAT} file'}")
    version = meta.get("version")
    if version == 1:
        decoder, root = _format1(src, hlen, header, verify_payload), header.get("root")
    elif version == str(VERSION) and meta is not header:
        decoder, root = _format2(src, hlen, header, verify_payload)
    else:
        raise CheckpointError(
            f"checkpoint {path} has format version {version!r}; this build reads versions 1 "
            f"and {VERSION}"
        )
    if expected_sha256 is not None and src.sha256 is not None:
        _check_manifest(path, src.sha256.hexdigest(), expected_sha256)
    try:
        return decoder.value(root, "state")
    except RecursionError:
        raise CheckpointError(f"checkpoint {path} is corrupted: nesting too deep") from None


def load_checkpoint(path: Path, expected_sha256: str | None = None) -> dict:
    """Read and verify a checkpoint in one pass over the file; with ``expected_sha256`` the
    whole file must match it (checked instead of the payload's own hash)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            src = _Source(f, os.fstat(f.fileno()).st_size, path, expected_sha256 is not None)
            state = _read_state(src, expected_sha256 is None, expected_sha256)
    except CheckpointError:
        if expected_sha256 is not None:  # a damaged file is named as failing its manifest
            _check_manifest(path, sha256_of(path), expected_sha256)
        raise
    except FileNotFoundError:
        raise CheckpointMissing(errno.ENOENT, f"checkpoint not found: {path}") from None
    except IsADirectoryError:
        raise CheckpointError(f"checkpoint {path} is a directory") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a dict")
    return state


def verify_file(path: Path, sha256: str, size: int | None = None) -> None:
    """``path`` matches what a manifest says of it (its sha256, and its size if given);
    else a :class:`CheckpointError` names it, with both sizes when they differ."""
    path = Path(path)
    _check_manifest(path, sha256_of(path), sha256, size)


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file (checkpoint manifests record it per worker)."""
    path = Path(path)
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except FileNotFoundError:
        raise CheckpointMissing(errno.ENOENT, f"checkpoint not found: {path}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    return h.hexdigest()


def iter_tensors(state: Any) -> Iterator[torch.Tensor]:
    """Every torch tensor inside a nested state (for tests and diagnostics)."""
    if _is_torch(state, "Tensor"):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from iter_tensors(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from iter_tensors(v)
