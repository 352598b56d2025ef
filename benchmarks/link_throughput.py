"""Throughput of one ring link for 16 MiB fp32 tensors over loopback (a benchmark, not a test).

    python benchmarks/link_throughput.py            # every method, ~10 timed transfers each
    python benchmarks/link_throughput.py --quick    # raw TCP, gloo, gRPC baseline, real link

Sender and receiver are two separate, long-lived processes (``spawn``); the parent only
orchestrates. Every method moves the same (8, 512, 1024) fp32 tensor (16 MiB) one transfer
at a time:

* a transfer is timed **on the sender**, from "tensor in hand" (before any encoding) until
  the receiver's acknowledgement arrives. The receiver acknowledges only after the whole
  tensor has been received, validated and decoded (for chunked/parallel variants:
  reassembled into a preallocated tensor). So each figure includes encode + transport +
  decode + one tiny ack round trip, and nothing is pipelined across transfers.
* MB/s = 16,777,216 bytes / median transfer time / 1e6, over ``--reps`` transfers after
  ``--warmup`` untimed ones.

Methods

1. raw TCP: ``sendall`` of the tensor's memory, ``recv_into`` a preallocated buffer, 1-byte ack.
2. torch.distributed gloo ``send``/``recv`` (init_method tcp://127.0.0.1:port), 1-element ack.
3. gRPC mTLS, the real link: certificates from :func:`mobius_fed.transport.certs.init_certs`,
   server bound with :func:`tls.add_port`, client :func:`tls.open_channel`, the generated
   ``RingLink.Stream`` bidi method, frames built with :func:`codec.make_frame` and checked
   with :func:`codec.validate_frame` + :func:`codec.decode_tensor` (CRC, shape, finiteness).
   One frame per tensor.
4. the real ring link ("ring link"): a :class:`mobius_fed.worker.link.RingLinks` in each
   process (worker 0 sends, worker 1 receives; P=2, mTLS, both streams connected exactly
   as the daemon does), ``send_tensor(key, t)`` on the sender and ``inbox.get(key)`` on the
   receiver: pre-serialized chunk frames (``chunk_bytes``, default
   :data:`codec.CHUNK_BYTES`), per-piece validation and reassembly into a preallocated
   tensor. The ack is one byte on a side TCP socket (as for raw TCP); the frame rules'
   tensor shape is set to the benchmark's (8, 512, 1024).
5. gRPC levers (mTLS unless marked plaintext):

   * chunking: the flat tensor is cut into ``chunk`` byte pieces; piece k travels as a
     normal Frame whose tensor is the 1-D slice (``make_frame(tensor=flat[a:b])``); header
     ``step`` = transfer index, ``tick`` = stream index, ``micro`` = piece index (bench-only
     use of those fields). The receiver validates the header, ``decode_tensor`` s the piece
     with ``expected_shape=(b-a,)`` and copies it into ``out[a:b]`` of a preallocated tensor;
     it acks once the last piece of its part is in.
   * parallel streams: the flat tensor is split into S equal parts, part s on stream s
     (own thread on the sender). "chan" = one channel per stream, made distinct with
     ``("grpc.use_local_subchannel_pool", 1)`` plus a unique dummy arg so each gets its own
     TCP/TLS connection; "1conn" = S calls multiplexed on one channel.
   * HTTP/2 / TCP options on both server and channel (see ``HTTP2_OPTS``).
   * pre-serialized send ("preser"): instead of ``make_frame`` (tensor->bytes copy, protobuf
     setter copy) + ``Frame.SerializeToString`` (another copy), the sender writes the
     protobuf wire bytes itself in one ``b"".join`` copy straight from the tensor's memory
     and passes ``bytes`` through a stub with ``request_serializer=None``. The receiver is
     unchanged (parses with the real ``Frame.FromString`` and validates); the bytes are
     checked to parse to exactly what ``make_frame`` builds.

Environment: torch intra-op threads are set to 1 in both workers (sender and receiver share
this machine's cores; on a real ring they run on different hosts).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import socket
import statistics
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

SHAPE = (8, 512, 1024)
NUMEL = 8 * 512 * 1024
NBYTES = NUMEL * 4  # 16 MiB
RUN_ID = "bench"
MiB = 1 << 20

HTTP2_OPTS: list[tuple[str, int | str]] = [
    ("grpc.http2.max_frame_size", 16 * MiB - 1),  # largest allowed HTTP/2 DATA frame
    ("grpc.http2.lookahead_bytes", 64 * MiB),  # stream flow-control window target
    ("grpc.http2.bdp_probe", 0),  # fixed windows instead of BDP-driven growth
    ("grpc.http2.write_buffer_size", 64 * MiB),
    ("grpc.experimental.tcp_read_chunk_size", 4 * MiB),
    ("grpc.experimental.tcp_min_read_chunk_size", 1 * MiB),
    ("grpc.experimental.tcp_max_read_chunk_size", 16 * MiB),
]


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # "tcp" | "gloo" | "grpc" | "link"
    tls: bool = True
    chunk: int | None = None  # bytes per frame; None = one frame per part
    streams: int = 1
    separate_channels: bool = True
    preser: bool = False
    opts: tuple = ()
    port: int = 0
    port2: int = 0  # "link": worker 0's ring port
    ack_port: int = 0  # "link": side socket for acks
    quick: bool = False  # part of --quick
    malloc: bool = False  # glibc mallopt tuning in both workers (see tune_malloc)
    fastfin: bool = False  # receiver: decode_fast (sum-based finiteness) instead of codec's
    n: int = 0  # transfers (warmup + reps)
    certs: str = ""


# ----------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tensor():
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=g, dtype=torch.float32)


def bounds(spec: Spec) -> list[list[tuple[int, int]]]:
    """Element ranges [a, b) of the flat tensor: per stream, per frame."""
    part = NUMEL // spec.streams
    out = []
    for s in range(spec.streams):
        lo, hi = s * part, (s + 1) * part
        step = (spec.chunk // 4) if spec.chunk else (hi - lo)
        out.append([(a, min(a + step, hi)) for a in range(lo, hi, step)])
    return out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def frame_bytes(header_bytes: bytes, t, shape) -> bytes:
    """Protobuf wire bytes of a Frame (header fields + tensor), one copy of the tensor data.

    ``header_bytes`` = ``Frame(run_id=..., step=..., ...).SerializeToString()`` without a
    tensor; ``t`` a contiguous CPU fp32 tensor. Field 7 (tensor) = Tensor{dtype=1, shape=2,
    data=3, crc32=4}; protobuf parsers accept fields in any order.
    """
    from mobius_fed.proto import ring_pb2

    mv = memoryview(t.numpy()).cast("B")
    n = mv.nbytes
    crc = zlib.crc32(mv)  # releases the GIL, no copy
    meta = ring_pb2.Tensor(dtype=ring_pb2.FLOAT32, shape=list(shape)).SerializeToString()
    tail = b"\x20" + _varint(crc)  # field 4 (crc32), varint
    data_hdr = b"\x1a" + _varint(n)  # field 3 (data), length-delimited
    tlen = len(meta) + len(data_hdr) + n + len(tail)
    return b"".join((header_bytes, b"\x3a", _varint(tlen), meta, data_hdr, mv, tail))


_TUNED = False


def tune_malloc() -> bool:
    """Keep 16 MiB buffers on the malloc heap instead of fresh mmap()s.

    glibc serves blocks above M_MMAP_THRESHOLD (128 KiB, adaptive up to 32 MiB) with a
    fresh mmap and unmaps them on free, so every 16 MiB copy on the link (tensor->bytes,
    protobuf setter, serialization, gRPC slices, ``.data``) page-faults 4096 new pages.
    Raising the threshold to its 32 MiB maximum and the trim threshold far above it makes
    freed buffers get reused. Once per process, before the link starts; no-op off glibc.
    """
    global _TUNED
    if _TUNED:
        return True
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = libc.mallopt(M_MMAP_THRESHOLD, 32 * MiB) == 1
        ok = ok and libc.mallopt(M_TRIM_THRESHOLD, 1024 * MiB) == 1
    except (OSError, AttributeError):
        ok = False
    _TUNED = ok
    return ok


def decode_fast(msg, *, expected_shape, expected_dtype="fp32"):
    """Proposed codec.decode_tensor: same checks, finiteness via one reduction.

    ``torch.isfinite(t).all()`` builds a bool tensor and runs at ~1 GB/s here; the sum of
    a tensor is finite iff every element is finite, except for overflow of huge-but-finite
    values, so only a non-finite sum falls back to the exact element-wise test.
    """
    import torch

    from mobius_fed.proto import ring_pb2
    from mobius_fed.transport.codec import FrameError

    if msg.dtype != ring_pb2.FLOAT32 or expected_dtype != "fp32":
        raise FrameError("tensor rejected: dtype")
    shape = tuple(msg.shape)
    if shape != tuple(expected_shape):
        raise FrameError(f"tensor rejected: shape {shape}")
    numel = 1
    for n in shape:
        numel *= n
    data = msg.data  # one fresh copy (upb)
    if len(data) != numel * 4:
        raise FrameError("tensor rejected: length")
    if zlib.crc32(data) != msg.crc32:
        raise FrameError("tensor rejected: crc32")
    t = torch.frombuffer(data, dtype=torch.float32).view(shape)
    if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
        raise FrameError("tensor rejected: non-finite values (NaN or Inf)")
    return t


# ----------------------------------------------------------------------------- receiver


def _tcp_recv(spec: Spec, conn) -> None:
    import torch

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", spec.port))
    srv.listen(1)
    conn.send("ready")
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = torch.empty(SHAPE, dtype=torch.float32)
    mv = memoryview(out.numpy()).cast("B")
    for _ in range(spec.n):
        got = 0
        while got < NBYTES:
            r = c.recv_into(mv[got:], NBYTES - got)
            if r == 0:
                raise ConnectionError("sender closed")
            got += r
        c.sendall(b"\x01")
    c.close()
    srv.close()


def _gloo_recv(spec: Spec, conn) -> None:
    import torch
    import torch.distributed as dist

    conn.send("ready")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=1, world_size=2
    )
    out = torch.empty(SHAPE, dtype=torch.float32)
    ack = torch.zeros(1)
    for _ in range(spec.n):
        dist.recv(out, src=0)
        dist.send(ack, dst=0)
    dist.barrier()
    dist.destroy_process_group()


def _grpc_serve(spec: Spec, conn) -> None:
    import grpc
    import torch

    from mobius_fed.proto import ring_pb2, ring_pb2_grpc
    from mobius_fed.transport import codec, tls
    from mobius_fed.transport.certs import CertLayout

    layout = CertLayout(
        root=Path(spec.certs),
        ca_cert=Path(spec.certs) / "ca.crt",
        ca_key=Path(spec.certs) / "ca.key",
        workers=2,
    )
    plan = bounds(spec)
    out = torch.empty(NUMEL, dtype=torch.float32)  # preallocated reassembly target
    single = spec.streams == 1 and spec.chunk is None
    sender_id = tls.worker_identity(0)
    decode = decode_fast if spec.fastfin else codec.decode_tensor

    class Servicer(ring_pb2_grpc.RingLinkServicer):
        def Stream(self, request_iterator, context):
            if spec.tls:
                tls.require_peer(context, {sender_id})
            j = k = 0
            s = None
            for fr in request_iterator:
                if s is None:
                    s = fr.tick
                codec.validate_frame(
                    fr,
                    run_id=RUN_ID,
                    step=j,
                    origin=0,
                    tick=s,
                    micro=k,
                    direction=ring_pb2.FORWARD,
                )
                if single:
                    t = decode(fr.tensor, expected_shape=SHAPE, expected_dtype="fp32")
                    del t  # would be handed to the stage as is (no reassembly copy)
                else:
                    a, b = plan[s][k]
                    t = decode(fr.tensor, expected_shape=(b - a,), expected_dtype="fp32")
                    out[a:b].copy_(t)
                k += 1
                if k == len(plan[s]):
                    yield ring_pb2.Frame(run_id=RUN_ID, step=j, tick=s, direction=ring_pb2.BACKWARD)
                    j += 1
                    k = 0

    base = list(tls.GRPC_OPTIONS) + list(spec.opts)
    server = grpc.server(ThreadPoolExecutor(max_workers=spec.streams + 4), options=base)
    ring_pb2_grpc.add_RingLinkServicer_to_server(Servicer(), server)
    node = layout.worker(1) if spec.tls else None
    tls.add_port(server, f"127.0.0.1:{spec.port}", node, insecure=not spec.tls)
    server.start()
    conn.send("ready")
    conn.recv()  # "stop"
    server.stop(None)


def _link(spec: Spec, rank: int, current_step):
    """A real RingLinks for worker ``rank`` of a P=2 ring (worker 0 sends, 1 receives)."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.transport.certs import CertLayout
    from mobius_fed.worker.frames import FrameRules
    from mobius_fed.worker.link import RingLinks

    layout = CertLayout(
        root=Path(spec.certs),
        ca_cert=Path(spec.certs) / "ca.crt",
        ca_key=Path(spec.certs) / "ca.key",
        workers=2,
    )
    cfg = TrainConfig(preset="cpu-base", workers=2, batch_size=8)
    rules = FrameRules(cfg, rank, RUN_ID, current_step)
    rules.shape = SHAPE  # the benchmark's tensor, not the preset's hidden state
    ports = (spec.port2, spec.port)
    kw = {} if spec.chunk is None else {"chunk_bytes": spec.chunk}
    return RingLinks(
        rules,
        listen=f"127.0.0.1:{ports[rank]}",
        successor=f"127.0.0.1:{ports[1 - rank]}",
        tls=layout.worker(rank),
        peer_timeout=60,
        **kw,
    )


