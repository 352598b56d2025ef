"""A worker's two ring links: one long-lived bidirectional gRPC stream per ring edge.

Worker i serves ``RingLink.Stream`` for its predecessor i-1 (FORWARD frames arrive on the
request side, BACKWARD frames leave on the response side) and calls ``Stream`` on its
successor i+1 (FORWARD frames leave, BACKWARD frames arrive). Frames for other workers are
relayed in the same direction; frames for this worker are validated, decoded and put in
the inbox the step executor reads.

Trust (ARCHITECTURE §7, §8). Every frame has one producer and one route, computed from the
schedule (:meth:`FrameRules.arrival`): a frame is accepted only when the authenticated
neighbour it came from is the hop before this worker on that route, at every hop. A
server keeps one *session* for its predecessor and at most one live stream in it; a
second stream from that identity is refused with ``ALREADY_EXISTS``. Every frame belongs
to the session that carried it: when a session ends, its half-received tensors, the
relayed tensors it had not completed and its delivered-but-unconsumed frames are dropped.
Each frame key is consumed (or relayed) once; a replay is refused. Relays forward a tensor
only once all of its pieces validated, so nothing partial leaves a dead session.

Transient faults (ARCHITECTURE §11). A session survives its stream: each side keeps the
frames it sent until the other side acknowledges them (ACK frames, every few frames), and
counts the frames it received. When a stream breaks, the client re-dials with backoff for
up to ``link_grace`` seconds and presents the session's secret token and its count; the
server answers with its own count and both resend the rest, in order. The step then
completes with unchanged math. Past the grace the inbox fails with an error naming the
ring edge. Keepalive: the client pings every ``client_keepalive_ms``; the server accepts
pings that often (``grpc.http2.min_ping_interval_without_data_ms``) and pings the client
itself, so a dead connection is noticed on both sides within seconds.

Bytes on the wire: both sides of the stream carry pre-serialized ``Frame`` bytes (the
Stream method is registered with no (de)serializers on either end). A tensor is encoded
once, straight from its memory into the frame bytes (:func:`codec.encode_frames`), split
into frames of at most ``chunk_bytes``; a relay validates each frame and re-sends the very
bytes it received. ``bytes_sent`` and the capture file count every tensor and FIN frame
handed to gRPC, resends included; link-control ACK frames (a few bytes) are not counted.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2

from mobius_fed.machines import EDGE, EdgeState
from mobius_fed.proto import ring_pb2, ring_pb2_grpc
from mobius_fed.transport.allocator import tune_allocator
from mobius_fed.transport.codec import (
    FrameError,
    TensorAssembler,
    encode_frames,
    max_message_bytes,
    parse_frame,
)
from mobius_fed.transport.compress import Codec
from mobius_fed.transport.link_tuning import LinkTuning, refuse_renamed_variables
from mobius_fed.transport.tls import (
    NodeTLS,
    add_port,
    channel_credentials,
    peer_identity,
    worker_identity,
)
from mobius_fed.transport.wire_stages import codecs
from mobius_fed.worker.frames import (
    ACK,
    BACKWARD,
    CLOSE,
    DELIVER,
    FIN,
    FORWARD,
    RELAY,
    FrameKey,
    FrameRules,
    edge_name,
)

log = logging.getLogger("mobius.link")
_SERVICE = ring_pb2.DESCRIPTOR.services_by_name["RingLink"].full_name
STREAM_METHOD = f"/{_SERVICE}/Stream"

# Handshake metadata (see ring.proto).
MD_RUN, MD_SESSION, MD_ACK = "mobius-run", "mobius-session", "mobius-ack"

ACK_EVERY = 8
"""A receiver acknowledges after this many frames (and at once after a FIN)."""
SERVER_THREADS = 16
"""gRPC handler threads of a worker's server: ring streams take at most RING_HANDLERS."""
RING_HANDLERS = 4
"""Stream handlers at once: the live one plus ones being refused or taking over."""
MAX_CONCURRENT_RPCS = 32
"""Beyond this many RPCs in flight the server answers RESOURCE_EXHAUSTED at once."""
MAX_STREAMS_PER_CONNECTION = 8
IDLE_CONNECTION_MS = 120_000
"""A connection with no RPC for this long is closed (a live ring stream is never idle)."""
HANDSHAKE_TIMEOUT_S = 10.0
"""A dialled stream whose server does not answer the handshake within this is dropped."""


@dataclass(frozen=True)
class LinkTimers:
    """HTTP/2 keepalive of ring links and the client's re-dial backoff.

    The server accepts a client ping every ``min_ping_interval_ms`` even when no data flows
    (it must not exceed ``client_keepalive_ms``, else the server answers the client's
    pings with GOAWAY "too_many_pings"); both sides ping, so a connection that died
    without a FIN/RST is noticed within ``*_keepalive_ms + keepalive_timeout_ms``.
    """

    client_keepalive_ms: int = 5_000
    server_keepalive_ms: int = 5_000
    keepalive_timeout_ms: int = 5_000
    min_ping_interval_ms: int = 4_000
    first_backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.min_ping_interval_ms > self.client_keepalive_ms:
            raise ValueError(
                f"min_ping_interval_ms {self.min_ping_interval_ms} > client_keepalive_ms "
                f"{self.client_keepalive_ms}: the server would refuse the client's pings"
            )


class PeerError(RuntimeError):
    """A ring peer is unreachable, went away, or sent something unusable."""


def _culprit(exc: FrameError, who: str, edge: str) -> str:
    """``frame rejected: X`` → ``frame rejected from <who> on edge <edge>: X``."""
    text = str(exc)
    for head in ("frame rejected", "tensor rejected"):
        if text.startswith(head + ": "):
            return f"{head} from {who} on edge {edge}: {text[len(head) + 2 :]}"
    return f"frame rejected from {who} on edge {edge}: {text}"


# ----------------------------------------------------------------------------- inbox


