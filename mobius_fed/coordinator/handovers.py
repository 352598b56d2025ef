"""Who holds each rank: the standby pool, handovers to a standby, the operator's
``mobius-fed replace`` and a resumed run's earlier handovers (docs/recovery.md "Handover to
a standby"). The control service reads ranks through :attr:`Handovers.pool` and hands a
lost rank over through :meth:`Handovers.hand_over`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from mobius_fed.coordinator.standby import StandbyPool
from mobius_fed.coordinator.state import RunState
from mobius_fed.coordinator.status_model import HandoverModel
from mobius_fed.machines import LIVE_PHASES, OFF_STATES
from mobius_fed.transport.tls import identity_of_node_name, node_name_of, parse_identity

log = logging.getLogger("mobius.coordinator")


class Handovers:
    """The ranks handed to standby sites. ``cond`` is the control service's lock (a
    handover and a registration never interleave); ``mark_lost(rank, why, identity)``
    counts a forcibly replaced site lost."""

    def __init__(
        self,
        state: RunState,
        cond: threading.Condition,
        mark_lost: Callable[[int, str, str | None], None],
    ) -> None:
        self.state, self.P, self._cond, self._mark_lost = state, state.P, cond, mark_lost
        self.pool = StandbyPool()

    def hand_over(self, rank: int, why: str, standby: str | None = None) -> str | None:
        """Hand lost ``rank`` to a live standby (``standby``, or any): its identity holds
        the rank from now on, the one it replaces is refused. The standby's name, or None
        when there is none to hand it to."""
        with self._cond:
            chosen = self.pool.pick(standby)
            if chosen is None:
                return None
            old = self.pool.assign(rank, chosen, why)
            self.state.record_handover(rank, old, chosen.identity, why)
            self._cond.notify_all()
        log.warning(
            "handover: worker-%d goes to %s (%s) because %s; %s is refused from now on",
            rank,
            chosen.name,
            chosen.identity,
            why,
            old,
        )
        return chosen.name

    def restore(self, saved: list[HandoverModel]) -> None:
        """A resumed run's earlier handovers, in order: each standby holds its rank again
        and each replaced identity stays refused (before any registration is answered)."""
        for h in saved:
            self.pool.restore(h.rank, h.standby, h.replaced, h.why)
            log.warning(
                "resumed handover: worker-%d is held by %s (since round %s); %s stays refused",
                h.rank,
                node_name_of(h.standby),
                "?" if h.round is None else h.round,
                h.replaced,
            )

    def forget(self) -> None:
        """The resumed run started afresh after all: its earlier handovers do not hold."""
        self.pool = StandbyPool(self.pool.alive_s)

    def replace(self, worker: str, standby: str, force: bool) -> str:
        """``mobius-fed replace``: hand ``worker``'s rank to ``standby``; ValueError naming
        why not (an unknown name, no such standby waiting, a live worker without force)."""
        rank = rank_of_name(worker, self.P)
        if identity_of_node_name(standby) is None or not standby.startswith("standby-"):
            raise ValueError(f"{standby!r} is not a standby's name (standby-<n>)")
        if self.state.phase not in LIVE_PHASES:
            raise ValueError(f"run {self.state.run_id} has ended ({self.state.phase})")
        if self.pool.pick(standby) is None:
            waiting = ", ".join(self.pool.names()) or "none"
            raise ValueError(
                f"{standby} is not registered with the coordinator as a waiting standby "
                f"(standbys waiting: {waiting})"
            )
        w = self.state.workers[rank]
        alive = w.state not in OFF_STATES
        if alive and not force:
            raise ValueError(
                f"{worker} is alive (state {w.state}): replacing it takes its rank from a "
                "working site; pass --force to replace it anyway (its process is then refused)"
            )
        why = "the operator replaced it (mobius-fed replace" + (" --force)" if alive else ")")
        replaced = self.pool.identity_of(rank)
        if self.hand_over(rank, why, standby) is None:
            raise ValueError(f"{standby} left the pool meanwhile")
        if alive:
            self._mark_lost(rank, f"replaced by {standby} (mobius-fed replace --force)", replaced)
        return f"{worker} handed over to {standby}" + (" (it was alive: forced)" if alive else "")

    def identities(self) -> list[str]:
        """Who holds each rank now: what a ring order tells the neighbours."""
        return [self.pool.identity_of(rank) for rank in range(self.P)]


def rank_of_name(worker: str, workers: int) -> int:
    """The rank of ``worker-<i>``; ValueError for another name or a rank past the run's."""
    identity = identity_of_node_name(worker)
    role, index = parse_identity(identity) if identity else ("", None)
    if role != "worker" or index is None:
        raise ValueError(f"{worker!r} is not a worker's name (worker-<i>)")
    if index >= workers:
        raise ValueError(f"{worker} is not a worker of this run (P={workers})")
    return index
