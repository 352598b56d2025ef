"""A worker's two ring links: one long-lived bidirectional gRPC stream per ring edge.

Worker i serves ``RingLink.Stream`` for i-1 (FORWARD in on the request side, BACKWARD out on
the response side) and calls it on i+1; frames for others are relayed, frames for this
worker go to the executor's inbox. Trust, sessions, resume and keepalive: docs/ring.md
"Ring trust model and link faults"; docs/architecture.md §7 (wire), §8 (trust), §11.

:class:`RingLinks` composes three objects, each owning its own state:
:class:`~mobius_fed.worker.link_server.PredecessorServer` (the in-edge's session),
:class:`~mobius_fed.worker.link_client.SuccessorClient` (the out-edge's session) and
:class:`~mobius_fed.worker.link_session.FrameRouter`, which both hand every received
frame to (relay records, refusals).

The Stream method is registered with no (de)serializers on either end: both sides carry
pre-serialized ``Frame`` bytes, and a relay re-sends the very bytes it received.
``bytes_sent`` and the capture file count every tensor and FIN frame handed to gRPC,
resends included; link-control ACK frames are not counted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from mobius_fed.machines import EdgeState
from mobius_fed.proto import ring_pb2
from mobius_fed.relay.edges import EdgeTunnels
from mobius_fed.relay.plan import DIRECT
from mobius_fed.transport.allocator import tune_allocator
from mobius_fed.transport.codec import encode_frames, max_message_bytes
from mobius_fed.transport.compress import Codec
from mobius_fed.transport.link_tuning import LinkTuning, refuse_renamed_variables
from mobius_fed.transport.tls import NodeTLS, keepalive_scale
from mobius_fed.worker.commitments import SENT, FrameLedger
from mobius_fed.worker.config import dialable
from mobius_fed.worker.frames import BACKWARD, FIN, FrameKey, FrameRules
from mobius_fed.worker.link_client import SuccessorClient
from mobius_fed.worker.link_server import PredecessorServer
from mobius_fed.worker.link_session import (
    ACK_EVERY,
    Capture,
    Endpoint,
    FrameRouter,
    Inbox,
    LinkSettings,
    LinkTimers,
    PeerError,
)

__all__ = ["LinkTimers", "PeerError", "RingLinks"]
log = logging.getLogger("mobius.link")


def _check_numbers(chunk_bytes: int, ack_every: int, link_grace: float) -> None:
    """Refuse a piece size, an ACK interval or a grace out of range, naming it."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    if ack_every < 1:
        raise ValueError(f"ack_every must be ≥ 1, got {ack_every}")
    if link_grace < 0:
        raise ValueError(f"link_grace must be ≥ 0, got {link_grace}")


