"""RingLinks in-process over mTLS on loopback: chunked tensors, relays, bad pieces, capture."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.proto import ring_pb2, ring_pb2_grpc
from mobius_fed.transport.certs import CertLayout, init_certs
from mobius_fed.transport.codec import WIRE_DTYPES, chunk_count, encode_frames
from mobius_fed.transport.tls import open_channel
from mobius_fed.worker.frames import BACKWARD, FORWARD, TRAIN, FrameKey, FrameRules
from mobius_fed.worker.link import RingLinks

RUN = "link-test"
CHUNK = 256 << 10  # (8, 256, 192) fp32 = 1.5 MiB -> 6 pieces; bf16/fp16 -> 3 pieces
SHAPE = (8, 256, 192)
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertLayout:
    return init_certs(tmp_path_factory.mktemp("certs"), workers=3)


def _config(P: int, wire: str = "fp32") -> TrainConfig:
    return TrainConfig(preset="cpu-base", batch_size=8, workers=P, wire_dtype=wire)


def _ring(
    certs: CertLayout,
    P: int,
    wire: str = "fp32",
    capture: Path | None = None,
    chunk_bytes: int = CHUNK,
) -> list[RingLinks]:
    cfg = _config(P, wire)
    links = [
        RingLinks(
            FrameRules(cfg, r, RUN, lambda: 0),
            listen="127.0.0.1:0",
            successor="",
            tls=certs.worker(r),
            peer_timeout=TIMEOUT,
            capture=capture if r == 0 else None,
            chunk_bytes=chunk_bytes,
        )
        for r in range(P)
    ]
    ports = [link.start_server() for link in links]
    for r, link in enumerate(links):
        link.successor_addr = f"127.0.0.1:{ports[(r + 1) % P]}"
    for link in links:
        link.connect()
    return links


def _close(links: list[RingLinks]) -> None:
    """Close all at once, as the workers of a ring do after FIN (each close waits for the
    successor's side of the stream to end)."""
    threads = [threading.Thread(target=link.close) for link in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.fixture
def ring2(certs: CertLayout, request: pytest.FixtureRequest) -> Iterator[list[RingLinks]]:
    links = _ring(certs, 2, getattr(request, "param", "fp32"))
    yield links
    _close(links)


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) * 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("ring2", ["fp32", "bf16", "fp16"], indirect=True)
def test_chunked_round_trip_is_bitwise_exact(ring2: list[RingLinks]) -> None:
    a, b = ring2
    wire = a.rules.cfg.wire_dtype
    x = _x()
    assert chunk_count(x.numel(), WIRE_DTYPES[wire].itemsize, CHUNK) > 1
    fwd = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)  # slot 1 of stream 0: read by worker 1
    a.send_tensor(fwd, x)
    got = b.inbox.get(fwd, TIMEOUT, "forward")
    want = x.to(WIRE_DTYPES[wire]).float()
    assert got.dtype == torch.float32 and got.shape == SHAPE
    assert torch.equal(_bits(got), _bits(want))
    bwd = FrameKey(TRAIN, 0, BACKWARD, 0, 1, 0)  # its gradient: back to worker 0
    g = _x(1)
    b.send_tensor(bwd, g)
    back = a.inbox.get(bwd, TIMEOUT, "backward")
    assert torch.equal(_bits(back), _bits(g.to(WIRE_DTYPES[wire]).float()))
    assert a.forward_out.frames_sent == chunk_count(x.numel(), WIRE_DTYPES[wire].itemsize, CHUNK)
    assert not a.rejected and not b.rejected


def test_interleaved_tensors_and_small_ones(ring2: list[RingLinks]) -> None:
    """Pieces of different tensors may interleave on one stream; small ones are one frame."""
    a, b = ring2
    k1, k2 = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0), FrameKey(TRAIN, 1, FORWARD, 0, 1, 0)
    f1 = list(_frames(k1, _x(1)))
    f2 = list(_frames(k2, _x(2)))
    for p, q in zip(f1, f2, strict=True):
        a.forward_out.put(p)
        a.forward_out.put(q)
    assert torch.equal(b.inbox.get(k2, TIMEOUT, "k2"), _x(2))
    assert torch.equal(b.inbox.get(k1, TIMEOUT, "k1"), _x(1))
    assert a.forward_out.frames_sent == len(f1) + len(f2) == 12


