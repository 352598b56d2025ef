"""A ``flwr.serverapp.Grid`` whose messages travel over the coordinator's mTLS sessions.

Instructions go out on each worker's ``Control.Session`` response side, replies come back
on its request side. A lost worker or a ring edge reported down raises
:class:`IncidentRaised` in the waiting round at once, since ``Strategy.start`` has no
retry; late replies of an abandoned round are dropped (docs/architecture.md §11).
"""

from __future__ import annotations

import queue
import re
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from flwr.app import Message

from mobius_fed.proto import control_pb2
from mobius_fed.schedule import ring_predecessor, ring_successor
from mobius_fed.transport.flower_wire import (
    ERROR_FATAL,
    ERROR_RING,
    RunGrid,
    message_from_bytes,
    message_to_bytes,
    rank_of_node,
    worker_node_id,
)

_EDGE = re.compile(r"worker-\d+ → worker-\d+")
# A receiving worker's error reply that opens with the refusal it names the sender of
# (worker/link_session.culprit); a later time-out that quotes it is not counted again.
_REFUSED_FROM = re.compile(r"(?:frame|tensor) rejected from mobius://worker/(\d+) on edge")


def refused_sender(reason: str) -> int | None:
    """The rank whose frame a worker's error reply says it refused (None: not a refusal)."""
    m = _REFUSED_FROM.match(reason)
    return int(m.group(1)) if m else None


class RunFailed(RuntimeError):
    """The run cannot go on (it ends with this error)."""


class GridTimeout(RunFailed):
    """Some workers did not answer in time."""

    def __init__(self, ranks: list[int], timeout: float, errors: str = ""):
        super().__init__(f"{names(ranks)} did not answer within {timeout}s{errors}")
        self.ranks = ranks
        self.errors = errors  # "; worker-2 reported: …" for the error replies that did come


class IncidentRaised(RuntimeError):
    """A worker or ring edge was lost: the round in flight is abandoned."""

    def __init__(
        self,
        kind: str,
        what: str,
        rank: int | None,
        edge: str | None = None,
        *,
        last_seen: float | None = None,
    ):
        super().__init__(what)
        self.kind, self.what, self.rank, self.edge = kind, what, rank, edge
        self.last_seen = last_seen  # unix time of the culprit's last sign of life, if known
        self.opened: Any = None  # its IncidentModel, once recorded in the run state
        self.site: str | None = None  # the site lost, by name (worker-2, standby-0)

    def fields(self, P: int, rnd: int) -> dict[str, Any]:
        """The incident record's fields, detected now, with ``rnd`` the round in flight."""
        now = time.time()
        edge = self.edge
        if edge is None and self.rank is not None:
            edge = edges_of([self.rank], P)
        return dict(
            kind=self.kind,
            what=self.what,
            rank=self.rank,
            edge=edge,
            round=rnd,
            site=self.site,
            detected_at=now,
            detection_s=None if self.last_seen is None else max(0.0, now - self.last_seen),
        )


def names(ranks) -> str:
    return ", ".join(f"worker-{r}" for r in ranks)


def edges_of(ranks, P: int) -> str:
    """The ring edges that touch ``ranks`` (P: groups per ring, each ring its own edges)."""
    edges = []
    for r in ranks:
        pred, succ = ring_predecessor(r, P), ring_successor(r, P)
        edges += [f"worker-{pred} → worker-{r}", f"worker-{r} → worker-{succ}"]
    return ", ".join(dict.fromkeys(edges))


