"""The coordinator's standby pool: standby sites waiting for a rank, the ranks handed to
them, and the identities a handover replaced (docs/recovery.md "Handover to a standby").

A standby (``mobius-worker --standby``) has a certificate of its own that names a standby
identity (``mobius://standby/<n>``), never a rank: it registers again every heartbeat
interval and waits here. A handover assigns it a rank; from then on that identity *is*
the rank (the control service reads the rank through :meth:`StandbyPool.rank_of`), and
the identity it replaced is refused with the reason (:meth:`StandbyPool.refusal`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from mobius_fed.transport.tls import node_name_of, parse_identity, worker_identity

STANDBY = "standby"


@dataclass
class Standby:
    """A standby site waiting in the pool."""

    identity: str
    data: tuple[str, int]  # its data's (tokenizer, vocab)
    seen: float  # monotonic time of its latest registration

    @property
    def name(self) -> str:
        return node_name_of(self.identity)

    @property
    def index(self) -> int:
        return parse_identity(self.identity)[1] or 0


class StandbyPool:
    """Standbys waiting for a rank, and who holds each handed-over rank.

    ``alive_s``: a standby that has not registered again for this long is not offered a
    rank (its process is gone)."""

    def __init__(self, alive_s: float = 10.0) -> None:
        self.alive_s = alive_s
        self.waiting: dict[str, Standby] = {}
        self.assigned: dict[str, int] = {}  # standby identity → the rank it holds
        self.replaced: dict[str, str] = {}  # identity → why it is refused from now on
        self._lock = threading.Lock()

    def offer(self, identity: str, data: tuple[str, int]) -> None:
        """``identity`` registered (again) as a standby without a rank (a poll that raced
        with its handover does not put it back in the pool)."""
        with self._lock:
            if identity not in self.assigned and identity not in self.replaced:
                self.waiting[identity] = Standby(identity, data, time.monotonic())

    def rank_of(self, identity: str | None) -> int | None:
        """The rank ``identity`` holds now: a worker's own, or one handed to a standby;
        None for a replaced identity or a standby without a rank."""
        if identity is None or identity in self.replaced:
            return None
        role, index = parse_identity(identity)
        if role == STANDBY:
            return self.assigned.get(identity)
        return index if role == "worker" else None

    def identity_of(self, rank: int) -> str:
        """Who holds ``rank`` now: the standby it was handed to, or worker-<rank>."""
        for identity, held in self.assigned.items():
            if held == rank and identity not in self.replaced:
                return identity
        return worker_identity(rank)

    def refusal(self, identity: str | None) -> str | None:
        """Why ``identity`` is refused (replaced by a handover), or None."""
        return None if identity is None else self.replaced.get(identity)

    def pick(self, name: str | None = None) -> Standby | None:
        """A live waiting standby: ``name`` (``standby-<n>``), else the lowest index."""
        with self._lock:
            now = time.monotonic()
            live = [s for s in self.waiting.values() if now - s.seen <= self.alive_s]
            if name is not None:
                live = [s for s in live if s.name == name]
            return min(live, key=lambda s: s.index) if live else None

    def live(self) -> list[str]:
        """The standbys waiting now that a handover can take, by name."""
        with self._lock:
            now = time.monotonic()
            return sorted(s.name for s in self.waiting.values() if now - s.seen <= self.alive_s)

    def names(self) -> list[str]:
        """The standbys waiting now (live or not), by name."""
        return sorted(s.name for s in self.waiting.values())

    def restore(self, rank: int, standby: str, replaced: str, why: str) -> None:
        """An earlier handover of this run (a resumed coordinator): ``standby`` holds
        ``rank``, ``replaced`` is refused, as :meth:`assign` left them."""
        with self._lock:
            self._hand(rank, standby, replaced, why)

    def assign(self, rank: int, standby: Standby, why: str) -> str:
        """Hand ``rank`` to ``standby``; the identity that held it is refused from now on
        with ``why``. Returns that replaced identity."""
        with self._lock:
            old = self.identity_of(rank)
            self._hand(rank, standby.identity, old, why)
            return old

    def _hand(self, rank: int, standby: str, replaced: str, why: str) -> None:
        """``standby`` holds ``rank`` and ``replaced`` is refused (the caller holds the lock)."""
        self.waiting.pop(standby, None)
        self.assigned[standby] = rank
        self.replaced[replaced] = (
            f"{node_name_of(replaced)} ({replaced}) was replaced by {node_name_of(standby)} "
            f"as worker-{rank} ({why}); it is refused from now on"
        )