def _link_key(j: int):
    from mobius_fed.worker.frames import FORWARD, TRAIN, FrameKey

    return FrameKey(TRAIN, j, FORWARD, 0, 1, 0)  # slot 1 of stream 0: read by worker 1


def _link_recv(spec: Spec, conn) -> None:
    now = [0]
    links = _link(spec, 1, lambda: now[0])
    links.start_server()
    conn.send("ready")
    links.connect()
    ack = None
    for _ in range(200):
        try:
            ack = socket.create_connection(("127.0.0.1", spec.ack_port))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    if ack is None:
        raise ConnectionError("no ack socket")
    ack.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for j in range(spec.n):
        now[0] = j
        links.inbox.get(_link_key(j), 60, f"transfer {j}")
        ack.sendall(b"\x01")
    links.finish(timeout=30)
    ack.close()


def receiver_main(conn) -> None:
    import logging

    import torch

    logging.disable(logging.WARNING)  # the plaintext reference variant warns by design
    torch.set_num_threads(1)
    while True:
        spec = conn.recv()
        if spec is None:
            return
        if spec.malloc:
            tune_malloc()
        recv = {"tcp": _tcp_recv, "gloo": _gloo_recv, "grpc": _grpc_serve, "link": _link_recv}
        recv[spec.kind](spec, conn)
        conn.send("done")


