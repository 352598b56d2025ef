"""The ring: real mobius-worker processes over mTLS gRPC on loopback, equal to the reference."""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from mobius_fed.data import SiteData
from mobius_fed.proto import ring_pb2, ring_pb2_grpc
from mobius_fed.transport.certs import init_certs
from mobius_fed.transport.codec import make_frame
from mobius_fed.transport.tls import NodeTLS, open_channel
from tests.ring_harness import CutProxy, Ring

pytestmark = pytest.mark.slow

BASE = dict(preset="cpu-tiny", steps=10, batch_size=4, sync_every=0, eval_every=0)


def assert_matches_reference(ring: Ring, tol: float = 1e-5) -> float:
    ref, ref_eval = ring.reference()
    got = ring.losses()
    assert set(got) == set(ref), "every (step, origin) loss must be reported"
    worst = max(abs(got[k] - ref[k]) for k in ref)
    assert worst <= tol, f"ring differs from the reference engine by {worst:.3g}"
    ring_eval = ring.eval_losses()
    assert max(abs(ring_eval[s] - v) for s, v in enumerate(ref_eval)) <= tol
    for i in range(ring.P):  # and the ring shut down cleanly: every FIN went round
        assert "not every peer finished" not in ring.log(i, tail=None), ring.log(i)
    return worst


@pytest.mark.parametrize(
    ("P", "order", "optimizer", "micro"),
    [
        (4, "cyclic", "adamw", 1),
        (4, "ordered", "adamw", 1),
        (2, "cyclic", "adamw", 1),
        (3, "ordered", "adamw", 1),
        # Two micro-batches at P = 3 here; at P = 4 (the slowest point, 15 s) in the long
        # matrix: P = 4 runs above with one micro-batch, M = 2 on the next line.
        pytest.param(4, "cyclic", "adamw", 2, marks=pytest.mark.long),
        (3, "cyclic", "adamw", 2),
    ],
)
def test_ring_equals_reference(tmp_path: Path, P: int, order: str, optimizer: str, micro: int):
    train = {**BASE, "order": order, "optimizer": optimizer, "micro_batches": micro}
    ring = Ring(tmp_path, P, train).prepare().start()
    ring.wait()
    assert_matches_reference(ring)


@pytest.mark.parametrize(
    ("P", "order", "loops", "split"),
    [
        (4, "cyclic", 2, "4,4,2,2"),
        (4, "ordered", 1, "4,4,2,2"),
        (3, "cyclic", 1, "2,6,4"),
        (3, "ordered", 2, "1,4,7"),
    ],
)
def test_ring_with_uneven_groups_equals_reference(
    tmp_path: Path, P: int, order: str, loops: int, split: str
):
    """Groups sized to their sites (``--layers-per-group``): every worker builds its own
    F_i from the split, and the ring's train and eval losses equal the reference's bit for
    bit (docs/ring.md, "Sites of unequal speed"); with worker-1 emulating a site ×2 slower
    (``--emulate-slowdown``, as the speed benchmark runs it) too."""
    train = {**BASE, "steps": 4, "order": order, "loops": loops, "layers_per_group": split}
    train.update(optimizer="adamw", eval_batches=1)
    ring = Ring(tmp_path, P, train).prepare().start(extra={1: ["--emulate-slowdown", "2"]})
    ring.wait()
    assert assert_matches_reference(ring, tol=0.0) == 0.0


def test_ring_with_muon_equals_reference_and_no_raw_data_leaves_home(tmp_path: Path):
    """Muon (bf16 Newton–Schulz) too: the ring feeds every kernel the same fp32 inputs in
    the same accumulation order as the reference, so gradients are bitwise equal and even
    bf16 rounding cannot diverge; the bound stays the 1e-5 of the fp32 contract."""
    train = {**BASE, "order": "cyclic", "optimizer": "muon", "steps": 6}
    ring = Ring(tmp_path, 4, train).prepare()
    capture = tmp_path / "worker-0.frames"
    ring.start(extra={0: ["--capture-frames", str(capture)]}).wait()
    assert_matches_reference(ring)

    sent = capture.read_bytes()
    assert len(sent) > 100_000, "the capture must hold the frames worker 0 sent"
    cfg = ring.config()
    site = SiteData(ring.site(0), cfg.model().seq_len)
    for step in range(cfg.steps):
        x, y = site.batch("train", seed=cfg.seed, step=step, batch_size=cfg.batch_size)
        for seq in (*x, *y):
            window = seq[:24].numpy()
            for dtype in (np.uint8, np.uint16, np.int32, np.int64):  # text bytes, ids
                assert window.astype(dtype).tobytes() not in sent


def _tls(certs: Path, name: str) -> NodeTLS:
    """Node ``name``'s own bundle (a daemon refuses a directory holding others' keys)."""
    d = certs / "nodes" / name
    return NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key")


HANDSHAKE = (("mobius-run", "test-run"), ("mobius-ack", "0"))  # a new ring session


