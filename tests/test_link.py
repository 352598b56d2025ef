"""RingLinks in-process over mTLS on loopback: chunked tensors, relays, bad pieces,
capture, one session per edge, leftovers and replays, message limits, keepalive, and
transient link faults (a TCP proxy that cuts the connection)."""

from __future__ import annotations

import socket
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.proto import ring_pb2
from mobius_fed.transport.certs import CertLayout, init_certs
from mobius_fed.transport.codec import WIRE_DTYPES, chunk_count, encode_frames
from mobius_fed.transport.tls import open_channel
from mobius_fed.worker.commitments import RECEIVED, SENT, FrameLedger
from mobius_fed.worker.frames import BACKWARD, FIN, FORWARD, TRAIN, FrameKey, FrameRules
from mobius_fed.worker.link import LinkTimers, PeerError, RingLinks
from mobius_fed.worker.link_session import ACK_EVERY, Endpoint, FrameRouter, Inbox
from tests.ring_harness import CutProxy

RUN = "link-test"
CHUNK = 256 << 10  # (8, 256, 192) fp32 = 1.5 MiB -> 6 pieces; bf16/fp16 -> 3 pieces
SHAPE = (8, 256, 192)
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertLayout:
    return init_certs(tmp_path_factory.mktemp("certs"), workers=3)


def _config(P: int, wire: str = "fp32", order: str = "cyclic") -> TrainConfig:
    return TrainConfig(preset="cpu-base", batch_size=8, workers=P, wire_dtype=wire, order=order)


def _links(
    certs: CertLayout,
    P: int,
    wire: str = "fp32",
    capture: Path | None = None,
    chunk_bytes: int = CHUNK,
    order: str = "cyclic",
    **kw,
) -> list[RingLinks]:
    """P RingLinks with their servers started and successors set, not yet connected."""
    cfg = _config(P, wire, order)
    links = [
        RingLinks(
            FrameRules(cfg, r, RUN, lambda: 0),
            listen="127.0.0.1:0",
            successor="",
            tls=certs.bundle(f"worker-{r}"),
            peer_timeout=TIMEOUT,
            capture=capture if r == 0 else None,
            chunk_bytes=chunk_bytes,
            **kw,
        )
        for r in range(P)
    ]
    ports = [link.start_server() for link in links]
    for r, link in enumerate(links):
        link.successor_addr = f"127.0.0.1:{ports[(r + 1) % P]}"
    return links


def _ring(certs: CertLayout, P: int, *args, **kw) -> list[RingLinks]:
    links = _links(certs, P, *args, **kw)
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
    """Ordered mode relays: stream 1's embedding travels home 1 → 2 → 0 (its first group)."""
    links = _ring(certs, 3, order="ordered")
    try:
        w0, w1, w2 = links
        fwd = FrameKey(TRAIN, 0, FORWARD, 1, 0, 0)
        assert w1.rules.route(FORWARD, 1, 0) == [1, 2, 0]
        x = _x()
        w1.send_tensor(fwd, x)
        assert torch.equal(w0.inbox.get(fwd, TIMEOUT, "relayed forward"), x)
        bwd = FrameKey(TRAIN, 0, BACKWARD, 1, 0, 0)  # its gradient: 0 → 2 → 1
        g = _x(1)
        w0.send_tensor(bwd, g)
        assert torch.equal(w1.inbox.get(bwd, TIMEOUT, "relayed backward"), g)
        n = chunk_count(x.numel(), 4, CHUNK)
        # The relay re-sent the very bytes it received: same frames, same byte count.
        back1, back2 = w0.backward_out, w2.backward_out
        assert back1 is not None and back2 is not None
        assert w2.forward_out.frames_sent == n
        assert w2.forward_out.bytes_sent == w1.forward_out.bytes_sent
        assert back2.frames_sent == n and back2.bytes_sent == back1.bytes_sent
        assert not w2.inbox._items, "a relay keeps nothing"
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


HANDSHAKE = (("mobius-run", RUN), ("mobius-ack", "0"))  # opens a new ring session