# ----------------------------------------------------------------------------- sender


def _tcp_send(spec: Spec, t) -> list[float]:
    c = socket.socket()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(100):
        try:
            c.connect(("127.0.0.1", spec.port))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    one = bytearray(1)
    times = []
    for _ in range(spec.n):
        t0 = time.perf_counter()
        c.sendall(memoryview(t.numpy()).cast("B"))
        if c.recv_into(one, 1) != 1:
            raise ConnectionError("receiver closed")
        times.append(time.perf_counter() - t0)
    c.close()
    return times


def _gloo_send(spec: Spec, t) -> list[float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=0, world_size=2
    )
    ack = torch.zeros(1)
    times = []
    for _ in range(spec.n):
        t0 = time.perf_counter()
        dist.send(t, dst=1)
        dist.recv(ack, src=1)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    return times


def _grpc_send(spec: Spec, t) -> list[float]:
    import grpc

    from mobius_fed.proto import ring_pb2, ring_pb2_grpc
    from mobius_fed.transport import codec, tls
    from mobius_fed.transport.certs import CertLayout

    layout = CertLayout(
        root=Path(spec.certs),
        ca_cert=Path(spec.certs) / "ca.crt",
        ca_key=Path(spec.certs) / "ca.key",
        workers=2,
    )
    node = layout.worker(0) if spec.tls else None
    plan = bounds(spec)
    flat = t.view(-1)
    single = spec.streams == 1 and spec.chunk is None

    def channel(s: int):
        ch = tls.open_channel(f"127.0.0.1:{spec.port}", node, insecure=not spec.tls)
        if spec.opts or (spec.streams > 1 and spec.separate_channels):
            # open_channel takes no extra options: rebuild with the same credentials and
            # tls.channel_options() plus the variant's options.
            ch.close()
            opts = tls.channel_options() + list(spec.opts)
            if spec.streams > 1 and spec.separate_channels:
                opts += [("grpc.use_local_subchannel_pool", 1), ("mobius.bench.channel", s)]
            if spec.tls:
                ch = grpc.secure_channel(
                    f"127.0.0.1:{spec.port}", tls.channel_credentials(node), opts
                )
            else:
                ch = grpc.insecure_channel(f"127.0.0.1:{spec.port}", opts)
        grpc.channel_ready_future(ch).result(timeout=20)
        return ch

    nch = spec.streams if spec.separate_channels else 1
    chans = [channel(s) for s in range(nch)]
    calls = []
    for s in range(spec.streams):
        ch = chans[s % nch]
        if spec.preser:
            method = ch.stream_stream(
                "/mobius_fed.ring.v1.RingLink/Stream",
                request_serializer=None,  # we pass wire bytes
                response_deserializer=ring_pb2.Frame.FromString,
            )
        else:
            method = ring_pb2_grpc.RingLinkStub(ch).Stream
        q: queue.Queue = queue.Queue()

        def gen(q=q):
            while True:
                item = q.get()
                if item is None:
                    return
                yield item

        calls.append((q, method(gen())))

    def send_part(s: int, j: int) -> None:
        q, responses = calls[s]
        for k, (a, b) in enumerate(plan[s]):
            piece = t if single else flat[a:b]
            if spec.preser:
                hdr = ring_pb2.Frame(
                    run_id=RUN_ID,
                    step=j,
                    origin=0,
                    tick=s,
                    micro=k,
                    direction=ring_pb2.FORWARD,
                ).SerializeToString()
                q.put(frame_bytes(hdr, piece, piece.shape))
            else:
                q.put(
                    codec.make_frame(
                        run_id=RUN_ID,
                        step=j,
                        origin=0,
                        tick=s,
                        micro=k,
                        direction=ring_pb2.FORWARD,
                        tensor=piece,
                    )
                )
        ack = next(responses)
        if ack.step != j or ack.tick != s:
            raise RuntimeError(f"bad ack {ack}")

    pool = ThreadPoolExecutor(max_workers=spec.streams) if spec.streams > 1 else None
    times = []
    for j in range(spec.n):
        t0 = time.perf_counter()
        if pool is None:
            send_part(0, j)
        else:
            for f in [pool.submit(send_part, s, j) for s in range(spec.streams)]:
                f.result()
        times.append(time.perf_counter() - t0)
    for q, responses in calls:
        q.put(None)
        for _ in responses:
            pass
    if pool is not None:
        pool.shutdown()
    for ch in chans:
        ch.close()
    return times