class Inbox:
    """Decoded tensors addressed to this worker, keyed by :class:`FrameKey`.

    Each entry remembers the session that delivered it (:meth:`drop` removes a dead
    session's unconsumed entries); a key is consumed once per step window, and a key
    already queued or consumed is refused (:meth:`check_new`).
    """

    def __init__(self, current_step: Callable[[], int] = lambda: 0) -> None:
        self._items: dict[FrameKey, tuple[torch.Tensor, object]] = {}
        self._consumed: set[FrameKey] = set()
        self._pruned_at = -1
        self._current_step = current_step
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.fins: set[int] = set()
        self._fin_from: dict[int, object] = {}
        self.last_problem: str | None = None  # named in a timeout: why a frame never came
        self.on_consume: Callable[[object], None] = lambda owner: None
        self.held: Callable[[], bool] = lambda: False  # timeouts pause while this is true
        self.describe_links: Callable[[], str] = lambda: ""

    def check_new(self, key: FrameKey) -> None:
        with self._cond:
            self._check_new(key)

    def _check_new(self, key: FrameKey) -> None:
        if key in self._items:
            raise FrameError(f"frame rejected: duplicate {key.describe()} (already queued)")
        if key in self._consumed:
            raise FrameError(f"frame rejected: replay of {key.describe()} (already consumed)")

    def put(self, key: FrameKey, tensor: torch.Tensor, owner: object = None) -> None:
        with self._cond:
            self._check_new(key)
            self._items[key] = (tensor, owner)
            self._cond.notify_all()

    def drop(self, owner: object) -> int:
        """Forget the unconsumed entries and the FINs ``owner`` delivered; return how many
        entries."""
        with self._cond:
            keys = [k for k, (_, o) in self._items.items() if o is owner]
            for k in keys:
                del self._items[k]
            for origin in [o for o, who in self._fin_from.items() if who is owner]:
                del self._fin_from[origin]
                self.fins.discard(origin)
            return len(keys)

    def add_fin(self, origin: int, owner: object = None) -> bool:
        """Record worker ``origin``'s FIN; False if it was already recorded."""
        with self._cond:
            if origin in self.fins:
                return False
            self.fins.add(origin)
            self._fin_from[origin] = owner
            self._cond.notify_all()
            return True

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _prune(self) -> None:
        now = self._current_step()
        if now != self._pruned_at:  # frames of earlier steps are refused by the window
            self._consumed = {k for k in self._consumed if k.step >= now - 1}
            self._pruned_at = now

    def get(self, key: FrameKey, timeout: float, waiting_for: str) -> torch.Tensor:
        """Wait for ``key``. Time while a ring edge is reconnecting does not count."""
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        with self._cond:
            while key not in self._items:
                if self._error is not None:
                    raise PeerError(str(self._error)) from self._error
                now = time.monotonic()
                if self.held():
                    deadline += now - last
                last = now
                left = deadline - now
                if left <= 0:
                    hint = f"; last refused frame: {self.last_problem}" if self.last_problem else ""
                    links = self.describe_links()
                    raise PeerError(
                        f"timed out after {timeout:.0f}s waiting for {waiting_for}{hint}"
                        + (f" ({links})" if links else "")
                    )
                self._cond.wait(min(left, 0.5))
            tensor, owner = self._items.pop(key)
            self._prune()
            self._consumed.add(key)
        self.on_consume(owner)
        return tensor

    def wait_fins(self, expected: set[int], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: expected <= self.fins or self._error is not None, timeout
            )


class _Capture:
    """Audit file of every frame's bytes this worker sends, shared by its senders."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("ab", buffering=0)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._file.closed:  # a late frame while the link shuts down
                return
            view = memoryview(data)
            while view:  # unbuffered writes may be partial
                view = view[self._file.write(view) :]


# ------------------------------------------------------------------- session state


class _Stream:
    """One gRPC Stream call carrying a session."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.cursor = 1  # sequence number of the next frame to send on this stream
        self.dead = False
        self.ended = False
        self.failure: str | None = None
        self.go = threading.Event()  # client side: the handshake told us where to resume
        self.session: _Session | None = None
        self.rx_at_start = 0  # server side: the count sent back in the handshake


