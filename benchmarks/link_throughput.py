"""Throughput of one ring link for 16 MiB fp32 tensors over loopback (a benchmark, not a test).

    python benchmarks/link_throughput.py            # every method, ~10 timed transfers each
    python benchmarks/link_throughput.py --quick    # raw TCP, gloo, gRPC baseline, real link
    python benchmarks/link_throughput.py --quick --rounds 5      # the same, interleaved 5x
    python benchmarks/link_throughput.py --levers --rounds 6     # what moves the link
    python benchmarks/link_throughput.py --codec-costs           # the link's own CPU work

Measuring on a shared machine: ``--rounds R`` runs every method R times, interleaved
(method A, B, C, then A, B, C again), and reports the median MB/s over rounds and the
median of the per-round ratios to gloo and raw TCP measured in the same round. The
"CPU ms" column is the CPU time of all threads of the sender and the receiver per
transfer (``getrusage`` around the transfer loop; the plain gRPC servers count from ready
to stop, their client's TLS handshake included): unlike MB/s it hardly depends on what
else runs on the machine, so a lever that lowers it is a lever, whatever the noise.
Process-wide settings (allocator, collector) cannot be undone, so every profile of them
runs in its own pair of sender/receiver processes.

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
     setter copy) + ``Frame.SerializeToString`` (another copy), the sender takes the wire
     bytes from the codec's ``encode_frames`` (one copy straight from the tensor's memory,
     as the link does) and passes ``bytes`` through a stub with ``request_serializer=None``.
     The receiver is unchanged (parses with the real ``Frame.FromString`` and validates);
     the bytes are checked to parse to exactly what ``make_frame`` builds.

Environment: torch intra-op threads are set to 1 in both workers (sender and receiver share
this machine's cores; on a real ring they run on different hosts).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
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


ZEROCOPY_OPTS: tuple[tuple[str, int], ...] = (
    ("grpc.experimental.tcp_tx_zerocopy_enabled", 1),
    ("grpc.experimental.tcp_tx_zerocopy_send_bytes_threshold", 256 << 10),
)


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # "tcp" | "gloo" | "grpc" | "link" | "tls"
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
    gcfreeze: bool = False  # gc.freeze() in both workers once set up (see freeze_gc)
    thp: bool = False  # both workers start with THP_MEM_ALLOC_ENABLE=1 (torch's huge pages)
    aio: bool = False  # "grpc": grpc.aio client and server instead of the sync API
    tuning: tuple = ()  # "link": LinkTuning fields, as (name, value) pairs
    switch_ms: float = 5.0  # the interpreter's GIL switch interval in both workers
    ack_every: int = 0  # "link": frames per acknowledgement (0: the link's ACK_EVERY)
    n: int = 0  # transfers (warmup + reps)
    certs: str = ""


# ----------------------------------------------------------------------------- helpers

LOOP_CPU = [0.0]
"""CPU seconds (all threads of this process) of the last transfer loop, set by the
tcp, gloo and link methods."""


def _cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


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


def frame_bytes(step: int, tick: int, micro: int, t) -> bytes:
    """Wire bytes of one Frame carrying all of ``t`` (fp32), by the codec's own
    ``encode_frames`` (one copy of the tensor data)."""
    from mobius_fed.proto import ring_pb2
    from mobius_fed.transport import codec

    (one,) = codec.encode_frames(
        run_id=RUN_ID,
        step=step,
        origin=0,
        tick=tick,
        micro=micro,
        direction=ring_pb2.FORWARD,
        tensor=t,
        chunk_bytes=max(1, t.numel() * 4),
    )
    return one


def tune_malloc() -> bool:
    """The link's own allocator tuning (``mobius_fed.transport.allocator``)."""
    from mobius_fed.transport.allocator import tune_allocator

    return tune_allocator()


def freeze_gc() -> None:
    """Move every object alive now (imports, the link's state) out of the collector's
    reach: ``gc.freeze()``. Later full collections then walk only what the transfers
    create, instead of the tens of thousands of objects that torch and gRPC import."""
    import gc

    gc.collect()
    gc.freeze()


def _tune_process(spec: Spec) -> None:
    sys.setswitchinterval(spec.switch_ms / 1e3)
    if spec.malloc:
        tune_malloc()
    if spec.gcfreeze:
        freeze_gc()


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


