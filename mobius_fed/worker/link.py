"""A worker's two ring links: one long-lived bidirectional gRPC stream per ring edge.

Worker i serves ``RingLink.Stream`` for i-1 (FORWARD in on the request side, BACKWARD out on
the response side) and calls it on i+1; frames for others are relayed, frames for this
worker go to the executor's inbox. Trust, sessions, resume and keepalive: docs/ring.md
"Ring trust model and link faults"; docs/architecture.md §7 (wire), §8 (trust), §11.

The Stream method is registered with no (de)serializers on either end: both sides carry
pre-serialized ``Frame`` bytes, and a relay re-sends the very bytes it received.
``bytes_sent`` and the capture file count every tensor and FIN frame handed to gRPC,
resends included; link-control ACK frames are not counted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from mobius_fed.engine.wire_stages import codecs
from mobius_fed.machines import EDGE, EdgeState
from mobius_fed.proto import ring_pb2, ring_pb2_grpc
from mobius_fed.relay.edges import EdgeTunnels
from mobius_fed.relay.plan import DIRECT
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
from mobius_fed.transport.tls import NodeTLS, worker_identity
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
from mobius_fed.worker.link_client import SuccessorClient
from mobius_fed.worker.link_server import PredecessorServer
from mobius_fed.worker.link_session import (
    ACK_EVERY,
    Capture,
    Endpoint,
    Inbox,
    LinkTimers,
    PeerError,
    Session,
)

log = logging.getLogger("mobius.link")


class RingLinks(PredecessorServer, SuccessorClient, ring_pb2_grpc.RingLinkServicer):
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
        ack_every: int = ACK_EVERY,
        tunnels: EdgeTunnels | None = None,
    ) -> None:
        if tuning is None:
            refuse_renamed_variables(os.environ)  # a stale MOBIUS_LINK_<X> must not be ignored
            tuning = LinkTuning()
        self.tuning = tuning
        if tuning.allocator:
            tune_allocator()  # process-wide, once: the link's buffers stay on the heap
        chunk_bytes = tuning.chunk if chunk_bytes is None else chunk_bytes
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if ack_every < 1:
            raise ValueError(f"ack_every must be ≥ 1, got {ack_every}")
        self.ack_every = ack_every  # a receiver acknowledges after this many frames
        if link_grace < 0:
            raise ValueError(f"link_grace must be ≥ 0, got {link_grace}")
        self.rules, self.rank, self.P = rules, rules.rank, rules.P
        self.codecs = codecs(rules.cfg)  # (forward, backward), once per link
        self.chunk_bytes = chunk_bytes
        # Sent and received alike: a message larger than one of our pieces is refused
        # (RESOURCE_EXHAUSTED), so every worker of a ring must use the same piece size.
        self.max_message = max_message_bytes(chunk_bytes)
        self.tunnels = tunnels  # a tunnelled out-edge dials its local forwarder
        self.listen = listen
        self.successor_addr = tunnels.successor_address if tunnels else successor
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
        self._capture = Capture(capture) if capture else None
        self.rejected: list[str] = []
        self._closing = threading.Event()
        self._relayed: set[FrameKey] = set()
        self._relay_lock = threading.Lock()
        self._init_server()
        self._init_client()

    @property
    def forward_out(self) -> Endpoint:
        """What this worker sends to its successor (FORWARD frames, FINs)."""
        return self._out.end

    @property
    def backward_out(self) -> Endpoint | None:
        """What this worker sends to its predecessor (BACKWARD frames), if connected."""
        s = self._in
        return s.end if s is not None else None

    def _grpc_options(self, keepalive_ms: int) -> list[tuple[str, int | str]]:
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

    # --------------------------------------------------------------- routing
    def _assembler(self, direction: int) -> TensorAssembler:
        """Piece validation/reassembly state for one incoming session: FORWARD (from the
        predecessor) or BACKWARD frames (from the successor), each with its codec."""
        codec = self.codecs[0 if direction == FORWARD else 1]
        shape = self.rules.shape_of(direction)
        return TensorAssembler(shape, self.rules.cfg.wire_dtype, codec=codec)

    def _new_session(self, who: str, direction: int) -> Session:
        """A session whose incoming frames travel ``direction``."""
        return Session(who, self._assembler(direction), self._capture, self.ack_every)

    def _ack_frame(self, n: int) -> bytes:
        return ring_pb2.Frame(run_id=self.rules.run_id, direction=ACK, ack=n).SerializeToString()

    def _refused(self, msg: str) -> None:
        self.rejected.append(msg)
        self.inbox.last_problem = msg
        log.error("worker-%d: %s; session closed, still serving", self.rank, msg)

    def _accept(self, data: bytes, side: int, s: Session) -> bool:
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
        if isinstance(owner, Session):
            owner.carrying = True

    def send_tensor(self, key: FrameKey, tensor: torch.Tensor) -> None:
        """Encode ``tensor`` (in the run's wire dtype) as the frame(s) ``key`` and send them."""
        self._send_frames(key, tensor, wire=self.rules.cfg.wire_dtype)

    def send_packed(self, key: FrameKey, payload: torch.Tensor, codec: Codec) -> None:
        """Send a lossy codec's ``payload`` of a full-size tensor as the frame(s) ``key``."""
        self._send_frames(key, payload, packed=(codec.spec, self.rules.shape_of(key.direction)))

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

    def _outgoing(self, direction: int) -> Endpoint:
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
            assert s is not None  # ready: the predecessor's stream is open
            s.carrying = True
            return s.end

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
        edges = {
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
        for side in ("in", "out"):
            edges[side].update(self.tunnels.describe(side) if self.tunnels else {"path": DIRECT})
        return edges

    def _describe_edges(self) -> str:
        edges = self.edge_states().values()
        return "; ".join(f"{v['edge']} {v['state']}" for v in edges if v["state"] != EdgeState.UP)

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
            if self._in is not None:
                self._in.stop()
        if self._client_thread is not None:
            self._client_thread.join(timeout=10)
        if self._channel is not None:
            self._channel.close()
        if self._server is not None:
            self._server.stop(grace=1.0).wait()
        if self.tunnels is not None:
            self.tunnels.close()
        if self._capture is not None:
            self._capture.close()
