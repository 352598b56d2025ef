"""Checkpoint files: exact round trips, verification, no pickle, atomic writes, disk full."""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from mobius_fed.checkpoint import (
    TMP_MARKER,
    CheckpointError,
    CheckpointMissing,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    sha256_of,
)
from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.engine import ReferenceEngine

REPO = Path(__file__).resolve().parents[1]
LEGACY = REPO / "tests/fixtures/checkpoint-v1.ckpt"  # written by the format-1 writer


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def assert_identical(a, b, where: str = "state") -> None:
    """Same structure, same Python types, same key types and order, bitwise-equal tensors."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, np.ndarray | np.generic):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.shape(a) == np.shape(b), where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        assert [type(k) for k in a] == [type(k) for k in b], where
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        ), where
    else:
        assert a == b, where


def _trained_optimizers() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    muon = torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, momentum=0.95)
    adamw = torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1)
    for o in (muon, adamw):
        for g in o.param_groups:
            g["base_lr"] = g["lr"]
    for _ in range(2):
        loss = model(torch.randn(4, 6)).pow(2).mean()
        loss.backward()
        muon.step()
        adamw.step()
    return {"model": model.state_dict(), "opts": [muon.state_dict(), adamw.state_dict()]}


def test_round_trip_of_every_supported_value(tmp_path: Path) -> None:
    x = torch.randn(3, 4)
    state = {
        **_trained_optimizers(),
        "bf16": torch.randn(2, 3).to(torch.bfloat16),
        "f16": torch.randn(5).half(),
        "f64": torch.tensor([1e-300, -0.0, float("nan"), float("inf")], dtype=torch.float64),
        "ints": [
            torch.arange(4, dtype=d)
            for d in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
        ],
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "strided": x.t(),  # non-contiguous: stored contiguous, same values
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np_be": np.arange(3, dtype=">i4"),
        "np_scalar": np.float64(2.5),
        "np_int": np.int64(-7),
        "bytes": b"\x00\x01binary",
        "floats": [0.1, -0.0, math.nan, math.inf, -math.inf, 1e308, 5e-324],
        "ints_py": [0, -1, 2**70, True, False, None],
        "tuple": (1, (2.0, "three"), []),
        "int_keys": {0: "a", 7: {1: 2}, "7": "string key"},
        "text": "ünïcode ✓",
        "od": OrderedDict([("b", 1), ("a", 2)]),
    }
    path = save_checkpoint(tmp_path / "all.ckpt", state)
    back = load_checkpoint(path)
    expected = dict(state)
    expected["strided"] = x.t().contiguous()
    assert_identical(expected, back)
    assert back["model"]._metadata == state["model"]._metadata  # torch's version metadata
    assert isinstance(back["tuple"], tuple) and isinstance(
        back["opts"][1]["param_groups"][0]["betas"], tuple
    )
    assert back["np_be"].dtype == np.dtype(">i4")


def test_loaded_values_own_their_memory(tmp_path: Path) -> None:
    """Each tensor and array is read into a writable buffer of exactly its size: nothing
    keeps the rest of the file alive, and writing one value changes no other."""
    state = {"a": torch.randn(64, 8), "b": torch.zeros(3), "c": torch.tensor(2.0)}
    state |= {"z": torch.zeros(100, dtype=torch.complex128), "np": np.arange(5.0)}
    path = save_checkpoint(tmp_path / "own.ckpt", state)
    for expected in (None, sha256_of(path)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch's "buffer is not writable"
            back = load_checkpoint(path, expected_sha256=expected)
        tensors = [back[k] for k in ("a", "b", "c", "z")]
        assert [t.untyped_storage().nbytes() for t in tensors] == [t.nbytes for t in tensors]
        assert all(t.data_ptr() % t.element_size() == 0 for t in tensors)
        back["a"].add_(1.0)
        back["np"][0] = 9.0
        assert torch.equal(back["a"], state["a"] + 1.0) and back["np"].flags.owndata is False
        assert_identical({k: back[k] for k in "bcz"}, {k: state[k] for k in "bcz"})


def _legacy_state() -> dict:
    """What tests/fixtures/checkpoint-v1.ckpt holds (it was written from this function)."""
    from flwr.app import ArrayRecord

    g = torch.Generator().manual_seed(22)
    lin = torch.nn.Linear(4, 3)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, 4, generator=g))
        lin.bias.copy_(torch.randn(3, generator=g))
    return {
        "rank": 1,
        "step": 7,
        "group": lin.state_dict(),
        "bf16": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "ints": [torch.arange(4, dtype=d) for d in (torch.int8, torch.int64, torch.uint8)],
        "bool": torch.tensor([True, False]),
        "empty": torch.empty(0, 2),
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np_scalar": np.float64(2.5),
        "bytes": b"\x00\x01binary",
        "floats": [0.1, -0.0, math.nan, math.inf],
        "tuple": (1, (2.0, "three")),
        "int_keys": {0: "a", "7": "string key"},
        "od": OrderedDict([("b", 1), ("a", 2)]),
        "arrays": ArrayRecord({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}),
    }


def _same_legacy(back: dict) -> None:
    want = _legacy_state()
    arrays = (want.pop("arrays"), back.pop("arrays"))
    assert_identical(want, back)
    assert list(arrays[1].keys()) == ["w"] and arrays[1]["w"].data == arrays[0]["w"].data


def test_format1_files_still_load(tmp_path: Path) -> None:
    assert LEGACY.read_bytes()[8:60].startswith(b'{"format":"mobius-fed-checkpoint"')
    _same_legacy(load_checkpoint(LEGACY))
    _same_legacy(load_checkpoint(LEGACY, expected_sha256=sha256_of(LEGACY)))
    again = save_checkpoint(tmp_path / "v2.ckpt", load_checkpoint(LEGACY))  # rewritten as v2
    _same_legacy(load_checkpoint(again))


def test_files_are_safetensors_with_named_tensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    path = save_checkpoint(tmp_path / "w.ckpt", _legacy_state())
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "mobius-fed-checkpoint" and meta["version"] == "2"
        assert torch.equal(f.get_tensor("group.weight"), _legacy_state()["group"]["weight"])
        assert f.get_tensor("bf16").dtype == torch.bfloat16
        assert {"ints.0", "ints.2", "np", "arrays.w", "bytes"} <= set(f.keys())


def test_reference_engine_state_round_trips_bitwise_and_resumes(tmp_path: Path) -> None:
    sites = prepare_sites(None, tmp_path / "sites", 2, text=embedded_corpus())
    cfg = TrainConfig(
        preset="cpu-tiny",
        workers=2,
        loops=1,
        steps=6,
        batch_size=2,
        warmup_steps=1,
        eval_batches=1,
        seed=0,
    )

    def engine() -> ReferenceEngine:
        return ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len, cfg.encoding) for d in sites])

    a = engine()
    for _ in range(2):
        a.train_step()
    path = a.save(tmp_path / "ref.ckpt")
    sd = a.state_dict()
    assert_identical(sd, load_checkpoint(path, expected_sha256=sha256_of(path)))
    b = engine()
    b.load(path)
    assert [a.train_step().loss for _ in range(2)] == [b.train_step().loss for _ in range(2)]


def test_ring_executor_state_round_trips(tmp_path: Path) -> None:
    from mobius_fed.worker.executor import RingExecutor

    sites = prepare_sites(None, tmp_path / "sites", 1, text=embedded_corpus())
    cfg = TrainConfig(
        preset="cpu-tiny",
        workers=1,
        loops=1,
        steps=4,
        batch_size=2,
        warmup_steps=1,
        eval_batches=1,
        seed=0,
    )
    site = SiteData(sites[0], cfg.model().seq_len, cfg.encoding)
    ex = RingExecutor(cfg, 0, site, "run")
    try:
        ex.train_step()  # P = 1: no links; fills Muon and AdamW state
    except AssertionError:
        pytest.skip("this executor needs links even for P = 1")
    sd = ex.state_dict()
    assert any(o["state"] for o in sd["group_opts"])
    path = save_checkpoint(tmp_path / "w.ckpt", sd)
    back = load_checkpoint(path)
    assert_identical(sd, back)
    other = RingExecutor(cfg, 0, site, "run")
    other.load_state_dict(back)
    assert ex.train_step().loss == other.train_step().loss


def test_flower_array_record_round_trips(tmp_path: Path) -> None:
    from flwr.app import ArrayRecord

    rec = ArrayRecord({"w": torch.randn(3, 2), "b": torch.arange(4)})
    back = load_checkpoint(save_checkpoint(tmp_path / "er.ckpt", {"arrays": rec, "m": None}))
    assert type(back["arrays"]).__name__ == "ArrayRecord"
    assert list(back["arrays"].keys()) == ["w", "b"]
    for k in rec:
        assert back["arrays"][k].data == rec[k].data and back["arrays"][k].dtype == rec[k].dtype


def test_unknown_types_are_refused_naming_the_key_path(tmp_path: Path) -> None:
    target = tmp_path / "x.ckpt"
    for bad, where in (
        ({"a": [1, {2: {3}}]}, "state['a'][1][2]"),
        ({"fn": print}, "state['fn']"),
        ({"k": {(1, 2): 3}}, "state['k']"),
        ({"obj": np.array([object()])}, "state['obj']"),
    ):
        with pytest.raises(CheckpointError) as err:
            save_checkpoint(target, bad)
        assert str(target) in str(err.value) and where in str(err.value), err.value
    assert not target.exists() and not list(tmp_path.iterdir())


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"not found: .*nope\.ckpt") as err:
        load_checkpoint(tmp_path / "nope.ckpt")
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, CheckpointMissing)
    with pytest.raises(CheckpointError, match="nope"):
        sha256_of(tmp_path / "nope.ckpt")


def test_flipped_exponent_bit_is_caught(tmp_path: Path) -> None:
    w = torch.full((64,), 1.5)
    path = save_checkpoint(tmp_path / "c.ckpt", {"w": w})
    good = sha256_of(path)
    raw = bytearray(path.read_bytes())
    # 1.5f = 0x3FC00000 little-endian: the exponent's top bit is bit 6 of the last byte.
    at = raw.rfind(bytes.fromhex("0000c03f"))
    raw[at + 3] ^= 0x40
    path.write_bytes(bytes(raw))
    bad = hashlib.sha256(raw).hexdigest()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, expected_sha256=good)
    msg = str(err.value)
    assert str(path) in msg and good in msg and bad in msg
    # without the manifest hash, the payload hash in the header still catches it
    with pytest.raises(CheckpointError, match="corrupted: payload sha256"):
        load_checkpoint(path)


@pytest.mark.parametrize("cut", [0, 5, 9, 200, -1])
def test_truncated_file_is_named(tmp_path: Path, cut: int) -> None:
    path = save_checkpoint(tmp_path / "t.ckpt", {"w": torch.randn(100), "n": 1})
    data, good = path.read_bytes(), sha256_of(path)
    path.write_bytes(data[: cut if cut >= 0 else len(data) + cut])
    with pytest.raises(CheckpointError, match=r"t\.ckpt.*(truncated|unreadable|not a)"):
        load_checkpoint(path)
    # with a manifest, a damaged file is named as failing it, whatever else is wrong
    with pytest.raises(CheckpointError, match=rf"t\.ckpt does not match its manifest.*{good}"):
        load_checkpoint(path, expected_sha256=good)


def _rewrite_header(path: Path, data: bytes, header: dict) -> None:
    import json

    text = json.dumps(header).encode()
    hlen = int.from_bytes(data[:8], "little")
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + hlen :])


def test_corrupted_header_offsets_are_refused(tmp_path: Path) -> None:
    import json

    path = save_checkpoint(tmp_path / "h.ckpt", {"w": torch.randn(8)})
    data = path.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])

    def node(h: dict, key: str, value) -> None:
        root = json.loads(h["__metadata__"]["root"])
        root["items"][0][1][key] = value
        h["__metadata__"]["root"] = json.dumps(root)

    for mutate, why in (
        (lambda h: node(h, "key", "nope"), "no tensor named 'nope'"),
        (lambda h: node(h, "shape", [9]), "needed"),
        (lambda h: node(h, "dtype", "object"), "unknown tensor dtype"),
        (lambda h: node(h, "T", "pickle"), "unknown value tag"),
        (lambda h: h["__metadata__"].__setitem__("version", "99"), "format version '99'"),
        (lambda h: h["w"].__setitem__("data_offsets", [0, 10**9]), "truncated or corrupted"),
        (lambda h: h["w"].__setitem__("dtype", "F16"), r"tensor 'w': data_offsets \[0, 32\]"),
        (lambda h: h["w"].__setitem__("dtype", "I4"), "tensor 'w': dtype 'I4'"),
        (lambda h: h["w"].__setitem__("data_offsets", [4, 36]), "'w' starts at byte 4"),
        (lambda h: h["w"].__setitem__("shape", [4]), r"data_offsets \[0, 32\] for a F32"),
        (lambda h: h.__setitem__("v", h["w"]), "'w' starts at byte 0 of the data, not 32"),
        (lambda h: h.pop("__metadata__"), "safetensors file without mobius-fed metadata"),
    ):
        h = json.loads(json.dumps(header))
        mutate(h)
        _rewrite_header(path, data, h)
        with pytest.raises(CheckpointError, match=why) as err:
            load_checkpoint(path)
        assert str(path) in str(err.value)
    path.write_bytes(data + b"\0")
    with pytest.raises(CheckpointError, match="tensors end at byte 32 of the data, the file holds"):
        load_checkpoint(path)


def test_corrupted_format1_header_is_refused(tmp_path: Path) -> None:
    import json

    data = LEGACY.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    path = tmp_path / "v1.ckpt"
    for mutate, why in (
        (lambda h: h["root"]["items"][2][1]["items"][0][1].__setitem__("at", [0, 10**9]), "outs"),
        (lambda h: h["root"]["items"][2][1]["items"][0][1].__setitem__("shape", [9]), "needed"),
        (lambda h: h.__setitem__("version", 99), "format version 99"),
        (lambda h: h.__setitem__("data_sha256", "0" * 64), "payload sha256"),
    ):
        h = json.loads(json.dumps(header))
        mutate(h)
        _rewrite_header(path, data, h)
        with pytest.raises(CheckpointError, match=why) as err:
            load_checkpoint(path)
        assert str(path) in str(err.value)


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickles_are_refused_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    payload = pickle.dumps({"w": _Marker(str(marker))})
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(payload)
    zipped = tmp_path / "torch.pt"  # what torch.save writes: a zip holding data.pkl
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("archive/data.pkl", payload)
    prefixed = tmp_path / "prefixed.ckpt"  # a plausible header length, then a pickle
    prefixed.write_bytes(len(payload).to_bytes(8, "little") + payload)
    for path, why in ((raw, "is a pickle: refused"), (zipped, "zip archive"), (prefixed, "")):
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(path)
        assert str(path) in str(err.value) and why in str(err.value), err.value
    assert not marker.exists()


def test_checkpoint_module_never_imports_pickle_loaders() -> None:
    src = (REPO / "mobius_fed/checkpoint.py").read_text()
    for banned in ("import pickle", "torch.load(", "np.load(", "pickle.load", "weights_only"):
        assert banned not in src, banned


def test_atomic_overwrite_and_failed_write_keeps_previous(tmp_path: Path, monkeypatch) -> None:
    import safetensors

    from mobius_fed import checkpoint

    path = save_checkpoint(tmp_path / "c.ckpt", {"v": 1})

    def failing_write(specs, filename, metadata=None):  # a disk that fails mid-file
        Path(filename).write_bytes(b"par")
        raise safetensors.SafetensorError("I/O error: Input/output error (os error 5)")

    monkeypatch.setattr(checkpoint, "serialize_file", failing_write)
    with pytest.raises(CheckpointError, match=r"c\.ckpt.*Input/output error \(EIO\)"):
        save_checkpoint(path, {"v": 2})
    monkeypatch.undo()
    assert load_checkpoint(path) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]


def test_unwritable_places_are_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"file/inside\.ckpt: (File exists|Not a directory)"):
        save_checkpoint(blocker / "inside.ckpt", {"v": 1})
    ro = tmp_path / "ro"
    if _tiny_tmpfs(ro, "ro,size=64k"):
        try:
            with pytest.raises(
                CheckpointError, match=r"ro/c\.ckpt: Read-only file system \(EROFS\)"
            ):
                save_checkpoint(ro / "c.ckpt", {"v": 1})
        finally:
            subprocess.run(["umount", str(ro)], check=False)
    elif os.geteuid() != 0:
        ro.chmod(0o500)
        with pytest.raises(CheckpointError, match=r"ro/c\.ckpt: Permission denied \(EACCES\)"):
            save_checkpoint(ro / "c.ckpt", {"v": 1})


def _tiny_tmpfs(path: Path, options: str = "size=64k") -> bool:
    path.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    return r.returncode == 0


def test_disk_full_is_named_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    if _tiny_tmpfs(mnt):
        try:
            _check_enospc(mnt)
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
        return
    # No mount permission: the same check in a child limited by RLIMIT_FSIZE (EFBIG).
    script = textwrap.dedent(
        f"""
        import os, resource, signal, sys
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch
        torch.set_num_threads(1)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        sys.path.insert(0, {str(REPO)!r})
        from mobius_fed.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
        d = {str(mnt)!r}
        save_checkpoint(d + "/c.ckpt", {{"w": torch.zeros(1000)}})
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        try:
            save_checkpoint(d + "/c.ckpt", {{"w": torch.ones(100000)}})
        except CheckpointError as e:
            print("ERR", e)
        assert torch.equal(load_checkpoint(d + "/c.ckpt")["w"], torch.zeros(1000))
        print("FILES", sorted(os.listdir(d)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert f"ERR cannot write checkpoint {mnt}/c.ckpt" in out.stdout and "EFBIG" in out.stdout
    assert "FILES ['c.ckpt']" in out.stdout


def _check_enospc(mnt: Path) -> None:
    path = save_checkpoint(mnt / "c.ckpt", {"w": torch.zeros(1000)})  # ~4 KiB
    before = path.read_bytes()
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(path, {"w": torch.ones(100_000)})  # 400 KB > 64 KiB
    msg = str(err.value)
    assert str(path) in msg and "No space left on device (ENOSPC)" in msg, msg
    assert sorted(p.name for p in mnt.iterdir()) == ["c.ckpt"]  # no temporary file
    assert path.read_bytes() == before
    assert torch.equal(load_checkpoint(path)["w"], torch.zeros(1000))


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for r in (1, 2, 3, 10):
        save_checkpoint(tmp_path / f"round-{r:06d}.ckpt", {"r": r})
    dead = tmp_path / f".round-000011.ckpt{TMP_MARKER}999999999-abcd"
    dead.mkdir()  # what a writer killed mid-file leaves: its private directory
    (dead / "round-000011.ckpt").write_bytes(b"partial")
    removed = prune_checkpoints(tmp_path, "round-*.ckpt", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000003.ckpt", "round-000010.ckpt"]
    assert dead in removed
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, "round-*.ckpt", keep=0)
    rounds = tmp_path / "coordinator"
    for r in (5, 10, 15):
        save_checkpoint(rounds / f"round-{r:06d}" / "er.ckpt", {"r": r})
    prune_checkpoints(rounds, "round-*", keep=1)
    assert [p.name for p in rounds.iterdir()] == ["round-000015"]
