"""The run's state machines: run phase, worker state (the coordinator's view), the worker's
own state (the worker's view), incident state, ring-edge state.

Each state is a ``StrEnum`` (it serialises as its string: status JSON, gRPC and metrics carry
the same words), and each machine is one table of allowed edges. On the coordinator, where
reports race (a heartbeat may arrive after the next session opened), :meth:`Machine.step`
logs and refuses an edge not in the table (the state stays); a :class:`StateCell` holds one
thing's state and :meth:`StateCell.move` raises :class:`IllegalTransition` instead (the
worker's own state: a handler that reports a state it cannot be in is a bug, named to the
coordinator). Staying put is not a transition. The diagrams and the why of each move:
docs/architecture.md §10.1–10.4.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Generic, TypeVar

log = logging.getLogger("mobius.machines")


class Phase(StrEnum):
    WAITING = "waiting"
    TRAINING = "training"
    RECOVERING = "recovering"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"


class WorkerState(StrEnum):
    EXPECTED = "expected"  # not registered yet
    REGISTERED = "registered"  # registered, no session yet
    READY = "ready"  # session open, idle
    TRAINING = "training"
    EVALUATING = "evaluating"
    LOST = "lost"  # session closed, heartbeat timeout or reported by a ring peer
    REJOINING = "rejoining"  # lost, then registered again: waiting for the restore
    RESTORING = "restoring"  # loading the rollback state
    RECOVERED = "recovered"  # back in the ring after an incident (until its next heartbeat)
    DONE = "done"  # kept for the wire; nothing sets it today
    FINISHED = "finished"  # the run ended done: the worker was told to stop
    STOPPED = "stopped"  # the run failed or was stopped: the worker was told to stop


class IncidentState(StrEnum):
    OPEN = "open"
    RECOVERED = "recovered"
    FAILED = "failed"


class EdgeState(StrEnum):
    UP = "up"
    DOWN = "down"
    RECONNECTING = "reconnecting"
    CLOSED = "closed"
    UNKNOWN = "unknown"


class RingState(StrEnum):
    """One ring's health in the status document (R rings of P; docs/rings.md): derived
    from its workers' and its edges' states, worst first."""

    STALLED = "stalled"  # a worker of the ring lost (or rejoining), or one of its edges down
    RESTORING = "restoring"  # a worker of the ring loading the rollback state
    WAITING = "waiting"  # a worker of the ring not registered yet
    RECONNECTING = "reconnecting"  # an edge of the ring reconnecting within its grace
    HEALTHY = "healthy"
    ENDED = "ended"  # the run ended


S = TypeVar("S", bound=StrEnum)


class IllegalTransition(ValueError):
    """A move its machine's table does not allow; the message names machine, thing and edge."""


class Machine(Generic[S]):
    """One state machine: its states and the table of allowed edges."""

    def __init__(self, name: str, states: type[S], edges: Mapping[S, Iterable[S]]) -> None:
        self.name, self.states = name, states
        self.edges: dict[S, frozenset[S]] = {s: frozenset(edges.get(s, ())) for s in states}

    def allowed(self, old: S | str, new: S | str) -> bool:
        old, new = self.states(old), self.states(new)
        return old == new or new in self.edges[old]

    def refusal(self, old: S, new: S, who: str = "") -> str:
        allowed = ", ".join(sorted(self.edges[old])) or "none"
        of = f" of {who}" if who else ""
        return f"illegal {self.name} transition{of}: {old} → {new} (allowed: {allowed})"

    def step(self, old: S | str, new: S | str, who: str = "") -> S:
        """``new`` when the table allows ``old → new``; else log the bug and stay at ``old``."""
        old, new = self.states(old), self.states(new)
        if self.allowed(old, new):
            return new
        log.error("%s; refused", self.refusal(old, new, who))
        return old

    def check(self, old: S | str, new: S | str, who: str = "") -> S:
        """``new`` when the table allows ``old → new``; else :class:`IllegalTransition`."""
        old, new = self.states(old), self.states(new)
        if not self.allowed(old, new):
            raise IllegalTransition(self.refusal(old, new, who))
        return new


