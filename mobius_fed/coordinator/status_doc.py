"""The status and history documents of a run, read from its :class:`RunState` under its
lock: the phase, the ring's edges and health, incidents, handovers, bounds, pace and the
losses (the schema: :mod:`mobius_fed.coordinator.status_model`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from mobius_fed.coordinator.status_model import HandoverModel, IncidentModel, WorkerModel
from mobius_fed.machines import (
    DOWN_STATES,
    ENDED_PHASES,
    EdgeState,
    Phase,
    RingState,
    WorkerState,
)
from mobius_fed.schedule import ring_successor

log = logging.getLogger("mobius.coordinator")


class RunView(Protocol):
    """What these documents read of a run: :class:`~mobius_fed.coordinator.state.RunState`
    (named here by its fields, so that the state module imports this one and not back)."""

    run_id: str
    P: int
    steps: int
    strategy: str
    num_rounds: int
    rings: int
    phase: Phase
    round: int
    step: int
    error: str | None
    checkpoint: str | None
    started_at: float
    finished_at: float | None
    workers: dict[int, WorkerModel]
    losses: dict[int, dict[int, float]]
    evals: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    incidents: list[IncidentModel]
    handovers: list[HandoverModel]
    config: dict[str, Any] | None
    privacy: Callable[[int], dict[str, Any] | None] | None
    standby: Callable[[], dict[str, Any]] | None
    commitments: Callable[[], dict[str, Any]] | None
    audits: Callable[[], dict[str, Any]] | None
    clipped: dict[str, int]
    clip_last: dict[str, str]
    refused: dict[str, int]
    suspect_after: int
    _lock: threading.RLock

    @property
    def ring_size(self) -> int: ...


def status_doc(state: RunView) -> dict[str, Any]:
    with state._lock:
        now = time.time()
        last_eval = state.evals[-1] if state.evals else None
        return {
            "run_id": state.run_id,
            "phase": state.phase,
            "round": state.round,
            "num_rounds": state.num_rounds,
            "step": state.step,
            "steps": state.steps,
            "strategy": state.strategy,
            "error": state.error,
            "checkpoint": state.checkpoint,
            "started_at": state.started_at,
            "finished_at": state.finished_at,
            "eval_loss": last_eval["loss"] if last_eval else None,
            "eval_origin_losses": last_eval["origin_losses"] if last_eval else None,
            "server_time": now,
            "rings": state.rings,
            "ring": (edges := ring_doc(state)),
            "ring_health": ring_health(state, edges),
            "incidents": [i.model_dump() for i in state.incidents],
            "handovers": [h.model_dump() for h in state.handovers],
            "standby": None if state.standby is None else state.standby(),
            "config": state.config,
            "pace": pace(state),
            "timeline": timeline(state),
            "privacy": privacy_block(state),
            "bounds": bounds_block(state),
            "commitments": None if state.commitments is None else state.commitments(),
            "audits": None if state.audits is None else state.audits(),
            "train_loss": train_loss(state),
            "workers": [
                {
                    **w.model_dump(),
                    "heartbeat_age_s": None
                    if w.last_heartbeat is None
                    else max(0.0, now - w.last_heartbeat),
                }
                for w in (state.workers[i] for i in sorted(state.workers))
            ],
        }


def pace(state: RunView) -> dict[str, Any] | None:
    """The slowest worker by compute per step, and the next slowest's share of it."""
    per = {r: w.step_compute_s for r, w in state.workers.items()}
    if state.P < 2 or any(v is None or v <= 0 for v in per.values()):
        return None
    ranked = sorted(per, key=lambda r: (-(per[r] or 0.0), r))
    slow, slow_s, next_s = ranked[0], per[ranked[0]] or 0.0, per[ranked[1]] or 0.0
    share = next_s / slow_s
    return {
        "slowest": f"worker-{slow}",
        "share": share,
        "step_compute_s": slow_s,
        "others_s": next_s,
        "summary": f"worker-{slow} holds the ring to {share:.2f} of the others' pace",
    }


def timeline(state: RunView) -> dict[str, Any] | None:
    """The latest training round per step: the slowest worker's compute, waits and the rest
    of its training time, and the barrier (the round's time outside training)."""
    if not state.rounds:
        return None
    r = state.rounds[-1]
    steps, figs = r.get("steps") or 0, r.get("workers") or {}
    timed = {k: f for k, f in figs.items() if f.get("train_s") is not None}
    if steps <= 0 or not timed:
        return None
    slow = max(timed.values(), key=lambda f: f["train_s"])
    compute = (slow.get("compute_s") or 0.0) / steps
    wait = None if slow.get("wait_s") is None else slow["wait_s"] / steps
    other = max(0.0, slow["train_s"] / steps - compute - (wait or 0.0))
    step, barrier = r["seconds"] / steps, r["overhead_s"] / steps
    parts = f"compute {compute:.3f}" + ("" if wait is None else f", wait {wait:.3f}")
    return {
        "round": r["round"],
        "step_s": step,
        "compute_s": compute,
        "wait_s": wait,
        "other_s": other,
        "barrier_s": barrier,
        "summary": f"step {step:.3f} s: {parts}, other {other:.3f}, barrier {barrier:.3f}",
    }


