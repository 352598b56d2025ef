"""The state a ring link keeps across its gRPC streams: the inbox of decoded tensors,
each edge's session (frames sent and kept until acknowledged, frames received), which a
broken stream resumes (see :mod:`mobius_fed.worker.link`, "Transient faults"), and the
router both edges hand received frames to.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mobius_fed.engine.wire_stages import codecs
from mobius_fed.machines import EdgeState
from mobius_fed.proto import ring_pb2
from mobius_fed.transport.codec import FrameError, NonFiniteError, TensorAssembler, parse_frame
from mobius_fed.transport.link_tuning import LinkTuning
from mobius_fed.transport.tls import NodeTLS, worker_identity
from mobius_fed.worker.commitments import RECEIVED, SENT, FrameLedger
from mobius_fed.worker.frames import (
    ACK,
    CLOSE,
    DELIVER,
    FIN,
    FORWARD,
    RELAY,
    FrameKey,
    FrameRules,
)

log = logging.getLogger("mobius.link")
RING_SERVICE = ring_pb2.DESCRIPTOR.services_by_name["RingLink"].full_name
STREAM_METHOD = f"/{RING_SERVICE}/Stream"

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

    def scaled(self, factor: float) -> LinkTimers:
        """Every keepalive time and timeout × ``factor`` (``MOBIUS_KEEPALIVE_SCALE``,
        transport/tls.py); the re-dial backoff stays."""
        return replace(
            self,
            client_keepalive_ms=round(self.client_keepalive_ms * factor),
            server_keepalive_ms=round(self.server_keepalive_ms * factor),
            keepalive_timeout_ms=round(self.keepalive_timeout_ms * factor),
            min_ping_interval_ms=round(self.min_ping_interval_ms * factor),
        )


@dataclass(frozen=True)
class LinkSettings:
    """What both ends of a worker's ring link read and never change."""

    rank: int
    P: int
    tls: NodeTLS | None
    insecure: bool
    peer_timeout: float
    link_grace: float
    timers: LinkTimers
    tuning: LinkTuning
    max_message: int  # sent and received alike (see RingLinks)
    base: int = 0  # R rings: the global rank of this ring's worker 0 (identities are global)
    # after a handover: the identity that holds each global rank, as the coordinator
    # assigned it (docs/recovery.md "Handover to a standby"); () or "": worker-<rank>
    identities: tuple[str, ...] = ()

    def identity(self, rank: int) -> str:
        """Who holds this ring's ``rank`` (local): worker-<base+rank>, or its standby."""
        g = self.base + rank
        assigned = self.identities[g] if g < len(self.identities) else ""
        return assigned or worker_identity(g)

    def neighbour_identity(self, rank: int, role: str) -> str:
        """:meth:`identity` of the neighbour ``rank`` (``role``: predecessor or successor),
        logging when a handover made it a standby: accepted because the coordinator said so."""
        who = self.identity(rank)
        if who != worker_identity(self.base + rank):
            log.warning(
                "worker-%d accepts %s as its %s worker-%d: the coordinator assigned it that "
                "rank (a handover)",
                self.base + self.rank,
                who,
                role,
                self.base + rank,
            )
        return who

    def grpc_options(self, keepalive_ms: int) -> list[tuple[str, int | str]]:
        """What both ends of a link set: message sizes, tuning, pings every ``keepalive_ms``."""
        t = self.timers
        return [
            ("grpc.max_receive_message_length", self.max_message),
            ("grpc.max_send_message_length", self.max_message),
            *self.tuning.grpc_options(),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", t.keepalive_timeout_ms),
            # grpcio ≥ 1.6x waits this long for any ping's ack (default: a minute or more);
            # without it an unanswered keepalive ping does not end the connection.
            ("grpc.http2.ping_timeout_ms", t.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]


class PeerError(RuntimeError):
    """A ring peer is unreachable, went away, or sent something unusable."""


def culprit(exc: FrameError, who: str, edge: str) -> str:
    """``frame rejected: X`` → ``frame rejected from <who> on edge <edge>: X``."""
    text = str(exc)
    for head in ("frame rejected", "tensor rejected"):
        if text.startswith(head + ": "):
            return f"{head} from {who} on edge {edge}: {text[len(head) + 2 :]}"
    return f"frame rejected from {who} on edge {edge}: {text}"


def edge_report(peer: int, edge: str, state: EdgeState, reconnects: int, down: float) -> dict:
    """One ring edge as status reports show it (see ``RingLinks.edge_states``)."""
    return {
        "peer": f"worker-{peer}",
        "edge": edge,
        "state": state,
        "reconnects": reconnects,
        "down_s": round(down, 3),
    }


# ----------------------------------------------------------------------------- inbox


class Inbox:
    """Decoded tensors addressed to this worker, keyed by :class:`FrameKey`.

    Each entry remembers the session that delivered it (:meth:`drop` removes a dead
    session's unconsumed entries); a key is consumed once per step window, and a key
    already queued or consumed is refused (:meth:`check_new`).
    """

    def __init__(
        self, current_step: Callable[[], int] = lambda: 0, peers: frozenset[int] = frozenset()
    ) -> None:
        self.peers = peers  # the workers whose FIN ends the run for this one
        self._items: dict[FrameKey, tuple[torch.Tensor, object]] = {}
        self._consumed: set[FrameKey] = set()
        self._pruned_at = -1
        self._current_step = current_step
        self._cond = threading.Condition()
        self.error: BaseException | None = None  # the first failure: get() raises it
        self.fins: set[int] = set()
        self._fin_from: dict[int, object] = {}
        self.last_problem: str | None = None  # named in a timeout: why a frame never came
        self.held: Callable[[], bool] = lambda: False  # timeouts pause while this is true
        self.describe_links: Callable[[], str] = lambda: ""

    def check_new(self, key: FrameKey) -> None:
        with self._cond:  # an RLock: put() holds it already
            if key in self._items:
                raise FrameError(f"frame rejected: duplicate {key.describe()} (already queued)")
            if key in self._consumed:
                raise FrameError(f"frame rejected: replay of {key.describe()} (already consumed)")

    def put(self, key: FrameKey, tensor: torch.Tensor, owner: object = None) -> None:
        with self._cond:
            self.check_new(key)
            self._items[key] = (tensor, owner)
            self._cond.notify_all()

    def drop(self, owner: object) -> int:
        """Forget the unconsumed entries and FINs ``owner`` delivered; return how many entries."""
        with self._cond:
            keys = [k for k, (_, o) in self._items.items() if o is owner]
            for k in keys:
                del self._items[k]
            for origin in [o for o, who in self._fin_from.items() if who is owner]:
                del self._fin_from[origin]
                self.fins.discard(origin)
            return len(keys)

    def has_fin(self, origin: int) -> bool:
        with self._cond:
            return origin in self.fins

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
            if self.error is None:
                self.error = error
            self._cond.notify_all()

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
                if self.error is not None:
                    raise PeerError(str(self.error)) from self.error
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
        if isinstance(owner, Session):
            owner.carrying = True
        return tensor

    def all_finished(self) -> bool:
        return self.peers <= self.fins

    def wait_fins(self, timeout: float) -> bool:
        """Wait until every peer's FIN came (True) or the link failed."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.all_finished() or self.error is not None, timeout
            )


class Capture:
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


@dataclass(eq=False)
class StreamCall:
    """One gRPC Stream call carrying a session."""

    who: str
    cursor: int = 1  # sequence number of the next frame to send on this stream
    dead: bool = False
    ended: bool = False
    failure: str | None = None
    go: threading.Event = field(default_factory=threading.Event)  # client: resume point known
    session: Session | None = None
    rx_at_start: int = 0  # server side: the count sent back in the handshake


class Endpoint:
    """One end of a ring edge's session: the frames it sends, kept until acknowledged,
    and the count of frames it received from the other end.

    Frames are numbered from 1 in the order :meth:`put` receives them; a stream sends them
    from its cursor on, interleaved with ACK frames that report ``rx``.
    """

    def __init__(self, capture: Capture | None, ack_every: int = ACK_EVERY) -> None:
        self.ack_every = ack_every
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
        self.stream: StreamCall | None = None
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

    def end_stream(self, st: StreamCall) -> None:
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

    def resume(self, n: int, st: StreamCall) -> str | None:
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
            if flush or self.rx - self.rx_acked >= self.ack_every:
                self.cond.notify_all()

    def frames(self, st: StreamCall, ack_frame: Callable[[int], bytes]) -> Iterator[bytes]:
        """What stream ``st`` sends: frames from its cursor on, and ACKs when due."""
        while True:
            counted = False
            with self.cond:
                while True:
                    if st.dead or self.stream is not st:
                        return
                    due = self.rx - self.rx_acked
                    if due > 0 and (self.flush_ack or due >= self.ack_every):
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

    def unacknowledged(self) -> int:
        """Frames put and not yet confirmed by the other end."""
        with self.cond:
            return self.queued - self.acked

    def wait_acked(self, seq: int, timeout: float) -> bool:
        """Wait until the peer confirmed frames up to ``seq`` (True), or the link ended for
        good (``done``: no stream will bring a confirmation; a broken stream is re-dialled
        first while frames are unconfirmed) or ``timeout`` passed (False)."""
        with self.cond:
            self.cond.wait_for(lambda: self.acked >= seq or self.done, timeout)
            return self.acked >= seq


class Session:
    """Everything one ring edge's session owns on this worker."""

    def __init__(
        self,
        who: str,
        pieces: TensorAssembler,
        capture: Capture | None,
        ack_every: int = ACK_EVERY,
    ) -> None:
        self.who = who
        self.token = secrets.token_hex(16)
        self.end = Endpoint(capture, ack_every)
        self.pieces = pieces
        self.relay_hold: dict[FrameKey, list[bytes]] = {}
        self.rx_lock = threading.Lock()  # one frame at a time; a takeover waits for it
        self.carrying = False  # its frames were consumed, or this worker sent it frames
        self.fin_seen = False  # the sending neighbour's own FIN came through it
        self.finished = False
        self.down_since: float | None = None
        self.last_error = ""
        self.timer: threading.Timer | None = None  # server side: the reconnect grace

    def stop(self) -> None:
        """No more frames either way: cancel the grace timer and end the live stream."""
        if self.timer is not None:
            self.timer.cancel()
        self.end.close()
        if (st := self.end.stream) is not None:
            self.end.end_stream(st)


class FrameRouter:
    """Checks every frame either session receives, then delivers it to the inbox or relays
    it on through ``outgoing(direction)``; owns the record of relayed tensors and refusals."""

    def __init__(
        self,
        rules: FrameRules,
        inbox: Inbox,
        outgoing: Callable[[int], Endpoint],
        capture: Capture | None,
        ack_every: int,
        ledger: FrameLedger | None = None,
    ) -> None:
        self.rules, self.inbox, self._outgoing = rules, inbox, outgoing
        self.ledger = ledger  # audit.commitments: the digest of each frame delivered or relayed
        self.codecs = codecs(rules.cfg)  # (forward, backward), once per link
        self._capture, self._ack_every = capture, ack_every
        self.rejected: list[str] = []
        self._relayed: set[FrameKey] = set()
        self._relay_lock = threading.Lock()
        self._fin_lock = threading.Lock()

    def assembler(self, direction: int) -> TensorAssembler:
        """Piece validation/reassembly state for one incoming session: FORWARD (from the
        predecessor) or BACKWARD frames (from the successor), each with its codec."""
        codec = self.codecs[0 if direction == FORWARD else 1]
        shape = self.rules.shape_of(direction)
        return TensorAssembler(shape, self.rules.cfg.wire_dtype, codec=codec)

    def new_session(self, who: str, direction: int) -> Session:
        """A session whose incoming frames travel ``direction``."""
        return Session(who, self.assembler(direction), self._capture, self._ack_every)

    def ack_frame(self, n: int) -> bytes:
        return ring_pb2.Frame(run_id=self.rules.run_id, direction=ACK, ack=n).SerializeToString()

    def refused(self, msg: str) -> None:
        self.rejected.append(msg)
        self.inbox.last_problem = msg
        log.error("worker-%d: %s; session closed, still serving", self.rules.rank, msg)

    def accept(self, data: bytes, side: int, s: Session) -> bool:
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
            self._fin(frame.origin, data, verdict == RELAY, s)
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
        try:
            tensor = s.pieces.add(key, frame, keep=mine, what=key.describe(), data=payload)
        except NonFiniteError as exc:
            raise self.rules.non_finite(key, exc) from exc
        digest = None
        if self.ledger is not None:  # the bytes as they came off the wire
            digest = self.ledger.piece(side, key, frame.chunk, frame.chunks, data)
        if not mine:
            self._relay(key, frame, data, side, s, digest)
        elif tensor is not None:
            self.rules.check_tensor(key, tensor, side)  # the bounds (BoundError)
            self.inbox.put(key, tensor, owner=s)
            self._commit(key, RECEIVED, side, digest)
        s.end.received()
        return False

    def _relay(
        self,
        key: FrameKey,
        frame: ring_pb2.Frame,
        data: bytes,
        side: int,
        s: Session,
        digest: str | None,
    ) -> None:
        """Hold a validated piece of a frame for another worker; after its last piece,
        forward them all as received."""
        held = s.relay_hold.setdefault(key, [])
        held.append(data)
        if frame.chunk == frame.chunks - 1:
            del s.relay_hold[key]
            self._mark_relayed(key)
            out = self._outgoing(frame.direction)
            for piece in held:
                out.put(piece)
            self._commit(key, RECEIVED, side, digest)
            self._commit(key, SENT, side, digest)  # the very bytes, passed on

    def _commit(self, key: FrameKey, way: str, side: int, digest: str | None) -> None:
        """Record frame ``key``, which came in on ``side``, in the ledger: RECEIVED from the
        neighbour it came from, or SENT on to the next one (a relay)."""
        if self.ledger is None or digest is None:
            return
        back = (side == FORWARD) != (way == SENT)  # from the predecessor, or on to it
        peer = (self.rules.rank + (-1 if back else 1)) % self.rules.P
        self.ledger.record(key, way, peer, digest)

    def _fin(self, origin: int, data: bytes, relay: bool, s: Session) -> None:
        """Record worker ``origin``'s FIN, relaying it first where its route goes on.

        Idempotent: a FIN repeated (e.g. one a dropped session already passed on) is
        neither recorded again nor relayed; it carries nothing else. Relayed and counted
        *before* it is recorded: ``RingLinks.finish`` wakes once every FIN is recorded, then
        reads how far its out-edge must be acknowledged (a relayed FIN queued later would
        be missed, or dropped by the links' close) and may close the links at once (a
        closing end sends its count, this FIN's acknowledgement, only if it is counted).
        """
        with self._fin_lock:
            new = not self.inbox.has_fin(origin)
            if new and relay:
                self._outgoing(FIN).put(data)
            if origin == (self.rules.rank - 1) % self.rules.P:
                s.fin_seen = True
            s.end.received(flush=True)
            if new:
                self.inbox.add_fin(origin, owner=s)

    def _mark_relayed(self, key: FrameKey) -> None:
        with self._relay_lock:
            now = self.rules.current_step()
            if len(self._relayed) > 256:
                self._relayed = {k for k in self._relayed if k.step >= now - 2}
            self._relayed.add(key)