def _accept_one(port: int, ready=None) -> tuple[socket.socket, socket.socket]:
    """Listen on 127.0.0.1:port, say "ready" on ``ready`` if given, accept one TCP_NODELAY
    connection; (listening socket, connection)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    if ready is not None:
        ready.send("ready")
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return srv, c


def _tcp_recv(spec: Spec, conn) -> None:
    import torch

    srv, c = _accept_one(spec.port, conn)
    out = torch.empty(SHAPE, dtype=torch.float32)
    mv = memoryview(out.numpy()).cast("B")
    cpu0 = _cpu()
    for _ in range(spec.n):
        _recv_exact(c, mv)
        c.sendall(b"\x01")
    LOOP_CPU[0] = _cpu() - cpu0
    c.close()
    srv.close()


def _tls_context(spec: Spec, server: bool):
    """Python's ssl (OpenSSL): TLS 1.3 only, both sides present our certificates."""
    import ssl

    node = _layout(spec).worker(1 if server else 0)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(node.cert, node.key)
    ctx.load_verify_locations(node.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = False  # identities are URIs; the CA check is what matters here
    return ctx


def _recv_exact(c, mv) -> None:
    got = 0
    while got < len(mv):
        r = c.recv_into(mv[got:], len(mv) - got)
        if r == 0:
            raise ConnectionError("sender closed")
        got += r


def _tls_recv(spec: Spec, conn) -> None:
    """Reference only: mTLS on a plain socket, decrypted straight into the tensor, each
    1 MiB piece CRC-checked and summed for finiteness as the link's receiver does."""
    import struct

    import torch

    from mobius_fed.transport.codec import _crc32

    srv, raw = _accept_one(spec.port, conn)
    c = _tls_context(spec, server=True).wrap_socket(raw, server_side=True)
    out = torch.empty(NUMEL, dtype=torch.float32)
    mv = memoryview(out.numpy()).cast("B")
    piece = spec.chunk or MiB
    crcs = bytearray(4 * (NBYTES // piece))
    cpu0 = _cpu()
    for _ in range(spec.n):
        got = []
        for a in range(0, NBYTES, piece):
            _recv_exact(c, mv[a : a + piece])
            got.append(_crc32(mv[a : a + piece]))
            if not bool(torch.isfinite(out[a // 4 : (a + piece) // 4].sum())):
                raise ValueError("non-finite piece")
        _recv_exact(c, memoryview(crcs))
        if list(struct.unpack(f"<{len(got)}I", crcs)) != got:
            raise ValueError("crc mismatch")
        c.sendall(b"\x01")
    LOOP_CPU[0] = _cpu() - cpu0
    c.close()
    srv.close()


def _dial(port: int) -> socket.socket:
    """A TCP_NODELAY connection to 127.0.0.1:port, retried while the receiver starts."""
    c = socket.socket()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(100):
        try:
            c.connect(("127.0.0.1", port))
            return c
        except ConnectionRefusedError:
            time.sleep(0.05)
    c.connect(("127.0.0.1", port))  # the last try raises what refused it
    return c


def _tls_send(spec: Spec, t) -> list[float]:
    import struct

    from mobius_fed.transport.codec import _crc32

    c = _tls_context(spec, server=False).wrap_socket(_dial(spec.port))
    mv = memoryview(t.numpy()).cast("B")
    piece = spec.chunk or MiB

    def send_one() -> None:
        crcs = []
        for a in range(0, NBYTES, piece):
            crcs.append(_crc32(mv[a : a + piece]))
            c.sendall(mv[a : a + piece])
        c.sendall(struct.pack(f"<{len(crcs)}I", *crcs))

    return _timed_sends(spec, c, send_one)


def _timed_sends(spec: Spec, c, send_one) -> list[float]:
    """``spec.n`` timed transfers on socket ``c``, each acknowledged by one byte; closes c."""
    one = bytearray(1)
    times = []
    cpu0 = _cpu()
    for _ in range(spec.n):
        t0 = time.perf_counter()
        send_one()
        if c.recv_into(one, 1) != 1:
            raise ConnectionError("receiver closed")
        times.append(time.perf_counter() - t0)
    LOOP_CPU[0] = _cpu() - cpu0
    c.close()
    return times


def _gloo_recv(spec: Spec, conn) -> None:
    import torch
    import torch.distributed as dist

    conn.send("ready")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=1, world_size=2
    )
    out = torch.empty(SHAPE, dtype=torch.float32)
    ack = torch.zeros(1)
    cpu0 = _cpu()
    for _ in range(spec.n):
        dist.recv(out, src=0)
        dist.send(ack, dst=0)
    LOOP_CPU[0] = _cpu() - cpu0
    dist.barrier()
    dist.destroy_process_group()


def _grpc_serve(spec: Spec, conn) -> None:
    import grpc
    import torch

    from mobius_fed.proto import ring_pb2_grpc
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
            rx = _PieceReceiver(plan, out, decode, single)
            for fr in request_iterator:
                ack = rx.accept(fr)
                if ack is not None:
                    yield ack

    base = list(tls.grpc_options()) + list(spec.opts)
    server = grpc.server(ThreadPoolExecutor(max_workers=spec.streams + 4), options=base)
    ring_pb2_grpc.add_RingLinkServicer_to_server(Servicer(), server)
    node = layout.worker(1) if spec.tls else None
    tls.add_port(server, f"127.0.0.1:{spec.port}", node, insecure=not spec.tls)
    server.start()
    conn.send("ready")
    cpu0 = _cpu()  # includes the client's TLS handshake
    conn.recv()  # "stop"
    LOOP_CPU[0] = _cpu() - cpu0
    server.stop(None)


def _bench_tuning():
    from mobius_fed.transport.link_tuning import LinkTuning

    class BenchTuning(LinkTuning):
        """The link's tuning plus raw gRPC arguments (``Spec.opts``) under trial."""

        def __init__(self, extra: tuple = (), **fields) -> None:
            super().__init__(**fields)
            object.__setattr__(self, "extra", extra)

        def grpc_options(self) -> list:
            return [*super().grpc_options(), *self.extra]

    return BenchTuning


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
    from mobius_fed.worker.link_session import ACK_EVERY

    _BenchTuning = _bench_tuning()
    ports = (spec.port2, spec.port)
    kw: dict = {} if spec.chunk is None else {"chunk_bytes": spec.chunk}
    kw["ack_every"] = spec.ack_every or ACK_EVERY
    kw["tuning"] = _BenchTuning(**dict(spec.tuning), extra=tuple(spec.opts))
    return RingLinks(
        rules,
        listen=f"127.0.0.1:{ports[rank]}",
        successor=f"127.0.0.1:{ports[1 - rank]}",
        tls=layout.worker(rank) if spec.tls else None,
        insecure=not spec.tls,
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
    cpu0 = _cpu()
    for j in range(spec.n):
        now[0] = j
        links.inbox.get(_link_key(j), 60, f"transfer {j}")
        ack.sendall(b"\x01")
    LOOP_CPU[0] = _cpu() - cpu0
    links.finish(timeout=30)
    ack.close()


def _layout(spec: Spec):
    from mobius_fed.transport.certs import CertLayout

    root = Path(spec.certs)
    return CertLayout(root=root, ca_cert=root / "ca.crt", ca_key=root / "ca.key", workers=2)


class _PieceReceiver:
    """What both gRPC receivers (sync and aio) do per frame: validate it against the
    expected step, tick and piece, decode it into the reassembly target (or, for one
    whole-tensor frame, decode only), and return the ACK once a tensor is complete."""

    def __init__(self, plan, out, decode, single: bool) -> None:
        self.plan, self.out, self.decode, self.single = plan, out, decode, single
        self.j = self.k = 0
        self.s: int | None = None

    def accept(self, fr):
        from mobius_fed.proto import ring_pb2
        from mobius_fed.transport import codec

        if self.s is None:
            self.s = fr.tick
        s, k = self.s, self.k
        codec.validate_frame(
            fr, run_id=RUN_ID, step=self.j, origin=0, tick=s, micro=k, direction=ring_pb2.FORWARD
        )
        if self.single:
            t = self.decode(fr.tensor, expected_shape=SHAPE, expected_dtype="fp32")
            del t  # would be handed to the stage as is (no reassembly copy)
        else:
            a, b = self.plan[s][k]
            t = self.decode(fr.tensor, expected_shape=(b - a,), expected_dtype="fp32")
            self.out[a:b].copy_(t)
        self.k += 1
        if self.k < len(self.plan[s]):
            return None
        ack = ring_pb2.Frame(run_id=RUN_ID, step=self.j, tick=s, direction=ring_pb2.BACKWARD)
        self.j += 1
        self.k = 0
        return ack


def _grpc_serve_aio(spec: Spec, conn) -> None:
    """The "grpc" receiver on grpc.aio: the same validation, decode and acks."""
    import asyncio

    import grpc
    import torch

    from mobius_fed.proto import ring_pb2_grpc
    from mobius_fed.transport import codec, tls

    plan = bounds(spec)
    out = torch.empty(NUMEL, dtype=torch.float32)
    decode = decode_fast if spec.fastfin else codec.decode_tensor

    class Servicer(ring_pb2_grpc.RingLinkServicer):
        async def Stream(self, request_iterator, context):
            rx = _PieceReceiver(plan, out, decode, single=False)
            async for fr in request_iterator:
                ack = rx.accept(fr)
                if ack is not None:
                    yield ack

    async def serve() -> None:
        server = grpc.aio.server(options=list(tls.grpc_options()) + list(spec.opts))
        ring_pb2_grpc.add_RingLinkServicer_to_server(Servicer(), server)
        node = _layout(spec).worker(1) if spec.tls else None
        tls.add_port(server, f"127.0.0.1:{spec.port}", node, insecure=not spec.tls)
        await server.start()
        conn.send("ready")
        cpu0 = _cpu()  # includes the client's TLS handshake
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "stop"
        LOOP_CPU[0] = _cpu() - cpu0
        await server.stop(None)

    asyncio.run(serve())


def _grpc_send_aio(spec: Spec, t) -> list[float]:
    """The "grpc" sender on grpc.aio: pre-serialized pieces written with ``call.write``;
    several streams are concurrent tasks on one event loop."""
    import asyncio

    import grpc

    from mobius_fed.proto import ring_pb2
    from mobius_fed.transport import tls

    node = _layout(spec).worker(0) if spec.tls else None
    plan = bounds(spec)
    flat = t.view(-1)

    async def run() -> list[float]:
        nch = spec.streams if spec.separate_channels else 1
        chans = []
        for s in range(nch):
            opts = tls.channel_options() + list(spec.opts)
            opts += [("grpc.use_local_subchannel_pool", 1), ("mobius.bench.channel", s)]
            target = f"127.0.0.1:{spec.port}"
            if spec.tls:
                ch = grpc.aio.secure_channel(target, tls.channel_credentials(node), opts)
            else:
                ch = grpc.aio.insecure_channel(target, opts)
            await ch.channel_ready()
            chans.append(ch)
        calls = [
            chans[s % nch].stream_stream(
                "/mobius_fed.ring.v1.RingLink/Stream",
                request_serializer=None,
                response_deserializer=ring_pb2.Frame.FromString,
            )()
            for s in range(spec.streams)
        ]

        async def send_part(s: int, j: int) -> None:
            call = calls[s]
            for k, (a, b) in enumerate(plan[s]):
                await call.write(frame_bytes(j, s, k, flat[a:b]))
            ack = await call.read()
            if ack.step != j or ack.tick != s:
                raise RuntimeError(f"bad ack {ack}")

        times = []
        cpu0 = _cpu()
        for j in range(spec.n):
            t0 = time.perf_counter()
            await asyncio.gather(*(send_part(s, j) for s in range(spec.streams)))
            times.append(time.perf_counter() - t0)
        LOOP_CPU[0] = _cpu() - cpu0
        for call in calls:
            await call.done_writing()
        for ch in chans:
            await ch.close()
        return times

    return asyncio.run(run())


def receiver_main(conn) -> None:
    import logging

    import torch

    logging.disable(logging.WARNING)  # the plaintext reference variant warns by design
    torch.set_num_threads(1)
    while True:
        spec = conn.recv()
        if spec is None:
            return
        _tune_process(spec)
        recv = {
            "tcp": _tcp_recv,
            "gloo": _gloo_recv,
            "grpc": _grpc_serve,
            "link": _link_recv,
            "tls": _tls_recv,
        }
        if spec.kind == "grpc" and spec.aio:
            _grpc_serve_aio(spec, conn)
        else:
            recv[spec.kind](spec, conn)
        conn.send(("done", LOOP_CPU[0]))


# ----------------------------------------------------------------------------- sender


def _tcp_send(spec: Spec, t) -> list[float]:
    c = _dial(spec.port)
    mv = memoryview(t.numpy()).cast("B")
    return _timed_sends(spec, c, lambda: c.sendall(mv))


def _gloo_send(spec: Spec, t) -> list[float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=0, world_size=2
    )
    ack = torch.zeros(1)
    times = []
    cpu0 = _cpu()
    for _ in range(spec.n):
        t0 = time.perf_counter()
        dist.send(t, dst=1)
        dist.recv(ack, src=1)
        times.append(time.perf_counter() - t0)
    LOOP_CPU[0] = _cpu() - cpu0
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
                q.put(frame_bytes(j, s, k, piece))
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
    cpu0 = _cpu()
    for j in range(spec.n):
        t0 = time.perf_counter()
        if pool is None:
            send_part(0, j)
        else:
            for f in [pool.submit(send_part, s, j) for s in range(spec.streams)]:
                f.result()
        times.append(time.perf_counter() - t0)
    LOOP_CPU[0] = _cpu() - cpu0
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
    cpu0 = _cpu()
    for j in range(spec.n):
        t0 = time.perf_counter()
        links.send_tensor(_link_key(j), t)
        if c.recv_into(one, 1) != 1:
            raise ConnectionError("receiver closed")
        times.append(time.perf_counter() - t0)
    LOOP_CPU[0] = _cpu() - cpu0
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
        _tune_process(spec)
        try:
            send = {
                "tcp": _tcp_send,
                "gloo": _gloo_send,
                "grpc": _grpc_send,
                "link": _link_send,
                "tls": _tls_send,
            }
            if spec.kind == "grpc" and spec.aio:
                times = _grpc_send_aio(spec, t)
            else:
                times = send[spec.kind](spec, t)
            conn.send(("ok", times, LOOP_CPU[0]))
        except Exception as e:  # report, keep the worker alive for the next method
            conn.send(("error", f"{type(e).__name__}: {e}", 0.0))


# ----------------------------------------------------------------------------- driver


def self_check() -> None:
    """The hand-built wire bytes parse to exactly what make_frame builds."""
    import torch

    from mobius_fed.proto import ring_pb2
    from mobius_fed.transport import codec

    x = torch.randn(3, 5)
    kw = dict(run_id=RUN_ID, step=7, origin=0, tick=1, micro=2, direction=ring_pb2.FORWARD)
    ref = codec.make_frame(tensor=x, **kw)
    mine = ring_pb2.Frame.FromString(frame_bytes(7, 1, 2, x))
    assert mine == ref, "frame_bytes differs from make_frame"
    got = codec.decode_tensor(mine.tensor, expected_shape=(3, 5), expected_dtype="fp32")
    assert torch.equal(got, x)
    (real,) = codec.encode_frames(tensor=x, **kw)
    assert ring_pb2.Frame.FromString(real) == ref, "codec.encode_frames differs from make_frame"


THP_VAR = "THP_MEM_ALLOC_ENABLE"
"""torch: allocations of 2 MiB and more are 2 MiB-aligned and madvise(MADV_HUGEPAGE)d."""

SYSTEM = (("allocator", False),)
"""LinkTuning of the link with glibc malloc as configured (link.allocator = system)."""


def variants() -> list[Spec]:
    """Each process profile (allocator, collector) runs in its own pair of workers,
    because tune_malloc() cannot be undone in a running process."""
    m = MiB
    H = tuple(HTTP2_OPTS)
    T = dict(malloc=True)
    Q = dict(quick=True)
    return [
        Spec("raw TCP", "tcp", **Q),
        Spec("gloo send/recv", "gloo", **Q),
        Spec("gRPC plaintext, 1 frame", "grpc", tls=False),
        Spec("gRPC mTLS, 1 frame (make_frame)", "grpc", **Q),
        # The product link tunes the allocator itself (link.allocator = tuned): its pair
        # of processes is the tuned one; "allocator system" is the link without it.
        Spec("ring link", "link", **T, **Q),
        Spec("ring link, allocator system", "link", tuning=SYSTEM, **Q),
        Spec("ring link, 4 MiB chunks", "link", chunk=4 * m, **T, **Q),
        Spec("ring link, 1 frame", "link", chunk=NBYTES, **T),
        Spec("mTLS chunk 1 MiB", "grpc", chunk=1 * m),
        Spec("mTLS 1 frame, preser", "grpc", preser=True),
        Spec("mTLS chunk 1 MiB, preser", "grpc", chunk=1 * m, preser=True),
        # --- from here on both workers run with tune_malloc()
        Spec("M raw TCP", "tcp", **T),
        Spec("M gloo send/recv", "gloo", **T),
        Spec("ring link, 2 MiB chunks", "link", chunk=2 * m, **T),
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


def codec_costs(reps: int = 20) -> tuple[float, float]:
    """CPU ms of the link's own work on one 16 MiB tensor, in this process: encoding the
    frames (``codec.encode_frames``: CRC + one copy per piece) and receiving them
    (``parse_frame`` + ``TensorAssembler.add``: validation, CRC, finiteness, reassembly).
    What remains of a transfer's CPU time is gRPC, TLS and the kernel."""
    import torch

    from mobius_fed.proto import ring_pb2
    from mobius_fed.transport.allocator import tune_allocator
    from mobius_fed.transport.codec import TensorAssembler, encode_frames, parse_frame

    torch.set_num_threads(1)
    tune_allocator()
    t = make_tensor()
    kw = dict(run_id=RUN_ID, step=0, origin=0, tick=1, micro=0, direction=ring_pb2.FORWARD)

    def encode() -> list[bytes]:
        return list(encode_frames(tensor=t, **kw))

    def receive(frames: list[bytes]):
        pieces = TensorAssembler(SHAPE, "fp32")
        for raw in frames:
            frame, data = parse_frame(raw)
            out = pieces.add("k", frame, data=data)
        return out

    frames = encode()
    assert torch.equal(receive(frames), t)
    costs = []
    for fn in (encode, lambda: receive(frames)):
        for _ in range(3):
            fn()
        c0 = time.process_time()
        for _ in range(reps):
            fn()
        costs.append((time.process_time() - c0) / reps * 1e3)
    return costs[0], costs[1]


class Pair:
    """A sender and a receiver process for one process profile (allocator and collector
    settings cannot be undone in a running process, so each profile has its own pair)."""

    def __init__(self, ctx, thp: bool = False) -> None:
        self.rx_parent, rx_child = ctx.Pipe()
        self.tx_parent, tx_child = ctx.Pipe()
        self.rx = ctx.Process(target=receiver_main, args=(rx_child,), daemon=True)
        self.tx = ctx.Process(target=sender_main, args=(tx_child,), daemon=True)
        # torch reads THP_MEM_ALLOC_ENABLE once, at its first allocation: set it for the
        # children's start only (spawn passes this process's environment on).
        before = os.environ.get(THP_VAR)
        if thp:
            os.environ[THP_VAR] = "1"
        else:
            os.environ.pop(THP_VAR, None)
        try:
            self.rx.start()
            self.tx.start()
        finally:
            if before is None:
                os.environ.pop(THP_VAR, None)
            else:
                os.environ[THP_VAR] = before

    split: tuple[float, float] = (0.0, 0.0)  # the sender's and the receiver's share of cpu
    cpu: float | None = None
    """CPU seconds per transfer of the last method, sender plus receiver (the plain gRPC
    servers count from "ready" to "stop", their client's TLS handshake included)."""

    def run(self, spec: Spec) -> list[float] | str:
        """The sender's transfer times, or why it failed."""
        self.rx_parent.send(spec)
        if not self.rx_parent.poll(60) or self.rx_parent.recv() != "ready":
            raise RuntimeError(f"{spec.name}: receiver not ready")
        self.tx_parent.send(spec)
        if not self.tx_parent.poll(120):
            raise RuntimeError(f"{spec.name}: sender timed out")
        _, payload, tx_cpu = self.tx_parent.recv()  # ("ok", times, cpu) / ("error", text, 0)
        if spec.kind == "grpc":
            self.rx_parent.send("stop")
        if not self.rx_parent.poll(60):
            raise RuntimeError(f"{spec.name}: receiver did not finish")
        _, rx_cpu = self.rx_parent.recv()
        self.cpu = (tx_cpu + rx_cpu) / spec.n
        self.split = (tx_cpu / spec.n, rx_cpu / spec.n)
        return payload

    def close(self) -> None:
        for c in (self.rx_parent, self.tx_parent):
            c.send(None)
        self.rx.join(10)
        self.tx.join(10)


def levers() -> list[Spec]:
    """What ``--levers`` compares, interleaved round by round with gloo (see main)."""
    m = MiB
    MG = dict(malloc=True, gcfreeze=True)
    M = dict(malloc=True)
    G = MG
    return [
        Spec("ring link", "link", **M),
        Spec("ring link, allocator system", "link", tuning=SYSTEM),
        Spec("ring link, torch THP", "link", thp=True, **M),
        Spec("ring link, torch THP, allocator system", "link", thp=True, tuning=SYSTEM),
        Spec("ring link, http2 set", "link", opts=tuple(HTTP2_OPTS), **M),
        Spec("ring link, 16 MiB h2 frames", "link", opts=HTTP2_OPTS[:1], **M),
        Spec("ring link, 64 MiB window", "link", opts=HTTP2_OPTS[1:3], **M),
        Spec("ring link, 64 MiB write buffer", "link", opts=HTTP2_OPTS[3:4], **M),
        Spec("ring link, 4 MiB tcp reads", "link", opts=HTTP2_OPTS[4:], **M),
        Spec("ring link, tx zerocopy", "link", opts=ZEROCOPY_OPTS, **M),
        Spec("ring link, gc frozen", "link", **G),
        Spec("ring link, gc frozen, allocator system", "link", gcfreeze=True, tuning=SYSTEM),
        Spec("ring link, 512 KiB chunks", "link", chunk=m // 2, **M),
        Spec("ring link, 2 MiB chunks", "link", chunk=2 * m, **M),
        Spec("ring link, 4 MiB chunks", "link", chunk=4 * m, **M),
        Spec("ring link, plaintext (no TLS: reference only)", "link", tls=False, **M),
        Spec("ring link, GIL switch 0.5 ms", "link", switch_ms=0.5, **M),
        Spec("ring link, GIL switch 50 ms", "link", switch_ms=50.0, **M),
        Spec("ring link, ACK every 32 frames", "link", ack_every=32, **M),
        Spec("mTLS socket, no gRPC (reference only)", "tls", **M),
        Spec("sync 1 MiB preser, MG", "grpc", chunk=m, preser=True, fastfin=True, **MG),
        Spec("aio 1 MiB preser, MG", "grpc", chunk=m, aio=True, fastfin=True, **MG),
        Spec("sync 2 streams (chan), MG", "grpc", chunk=m, streams=2, preser=True, **MG),
        Spec("aio 2 streams (chan), MG", "grpc", chunk=m, streams=2, aio=True, **MG),
        Spec("aio 4 streams (chan), MG", "grpc", chunk=m, streams=4, aio=True, **MG),
        Spec("aio 2 streams (chan) x 2 MiB, MG", "grpc", chunk=2 * m, streams=2, aio=True, **MG),
        Spec("aio 2 streams (chan)", "grpc", chunk=m, streams=2, aio=True),
        Spec("sync 4 streams (chan), MG", "grpc", chunk=m, streams=4, preser=True, **MG),
        Spec(
            "aio 2 streams (1conn), MG",
            "grpc",
            chunk=m,
            streams=2,
            aio=True,
            separate_channels=False,
            **MG,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="only raw TCP, gloo, the gRPC baseline and the real link; 2 warm-up + 5 timed",
    )
    ap.add_argument(
        "--levers",
        action="store_true",
        help="the link levers (allocator, collector, piece size, grpc.aio, streams) instead",
    )
    ap.add_argument("--reps", type=int, default=None, help="timed transfers (default 10)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed transfers (default 3)")
    ap.add_argument(
        "--only",
        default="",
        help="run methods whose name contains this (several: separated by '|'; '=NAME': "
        "exactly that name)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every method this often, interleaved; figures are medians over rounds "
        "and ratios are taken to gloo of the same round",
    )
    ap.add_argument(
        "--codec-costs",
        action="store_true",
        help="only the link's own CPU work per tensor (encode; parse + validate + reassemble)",
    )
    args = ap.parse_args(argv)
    if args.codec_costs:
        enc, dec = codec_costs()
        print(f"16 MiB fp32, 1 MiB pieces, CPU ms per tensor: encode {enc:.2f}, receive {dec:.2f}")
        return 0
    reps = args.reps or (5 if args.quick else 10)
    warm = args.warmup if args.warmup is not None else (2 if args.quick else 3)

    from mobius_fed.transport.certs import init_certs

    self_check()
    ctx = mp.get_context("spawn")
    tmp = tempfile.TemporaryDirectory(prefix="link-bench-")
    init_certs(Path(tmp.name) / "certs", workers=2)

    pool = levers() if args.levers else variants()
    wanted = [w.strip().lower() for w in args.only.split("|")]

    def picked(name: str) -> bool:
        name = name.lower()
        return any(w[1:] == name if w.startswith("=") else w in name for w in wanted)

    specs = [v for v in pool if picked(v.name) and (v.quick or not args.quick)]
    must = [v for v in variants() if v.kind in ("tcp", "gloo") and not v.malloc and v not in specs]
    order = must + specs
    pairs: dict[tuple[bool, bool, bool], Pair] = {}
    per_round: list[dict[str, float | str]] = []
    cpu: dict[str, list[float]] = {}
    t_start = time.perf_counter()
    print(
        f"16 MiB fp32 {SHAPE}, {warm} warm-up + {reps} timed transfers each, "
        f"{args.rounds} round(s); timed on the sender until the receiver's post-decode ack; "
        "MB = 1e6 bytes",
        flush=True,
    )
    for r in range(args.rounds):
        got: dict[str, float | str] = {}
        for spec in order:
            spec = replace(
                spec,
                port=free_port(),
                port2=free_port(),
                ack_port=free_port(),
                n=warm + reps,
                certs=str(Path(tmp.name) / "certs"),
            )
            key = (spec.malloc, spec.gcfreeze, spec.thp)
            if key not in pairs:
                pairs[key] = Pair(ctx, thp=spec.thp)
            payload = pairs[key].run(spec)
            if isinstance(payload, str):
                got[spec.name] = payload
                print(f"  [{r}] {spec.name:<40} FAILED: {payload}", flush=True)
                continue
            med = statistics.median(payload[warm:])
            got[spec.name] = NBYTES / med / 1e6
            used = pairs[key].cpu
            if used is not None:
                cpu.setdefault(spec.name, []).append(used)
            print(
                f"  [{r}] {spec.name:<40} {got[spec.name]:8.0f} MB/s  "
                f"(median {med * 1e3:.1f} ms, min {min(payload[warm:]) * 1e3:.1f} ms"
                + (
                    f", CPU {used * 1e3:.1f} ms/transfer: sender {pairs[key].split[0] * 1e3:.1f}"
                    f" + receiver {pairs[key].split[1] * 1e3:.1f})"
                    if used is not None
                    else ")"
                ),
                flush=True,
            )
        per_round.append(got)
    for pair in pairs.values():
        pair.close()
    tmp.cleanup()

    def figures(name: str) -> tuple[float, float | None, float | None] | None:
        vals = [g[name] for g in per_round if isinstance(g[name], float)]
        if not vals:
            return None
        ratios = {}
        for base in ("gloo send/recv", "raw TCP"):
            rs = [
                g[name] / g[base]  # type: ignore[operator]
                for g in per_round
                if isinstance(g[name], float) and isinstance(g.get(base), float)
            ]
            ratios[base] = statistics.median(rs) if rs else None
        return statistics.median(vals), ratios["gloo send/recv"], ratios["raw TCP"]

    print()
    print(
        "M = both workers tune_malloc(); G = both workers freeze_gc(); F = receiver "
        "decode_fast; preser = hand-built wire bytes"
    )
    print(f"medians over {args.rounds} round(s); ratios: median of the per-round ratios")
    print(
        "CPU ms = CPU time (all threads, sender + receiver) per transfer, the cost that "
        "contention on a shared machine does not change much"
    )
    print(f"{'method':<42} {'MB/s':>8} {'÷ gloo':>8} {'÷ TCP':>8} {'CPU ms':>8}")
    print("-" * 78)
    results: dict[str, tuple] = {}
    for name in [s.name for s in order]:
        f = figures(name)
        if f is None:
            print(f"{name:<42} {'failed':>8}")
            continue
        results[name] = f
        v, rg, rt = f
        rgs = f"{rg:8.2f}" if rg is not None else f"{'-':>8}"
        rts = f"{rt:8.2f}" if rt is not None else f"{'-':>8}"
        used = f"{statistics.median(cpu[name]) * 1e3:8.1f}" if name in cpu else f"{'-':>8}"
        print(f"{name:<42} {v:8.0f} {rgs} {rts} {used}")
    real = results.get("ring link")
    if real is not None and real[1] is not None:
        print(
            f"\nring link (as shipped): {real[0]:.0f} MB/s = {real[1]:.2f} x gloo "
            f"(target >= 0.5: {'met' if real[1] >= 0.5 else 'NOT met'})"
        )
    system = results.get("ring link, allocator system")
    if real is not None and system is not None and "ring link" in cpu:
        per = statistics.median(cpu["ring link"]) * 1e3
        per_sys = statistics.median(cpu["ring link, allocator system"]) * 1e3
        print(
            f"allocator tuned vs system: {real[0] / system[0]:.2f} x MB/s, "
            f"CPU {per:.1f} vs {per_sys:.1f} ms per transfer"
        )
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