def _raw_stream(port: int, tls, frames, *, metadata=HANDSHAKE, timeout: float = TIMEOUT):
    """Send ``frames`` (messages or bytes) on a Stream of our own; return the RpcError."""
    ch = open_channel(f"127.0.0.1:{port}", tls, target_name="worker-1")
    raw = [f if isinstance(f, bytes) else f.SerializeToString() for f in frames]
    with ch, pytest.raises(grpc.RpcError) as err:
        call = ch.stream_stream(
            "/mobius_fed.ring.v1.RingLink/Stream",
            request_serializer=None,
            response_deserializer=None,
        )
        for _ in call(iter(raw), timeout=timeout, metadata=metadata):
            pass
    return err.value


@pytest.mark.parametrize("what", list(BAD))
def test_bad_pieces_are_refused(certs: CertLayout, what: str) -> None:
    """Bad pieces from the predecessor's identity, before the genuine link is up: refused,
    named, and the genuine predecessor connects and delivers afterwards."""
    links = _links(certs, 2)
    a, b = links
    try:
        b.connect()
        port = int(a.successor_addr.rsplit(":", 1)[1])  # worker 1's server
        frames, words = BAD[what]
        err = _raw_stream(port, certs.bundle("worker-0"), frames())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, what
        details = err.details()
        assert "rejected" in details and words in details, (what, details)
        assert "from mobius://worker/0 on edge worker-0 → worker-1" in details
        assert b.rejected == [details]
        # The worker keeps serving: the genuine link carries a chunked tensor.
        a.connect()
        key = FrameKey(TRAIN, 1, FORWARD, 0, 1, 0)
        a.send_tensor(key, _x(5))
        assert torch.equal(b.inbox.get(key, TIMEOUT, "after the refusal"), _x(5))
    finally:
        _close(links)


# ------------------------------------------------------------------ sessions and trust


def test_one_live_stream_per_edge(certs: CertLayout) -> None:
    links = _ring(certs, 2)
    try:
        a, b = links
        port = int(a.successor_addr.rsplit(":", 1)[1])
        t0 = time.monotonic()
        err = _raw_stream(port, certs.bundle("worker-0"), [])
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "already has a live ring stream from mobius://worker/0" in err.details()
        # refused at once: a stream it held would end only at its deadline (TIMEOUT)
        assert time.monotonic() - t0 < TIMEOUT / 4, "refused at once"
        bogus = (*HANDSHAKE[:1], ("mobius-session", "00" * 16), ("mobius-ack", "0"))
        err = _raw_stream(port, certs.bundle("worker-0"), [], metadata=bogus)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        err = _raw_stream(port, certs.bundle("worker-0"), [], metadata=())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a ring link client" in err.details()
        wrong_run = (("mobius-run", "another-run"), ("mobius-ack", "0"))
        err = _raw_stream(port, certs.bundle("worker-0"), [], metadata=wrong_run)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "another-run" in err.details()
        # The genuine link is untouched.
        key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
        a.send_tensor(key, _x())
        assert torch.equal(b.inbox.get(key, TIMEOUT, "genuine"), _x())
        assert b.edge_states()["in"]["state"] == "up"
    finally:
        _close(links)


def _frames_of(key: FrameKey, x: torch.Tensor, chunk: int = CHUNK) -> list[bytes]:
    return list(
        encode_frames(
            run_id=RUN,
            step=key.step,
            origin=key.origin,
            tick=key.tick,
            micro=key.micro,
            direction=key.direction,
            phase=key.phase,
            tensor=x,
            chunk_bytes=chunk,
        )
    )


def _session(port: int, tls, frames: list[bytes]):
    """Open a session of our own, send ``frames`` and keep the request side open (no
    half-close) until the call is cancelled; return (channel, call)."""
    ch = open_channel(f"127.0.0.1:{port}", tls, target_name="worker-1")
    done = threading.Event()

    def requests() -> Iterator[bytes]:
        yield from frames
        done.wait()

    call = ch.stream_stream(
        "/mobius_fed.ring.v1.RingLink/Stream", request_serializer=None, response_deserializer=None
    )(requests(), metadata=HANDSHAKE)
    call.add_done_callback(lambda _: done.set())
    md = dict(call.initial_metadata())
    assert "mobius-session" in md, call.details()
    return ch, call