def test_tensor_within_chunk_size_is_one_frame(certs: CertLayout) -> None:
    links = _ring(certs, 2, chunk_bytes=2 << 20)  # 1.5 MiB fits
    try:
        a, b = links
        key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
        a.send_tensor(key, _x())
        assert torch.equal(b.inbox.get(key, TIMEOUT, "forward"), _x())
        assert a.forward_out.frames_sent == 1
    finally:
        _close(links)


def test_relay_forwards_pieces_through_the_middle_worker(certs: CertLayout) -> None:
    links = _ring(certs, 3)
    try:
        w0, w1, w2 = links
        fwd = FrameKey(TRAIN, 0, FORWARD, 2, 3, 0)  # slot K of stream 2: home, worker 2
        assert w0.rules.destination(_header(fwd)) == 2
        x = _x()
        w0.send_tensor(fwd, x)
        assert torch.equal(w2.inbox.get(fwd, TIMEOUT, "relayed forward"), x)
        bwd = FrameKey(TRAIN, 0, BACKWARD, 0, 0, 0)  # slot 0 of stream 0: its embedding
        assert w2.rules.destination(_header(bwd)) == 0
        g = _x(1)
        w2.send_tensor(bwd, g)
        assert torch.equal(w0.inbox.get(bwd, TIMEOUT, "relayed backward"), g)
        n = chunk_count(x.numel(), 4, CHUNK)
        # The relay re-sent the very bytes it received: same frames, same byte count.
        assert w1.forward_out.frames_sent == n and w1._backward_out is not None
        assert w1.forward_out.bytes_sent == w0.forward_out.bytes_sent
        assert w1._backward_out.frames_sent == n
        assert w1._backward_out.bytes_sent == w2._backward_out.bytes_sent  # type: ignore[union-attr]
        assert not w1.inbox._items, "a relay keeps nothing"
        assert not any(link.rejected for link in links)
    finally:
        _close(links)


def test_capture_holds_exactly_the_bytes_sent(certs: CertLayout, tmp_path: Path) -> None:
    capture = tmp_path / "w0.frames"
    links = _ring(certs, 2, capture=capture)
    try:
        a, b = links
        keys = [FrameKey(TRAIN, s, FORWARD, 0, 1, 0) for s in (0, 1)]
        for i, k in enumerate(keys):
            a.send_tensor(k, _x(i))
        for k in keys:
            b.inbox.get(k, TIMEOUT, "forward")
    finally:
        _close(links)
    want = b"".join(p for i, k in enumerate(keys) for p in _frames(k, _x(i)))
    data = capture.read_bytes()
    assert data == want
    assert len(data) == a.bytes_sent == a.forward_out.bytes_sent


# ------------------------------------------------------------------------ bad pieces


def _header(key: FrameKey) -> ring_pb2.Frame:
    return ring_pb2.Frame(
        run_id=RUN,
        step=key.step,
        origin=key.origin,
        tick=key.tick,
        micro=key.micro,
        direction=key.direction,
        phase=key.phase,
    )


def _frames(key: FrameKey, x: torch.Tensor, wire: str = "fp32") -> Iterator[bytes]:
    return encode_frames(
        run_id=RUN,
        step=key.step,
        origin=key.origin,
        tick=key.tick,
        micro=key.micro,
        direction=key.direction,
        phase=key.phase,
        tensor=x,
        wire=wire,
        chunk_bytes=CHUNK,
    )


def _pieces() -> list[ring_pb2.Frame]:
    key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
    return [ring_pb2.Frame.FromString(p) for p in _frames(key, _x())]