class _Endpoint:
    """One end of a ring edge's session: the frames it sends, kept until acknowledged,
    and the count of frames it received from the other end.

    Frames are numbered from 1 in the order :meth:`put` receives them; a stream sends them
    from its cursor on, interleaved with ACK frames that report ``rx``.
    """

    def __init__(self, capture: _Capture | None) -> None:
        self.cond = threading.Condition()
        self._buf: dict[int, bytes] = {}
        self.acked = 0  # frames the other end confirmed (dropped from the buffer)
        self.queued = 0  # frames put so far (sequence number of the newest)
        self.sent_hi = 0  # highest sequence number handed to gRPC on any stream
        self.closed = False  # no more frames: streams end after the last one
        self.done = False  # client side: no stream will carry this session any more
        self.goodbye: bytes | None = None  # sent (uncounted) after the last frame
        self.rx = 0  # frames of the other direction received and processed
        self.rx_acked = 0  # the last count sent in an ACK
        self.flush_ack = False
        self.bytes_sent = 0
        self.frames_sent = 0
        self.resent = 0
        self.stream: _Stream | None = None
        self._capture = capture

    def put(self, data: bytes) -> int:
        """Queue one frame; return its sequence number (0: dropped, the link is closed)."""
        with self.cond:
            if self.closed:
                log.debug("dropping a frame sent after the link closed")
                return 0
            self.queued += 1
            self._buf[self.queued] = data
            self.cond.notify_all()
            return self.queued

    def close(self, goodbye: bytes | None = None) -> None:
        """No more frames; a stream ends after the last one (then sends ``goodbye``)."""
        with self.cond:
            self.closed = True
            self.goodbye = self.goodbye or goodbye
            self.cond.notify_all()

    def end_stream(self, st: _Stream) -> None:
        with self.cond:
            st.dead = True
            if self.stream is st:
                self.stream = None
            self.cond.notify_all()

    def on_ack(self, n: int) -> None:
        with self.cond:
            if not self.acked <= n <= self.sent_hi:
                raise FrameError(
                    f"frame rejected: ACK {n} (expected {self.acked}..{self.sent_hi}: "
                    "frames sent and not yet acknowledged)"
                )
            for seq in range(self.acked + 1, n + 1):
                self._buf.pop(seq, None)
            self.acked = n
            self.cond.notify_all()

    def resume(self, n: int, st: _Stream) -> str | None:
        """Make ``st`` this session's stream, resending after the peer's count ``n``."""
        with self.cond:
            if not self.acked <= n <= self.sent_hi:
                return (
                    f"the peer reports {n} frames received, but {self.acked}..{self.sent_hi} "
                    "are possible"
                )
            if self.stream is not None:
                self.stream.dead = True
            for seq in range(self.acked + 1, n + 1):
                self._buf.pop(seq, None)
            self.acked = n
            self.resent += self.sent_hi - n
            st.cursor = n + 1
            self.stream = st
            st.go.set()
            self.cond.notify_all()
            return None

    def received(self, flush: bool = False) -> None:
        with self.cond:
            self.rx += 1
            self.flush_ack = self.flush_ack or flush
            if flush or self.rx - self.rx_acked >= ACK_EVERY:
                self.cond.notify_all()

    def frames(self, st: _Stream, ack_frame: Callable[[int], bytes]) -> Iterator[bytes]:
        """What stream ``st`` sends: frames from its cursor on, and ACKs when due."""
        while True:
            counted = False
            with self.cond:
                while True:
                    if st.dead or self.stream is not st:
                        return
                    due = self.rx - self.rx_acked
                    if due > 0 and (self.flush_ack or due >= ACK_EVERY):
                        self.rx_acked, self.flush_ack = self.rx, False
                        data = ack_frame(self.rx)
                        break
                    if st.cursor <= self.queued:
                        seq = max(st.cursor, self.acked + 1)
                        data = self._buf[seq]
                        st.cursor = seq + 1
                        self.sent_hi = max(self.sent_hi, seq)
                        self.bytes_sent += len(data)
                        self.frames_sent += 1
                        counted = True
                        break
                    if self.closed:
                        if self.goodbye is None:
                            return
                        data, self.goodbye = self.goodbye, None
                        break
                    self.cond.wait()
            if counted and self._capture is not None:
                self._capture.write(data)
            yield data

    def wait_acked(self, seq: int, timeout: float) -> bool:
        """Wait until the peer confirmed frames up to ``seq`` or the link ended for good."""
        with self.cond:
            return self.cond.wait_for(lambda: self.acked >= seq or self.done, timeout)


class _Session:
    """Everything one ring edge's session owns on this worker."""

    def __init__(self, who: str, pieces: TensorAssembler, capture: _Capture | None) -> None:
        self.who = who
        self.token = secrets.token_hex(16)
        self.end = _Endpoint(capture)
        self.pieces = pieces
        self.relay_hold: dict[FrameKey, list[bytes]] = {}
        self.rx_lock = threading.Lock()  # one frame at a time; a takeover waits for it
        self.carrying = False  # its frames were consumed, or this worker sent it frames
        self.fin_seen = False  # the sending neighbour's own FIN came through it
        self.finished = False
        self.down_since: float | None = None
        self.last_error = ""
        self.timer: threading.Timer | None = None


# ------------------------------------------------------------------------- links