def test_a_closed_sessions_leftovers_never_block_the_genuine_frames(certs: CertLayout) -> None:
    """A session that delivered a whole frame and half of another, then went away: both
    are dropped when the genuine predecessor's session replaces it."""
    links = _links(certs, 2)
    a, b = links
    try:
        b.connect()
        port = int(a.successor_addr.rsplit(":", 1)[1])
        k1, k2 = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0), FrameKey(TRAIN, 1, FORWARD, 0, 1, 0)
        junk = torch.full(SHAPE, 7.0)
        frames = _frames_of(k1, junk) + _frames_of(k2, junk)[:2]
        ch, call = _session(port, certs.bundle("worker-0"), frames)
        deadline = time.monotonic() + TIMEOUT
        while k1 not in b.inbox._items:  # delivered, not consumed
            assert time.monotonic() < deadline
            time.sleep(0.02)
        call.cancel()
        ch.close()
        a.connect()  # a new session: the stale one and its leftovers are dropped
        a.send_tensor(k1, _x(1))
        a.send_tensor(k2, _x(2))
        assert torch.equal(b.inbox.get(k1, TIMEOUT, "genuine k1"), _x(1))
        assert torch.equal(b.inbox.get(k2, TIMEOUT, "genuine k2"), _x(2))
        assert not b.rejected
    finally:
        _close(links)


def test_a_consumed_key_is_never_accepted_again(certs: CertLayout) -> None:
    links = _links(certs, 2)
    a, b = links
    try:
        b.connect()
        port = int(a.successor_addr.rsplit(":", 1)[1])
        key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
        frames = _frames_of(key, _x(3))
        ch, call = _session(port, certs.bundle("worker-0"), [*frames])
        assert torch.equal(b.inbox.get(key, TIMEOUT, "first copy"), _x(3))
        call.cancel()
        ch.close()
        err = _raw_stream(port, certs.bundle("worker-0"), frames)  # the same bytes again
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "replay of TRAIN FORWARD step 0 origin 0 slot 1 micro 0" in err.details()
        dup = _raw_stream(
            port,
            certs.bundle("worker-0"),
            _frames_of(key.__class__(TRAIN, 1, FORWARD, 0, 1, 0), _x()) * 2,
        )
        assert "duplicate" in dup.details() or "duplicate chunk 0" in dup.details()
    finally:
        _close(links)


def test_frames_off_their_route_are_refused_never_relayed(certs: CertLayout) -> None:
    """Cyclic order never relays: worker 1 refuses, from worker 0, a frame that worker 2
    (not 0) produces, and a frame it would have to pass on."""
    links = _links(certs, 3)
    w0, w1, w2 = links
    try:
        w1.connect()
        w2.connect()
        port = int(w0.successor_addr.rsplit(":", 1)[1])
        cases = {  # key → words
            FrameKey(TRAIN, 0, FORWARD, 1, 2, 0): "route is worker-2 → worker-0",
            FrameKey(TRAIN, 0, FORWARD, 0, 2, 0): "route is worker-1 → worker-2",
        }
        for key, words in cases.items():
            err = _raw_stream(port, certs.bundle("worker-0"), _frames_of(key, _x()))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in err.details() and "cannot arrive from worker-0" in err.details()
        assert w1.forward_out.frames_sent == 0, "nothing was relayed"
        fin = ring_pb2.Frame(run_id=RUN, origin=1, direction=FIN)  # worker 1's own FIN
        err = _raw_stream(port, certs.bundle("worker-0"), [fin])
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        fat = ring_pb2.Frame(run_id=RUN, origin=0, direction=FIN)
        fat.tensor.shape.append(1)
        err = _raw_stream(port, certs.bundle("worker-0"), [fat])
        assert "FIN from origin 0 carries a tensor" in err.details()
        assert len(w1.rejected) == 4
    finally:
        _close(links)