def _wait_listening(port: int, certs: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ch = open_channel(f"127.0.0.1:{port}", _tls(certs, "worker-0"), target_name="worker-1")
        try:
            ring_pb2_grpc.RingLinkStub(ch).Ping(ring_pb2.PingRequest(), timeout=2)
            return
        except grpc.RpcError:
            time.sleep(0.3)
        finally:
            ch.close()
    raise AssertionError("worker-1 never started listening")


def _send(
    port: int, tls: NodeTLS | None, frames: list[ring_pb2.Frame], creds=None
) -> grpc.RpcError:
    if creds is not None:
        ch = grpc.secure_channel(
            f"127.0.0.1:{port}", creds, [("grpc.ssl_target_name_override", "worker-1")]
        )
    else:
        ch = open_channel(f"127.0.0.1:{port}", tls, target_name="worker-1")
    try:
        with pytest.raises(grpc.RpcError) as info:
            stream = ring_pb2_grpc.RingLinkStub(ch).Stream
            for _ in stream(iter(frames), timeout=20, metadata=HANDSHAKE):
                pass
        return info.value
    finally:
        ch.close()


def test_strangers_and_bad_frames_are_refused_while_the_ring_trains(tmp_path: Path):
    train = {**BASE, "steps": 8, "order": "cyclic", "optimizer": "adamw"}
    ring = Ring(tmp_path, 4, train).prepare()
    port, certs = ring.ports[1], ring.certs
    # Workers 1..3 first: worker 1 serves but stays at step 0 until worker 0 joins.
    ring.start(only=(1, 2, 3))
    try:
        _wait_listening(port, certs)
        shape = (4, 32, 32)  # batch_size 4 / 1 micro-batch, seq_len 32, d_model 32
        good = dict(
            run_id="test-run", step=0, origin=0, tick=1, micro=0, direction=ring_pb2.FORWARD
        )

        def frame(**over) -> ring_pb2.Frame:
            tensor = over.pop("tensor", torch.randn(shape))
            return make_frame(**{**good, **over}, tensor=tensor)

        # --- strangers -------------------------------------------------------
        ca = (certs / "ca.crt").read_bytes()
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        err = _send(port, None, [frame()], creds=no_cert)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        other = init_certs(tmp_path / "other-ca", 4)
        o = other.worker(0)
        foreign = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=o.key.read_bytes(),
            certificate_chain=o.cert.read_bytes(),
        )
        err = _send(port, None, [frame()], creds=foreign)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        err = _send(port, _tls(certs, "worker-3"), [frame()])
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "predecessor" in err.details() and "worker/3" in err.details()

        # --- bad frames from the predecessor's identity -----------------------
        pred = _tls(certs, "worker-0")
        bad_len = frame()
        bad_len.tensor.data = bad_len.tensor.data[:-4]
        bad_len.tensor.crc32 = zlib.crc32(bad_len.tensor.data)
        bad_crc = frame()
        bad_crc.tensor.crc32 ^= 1
        nan = torch.randn(shape)
        nan[0, 0, 0] = float("nan")
        inf = torch.randn(shape)
        inf[1, 2, 3] = float("inf")
        cases = {  # what is wrong → (frame, words the refusal must contain)
            "run": (frame(run_id="someone-else"), "run_id"),
            "step": (frame(step=10_000), "step 10000"),
            "origin": (frame(origin=9), "origin 9"),
            "shape": (frame(tensor=torch.randn(4, 32, 31)), "shape"),
            "dtype": (make_frame(**good, tensor=torch.randn(shape), wire="bf16"), "dtype"),
            "length": (bad_len, "16380 data bytes"),
            "checksum": (bad_crc, "crc"),
            "nan": (frame(tensor=nan), "non-finite"),
            "inf": (frame(tensor=inf), "non-finite"),
        }
        for what, (bad, words) in cases.items():
            err = _send(port, pred, [bad])
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert "rejected" in err.details() and words in err.details(), (what, err.details())

        # --- the genuine ring still trains, equal to the reference ------------
        # Once worker 0's stream is live, a second stream with its key is refused outright;
        # until then a bad frame is refused as above.
        ring.start(only=(0,))
        late_refusals, deadline = 0, time.monotonic() + 60
        while True:
            err = _send(port, pred, [cases["step"][0]])
            if err.code() == grpc.StatusCode.ALREADY_EXISTS:
                break
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
            late_refusals += 1
            assert time.monotonic() < deadline, "worker 0's stream never came up"
            time.sleep(0.2)
        assert "already has a live ring stream from mobius://worker/0" in err.details()
        ring.wait()
    finally:
        ring.stop()
    assert_matches_reference(ring)
    log1 = ring.log(1, tail=None)
    refused = log1.count(" rejected from mobius://worker/0 on edge worker-0 → worker-1: ")
    assert refused == len(cases) + late_refusals, "each bad frame is logged once, by culprit"
    assert "refused stream" in log1 and "mobius://worker/3" in log1


def test_a_cut_ring_edge_reconnects_and_the_run_equals_the_reference(tmp_path: Path):
    """A proxy on the edge worker-0 → worker-1 resets the connection in the middle of a
    step and refuses connections for 3 s: the edge reconnects within its grace, both ends
    resend what the other did not receive, and the losses are those of an undisturbed run."""
    train = {**BASE, "steps": 6, "order": "cyclic", "optimizer": "adamw"}
    ring = Ring(tmp_path, 3, train).prepare()
    proxy = CutProxy(ring.ports[1])
    ring.dial[0] = proxy.port  # worker 0 reaches worker 1 through the proxy
    cut_at = []
    # About 3 steps' worth of forward frames, then cut in the middle of the next one.
    proxy.on_bytes(150_000, lambda: (cut_at.append(time.monotonic()), proxy.cut(refuse_s=3.0)))
    try:
        ring.start().wait()
    finally:
        proxy.close()
    assert proxy.cuts >= 1 and cut_at, "the proxy never cut the edge"
    assert_matches_reference(ring, tol=0.0)
    log0, log1 = ring.log(0, tail=None), ring.log(1, tail=None)
    assert (
        "ring edge worker-0 → worker-1 down" in log0
        and "ring edge worker-0 → worker-1 back" in log0
    )
    assert (
        "ring edge worker-0 → worker-1 down" in log1
        and "ring edge worker-0 → worker-1 back" in log1
    )
