"""Flower arrays from the wire: decoded without pickle, checked against what is expected."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from numpy.lib import format as npy

from mobius_fed.transport.flower_wire import (
    message_from_bytes,
    message_to_bytes,
    set_task_identity,
)
from mobius_fed.transport.safe_arrays import (
    UnsafeArrayError,
    array_record_to_torch,
    array_to_numpy,
    parse_npy,
    spec_of,
    validate_array_record,
    validate_message_arrays,
)


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _npy(arr: np.ndarray, **header) -> bytes:
    buf = io.BytesIO()
    if header:
        npy.write_array_header_1_0(buf, header)
        buf.write(arr.tobytes(order="C"))
    else:
        np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _raw(data: bytes, dtype: str = "float32", shape: tuple[int, ...] = (3,)) -> Array:
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)


def _over_the_wire(record: ArrayRecord) -> ArrayRecord:
    """Through the same protobuf path as a worker's or coordinator's Flower message."""
    set_task_identity(1)
    msg = Message(RecordDict({"arrays": record, "c": ConfigRecord({"x": 1})}), 1000, "train")
    return message_from_bytes(message_to_bytes(msg)).content["arrays"]


def test_round_trip_matches_torch_state_dict() -> None:
    sd = torch.nn.Linear(4, 3).state_dict()
    rec = _over_the_wire(ArrayRecord({k: v.detach().clone() for k, v in sd.items()}))
    out = array_record_to_torch(rec, expected=spec_of(sd))
    assert list(out) == list(sd)
    for k in sd:
        assert torch.equal(out[k], sd[k]) and out[k].dtype == sd[k].dtype
    out["weight"].add_(1)  # writable, and a copy: the message is untouched
    assert torch.equal(torch.from_numpy(rec["weight"].numpy()), sd["weight"])


def test_pickled_object_array_is_refused_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    buf = io.BytesIO()
    np.save(buf, np.array([_Marker(str(marker))], dtype=object), allow_pickle=True)
    evil_record = ArrayRecord({"w": _raw(buf.getvalue(), "object", (1,))})
    with pytest.raises(UnsafeArrayError, match=r"'w'.*not a plain numeric dtype"):
        _over_the_wire(evil_record)  # refused when the message is parsed
    evil = evil_record
    with pytest.raises(UnsafeArrayError, match=r"'w'.*not a plain numeric dtype"):
        validate_array_record(evil)
    with pytest.raises(UnsafeArrayError):
        array_record_to_torch(evil)
    # Flower's own decoding refuses it too (np.load(..., allow_pickle=False)).
    with pytest.raises(ValueError, match="allow_pickle"):
        evil["w"].numpy()
    raw = ArrayRecord({"w": _raw(pickle.dumps(_Marker(str(marker))))})
    with pytest.raises(UnsafeArrayError, match="is a pickle"):
        validate_array_record(raw)
    assert not marker.exists()


def test_npz_archive_is_refused() -> None:
    zb = io.BytesIO()
    with zipfile.ZipFile(zb, "w") as z:
        z.writestr("w.npy", _npy(np.zeros(3, np.float32)))
    with pytest.raises(UnsafeArrayError, match="zip archive"):
        array_to_numpy(_raw(zb.getvalue()), "w")


@pytest.mark.parametrize(
    ("array", "why"),
    [
        (_raw(_npy(np.zeros(1, np.float32)), shape=(3,)), "differs from the declared shape"),
        (_raw(_npy(np.zeros(3, np.float64))), "differs from the declared float32"),
        (_raw(_npy(np.zeros(3, np.float32))[:-1]), "payload is 11 bytes"),
        (_raw(_npy(np.zeros(3, np.float32)) + b"\0"), "payload is 13 bytes"),
        (
            _raw(_npy(np.zeros(0, np.float32), descr="<f4", fortran_order=False, shape=(2**40,))),
            "needs 4398046511104",
        ),
        (Array(dtype="float32", shape=(3,), stype="torch.raw", data=b""), "serialization"),
        (_raw(b"\x93NUMPY\x09\x00" + bytes(8)), "unsupported .npy version"),
        (_raw(_npy(np.zeros(3, "<U1"))), "not a plain numeric dtype"),
    ],
)
def test_malformed_arrays_are_refused(array: Array, why: str) -> None:
    with pytest.raises(UnsafeArrayError, match="'w'") as err:
        array_to_numpy(array, "w")
    assert why in str(err.value), err.value
    with pytest.raises(UnsafeArrayError):
        validate_array_record(ArrayRecord({"w": array}))


def test_header_must_be_exactly_the_three_keys() -> None:
    body = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': __import__('os')}"
    data = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + b"\0" * 4
    with pytest.raises(UnsafeArrayError, match=r"unreadable \.npy header"):
        parse_npy(data, "w")
    body = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}"
    data = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + b"\0" * 4
    with pytest.raises(UnsafeArrayError, match="must be a dict of descr"):
        parse_npy(data, "w")


def test_expected_names_shapes_and_dtypes() -> None:
    sd = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int64)}
    spec = spec_of(sd)
    assert spec == {"a": ((2, 3), "float32"), "b": ((4,), "int64")}
    ok = ArrayRecord({k: v.clone() for k, v in sd.items()})
    validate_array_record(ok, expected=spec)
    # a (1,) tensor would silently broadcast over the whole matrix in param.copy_()
    small = ArrayRecord({"a": torch.zeros(1), "b": torch.zeros(4, dtype=torch.int64)})
    with pytest.raises(UnsafeArrayError, match=r"'a'.*expected \(float32, \(2, 3\)\)"):
        validate_array_record(small, expected=spec)
    with pytest.raises(UnsafeArrayError, match=r"missing \['b'\]"):
        validate_array_record(ArrayRecord({"a": torch.zeros(2, 3)}), expected=spec)
    extra = ArrayRecord({**{k: v.clone() for k, v in sd.items()}, "c": torch.zeros(1)})
    with pytest.raises(UnsafeArrayError, match=r"unexpected \['c'\]"):
        validate_array_record(extra, expected=spec)
    with pytest.raises(UnsafeArrayError, match="exceeds 10 bytes"):
        validate_array_record(ok, max_total_bytes=10)


def test_fortran_order_and_big_endian_decode_to_native_values() -> None:
    a = np.arange(6, dtype=">f4").reshape(2, 3)
    f = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    out = array_to_numpy(Array(a), "a")
    assert out.dtype == np.dtype("float32") and np.array_equal(out, a)
    fa = Array(f)
    assert np.array_equal(array_to_numpy(fa, "f"), f)


def test_validate_message_arrays() -> None:
    set_task_identity(1)
    good = Message(RecordDict({"arrays": ArrayRecord({"w": torch.ones(2)})}), 1000, "train")
    validate_message_arrays(message_from_bytes(message_to_bytes(good)))
    bad = Message(RecordDict({"arrays": ArrayRecord({"w": _raw(b"PK\x03\x04")})}), 1000, "train")
    with pytest.raises(UnsafeArrayError, match="message record 'arrays': array 'w'"):
        validate_message_arrays(message_from_bytes(message_to_bytes(bad)))