def test_messages_larger_than_a_piece_are_refused(certs: CertLayout) -> None:
    links = _ring(certs, 2)
    try:
        a, b = links
        port = int(a.successor_addr.rsplit(":", 1)[1])
        ch = open_channel(f"127.0.0.1:{port}", certs.bundle("worker-0"), target_name="worker-1")
        big = b"\x0a" + b"\xff\xff\xff\x01" + b"\0" * (CHUNK + (128 << 10))  # > CHUNK + slack
        ping = ch.unary_unary(
            "/mobius_fed.ring.v1.RingLink/Ping", request_serializer=None, response_deserializer=None
        )
        with ch, pytest.raises(grpc.RpcError) as err:
            ping(big, timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
        a.send_tensor(key, _x())
        assert torch.equal(b.inbox.get(key, TIMEOUT, "after"), _x())
    finally:
        _close(links)


# --------------------------------------------------------------------- link faults

FAST = LinkTimers(
    client_keepalive_ms=1000,
    server_keepalive_ms=1000,
    keepalive_timeout_ms=1000,
    min_ping_interval_ms=500,
)


def _proxied(
    certs: CertLayout, client_timers: LinkTimers | None = None, **kw
) -> tuple[list[RingLinks], CutProxy]:
    """A P=2 ring whose edge worker-0 → worker-1 runs through a cutting proxy, connected;
    ``client_timers``: worker 0's keepalive on that edge (its server keeps the defaults)."""
    links = _links(certs, 2, **kw)
    proxy = CutProxy(int(links[0].successor_addr.rsplit(":", 1)[1]))
    links[0].successor_addr = f"127.0.0.1:{proxy.port}"
    if client_timers is not None:
        links[0].timers = client_timers
    for link in links:
        link.connect()
    return links, proxy


def test_a_cut_edge_reconnects_and_resends_exactly_once(certs: CertLayout) -> None:
    """The proxy resets the connection in the middle of a chunked tensor and refuses
    connections for 2 s: the edge reconnects, each side resends what the other did not
    receive, and every tensor arrives once, bit for bit, in both directions; the digest
    each end commits of every frame (docs/security.md "Commitments") is the other's."""
    links, proxy = _proxied(certs, link_grace=20.0)
    a, b = links
    for link in links:  # before the first frame: each end records what it sent and received
        link.ledger = link.router.ledger = FrameLedger()
    try:
        sent: dict[FrameKey, torch.Tensor] = {}

        def exchange(step: int) -> None:
            fwd, bwd = (
                FrameKey(TRAIN, step, FORWARD, 0, 1, 0),
                FrameKey(TRAIN, step, BACKWARD, 0, 1, 0),
            )
            sent[fwd], sent[bwd] = _x(10 + step), _x(20 + step)
            a.send_tensor(fwd, sent[fwd])
            b.send_tensor(bwd, sent[bwd])
            assert torch.equal(b.inbox.get(fwd, TIMEOUT, "forward"), sent[fwd])
            assert torch.equal(a.inbox.get(bwd, TIMEOUT, "backward"), sent[bwd])

        exchange(0)
        # half-way into step 1; the cut comes once some of worker 0's frames were lost
        proxy.on_bytes(3 * CHUNK, lambda: proxy.cut(refuse_s=2.0), swallow=1)
        t0 = time.monotonic()
        exchange(1)
        assert time.monotonic() - t0 >= 2.0, "the tensors crossed the cut"
        assert proxy.cuts == 1
        out, inn = a.edge_states()["out"], b.edge_states()["in"]
        assert out["reconnects"] == 1 == inn["reconnects"]
        assert out["state"] == "up" == inn["state"]
        assert a.forward_out.resent > 0, "worker 0 resent what worker 1 had not received"
        assert not a.rejected and not b.rejected
        ends = [{(e.frame, e.way): e.sha256 for e in x.ledger.take(TRAIN, 0, 2)} for x in links]
        assert len(ends[0]) == len(ends[1]) == 4
        for (frame, way), digest in ends[0].items():
            assert ends[1][frame, SENT if way == RECEIVED else RECEIVED] == digest
    finally:
        _close(links)
        proxy.close()


def test_a_half_open_edge_is_taken_over_by_the_resumed_session(
    certs: CertLayout, caplog: pytest.LogCaptureFixture
) -> None:
    """The proxy silently stops forwarding (no RST): the client's keepalive notices, it
    re-dials, and its session token takes over the stream the server still thinks live."""
    # the client pings every second; the server keeps its 5 s + 5 s
    links, proxy = _proxied(certs, client_timers=FAST, link_grace=20.0)
    a, b = links
    try:
        sent = {}
        for step in (0, 1):
            if step == 1:
                proxy.freeze()
            fwd, bwd = (
                FrameKey(TRAIN, step, FORWARD, 0, 1, 0),
                FrameKey(TRAIN, step, BACKWARD, 0, 1, 0),
            )
            sent[fwd], sent[bwd] = _x(30 + step), _x(40 + step)
            a.send_tensor(fwd, sent[fwd])
            b.send_tensor(bwd, sent[bwd])
            assert torch.equal(b.inbox.get(fwd, TIMEOUT, "forward"), sent[fwd])
            assert torch.equal(a.inbox.get(bwd, TIMEOUT, "backward"), sent[bwd])
        assert a.edge_states()["out"]["reconnects"] == 1 == b.edge_states()["in"]["reconnects"]
        assert "resumed its session on edge worker-0 → worker-1; the old stream" in caplog.text
        assert not a.rejected and not b.rejected
    finally:
        _close(links)
        proxy.close()


@pytest.mark.parametrize(("scale", "reconnects"), [(1, 1), (4, 0)])
def test_the_keepalive_scale_outwaits_a_queue_ahead_of_the_pings(
    certs: CertLayout, scale: float, reconnects: int
) -> None:
    """The link holds every byte for 3 s and loses none (a slow link's full queue ahead of
    a ping's answer): pings that must be answered within 1 s end the connection and the
    edge re-dials; the same timers × 4 (MOBIUS_KEEPALIVE_SCALE) wait it out on one
    connection. Either way every tensor arrives once, bit for bit."""
    # the server keeps its 5 s + 5 s: longer than the stall
    links, proxy = _proxied(certs, client_timers=FAST.scaled(scale), link_grace=20.0)
    a, b = links
    try:
        for step in (0, 1):
            fwd = FrameKey(TRAIN, step, FORWARD, 0, 1, 0)
            x = _x(50 + step)
            a.send_tensor(fwd, x)
            assert torch.equal(b.inbox.get(fwd, TIMEOUT, "forward"), x)
            if step == 0:
                proxy.stall(3.0)
                time.sleep(3.5)
        assert a.edge_states()["out"]["reconnects"] == reconnects
        assert not a.rejected and not b.rejected
    finally:
        _close(links)
        proxy.close()


def test_ring_links_read_the_keepalive_scale(
    certs: CertLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MOBIUS_KEEPALIVE_SCALE multiplies a ring link's keepalive times, not its backoff."""
    monkeypatch.setenv("MOBIUS_KEEPALIVE_SCALE", "3")
    links = _links(certs, 2)
    try:
        t, base = links[0].timers, LinkTimers()
        assert (t.client_keepalive_ms, t.keepalive_timeout_ms) == (15_000, 15_000)
        assert t.min_ping_interval_ms == 3 * base.min_ping_interval_ms
        assert t.max_backoff_s == base.max_backoff_s
        opts = dict(links[0].client.options())
        assert opts["grpc.http2.ping_timeout_ms"] == 15_000
    finally:
        _close(links)


def test_a_cut_longer_than_the_grace_names_the_edge(certs: CertLayout) -> None:
    links, proxy = _proxied(certs, link_grace=1.5)
    a, b = links
    try:
        k = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
        a.send_tensor(k, _x())
        b.inbox.get(k, TIMEOUT, "before the cut")  # the edge now carries the ring
        t0 = time.monotonic()
        threading.Thread(target=proxy.cut, args=(30.0,), daemon=True).start()
        for link, key in ((a, FrameKey(TRAIN, 0, BACKWARD, 0, 1, 0)), (b, k)):
            with pytest.raises(PeerError, match="ring edge worker-0 → worker-1 down for 2s"):
                link.inbox.get(key, TIMEOUT, "a frame across the dead edge")
        assert time.monotonic() - t0 < 6.0
        assert a.edge_states()["out"]["state"] == "down"
        assert b.edge_states()["in"]["state"] == "down"
    finally:
        _close(links)
        proxy.close()


def _fin(origin: int) -> bytes:
    return ring_pb2.Frame(run_id=RUN, origin=origin, direction=FIN).SerializeToString()


def _finish_in_background(link: RingLinks, timeout: float) -> threading.Thread:
    thread = threading.Thread(target=link.finish, args=(timeout,), daemon=True)
    thread.start()
    return thread


def _sent_into(proxy: CutProxy, out: Endpoint, seq: int) -> None:
    """Wait until frame ``seq`` was handed to gRPC, whose bytes a frozen ``proxy`` takes."""
    deadline = time.monotonic() + TIMEOUT
    taken = proxy.swallowed
    while out.sent_hi < seq:  # woken by what the black hole takes: this frame's bytes
        left = deadline - time.monotonic()
        assert proxy.wait_swallowed(taken, left), f"frame {seq} was never sent"
        taken = proxy.swallowed


@pytest.mark.parametrize("lost", ["the FIN", "its acknowledgement"])
def test_finish_redials_when_the_stream_breaks_before_its_fin_is_acknowledged(
    certs: CertLayout, lost: str
) -> None:
    """The end of a run: worker 1's FIN reached worker 0, so worker 0 has every peer's FIN;
    then worker 0's own FIN, or the acknowledgement coming back, vanishes in the proxy and
    the connection is reset. finish must not take the broken stream for the end of the
    session: it re-dials within the grace, resends what is unacknowledged, and returns on
    the acknowledgement; worker 1 has the FIN at once, not after its FIN timeout."""
    links, proxy = _proxied(certs, link_grace=20.0)
    a, b = links
    out = a.forward_out
    try:
        b.forward_out.put(_fin(1))  # what b.finish sends first
        assert a.inbox.wait_fins(TIMEOUT), "worker 1's FIN never reached worker 0"
        proxy.freeze(answers_only=lost != "the FIN")
        fin_seq = out.queued + 1
        finishing = _finish_in_background(a, TIMEOUT)
        if lost == "the FIN":  # sent into the black hole
            _sent_into(proxy, out, fin_seq)
        else:  # it arrived; the acknowledgement does not come back
            assert b.inbox.wait_fins(TIMEOUT), "worker 0's FIN never reached worker 1"
        assert out.acked < fin_seq and finishing.is_alive(), "acknowledged through the freeze"
        cut_at = time.monotonic()
        proxy.cut()  # a reset; new connections pass
        finishing.join(TIMEOUT)
        assert not finishing.is_alive(), "finish did not return"
        assert out.acked >= fin_seq, "finish returned without the FIN's acknowledgement"
        assert b.inbox.wait_fins(TIMEOUT) and 0 in b.inbox.fins
        assert time.monotonic() - cut_at < 5.0, "worker 1 waited for worker 0's FIN"
        assert a.edge_states()["out"]["reconnects"] == 1 == b.edge_states()["in"]["reconnects"]
        assert not a.rejected and not b.rejected
    finally:
        _close(links)
        proxy.close()


def test_finish_names_the_successor_that_never_acknowledged_its_fin(
    certs: CertLayout, caplog: pytest.LogCaptureFixture
) -> None:
    """The successor stays unreachable after the reset: finish waits for the FIN's
    acknowledgement as long as it may, then says which successor never confirmed it."""
    links, proxy = _proxied(certs, link_grace=20.0)
    a, b = links
    out = a.forward_out
    try:
        b.forward_out.put(_fin(1))
        assert a.inbox.wait_fins(TIMEOUT)
        proxy.freeze()
        finishing = _finish_in_background(a, 2.0)  # waits min(2 s, 10 s) for the ack
        _sent_into(proxy, out, 1)
        threading.Thread(target=proxy.cut, args=(30.0,), daemon=True).start()
        finishing.join(TIMEOUT)
        assert not finishing.is_alive()
        assert out.acked == 0 and 0 not in b.inbox.fins
        assert "worker-1 never acknowledged" in caplog.text, caplog.text
        assert "edge worker-0 → worker-1" in caplog.text, caplog.text
    finally:
        _close(links)
        proxy.close()


def test_a_relayed_fin_is_queued_and_counted_before_it_is_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """finish wakes once every FIN is recorded and then reads how far its out-edge must be
    acknowledged: a FIN this worker relays must be queued by then, or finish may close the
    link and drop it (the successor then waits out its FIN timeout); and counted, so that a
    successor closing its links acknowledges it first."""
    rules = FrameRules(_config(3), 0, RUN, lambda: 0)
    inbox = Inbox(rules.current_step, frozenset({1, 2}))
    out = Endpoint(None)
    router = FrameRouter(rules, inbox, lambda direction: out, None, ACK_EVERY)
    s = router.new_session("worker-2", FORWARD)
    seen: list[tuple[int, int, int]] = []
    record = inbox.add_fin

    def add_fin(origin: int, owner: object = None) -> bool:
        if origin not in inbox.fins:  # when it is recorded: queued to relay, counted
            seen.append((origin, out.queued, s.end.rx))
        return record(origin, owner)

    monkeypatch.setattr(inbox, "add_fin", add_fin)
    assert rules.route(FIN, 2) == [2, 0, 1], "worker 0 relays worker 2's FIN to worker 1"
    router.accept(_fin(2), FORWARD, s)
    router.accept(_fin(2), FORWARD, s)  # a repeat is neither recorded nor relayed again
    assert seen == [(2, 1, 1)], seen
    assert out.queued == 1 and inbox.fins == {2} and s.end.rx == 2


def test_an_idle_link_outlives_many_keepalive_periods(certs: CertLayout) -> None:
    """Keepalive every second both ways, nothing else for 6 s: no "too_many_pings"
    GOAWAY, no reconnect; the same stream then carries a frame."""
    links = _ring(certs, 2, timers=FAST)
    try:
        a, b = links
        time.sleep(6.0)
        key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
        a.send_tensor(key, _x())
        assert torch.equal(b.inbox.get(key, TIMEOUT, "after idling"), _x())
        for link in links:
            for edge in link.edge_states().values():
                assert edge["state"] == "up" and edge["reconnects"] == 0, edge
    finally:
        _close(links)


def test_close_releases_the_port_for_a_new_incarnation(certs: CertLayout) -> None:
    links = _ring(certs, 2)
    port = int(links[0].successor_addr.rsplit(":", 1)[1])
    t0 = time.monotonic()
    _close(links)
    assert time.monotonic() - t0 < 5.0
    cfg = _config(2)
    fresh = RingLinks(
        FrameRules(cfg, 1, "link-test/e2", lambda: 0),
        listen=f"127.0.0.1:{port}",
        successor="127.0.0.1:1",
        tls=certs.bundle("worker-1"),
        peer_timeout=TIMEOUT,
    )
    assert fresh.start_server() == port
    fresh.close()


def test_close_ends_a_dial_to_a_successor_that_never_answers(certs: CertLayout) -> None:
    """An abort closes the links while connect() still dials a successor that is gone (a
    killed worker): the dial gives up at once with PeerError, not after peer_timeout."""
    cfg = _config(2)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    link = RingLinks(
        FrameRules(cfg, 0, RUN, lambda: 0),
        listen="127.0.0.1:0",
        successor=f"127.0.0.1:{dead}",
        tls=certs.bundle("worker-0"),
        peer_timeout=60.0,
    )
    link.start_server()
    raised: list[BaseException] = []

    def dial() -> None:
        try:
            link.connect()
        except BaseException as exc:
            raised.append(exc)

    dialer = threading.Thread(target=dial)
    dialer.start()
    time.sleep(1.5)  # a few backoff rounds
    assert dialer.is_alive()
    t0 = time.monotonic()
    link.close()
    dialer.join(timeout=10)
    assert not dialer.is_alive() and time.monotonic() - t0 < 8.0
    assert len(raised) == 1 and isinstance(raised[0], PeerError), raised
    assert "closed while dialling" in str(raised[0])