class ControlGrid(RunGrid):
    """Flower Grid over the Control service sessions of P workers."""

    def __init__(self, P: int, validate_reply=None, on_refused=None) -> None:
        self.P = P
        self.validate_reply = validate_reply  # raises on a reply the strategy must not see
        self.on_refused = on_refused  # (sender rank, reason): a worker refused its frame
        self._outboxes: dict[int, queue.Queue] = {}
        self._replies: dict[str, Message] = {}
        self._pending: dict[str, int] = {}  # message id → the rank it was sent to
        self._abandoned: set[str] = set()  # ids of messages of an abandoned round
        self._cond = threading.Condition()
        self._failure: str | None = None
        self._incident: IncidentRaised | None = None

    # --------------------------------------------------------- Grid protocol
    def get_node_ids(self) -> Iterable[int]:
        # Raising here matters: Flower's sample_nodes polls this forever while fewer than
        # P nodes are connected, so a worker lost between rounds must end the run.
        with self._cond:
            self._raise_if_failed()
            return [worker_node_id(r) for r in sorted(self._outboxes)]

    def open_sessions(self) -> list[int]:
        """Ranks that still hold a session (never raises)."""
        with self._cond:
            return sorted(self._outboxes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            rank = rank_of_node(msg.metadata.dst_node_id)
            with self._cond:
                self._raise_if_failed()
                box = self._outboxes.get(rank)
                if box is None:
                    raise RunFailed(f"worker-{rank} has no open session")
                self._pending[msg.metadata.message_id] = rank
            box.put(control_pb2.Envelope(flower_message=message_to_bytes(msg)))
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        with self._cond:
            return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send, then wait for every reply; a lost worker or an error reply raises."""
        ids = list(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not all(i in self._replies for i in ids):
                self._raise_if_failed()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    missing = [i for i in ids if i not in self._replies]
                    ranks = sorted(self._pending.get(i, -1) for i in missing)
                    self._abandoned |= set(missing)
                    # an error reply may be why the others are stuck (a worker that cannot
                    # listen leaves its predecessor dialling): name it beside the silent ones
                    errors = "".join(
                        f"; worker-{rank_of_node(r.metadata.src_node_id)} reported: "
                        f"{r.error.reason}"
                        for i in ids
                        if (r := self._replies.get(i)) is not None and r.has_error()
                    )
                    raise GridTimeout(ranks, timeout or 0.0, errors)  # a deadline: timeout given
                self._cond.wait(left if left is not None else 1.0)
            # Node order, not arrival or sampling order: aggregation sums in reply order,
            # and a fixed order makes the float sums reproducible.
            replies = sorted(
                (self._replies.pop(i) for i in ids), key=lambda m: m.metadata.src_node_id
            )
        for reply in replies:
            if reply.has_error():
                rank = rank_of_node(reply.metadata.src_node_id)
                err = reply.error
                if err.code == ERROR_FATAL:
                    self.fail(f"worker-{rank} failed: {err.reason}")
                    self._raise_if_failed()
                kind = "ring edge down" if err.code == ERROR_RING else "worker error"
                edges = ", ".join(dict.fromkeys(_EDGE.findall(err.reason or ""))) or None
                self.raise_incident(
                    IncidentRaised(kind, f"worker-{rank} reports: {err.reason}", rank, edges)
                )
                self._raise_if_failed()
        return replies

    # ------------------------------------------------------------- sessions
    def open_session(self, rank: int) -> queue.Queue:
        with self._cond:
            if rank in self._outboxes:
                raise RunFailed(f"worker-{rank} opened a second session")
            box: queue.Queue = queue.Queue()
            self._outboxes[rank] = box
            self._cond.notify_all()
            return box

    def close_session(self, rank: int, box: queue.Queue | None = None) -> queue.Queue | None:
        """Forget rank's session (only ``box`` if given: a newer session stays); return it."""
        with self._cond:
            current = self._outboxes.get(rank)
            if current is not None and (box is None or current is box):
                del self._outboxes[rank]
            else:
                current = None
            self._cond.notify_all()
            return current

    def deliver(self, rank: int, data: bytes) -> None:
        """Accept worker ``rank``'s reply to a message that was sent to that rank only."""
        reply = message_from_bytes(data)
        if rank_of_node(reply.metadata.src_node_id) != rank:
            raise RunFailed(f"worker-{rank} sent a reply as node {reply.metadata.src_node_id}")
        if self.validate_reply is not None and not reply.has_error():
            self.validate_reply(rank, reply)
        if reply.has_error() and self.on_refused is not None:
            # counted on arrival: the round's other replies may come only after the peer
            # timeout, and --evict-suspects acts on the count at once
            sender = refused_sender(reply.error.reason or "")
            if sender is not None:
                self.on_refused(sender, reply.error.reason)
        with self._cond:
            to = reply.metadata.reply_to_message_id
            if to in self._abandoned:
                self._abandoned.discard(to)  # a late reply from an abandoned round
                return
            if self._pending.get(to) != rank:
                raise RunFailed(f"worker-{rank} replied to message {to!r} it was not sent")
            del self._pending[to]
            self._replies[to] = reply
            self._cond.notify_all()

    def wait_for_sessions(self, timeout: float, ready=lambda: True) -> list[int]:
        """Wait until all P workers hold a session (and ``ready()``); return those missing."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (len(self._outboxes) < self.P or not ready()) and self._failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._failure is not None:  # a pending incident is the caller's to take
                raise RunFailed(self._failure)
            return [r for r in range(self.P) if r not in self._outboxes]

    def fail(self, reason: str) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = reason
            self._cond.notify_all()

    def raise_incident(self, incident: IncidentRaised) -> None:
        """Record ``incident`` (the first one wins) and wake the waiting round."""
        with self._cond:
            if self._incident is None:
                self._incident = incident
            self._cond.notify_all()

    def take_incident(self) -> IncidentRaised | None:
        """The pending incident, cleared; every unanswered message is abandoned."""
        with self._cond:
            incident, self._incident = self._incident, None
            self._abandoned |= set(self._pending)
            self._pending.clear()
            self._replies.clear()
            return incident

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def failure(self) -> str | None:
        return self._failure

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RunFailed(self._failure)
        if self._incident is not None:
            raise self._incident

    def broadcast(self, note: str, text: str = "") -> None:
        """Send a control note ("stop", "abort") to every open session."""
        with self._cond:
            boxes = list(self._outboxes.values())
        for box in boxes:
            box.put(control_pb2.Envelope(note=note, flower_message=text.encode()))