def bounds_block(state: RunView) -> dict[str, Any] | None:
    """E/R updates clipped and frames refused per site, and the suspects (None while
    nothing was clipped or refused)."""
    if not state.clipped and not state.refused:
        return None
    n = state.suspect_after
    bad = {s for s, k in state.clipped.items() if k >= n}
    bad |= {s for s, k in state.refused.items() if k >= n}
    return {
        "er_clipped": dict(sorted(state.clipped.items())),
        "frames_refused": dict(sorted(state.refused.items())),
        "last": dict(sorted(state.clip_last.items())),
        "suspects": sorted(bad),
    }


def privacy_block(state: RunView) -> dict[str, Any] | None:
    if state.privacy is None:
        return None
    try:
        return state.privacy(state.step)
    except Exception as exc:  # status must answer whatever the report does
        log.warning("privacy status block failed: %r", exc)
        return {"error": f"privacy report failed: {exc!r}"}


def train_loss(state: RunView) -> float | None:
    """Mean over origins of the latest step every origin reported."""
    for n in sorted(state.losses, reverse=True):
        per = state.losses[n]
        if len(per) == state.P:
            return sum(per.values()) / state.P
    return None


def ring_doc(state: RunView) -> list[dict[str, Any]]:
    """Each ring edge i → i+1 as its sender reports it (unknown until it does)."""
    edges = []
    for i in range(state.P):
        w, j = state.workers[i], ring_successor(i, state.ring_size)
        lost = w.state in DOWN_STATES or state.workers[j].state in DOWN_STATES
        out = w.edges.get("out", {}) if w.state not in DOWN_STATES else {}
        edge = EdgeState.DOWN if lost else out.get("state", EdgeState.UNKNOWN)
        if state.phase in ENDED_PHASES and not lost:
            edge = EdgeState.CLOSED  # the run ended: links were closed on purpose
        edges.append(
            {
                "edge": f"worker-{i} → worker-{j}",
                "state": edge,
                "reconnects": out.get("reconnects", 0),
                "down_s": out.get("down_s", 0.0),
                "bytes_per_s": w.bytes_per_s,  # what its sender reported
                "path": out.get("path"),  # direct | reversed | relayed (reachability)
                "tunnel_bytes_per_s": out.get("tunnel_bytes_per_s"),
                "wait_share": state.workers[j].wait_share,  # its receiver waiting on it
            }
        )
    return edges


def ring_health(state: RunView, edges: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ring's health from its workers' and its edges' states, worst first."""
    out = []
    for r in range(state.rings):
        ranks = list(range(r * state.ring_size, (r + 1) * state.ring_size))
        members = [state.workers[g] for g in ranks]
        own = [edges[g] for g in ranks]  # edge g is worker-g's out-edge, in its ring
        down = [f"worker-{w.rank} {w.state}" for w in members if w.state in DOWN_STATES]
        down += [f"{e['edge']} down" for e in own if e["state"] == EdgeState.DOWN]
        restoring = [f"worker-{w.rank} restoring" for w in members
                     if w.state == WorkerState.RESTORING]  # fmt: skip
        waiting = [f"worker-{w.rank} not registered" for w in members
                   if w.state == WorkerState.EXPECTED]  # fmt: skip
        again = [f"{e['edge']} reconnecting" for e in own
                 if e["state"] == EdgeState.RECONNECTING]  # fmt: skip
        ring, why = RingState.HEALTHY, None
        for s, reasons in (
            (RingState.STALLED, down),
            (RingState.RESTORING, restoring),
            (RingState.WAITING, waiting),
            (RingState.RECONNECTING, again),
        ):
            if reasons:
                ring, why = s, "; ".join(reasons)
                break
        else:
            if state.phase in ENDED_PHASES:
                ring = RingState.ENDED
        out.append(
            {
                "ring": r,
                "workers": ranks,
                "state": ring,
                "healthy": ring == RingState.HEALTHY,
                "step": min(w.step for w in members),
                "edges_up": sum(e["state"] == EdgeState.UP for e in own),
                "edges": len(own),
                "reason": why,
            }
        )
    return out


def step_rows(state: RunView, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
    """The recorded steps ``start ≤ n < end``: each step's mean loss (None until every
    origin reported) and its per-origin losses."""
    with state._lock:
        steps = []
        if end is None:
            keys = [n for n in sorted(state.losses) if n >= start]
        else:  # a round's steps: looked up, not found by a scan of the whole run
            keys = [n for n in range(start, end) if n in state.losses]
        for n in keys:
            per = state.losses[n]
            origin = [per.get(s) for s in range(state.P)]
            known = [x for x in origin if x is not None]
            mean = sum(known) / state.P if len(known) == state.P else None
            steps.append({"step": n, "loss": mean, "origin_losses": origin})
        return steps


def history_doc(state: RunView) -> dict[str, Any]:
    with state._lock:
        return {
            "run_id": state.run_id,
            "steps": step_rows(state),
            "evals": list(state.evals),
            "rounds": list(state.rounds),
            "incidents": [i.model_dump() for i in state.incidents],
            "handovers": [h.model_dump() for h in state.handovers],
        }