def _link_send(spec: Spec, t) -> list[float]:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", spec.ack_port))
    srv.listen(1)
    links = _link(spec, 0, lambda: 0)
    links.start_server()
    links.connect()
    c, _ = srv.accept()
    one = bytearray(1)
    times = []
    for j in range(spec.n):
        t0 = time.perf_counter()
        links.send_tensor(_link_key(j), t)
        if c.recv_into(one, 1) != 1:
            raise ConnectionError("receiver closed")
        times.append(time.perf_counter() - t0)
    links.finish(timeout=30)
    c.close()
    srv.close()
    return times


def sender_main(conn) -> None:
    import logging

    import torch

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    t = make_tensor()
    while True:
        spec = conn.recv()
        if spec is None:
            return
        if spec.malloc:
            tune_malloc()
        try:
            send = {"tcp": _tcp_send, "gloo": _gloo_send, "grpc": _grpc_send, "link": _link_send}
            times = send[spec.kind](spec, t)
            conn.send(("ok", times))
        except Exception as e:  # report, keep the worker alive for the next method
            conn.send(("error", f"{type(e).__name__}: {e}"))


# ----------------------------------------------------------------------------- driver


def self_check() -> None:
    """The hand-built wire bytes parse to exactly what make_frame builds."""
    import torch

    from mobius_fed.proto import ring_pb2
    from mobius_fed.transport import codec

    x = torch.randn(3, 5)
    kw = dict(run_id=RUN_ID, step=7, origin=0, tick=1, micro=2, direction=ring_pb2.FORWARD)
    ref = codec.make_frame(tensor=x, **kw)
    hdr = ring_pb2.Frame(**kw, chunks=1).SerializeToString()
    mine = ring_pb2.Frame.FromString(frame_bytes(hdr, x, x.shape))
    assert mine == ref, "hand-built frame bytes differ from make_frame"
    got = codec.decode_tensor(mine.tensor, expected_shape=(3, 5), expected_dtype="fp32")
    assert torch.equal(got, x)
    (real,) = codec.encode_frames(tensor=x, **kw)
    assert ring_pb2.Frame.FromString(real) == ref, "codec.encode_frames differs from make_frame"