class StateCell(Generic[S]):
    """One thing's state, changed only through its machine's table."""

    def __init__(self, machine: Machine[S], initial: S, who: str = "") -> None:
        self.machine, self.who = machine, who
        self._state = machine.states(initial)

    @property
    def state(self) -> S:
        return self._state

    def move(self, new: S) -> None:
        """→ ``new``; :class:`IllegalTransition` if the table does not allow it."""
        old, self._state = self._state, self.machine.check(self._state, new, self.who)
        if old != self._state:
            log.debug("%s of %s: %s → %s", self.machine.name, self.who, old, self._state)


ENDED_PHASES = frozenset({Phase.DONE, Phase.FAILED, Phase.STOPPED})
LIVE_PHASES = frozenset({Phase.WAITING, Phase.TRAINING, Phase.RECOVERING})
_END = (Phase.DONE, Phase.FAILED, Phase.STOPPED)
PHASE = Machine(
    "run phase",
    Phase,
    {
        Phase.WAITING: (Phase.TRAINING, *_END),
        Phase.TRAINING: (Phase.RECOVERING, *_END),
        Phase.RECOVERING: (Phase.TRAINING, Phase.FAILED, Phase.STOPPED),
    },
)

W = WorkerState
REPORTED_STATES = (W.REGISTERED, W.READY, W.TRAINING, W.EVALUATING, W.RESTORING)
"""States a worker may report about itself in a heartbeat (the rest are the coordinator's)."""
HEARTBEAT_SETS = (W.READY, W.TRAINING, W.EVALUATING, W.RESTORING)
"""The reported states a heartbeat moves a worker to. ``registered`` (no session yet) is the
coordinator's to set at Register: a heartbeat sent between sessions can arrive after the
next session opened, and must not take a worker back."""
OFF_STATES = frozenset({W.LOST, W.EXPECTED, W.DONE, W.FINISHED, W.STOPPED})
"""States ``mark_lost`` leaves alone: never joined, already lost, or the run let it go."""
DOWN_STATES = frozenset({W.LOST, W.REJOINING})
"""States in which a worker's ring edges are down."""
_OUT = (W.LOST, W.FINISHED, W.STOPPED)
WORKER = Machine(
    "worker state",
    WorkerState,
    {
        W.EXPECTED: (W.REGISTERED, W.STOPPED),
        **{s: (*HEARTBEAT_SETS, *_OUT) for s in (W.REGISTERED, W.READY, W.TRAINING, W.EVALUATING)},
        W.RESTORING: (*HEARTBEAT_SETS, W.RECOVERED, *_OUT),
        W.RECOVERED: (*HEARTBEAT_SETS, *_OUT),
        W.LOST: (W.REJOINING, W.RESTORING),
        W.REJOINING: (W.RESTORING, W.RECOVERED, *_OUT),
        W.DONE: _OUT,
    },
)

# The worker's own view: registered (no session), ready (session open, idle), and what its
# handlers are doing; a session may end in any of them. LOST, RECOVERED, … are the
# coordinator's words about a worker, never the worker's own.
OWN_WORKER = Machine(
    "worker's own state",
    WorkerState,
    {
        W.REGISTERED: (W.READY,),
        W.READY: (W.TRAINING, W.EVALUATING, W.RESTORING, W.REGISTERED),
        **{s: (W.READY, W.REGISTERED) for s in (W.TRAINING, W.EVALUATING, W.RESTORING)},
    },
)

INCIDENT = Machine(
    "incident state",
    IncidentState,
    {IncidentState.OPEN: (IncidentState.RECOVERED, IncidentState.FAILED)},
)

E = EdgeState
EDGE = Machine(
    "ring edge state",
    EdgeState,
    {E.DOWN: (E.UP,), E.UP: (E.RECONNECTING, E.DOWN), E.RECONNECTING: (E.UP, E.DOWN)},
)

MACHINES = (PHASE, WORKER, OWN_WORKER, INCIDENT, EDGE)