def _bad_offset() -> list[ring_pb2.Frame]:
    p = _pieces()
    p[1].tensor.offset += 1
    return p[:2]


def _short_piece() -> list[ring_pb2.Frame]:
    p = _pieces()
    p[2].tensor.data = p[2].tensor.data[:-3]  # not a whole number of elements
    p[2].tensor.crc32 = zlib.crc32(p[2].tensor.data)
    return p[:3]


def _short_last() -> list[ring_pb2.Frame]:
    p = _pieces()
    p[5].tensor.data = p[5].tensor.data[:-4]
    p[5].tensor.crc32 = zlib.crc32(p[5].tensor.data)
    return p


def _gap() -> list[ring_pb2.Frame]:
    """A shorter (legal) piece 2 leaves a gap before piece 3's offset."""
    p = _pieces()
    p[2].tensor.data = p[2].tensor.data[:-4]
    p[2].tensor.crc32 = zlib.crc32(p[2].tensor.data)
    return p[:4]


def _bad_crc() -> list[ring_pb2.Frame]:
    p = _pieces()
    p[3].tensor.crc32 ^= 1
    return p[:4]


def _nan_piece() -> list[ring_pb2.Frame]:
    x = _x()
    x.view(-1)[3 * (CHUNK // 4) + 5] = float("nan")  # inside piece 3
    key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
    return [ring_pb2.Frame.FromString(p) for p in _frames(key, x)]


def _wrong_total() -> list[ring_pb2.Frame]:
    p = _pieces()
    p[1].chunks += 1
    return p[:2]


def _wrong_shape() -> list[ring_pb2.Frame]:
    p = _pieces()
    del p[1].tensor.shape[:]
    p[1].tensor.shape.extend([8, 256, 191])
    return p[:2]


def _too_many() -> list[ring_pb2.Frame]:
    p = _pieces()
    p[0].chunks = p[0].tensor.shape[0] * 256 * 192 + 1
    return p[:1]


BAD = {  # what is wrong -> (frames to send, words the refusal must contain)
    "out of order": (lambda: [_pieces()[1]], "chunk 1 of 6"),
    "skipped": (lambda: [_pieces()[i] for i in (0, 2)], "expected chunk 1: missing"),
    "duplicate": (lambda: [_pieces()[i] for i in (0, 1, 1)], "duplicate chunk 1 of 6"),
    "wrong total": (_wrong_total, "chunks 7"),
    "bad offset": (_bad_offset, "offset 65537"),
    "short piece": (_short_piece, "262141 data bytes in chunk 2 of 6"),
    "short last": (_short_last, "262140 data bytes in chunk 5 of 6"),
    "gap": (_gap, "offset 196608 in chunk 3 of 6"),
    "crc": (_bad_crc, "crc"),
    "non-finite": (_nan_piece, "non-finite"),
    "shape": (_wrong_shape, "shape"),
    "too many": (_too_many, "chunks 393217"),
    "restarted": (lambda: [*_pieces()[:-1], _pieces()[0]], "duplicate chunk 0 of 6"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_pieces_are_refused(certs: CertLayout, what: str) -> None:
    links = _ring(certs, 2)
    a, b = links
    try:
        frames, words = BAD[what]
        port = int(a.successor_addr.rsplit(":", 1)[1])  # worker 1's server
        ch = open_channel(f"127.0.0.1:{port}", certs.worker(0), target_name="worker-1")
        with ch, pytest.raises(grpc.RpcError) as err:
            for _ in ring_pb2_grpc.RingLinkStub(ch).Stream(iter(frames()), timeout=TIMEOUT):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
        details = err.value.details()
        assert "rejected" in details and words in details, (what, details)
        assert b.rejected == [details]
        # The worker keeps serving: the genuine link still carries a chunked tensor.
        key = FrameKey(TRAIN, 1, FORWARD, 0, 1, 0)
        a.send_tensor(key, _x(5))
        assert torch.equal(b.inbox.get(key, TIMEOUT, "after the refusal"), _x(5))
    finally:
        _close(links)