def variants() -> list[Spec]:
    """Untuned variants first: tune_malloc() cannot be undone in a running worker."""
    m = MiB
    H = tuple(HTTP2_OPTS)
    T = dict(malloc=True)
    Q = dict(quick=True)
    return [
        Spec("raw TCP", "tcp", **Q),
        Spec("gloo send/recv", "gloo", **Q),
        Spec("gRPC plaintext, 1 frame", "grpc", tls=False),
        Spec("gRPC mTLS, 1 frame (make_frame)", "grpc", **Q),
        Spec("ring link (RingLinks, default chunks)", "link", **Q),
        Spec("ring link (RingLinks, 4 MiB chunks)", "link", chunk=4 * m, **Q),
        Spec("ring link (RingLinks, 1 frame)", "link", chunk=NBYTES),
        Spec("mTLS chunk 1 MiB", "grpc", chunk=1 * m),
        Spec("mTLS 1 frame, preser", "grpc", preser=True),
        Spec("mTLS chunk 1 MiB, preser", "grpc", chunk=1 * m, preser=True),
        # --- from here on both workers run with tune_malloc()
        Spec("M raw TCP", "tcp", **T),
        Spec("M gloo send/recv", "gloo", **T),
        Spec("M ring link (RingLinks, default chunks)", "link", **T),
        Spec("M ring link (RingLinks, 2 MiB chunks)", "link", chunk=2 * m, **T),
        Spec("M mTLS 1 frame (make_frame)", "grpc", **T),
        Spec("M mTLS chunk 1 MiB", "grpc", chunk=1 * m, **T),
        Spec("M mTLS chunk 2 MiB", "grpc", chunk=2 * m, **T),
        Spec("M mTLS chunk 4 MiB", "grpc", chunk=4 * m, **T),
        Spec("M mTLS 1 frame, preser", "grpc", preser=True, **T),
        Spec("M mTLS chunk 1 MiB, preser", "grpc", chunk=1 * m, preser=True, **T),
        Spec("M mTLS chunk 2 MiB, preser", "grpc", chunk=2 * m, preser=True, **T),
        Spec("M mTLS chunk 4 MiB, preser", "grpc", chunk=4 * m, preser=True, **T),
        Spec("M mTLS 1 frame, preser, http2", "grpc", preser=True, opts=H, **T),
        Spec("M mTLS chunk 2 MiB, preser, http2", "grpc", chunk=2 * m, preser=True, opts=H, **T),
        Spec("M mTLS 2 streams (chan), preser", "grpc", streams=2, preser=True, **T),
        Spec("M mTLS 4 streams (chan), preser", "grpc", streams=4, preser=True, **T),
        Spec(
            "M mTLS 2 streams (1conn), preser",
            "grpc",
            streams=2,
            preser=True,
            separate_channels=False,
            **T,
        ),
        # --- receiver also uses decode_fast (proposed codec change)
        Spec("MF mTLS 1 frame (make_frame)", "grpc", fastfin=True, **T),
        Spec("MF mTLS 1 frame, preser", "grpc", preser=True, fastfin=True, **T),
        Spec("MF mTLS chunk 1 MiB, preser", "grpc", chunk=1 * m, preser=True, fastfin=True, **T),
        Spec("MF mTLS chunk 2 MiB, preser", "grpc", chunk=2 * m, preser=True, fastfin=True, **T),
        Spec("MF mTLS chunk 4 MiB, preser", "grpc", chunk=4 * m, preser=True, fastfin=True, **T),
        Spec("MF mTLS 2 streams (chan), preser", "grpc", streams=2, preser=True, fastfin=True, **T),
        Spec(
            "MF mTLS 2 str (chan) x 2 MiB, preser",
            "grpc",
            streams=2,
            chunk=2 * m,
            preser=True,
            fastfin=True,
            **T,
        ),
        Spec("MF plaintext 1 frame, preser", "grpc", tls=False, preser=True, fastfin=True, **T),
        Spec(
            "MF plaintext chunk 2 MiB, preser",
            "grpc",
            tls=False,
            chunk=2 * m,
            preser=True,
            fastfin=True,
            **T,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="only raw TCP, gloo, the gRPC baseline and the real link; 2 warm-up + 5 timed",
    )
    ap.add_argument("--reps", type=int, default=None, help="timed transfers (default 10)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed transfers (default 3)")
    ap.add_argument("--only", default="", help="run methods whose name contains this")
    args = ap.parse_args(argv)
    reps = args.reps or (5 if args.quick else 10)
    warm = args.warmup if args.warmup is not None else (2 if args.quick else 3)

    from mobius_fed.transport.certs import init_certs

    self_check()
    ctx = mp.get_context("spawn")
    tmp = tempfile.TemporaryDirectory(prefix="link-bench-")
    init_certs(Path(tmp.name) / "certs", workers=2)
    rx_parent, rx_child = ctx.Pipe()
    tx_parent, tx_child = ctx.Pipe()
    rx = ctx.Process(target=receiver_main, args=(rx_child,), daemon=True)
    tx = ctx.Process(target=sender_main, args=(tx_child,), daemon=True)
    rx.start()
    tx.start()

    specs = [
        v for v in variants() if args.only.lower() in v.name.lower() and (v.quick or not args.quick)
    ]
    must = [v for v in variants() if v.kind in ("tcp", "gloo") and not v.malloc and v not in specs]
    results: dict[str, float | str] = {}
    t_start = time.perf_counter()
    print(
        f"16 MiB fp32 {SHAPE}, {warm} warm-up + {reps} timed transfers each, "
        f"timed on the sender until the receiver's post-decode ack; MB = 1e6 bytes",
        flush=True,
    )
    for spec in must + specs:
        spec = replace(
            spec,
            port=free_port(),
            port2=free_port(),
            ack_port=free_port(),
            n=warm + reps,
            certs=str(Path(tmp.name) / "certs"),
        )
        rx_parent.send(spec)
        if not rx_parent.poll(60) or rx_parent.recv() != "ready":
            raise RuntimeError(f"{spec.name}: receiver not ready")
        tx_parent.send(spec)
        if not tx_parent.poll(120):
            raise RuntimeError(f"{spec.name}: sender timed out")
        status, payload = tx_parent.recv()
        if spec.kind == "grpc":
            rx_parent.send("stop")
        if not rx_parent.poll(60):
            raise RuntimeError(f"{spec.name}: receiver did not finish")
        rx_parent.recv()
        if status == "ok":
            med = statistics.median(payload[warm:])
            results[spec.name] = NBYTES / med / 1e6
            print(
                f"  {spec.name:<36} {results[spec.name]:8.0f} MB/s  "
                f"(median {med * 1e3:.1f} ms, min {min(payload[warm:]) * 1e3:.1f} ms)",
                flush=True,
            )
        else:
            results[spec.name] = payload
            print(f"  {spec.name:<36} FAILED: {payload}", flush=True)
    for c in (rx_parent, tx_parent):
        c.send(None)
    rx.join(10)
    tx.join(10)
    tmp.cleanup()

    tcp = results.get("raw TCP")
    gloo = results.get("gloo send/recv")
    print()
    print(
        "M = both workers tune_malloc(); F = receiver decode_fast (proposed codec change);"
        " preser = hand-built wire bytes"
    )
    print(f"{'method':<38} {'MB/s':>8} {'÷ gloo':>8} {'÷ TCP':>8}")
    print("-" * 65)
    for name in [s.name for s in must + specs]:
        v = results[name]
        if isinstance(v, str):
            print(f"{name:<38} {'failed':>8}")
            continue
        rg = f"{v / gloo:8.2f}" if isinstance(gloo, float) else f"{'-':>8}"
        rt = f"{v / tcp:8.2f}" if isinstance(tcp, float) else f"{'-':>8}"
        print(f"{name:<38} {v:8.0f} {rg} {rt}")
    mtls = {
        k: v
        for k, v in results.items()
        if isinstance(v, float) and ("mTLS" in k or "ring link" in k)  # the link is mTLS
    }
    if mtls and isinstance(gloo, float):
        best = max(mtls, key=mtls.get)
        ratio = mtls[best] / gloo
        print(
            f"\nbest mTLS: {best}: {mtls[best]:.0f} MB/s = {ratio:.2f} x gloo "
            f"(target >= 0.5: {'met' if ratio >= 0.5 else 'NOT met'})"
        )
    real = results.get("ring link (RingLinks, default chunks)")
    if isinstance(real, float) and isinstance(gloo, float) and isinstance(tcp, float):
        print(
            f"real ring link (default chunks): {real:.0f} MB/s = {real / gloo:.2f} x gloo, "
            f"{real / tcp:.2f} x raw TCP"
        )
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