class RingLinks(ring_pb2_grpc.RingLinkServicer):
    """Server for the predecessor's stream plus client stream to the successor."""

    def __init__(
        self,
        rules: FrameRules,
        *,
        listen: str,
        successor: str,
        tls: NodeTLS | None,
        insecure: bool = False,
        peer_timeout: float = 120.0,
        capture: Path | None = None,
        chunk_bytes: int | None = None,
        link_grace: float = 60.0,
        timers: LinkTimers | None = None,
        tuning: LinkTuning | None = None,
    ) -> None:
        if tuning is None:
            refuse_renamed_variables(os.environ)  # a stale MOBIUS_LINK_<X> must not be ignored
            tuning = LinkTuning()
        self.tuning = tuning
        if tuning.allocator:
            tune_allocator()  # process-wide, once: the link's buffers stay on the heap
        if chunk_bytes is None:
            chunk_bytes = self.tuning.chunk
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if link_grace < 0:
            raise ValueError(f"link_grace must be ≥ 0, got {link_grace}")
        self.rules, self.rank, self.P = rules, rules.rank, rules.P
        self.chunk_bytes = chunk_bytes
        self.max_message = max_message_bytes(chunk_bytes)
        # A message larger than one of our pieces is refused (RESOURCE_EXHAUSTED): every
        # worker of a ring must use the same piece size (link.chunk).
        self.max_receive = self.max_message
        self.listen, self.successor_addr = listen, successor
        self.tls, self.insecure, self.peer_timeout = tls, insecure, peer_timeout
        self.link_grace = link_grace
        self.timers = timers or LinkTimers()
        self.pred, self.succ = (self.rank - 1) % self.P, (self.rank + 1) % self.P
        self.edge_in = edge_name(self.pred, self.rank)
        self.edge_out = edge_name(self.rank, self.succ)
        self.predecessor_identity = worker_identity(self.pred)
        self.successor_identity = worker_identity(self.succ)
        self.inbox = Inbox(rules.current_step)
        self.inbox.on_consume = self._consumed_from
        self.inbox.held = self._reconnecting
        self.inbox.describe_links = self._describe_edges
        self._capture = _Capture(capture) if capture else None
        self.rejected: list[str] = []
        self._closing = threading.Event()
        self._relayed: set[FrameKey] = set()
        self._relay_lock = threading.Lock()
        # server side: the predecessor's session
        self._lock = threading.Lock()
        self._in_ready = threading.Condition(self._lock)
        self._in: _Session | None = None
        self._handlers = 0
        self._in_reconnects = 0
        self._old_bytes = 0  # bytes sent by ended predecessor sessions
        self._server: grpc.Server | None = None
        # client side: the session with the successor
        self._out = _Session(self.successor_identity, self._assembler(BACKWARD), self._capture)
        self._out.token = ""  # the successor's server hands the token out
        self._out_state = EdgeState.DOWN
        self._out_reconnects = 0
        self._channel: grpc.Channel | None = None
        self._call = None
        self._dialing = None
        self._out_stream: _Stream | None = None
        self._client_thread: threading.Thread | None = None

    @property
    def forward_out(self) -> _Endpoint:
        """What this worker sends to its successor (FORWARD frames, FINs)."""
        return self._out.end

    @property
    def backward_out(self) -> _Endpoint | None:
        """What this worker sends to its predecessor (BACKWARD frames), if connected."""
        s = self._in
        return s.end if s is not None else None

    # ---------------------------------------------------------------- server
    def _server_options(self) -> list[tuple[str, int]]:
        t = self.timers
        return [
            ("grpc.max_receive_message_length", self.max_receive),
            ("grpc.max_send_message_length", self.max_message),
            *self.tuning.grpc_options(),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
            ("grpc.keepalive_time_ms", t.server_keepalive_ms),
            ("grpc.keepalive_timeout_ms", t.keepalive_timeout_ms),
            ("grpc.http2.ping_timeout_ms", t.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", t.min_ping_interval_ms),
            ("grpc.so_reuseport", 0),  # a second process on this port fails loudly
        ]

    def start_server(self) -> int:
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=SERVER_THREADS, thread_name_prefix="ring"),
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            options=self._server_options(),
        )
        # Registered by hand so that Stream moves raw bytes both ways: requests are parsed
        # here (the relay needs the received bytes) and responses are sent pre-serialized.
        handlers = {
            "Stream": grpc.stream_stream_rpc_method_handler(self.Stream),
            "Ping": grpc.unary_unary_rpc_method_handler(
                self.Ping,
                request_deserializer=ring_pb2.PingRequest.FromString,
                response_serializer=ring_pb2.PingReply.SerializeToString,
            ),
        }
        self.health = health.HealthServicer()
        # Health answers Check only: Watch is a long-lived stream that nothing here uses.
        check = grpc.unary_unary_rpc_method_handler(
            self.health.Check,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        self._server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(_SERVICE, handlers),
                grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": check}),
            )
        )
        try:
            port = add_port(self._server, self.listen, self.tls, insecure=self.insecure)
        except RuntimeError as exc:  # newer grpcio raises instead of returning 0
            raise PeerError(f"worker-{self.rank}: cannot listen on {self.listen}: {exc}") from exc
        if port == 0:
            raise PeerError(f"worker-{self.rank}: cannot listen on {self.listen}")
        self._server.start()
        for name in ("", "mobius_fed.ring.v1.RingLink"):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("worker-%d listening on %s", self.rank, self.listen)
        return port

    def Ping(self, request: ring_pb2.PingRequest, context: grpc.ServicerContext):
        return ring_pb2.PingReply(
            identity=worker_identity(self.rank), peer=peer_identity(context) or ""
        )

    def Stream(self, request_iterator, context: grpc.ServicerContext):
        who = peer_identity(context)
        label = who or "<plaintext peer>"
        if not self.insecure and who != self.predecessor_identity:
            msg = (
                f"worker-{self.rank} accepts ring frames only from its predecessor "
                f"{self.predecessor_identity}, not {who or '<no identity>'}"
            )
            log.error("refused stream: %s", msg)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, msg)
        md = dict(context.invocation_metadata())
        run = md.get(MD_RUN)
        if run is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"no {MD_RUN} metadata: not a ring link client (from {label})",
            )
        if run != self.rules.run_id:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"worker-{self.rank} serves run {self.rules.run_id!r}, not {run!r}",
            )
        try:
            ack = int(md.get(MD_ACK, "0"))
        except ValueError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad {MD_ACK} metadata")
        token = md.get(MD_SESSION, "")
        st = _Stream(label)
        refusal = self._admit(st, token, ack, label)
        if refusal is not None:
            code, msg = refusal
            log.warning("refused stream from %s on edge %s: %s", label, self.edge_in, msg)
            context.abort(code, msg)
        s = st.session
        assert s is not None
        try:
            if not context.add_callback(lambda: self._stream_ended(s, st, "broken")):
                return  # the call ended already (finally: the stream ends with it)
            context.send_initial_metadata(((MD_SESSION, s.token), (MD_ACK, str(st.rx_at_start))))
            threading.Thread(
                target=self._serve_receive,
                args=(s, st, request_iterator),
                daemon=True,
                name="ring-recv-fwd",
            ).start()
            yield from s.end.frames(st, self._ack_frame)
            if st.failure:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, st.failure)
        finally:
            if not st.ended:  # e.g. the call was cancelled while this handler started
                self._stream_ended(s, st, "broken")
            with self._lock:
                self._handlers -= 1

    def _admit(self, st: _Stream, token: str, ack: int, label: str):
        """Bind ``st`` to a session; return (status, reason) to refuse it instead."""
        with self._lock:
            if self._closing.is_set():
                return grpc.StatusCode.UNAVAILABLE, f"worker-{self.rank} is closing its links"
            if self._handlers >= RING_HANDLERS:
                return (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"worker-{self.rank} is busy with {self._handlers} ring streams",
                )
            s = self._in
            if token:
                if s is None or not hmac.compare_digest(token.encode(), s.token.encode()):
                    return (
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"worker-{self.rank} has no such ring session (it restarted, or "
                        "dropped the session after the grace period)",
                    )
                with s.rx_lock:  # a frame in progress on the old stream finishes first
                    old = s.end.stream
                    err = s.end.resume(ack, st)
                    st.rx_at_start = s.end.rx
                if err is not None:
                    return grpc.StatusCode.INVALID_ARGUMENT, f"cannot resume: {err}"
                if old is not None:
                    log.warning(
                        "worker-%d: %s resumed its session on edge %s; the old stream is dropped",
                        self.rank,
                        label,
                        self.edge_in,
                    )
                if s.down_since is not None:
                    log.warning(
                        "ring edge %s back after %.1fs (%d frame(s) to resend)",
                        self.edge_in,
                        time.monotonic() - s.down_since,
                        s.end.sent_hi - ack,
                    )
                self._in_reconnects += 1
                s.down_since = None
                if s.timer is not None:
                    s.timer.cancel()
            else:
                if s is not None and s.end.stream is not None:
                    return (
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"worker-{self.rank} already has a live ring stream from {s.who} on "
                        f"edge {self.edge_in}; a second one is refused (is another process "
                        "using this worker's key?)",
                    )
                if ack != 0:
                    return grpc.StatusCode.INVALID_ARGUMENT, f"a new session starts at {MD_ACK} 0"
                if s is not None:
                    self._drop_session(s, f"replaced by a new session from {label}")
                    if s.carrying and not s.finished:  # the ring's frames in flight are gone
                        self.inbox.fail(
                            PeerError(
                                f"ring edge {self.edge_in}: a new session from {label} replaced "
                                f"the interrupted one (did worker-{self.pred} restart?)"
                            )
                        )
                s = self._in = _Session(label, self._assembler(FORWARD), self._capture)
                s.end.resume(0, st)
                st.rx_at_start = 0
                self._in_ready.notify_all()
            st.session = s
            self._handlers += 1
            return None

    def _serve_receive(self, s: _Session, st: _Stream, request_iterator) -> None:
        how = "broken"  # a stream that ends without CLOSE may be resumed
        try:
            for data in request_iterator:
                with s.rx_lock:
                    if st.dead:
                        return
                    if self._accept(data, FORWARD, s):
                        how = "closed"
                        return
        except FrameError as exc:
            msg = _culprit(exc, st.who, self.edge_in)
            self._refused(msg)
            st.failure = msg
            how = "refused"
        except grpc.RpcError:
            pass
        except Exception as exc:  # a bug must not leave the executor waiting silently
            log.exception("worker-%d: receiving on edge %s failed", self.rank, self.edge_in)
            st.failure = f"internal error on edge {self.edge_in}: {exc!r}"
            how = "refused"
        finally:
            self._stream_ended(s, st, how)

    def _stream_ended(self, s: _Session, st: _Stream, how: str) -> None:
        """A predecessor stream ended: ``closed`` (CLOSE), ``refused`` or ``broken``."""
        fail: str | None = None
        with self._lock:
            if st.ended:
                return
            st.ended = True
            current = s.end.stream is st
            s.end.end_stream(st)
            if self._in is not s or not current or self._closing.is_set():
                return
            if how == "refused":
                self._drop_session(s, "it sent a frame that was refused")
                if s.carrying:
                    fail = st.failure
            elif how == "closed" and s.fin_seen:
                s.finished = True
            elif how == "closed":
                self._drop_session(s, "closed before finishing")
                if s.carrying:
                    fail = f"ring edge {self.edge_in}: {s.who} closed the link before finishing"
            elif s.fin_seen or self._all_finished():
                s.finished = True
            else:
                s.down_since = time.monotonic()
                s.last_error = "the stream broke"
                log.warning(
                    "ring edge %s down (stream from %s broke); waiting up to %.0fs for it to "
                    "reconnect",
                    self.edge_in,
                    s.who,
                    self.link_grace,
                )
                s.timer = threading.Timer(self.link_grace, self._grace_over, args=(s,))
                s.timer.daemon = True
                s.timer.start()
        if fail:
            self.inbox.fail(PeerError(fail))

    def _grace_over(self, s: _Session) -> None:
        with self._lock:
            if self._in is not s or s.down_since is None or self._closing.is_set():
                return
            self._drop_session(s, f"down for {self.link_grace:.0f}s")
            carrying = s.carrying
        msg = (
            f"ring edge {self.edge_in} down for {self.link_grace:.0f}s ({s.who} did not reconnect)"
        )
        log.error("%s", msg)
        if carrying:
            self.inbox.fail(PeerError(msg))

    def _drop_session(self, s: _Session, why: str) -> None:
        """Forget session ``s`` and everything it delivered but nobody consumed (lock held)."""
        if self._in is s:
            self._in = None
        self._old_bytes += s.end.bytes_sent
        if s.timer is not None:
            s.timer.cancel()
        s.end.close()
        st = s.end.stream
        if st is not None:
            s.end.end_stream(st)
        with s.rx_lock:  # a frame being processed lands first; later ones see st.dead
            dropped = self.inbox.drop(s)
            partial = s.pieces.pending + len(s.relay_hold)
            s.relay_hold.clear()
            s.pieces = self._assembler(FORWARD)
        unsent = s.end.queued - s.end.acked
        if dropped or partial or unsent or not s.finished:
            log.warning(
                "worker-%d: session of %s on edge %s ended (%s): dropped %d unconsumed "
                "frame(s), %d partial tensor(s), %d unacknowledged frame(s) to it",
                self.rank,
                s.who,
                self.edge_in,
                why,
                dropped,
                partial,
                unsent,
            )

    # ---------------------------------------------------------------- client
    def _channel_options(self) -> list[tuple[str, int | str]]:
        t = self.timers
        opts: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", self.max_receive),
            ("grpc.max_send_message_length", self.max_message),
            *self.tuning.grpc_options(),
            ("grpc.keepalive_time_ms", t.client_keepalive_ms),
            ("grpc.keepalive_timeout_ms", t.keepalive_timeout_ms),
            # grpcio ≥ 1.6x waits this long for any ping's ack (default: a minute or more);
            # without it an unanswered keepalive ping does not end the connection.
            ("grpc.http2.ping_timeout_ms", t.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", int(t.first_backoff_s * 1000) or 1),
            ("grpc.max_reconnect_backoff_ms", int(t.max_backoff_s * 1000) or 1),
        ]
        if not self.insecure:
            opts.append(("grpc.ssl_target_name_override", f"worker-{self.succ}"))
        return opts

    def _open_channel(self) -> grpc.Channel:
        if self.tls is not None:
            creds = channel_credentials(self.tls)
            return grpc.secure_channel(self.successor_addr, creds, self._channel_options())
        if not self.insecure:
            raise ValueError("no TLS material given; plaintext needs an explicit insecure=True")
        log.warning(
            "!!! INSECURE: connecting to %s WITHOUT TLS — no encryption, no authentication. "
            "Local debugging only; never on a real network. !!!",
            self.successor_addr,
        )
        return grpc.insecure_channel(self.successor_addr, self._channel_options())

    def connect(self) -> None:
        """Open the session with the successor, retrying with backoff until peer_timeout."""
        target = f"worker-{self.succ}"
        deadline = time.monotonic() + self.peer_timeout
        delay = self.timers.first_backoff_s
        while True:
            self._check_not_closed(target)
            self._channel = self._open_channel()
            try:
                grpc.channel_ready_future(self._channel).result(timeout=min(delay * 4, 5.0))
                reply = ring_pb2_grpc.RingLinkStub(self._channel).Ping(
                    ring_pb2.PingRequest(), timeout=10
                )
                if not self.insecure and reply.identity != self.successor_identity:
                    raise PeerError(
                        f"successor at {self.successor_addr} is {reply.identity}, "
                        f"expected {self.successor_identity}"
                    )
                err = self._open_stream()
                if err is None:
                    break
                code, details = err
                if code not in _RETRY:
                    raise PeerError(
                        f"worker-{self.rank}: successor {target} at {self.successor_addr} "
                        f"refused the ring stream: {code.name} {details}"
                    )
                raise _Retry(f"{code.name} {details}")
            except (grpc.FutureTimeoutError, grpc.RpcError, _Retry) as exc:
                self._channel.close()
                self._check_not_closed(target)
                if time.monotonic() > deadline:
                    why = str(exc) if isinstance(exc, _Retry) else repr(exc)
                    raise PeerError(
                        f"worker-{self.rank}: successor {target} at {self.successor_addr} "
                        f"unreachable after {self.peer_timeout:.0f}s ({why})"
                    ) from exc
                log.info(
                    "worker-%d waiting for successor %s at %s",
                    self.rank,
                    target,
                    self.successor_addr,
                )
                self._closing.wait(delay)
                delay = min(delay * 2, self.timers.max_backoff_s)
        self._check_not_closed(target)  # close() raced the last dial: it cancelled the call
        self._move_out(EdgeState.UP)
        self._client_thread = threading.Thread(
            target=self._client_loop, daemon=True, name="ring-recv-bwd"
        )
        self._client_thread.start()
        log.info(
            "worker-%d connected to successor %s at %s", self.rank, target, self.successor_addr
        )

    def _check_not_closed(self, target: str) -> None:
        """An abort closes the links while connect() may still be dialling: give up then."""
        if self._closing.is_set():
            raise PeerError(f"worker-{self.rank}: link closed while dialling successor {target}")

    def _open_stream(
        self, handshake_s: float = HANDSHAKE_TIMEOUT_S
    ) -> tuple[grpc.StatusCode, str] | None:
        """Start one Stream call of the session and resume it; None on success."""
        s, st = self._out, _Stream(self.successor_identity)
        assert self._channel is not None
        stream = self._channel.stream_stream(
            STREAM_METHOD, request_serializer=None, response_deserializer=None
        )  # raw frame bytes both ways
        end = s.end

        def requests() -> Iterator[bytes]:
            st.go.wait()
            yield from end.frames(st, self._ack_frame)

        md = ((MD_RUN, self.rules.run_id), (MD_SESSION, s.token), (MD_ACK, str(end.rx)))
        call = stream(requests(), metadata=md)
        self._dialing = call  # close() cancels it
        watchdog = threading.Timer(handshake_s, call.cancel)
        watchdog.daemon = True
        watchdog.start()
        try:
            got = dict(call.initial_metadata() or ())
        finally:
            watchdog.cancel()
        if MD_ACK not in got or MD_SESSION not in got:
            st.dead = True
            st.go.set()
            call.cancel()
            code = call.code() or grpc.StatusCode.UNKNOWN
            return code, call.details() or "no handshake from the successor"
        if s.token and got[MD_SESSION] != s.token:
            st.dead = True
            st.go.set()
            call.cancel()
            return grpc.StatusCode.FAILED_PRECONDITION, "the successor answered another session"
        try:
            n = int(got[MD_ACK])
        except ValueError:
            n = -1
        err = end.resume(n, st) if n >= 0 else "not a number"
        if err is not None:
            st.dead = True
            st.go.set()
            call.cancel()
            return grpc.StatusCode.FAILED_PRECONDITION, f"cannot resume: {err}"
        s.token = got[MD_SESSION]
        self._call, self._out_stream = call, st
        return None

    def _client_loop(self) -> None:
        """Receive BACKWARD frames; re-dial within the grace when the stream breaks."""
        s = self._out
        try:
            while True:
                call, st = self._call, self._out_stream
                err = self._receive_backward(call, st)
                s.end.end_stream(st)
                if err is None or self._closing.is_set():
                    self._move_out(EdgeState.DOWN)
                    return
                if not self._reconnect(err):
                    return
        finally:
            with s.end.cond:
                s.end.done = True
                s.end.cond.notify_all()

    def _receive_backward(self, call, st: _Stream) -> str | None:
        """Serve one stream; None when it ended for good, else why it broke."""
        s = self._out
        try:
            for data in call:
                with s.rx_lock:
                    self._accept(data, BACKWARD, s)
            if not self._closing.is_set():
                log.info("ring edge %s: worker-%d closed the stream", self.edge_out, self.succ)
            return None
        except FrameError as exc:
            msg = _culprit(exc, self.successor_identity, f"{self.edge_out} (BACKWARD side)")
            self._refused(msg)
            call.cancel()
            self.inbox.fail(PeerError(msg))
            return None
        except grpc.RpcError as exc:
            if self._closing.is_set():
                return None
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code not in _RETRY:
                self.inbox.fail(
                    PeerError(
                        f"ring edge {self.edge_out}: worker-{self.succ} ended the link: "
                        f"{code.name} {details}"
                    )
                )
                return None
            return f"{code.name} {details}"
        except Exception as exc:  # a bug must not leave the executor waiting silently
            log.exception("worker-%d: receiving on edge %s failed", self.rank, self.edge_out)
            self.inbox.fail(exc)
            return None

    def _reconnect(self, err: str) -> bool:
        """Re-dial until the session resumes (True) or the grace is spent (False)."""
        s = self._out
        s.down_since, s.last_error = time.monotonic(), err
        if self._all_finished():
            self._move_out(EdgeState.DOWN)
            return False
        self._move_out(EdgeState.RECONNECTING)
        log.warning(
            "ring edge %s down (%s); reconnecting for up to %.0fs",
            self.edge_out,
            err,
            self.link_grace,
        )
        delay = self.timers.first_backoff_s
        while not self._closing.is_set():
            waited = time.monotonic() - s.down_since
            if waited >= self.link_grace:
                break
            if self._closing.wait(min(delay, max(self.link_grace - waited, 0.0))):
                break
            delay = min(delay * 2, self.timers.max_backoff_s)
            old = self._channel
            self._channel = self._open_channel()
            if old is not None:
                old.close()
            try:
                left = self.link_grace - (time.monotonic() - s.down_since)
                result = self._open_stream(max(1.0, min(HANDSHAKE_TIMEOUT_S, left)))
            except grpc.RpcError as exc:  # pragma: no cover - raised by some grpcio versions
                result = (exc.code(), exc.details())
            if result is None:
                self._out_reconnects += 1
                self._move_out(EdgeState.UP)
                log.warning(
                    "ring edge %s back after %.1fs (%d frame(s) resent)",
                    self.edge_out,
                    time.monotonic() - s.down_since,
                    s.end.sent_hi - s.end.acked,
                )
                s.down_since = None
                return True
            code, details = result
            s.last_error = f"{code.name} {details}"
            if code not in _RETRY:
                self._move_out(EdgeState.DOWN)
                self.inbox.fail(
                    PeerError(f"ring edge {self.edge_out}: reconnect refused: {s.last_error}")
                )
                return False
        self._move_out(EdgeState.DOWN)
        if not self._closing.is_set() and not self._all_finished():
            msg = (
                f"ring edge {self.edge_out} down for {self.link_grace:.0f}s "
                f"(last error: {s.last_error})"
            )
            log.error("%s", msg)
            self.inbox.fail(PeerError(msg))
        return False

    # --------------------------------------------------------------- routing
    def _assembler(self, direction: int) -> TensorAssembler:
        """Piece validation/reassembly state for one incoming session: FORWARD (from the
        predecessor) or BACKWARD frames (from the successor), each with its codec."""
        fwd, bwd = codecs(self.rules.cfg)
        return TensorAssembler(
            self.rules.shape,
            self.rules.cfg.wire_dtype,
            codec=fwd if direction == FORWARD else bwd,
        )

    def _ack_frame(self, n: int) -> bytes:
        return ring_pb2.Frame(run_id=self.rules.run_id, direction=ACK, ack=n).SerializeToString()

    def _refused(self, msg: str) -> None:
        self.rejected.append(msg)
        self.inbox.last_problem = msg
        log.error("worker-%d: %s; session closed, still serving", self.rank, msg)

    def _accept(self, data: bytes, side: int, s: _Session) -> bool:
        """Validate one received frame (its serialized bytes) and deliver or relay it.

        True when it was the peer's CLOSE: the session ends, nothing more is read.
        """
        frame, payload = parse_frame(data)  # the tensor bytes stay in `data`, not copied
        if frame.direction == ACK:
            s.end.on_ack(self.rules.check_control(frame))
            return False
        if frame.direction == CLOSE:
            if side != FORWARD:
                raise FrameError("frame rejected: CLOSE on the BACKWARD side (clients send it)")
            self.rules.check_control(frame)
            return True
        verdict = self.rules.check_header(frame, side)
        if frame.direction == FIN:
            # Idempotent: a FIN repeated (e.g. one a dropped session already passed on) is
            # neither recorded again nor relayed; it carries nothing else.
            if self.inbox.add_fin(frame.origin, owner=s) and verdict == RELAY:
                self._out.end.put(data)
            if frame.origin == self.pred:
                s.fin_seen = True
            s.end.received(flush=True)
            return False
        # Every piece is validated in full (order, total, offset, size, dtype, full shape,
        # checksum, finiteness) before it is used; a relay holds a tensor's pieces until
        # the last one validated, then forwards them as received.
        key = FrameKey.of(frame)
        mine = verdict == DELIVER
        if frame.chunk == 0:
            if mine:
                self.inbox.check_new(key)
            else:
                with self._relay_lock:
                    if key in self._relayed:
                        raise FrameError(
                            f"frame rejected: replay of {key.describe()} (already relayed)"
                        )
        tensor = s.pieces.add(key, frame, keep=mine, what=key.describe(), data=payload)
        if mine:
            if tensor is not None:
                self.inbox.put(key, tensor, owner=s)
        else:
            held = s.relay_hold.setdefault(key, [])
            held.append(data)
            if frame.chunk == frame.chunks - 1:
                del s.relay_hold[key]
                self._mark_relayed(key)
                out = self._outgoing(frame.direction)
                for piece in held:
                    out.put(piece)
        s.end.received()
        return False

    def _mark_relayed(self, key: FrameKey) -> None:
        with self._relay_lock:
            now = self.rules.current_step()
            if len(self._relayed) > 256:
                self._relayed = {k for k in self._relayed if k.step >= now - 2}
            self._relayed.add(key)

    def _consumed_from(self, owner: object) -> None:
        if isinstance(owner, _Session):
            owner.carrying = True

    def send_tensor(self, key: FrameKey, tensor: torch.Tensor) -> None:
        """Encode ``tensor`` (in the run's wire dtype) as the frame(s) ``key`` and send them."""
        self._send_frames(key, tensor, wire=self.rules.cfg.wire_dtype)

    def send_packed(self, key: FrameKey, payload: torch.Tensor, codec: Codec) -> None:
        """Send a lossy codec's ``payload`` of a full-size tensor as the frame(s) ``key``."""
        self._send_frames(key, payload, packed=(codec.spec, self.rules.shape))

    def _send_frames(self, key: FrameKey, tensor: torch.Tensor, **encoding: Any) -> None:
        out = self._outgoing(key.direction)
        for data in encode_frames(
            run_id=self.rules.run_id,
            step=key.step,
            origin=key.origin,
            tick=key.tick,
            micro=key.micro,
            direction=key.direction,
            phase=key.phase,
            tensor=tensor,
            chunk_bytes=self.chunk_bytes,
            **encoding,
        ):
            out.put(data)  # gRPC sends piece k while piece k+1 is built

    def send(self, frame: ring_pb2.Frame) -> None:
        """Send a ready-made frame message (serialized here) in its direction."""
        self._outgoing(frame.direction).put(frame.SerializeToString())

    def _outgoing(self, direction: int) -> _Endpoint:
        if direction != BACKWARD:
            return self._out.end
        deadline = time.monotonic() + self.peer_timeout
        with self._in_ready:
            ready = False
            while not ready and self.inbox.error is None and time.monotonic() < deadline:
                ready = self._in_ready.wait_for(lambda: self._in is not None, 0.5)
            if self.inbox.error is not None:
                raise PeerError(str(self.inbox.error)) from self.inbox.error
            if not ready:
                raise PeerError(
                    f"worker-{self.rank}: predecessor worker-{self.pred} never opened its "
                    f"ring stream (edge {self.edge_in})"
                )
            s = self._in
            s.carrying = True  # type: ignore[union-attr]
            return s.end  # type: ignore[union-attr]

    # ---------------------------------------------------------------- status
    def _move_out(self, new: EdgeState) -> None:
        self._out_state = EDGE.step(self._out_state, new, f"edge {self.edge_out}")

    def _reconnecting(self) -> bool:
        s = self._in
        in_down = s is not None and s.down_since is not None
        return self._out_state == EdgeState.RECONNECTING or in_down

    def edge_states(self) -> dict:
        """Both ring edges of this worker, for status reports::

        {"in": {"peer": "worker-3", "state": "up", "reconnects": 0, "down_s": 0.0}, "out": …}

        ``state``: ``up``; ``reconnecting`` (dropped, within ``link_grace``); ``down``.
        """
        now = time.monotonic()
        s = self._in
        if s is not None and s.down_since is not None:
            in_state, in_down = EdgeState.RECONNECTING, now - s.down_since
        elif s is not None and s.end.stream is not None:
            in_state, in_down = EdgeState.UP, 0.0
        else:
            in_state, in_down = EdgeState.DOWN, 0.0
        o = self._out
        out_down = now - o.down_since if o.down_since is not None else 0.0
        return {
            "in": {
                "peer": f"worker-{self.pred}",
                "edge": self.edge_in,
                "state": in_state,
                "reconnects": self._in_reconnects,
                "down_s": round(in_down, 3),
            },
            "out": {
                "peer": f"worker-{self.succ}",
                "edge": self.edge_out,
                "state": self._out_state,
                "reconnects": self._out_reconnects,
                "down_s": round(out_down, 3),
            },
        }

    def _describe_edges(self) -> str:
        e = self.edge_states()
        bad = [f"{v['edge']} {v['state']}" for v in e.values() if v["state"] != "up"]
        return "; ".join(bad)

    # -------------------------------------------------------------- shutdown
    @property
    def bytes_sent(self) -> int:
        s = self._in
        return self._out.end.bytes_sent + self._old_bytes + (s.end.bytes_sent if s else 0)

    def _all_finished(self) -> bool:
        return set(range(self.P)) - {self.rank} <= self.inbox.fins

    def finish(self, timeout: float) -> None:
        """Announce FIN, wait until every other worker finished, then close both streams."""
        fin = ring_pb2.Frame(run_id=self.rules.run_id, origin=self.rank, direction=FIN)
        fin_seq = self._out.end.put(fin.SerializeToString())
        others = set(range(self.P)) - {self.rank}
        if not self.inbox.wait_fins(others, timeout):
            log.warning("worker-%d: not every peer finished within %.0fs", self.rank, timeout)
        # The successor confirms every FIN at once (and with it everything before it):
        # ours, and the ones relayed after it, which the successor still needs.
        end = self._out.end
        end.wait_acked(max(fin_seq, end.queued), min(timeout, 10.0))
        self.close()

    def close(self) -> None:
        """Close both links and release the listening port (idempotent).

        The successor is told with a CLOSE frame after everything already queued, so it
        does not wait for a resume; it ends the stream in turn (bounded wait here).
        """
        if self._closing.is_set():
            return
        self._closing.set()
        end = self._out.end
        if self._out_state == EdgeState.UP:
            end.close(ring_pb2.Frame(run_id=self.rules.run_id, direction=CLOSE).SerializeToString())
            with end.cond:
                end.cond.wait_for(lambda: end.done, 2.0)
        end.close()
        for call in (self._call, self._dialing):
            if call is not None:
                call.cancel()
        with self._lock:
            s = self._in
            if s is not None:
                if s.timer is not None:
                    s.timer.cancel()
                s.end.close()
                st = s.end.stream
                if st is not None:
                    s.end.end_stream(st)
        if self._client_thread is not None:
            self._client_thread.join(timeout=10)
        if self._channel is not None:
            self._channel.close()
        if self._server is not None:
            self._server.stop(grace=1.0).wait()
        if self._capture is not None:
            self._capture.close()


class _Retry(Exception):
    """A transient refusal while connecting: try again."""


_RETRY = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""Codes after which the client re-dials (within the grace) rather than giving up."""