class RingLinks:
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
        ring_base: int = 0,
        identities: tuple[str, ...] = (),
        ledger: FrameLedger | None = None,
    ) -> None:
        if tuning is None:
            refuse_renamed_variables(os.environ)  # a stale MOBIUS_LINK_<X> must not be ignored
            tuning = LinkTuning()
        if tuning.allocator:
            tune_allocator()  # process-wide, once: the link's buffers stay on the heap
        chunk_bytes = tuning.chunk if chunk_bytes is None else chunk_bytes
        _check_numbers(chunk_bytes, ack_every, link_grace)
        self.rules, self.tuning, self.chunk_bytes = rules, tuning, chunk_bytes
        # Sent and received alike: a message larger than one of our pieces is refused
        # (RESOURCE_EXHAUSTED), so every worker of a ring must use the same piece size.
        self.settings = s = LinkSettings(
            rank=rules.rank,
            P=rules.P,
            tls=tls,
            insecure=insecure,
            peer_timeout=peer_timeout,
            link_grace=link_grace,
            timers=timers or LinkTimers().scaled(keepalive_scale()),
            tuning=tuning,
            max_message=max_message_bytes(chunk_bytes),
            base=ring_base,
            identities=identities,
        )
        self.listen, self.tunnels = listen, tunnels  # a tunnelled out-edge dials its forwarder
        self.inbox = Inbox(rules.current_step, frozenset(range(s.P)) - {s.rank})
        self.inbox.held = self._reconnecting
        self.inbox.describe_links = self._describe_edges
        self._capture = Capture(capture) if capture else None
        self._closing = threading.Event()
        self.ledger = ledger  # audit.commitments: every frame's digest (worker/commitments)
        self.router = FrameRouter(
            rules, self.inbox, self._outgoing, self._capture, ack_every, ledger=ledger
        )
        self.rejected = self.router.rejected
        self.server = PredecessorServer(s, self.router, self._closing)
        address = tunnels.successor_address if tunnels else successor
        self.client = SuccessorClient(s, self.router, self._closing, address, tunnels)

    @property
    def timers(self) -> LinkTimers:
        return self.settings.timers

    @timers.setter
    def timers(self, timers: LinkTimers) -> None:
        """Before ``connect()``: the client dials with these; a started server keeps its own."""
        self.settings = self.client.cfg = replace(self.settings, timers=timers)

    @property
    def successor_addr(self) -> str:
        return self.client.address

    @successor_addr.setter
    def successor_addr(self, address: str) -> None:
        self.client.address = address

    @property
    def forward_out(self) -> Endpoint:
        """What this worker sends to its successor (FORWARD frames, FINs)."""
        return self.client.session.end

    @property
    def backward_out(self) -> Endpoint | None:
        """What this worker sends to its predecessor (BACKWARD frames), if connected."""
        s = self.server.session
        return s.end if s is not None else None

    def _channel_options(self) -> list[tuple[str, int | str]]:
        return self.client.options()

    def _server_options(self) -> list[tuple[str, int | str]]:
        return self.server.options()

    def start_server(self) -> int:
        """Listen for the predecessor; return the port."""
        port = self.server.start(self.listen)
        if self.tunnels is not None:  # an in-edge the predecessor cannot dial: tunnels
            self.tunnels.start_keeper(dialable(self.listen, port=port))
        return port

    def connect(self) -> None:
        """Open the session with the successor, retrying with backoff until peer_timeout."""
        self.client.connect()

    # --------------------------------------------------------------- sending
    def send_tensor(self, key: FrameKey, tensor: torch.Tensor) -> None:
        """Encode ``tensor`` (in the run's wire dtype) as the frame(s) ``key`` and send them."""
        self._send_frames(key, tensor, wire=self.rules.cfg.wire_dtype)

    def send_packed(self, key: FrameKey, payload: torch.Tensor, codec: Codec) -> None:
        """Send a lossy codec's ``payload`` of a full-size tensor as the frame(s) ``key``."""
        self._send_frames(key, payload, packed=(codec.spec, self.rules.shape_of(key.direction)))

    def _send_frames(self, key: FrameKey, tensor: torch.Tensor, **encoding: Any) -> None:
        out = self._outgoing(key.direction)
        digest = hashlib.sha256() if self.ledger is not None else None
        kept: list[bytes] | None = [] if self.ledger is not None and self.ledger.keeping else None
        for data in self.frames(key, tensor, **encoding):
            if digest is not None:  # the bytes as they go on the wire, piece by piece
                digest.update(data)
            if kept is not None:  # audits: the pieces, for an upload
                kept.append(data)
            out.put(data)  # gRPC sends piece k while piece k+1 is built
        if self.ledger is not None and digest is not None:
            peer = self.peer(key.direction)
            self.ledger.record(key, SENT, peer, digest.hexdigest(), kept)

    def frames(self, key: FrameKey, tensor: torch.Tensor, **encoding: Any) -> Iterator[bytes]:
        """The serialized pieces of frame ``key`` carrying ``tensor`` (built lazily)."""
        # the key's fields are the frame header's
        header = dict(asdict(key), run_id=self.rules.run_id, chunk_bytes=self.chunk_bytes)
        return encode_frames(tensor=tensor, **header, **encoding)

    def peer(self, direction: int) -> int:
        """The neighbour a frame travelling ``direction`` goes to from here (ring-local)."""
        step = -1 if direction == BACKWARD else 1
        return (self.settings.rank + step) % self.settings.P

    def _outgoing(self, direction: int) -> Endpoint:
        """The session end that sends frames travelling ``direction``."""
        if direction != BACKWARD:
            return self.client.session.end
        return self.server.sending_end(time.monotonic() + self.settings.peer_timeout)

    # ---------------------------------------------------------------- status
    def _reconnecting(self) -> bool:
        return self.client.state == EdgeState.RECONNECTING or self.server.reconnecting()

    def edge_states(self) -> dict:
        """Both ring edges of this worker, for status reports::

        {"in": {"peer": "worker-3", "state": "up", "reconnects": 0, "down_s": 0.0}, "out": …}

        ``state``: ``up``; ``reconnecting`` (dropped, within ``link_grace``); ``down``.
        """
        now = time.monotonic()
        edges = {"in": self.server.describe(now), "out": self.client.describe(now)}
        for side in ("in", "out"):
            edges[side].update(self.tunnels.describe(side) if self.tunnels else {"path": DIRECT})
        return edges

    def _describe_edges(self) -> str:
        edges = self.edge_states().values()
        return "; ".join(f"{v['edge']} {v['state']}" for v in edges if v["state"] != EdgeState.UP)

    # -------------------------------------------------------------- shutdown
    @property
    def bytes_sent(self) -> int:
        return self.client.session.end.bytes_sent + self.server.bytes_sent

    def finish(self, timeout: float) -> None:
        """Announce FIN, wait until every other worker finished, then close both streams."""
        fin = ring_pb2.Frame(run_id=self.rules.run_id, origin=self.settings.rank, direction=FIN)
        end = self.client.session.end
        fin_seq = end.put(fin.SerializeToString())
        if not self.inbox.wait_fins(timeout):
            log.warning(
                "worker-%d: not every peer finished within %.0fs", self.settings.rank, timeout
            )
        # The successor confirms every FIN at once (and with it everything before it):
        # ours, and the ones relayed after it, which the successor still needs (each is
        # queued before it is recorded). A stream that breaks before the confirmation is
        # re-dialled within the grace and resumed: what it lost is sent again.
        last, wait = max(fin_seq, end.queued), min(timeout, 10.0)
        if not end.wait_acked(last, wait):
            self._unconfirmed(last - end.acked, wait)
        self.close()

    def _unconfirmed(self, frames: int, waited: float) -> None:
        c = self.client
        why = f"; last error: {c.session.last_error}" if c.session.last_error else ""
        log.warning(
            "worker-%d: successor worker-%d never acknowledged the last %d frame(s) of the "
            "FIN exchange (within %.0fs; edge %s %s%s): it may wait for this worker's FIN "
            "until its own timeout",
            self.settings.base + self.settings.rank,
            self.settings.base + c.succ,
            frames,
            waited,
            c.edge_out,
            c.state,
            why,
        )

    def close(self) -> None:
        """Close both links and release the listening port (idempotent)."""
        if self._closing.is_set():
            return
        self._closing.set()
        self.client.close()
        self.server.close()
        if self.tunnels is not None:
            self.tunnels.close()
        if self._capture is not None:
            self._capture.close()
