"""The coordinator's view of a run: phase, rounds, workers, history (thread-safe)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mobius_fed.coordinator.status_model import (
    HandoverModel,
    IncidentModel,
    StatusModel,
    WorkerModel,
)
from mobius_fed.machines import (
    DOWN_STATES,
    ENDED_PHASES,
    INCIDENT,
    PHASE,
    WORKER,
    EdgeState,
    Machine,
    Phase,
    RingState,
    WorkerState,
)
from mobius_fed.schedule import ring_successor
from mobius_fed.transport.tls import node_name_of

log = logging.getLogger("mobius.coordinator")


@dataclass
class RunState:
    """Everything the status endpoints report; mutate only through the methods."""

    run_id: str
    P: int  # workers: all R·P sites
    steps: int
    strategy: str
    num_rounds: int = 0
    rings: int = 1  # R rings of P / R groups each (docs/rings.md)
    phase: Phase = Phase.WAITING
    round: int = 0
    step: int = 0
    error: str | None = None
    checkpoint: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    workers: dict[int, WorkerModel] = field(default_factory=dict)
    losses: dict[int, dict[int, float]] = field(default_factory=dict)  # step → origin → loss
    evals: list[dict[str, Any]] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    incidents: list[IncidentModel] = field(default_factory=list)
    handovers: list[HandoverModel] = field(default_factory=list)
    config: dict[str, Any] | None = None  # the run's configuration, for status and dashboard
    privacy: Callable[[int], dict[str, Any] | None] | None = None  # step → status block
    standby: Callable[[], dict[str, Any]] | None = None  # status's standby block
    # per site, by its name (worker-2, or standby-0 once it holds a rank): a handover's
    # standby starts clean and the replaced site's record stays
    clipped: dict[str, int] = field(default_factory=dict)  # site → E/R updates clipped
    clip_last: dict[str, str] = field(default_factory=dict)  # site → its last clip
    refused: dict[str, int] = field(default_factory=dict)  # site → its frames refused
    suspect_after: int = 3
    # called with the handovers after each change (the coordinator keeps them on disk)
    handover_sink: Callable[[list[HandoverModel]], None] | None = field(default=None, repr=False)
    layers: tuple[int, ...] | None = None  # the split: blocks of each worker's group
    loops: int = 1  # L: a worker applies its group L·P times per step
    totals: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("rounds", "evaluations", "tokens", "heartbeats"), 0.0
        )
    )
    _metrics: Any = field(default=None, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __post_init__(self) -> None:
        for i in range(self.P):
            layers = self.layers[i % self.ring_size] if self.layers else None
            model = WorkerModel(
                rank=i, ring=self.ring_of(i), identity=f"mobius://worker/{i}", layers=layers
            )
            self.workers.setdefault(i, model)

    # ------------------------------------------------------------- updates
    def update_worker(self, rank: int, **fields: Any) -> None:
        """Set worker ``rank``'s figures; a ``state`` goes through its machine's table."""
        with self._lock:
            _apply(self.workers[rank], WORKER, f"worker-{rank}", fields)

    def move_worker(self, rank: int, new: WorkerState, **fields: Any) -> bool:
        """Worker ``rank`` → ``new`` (with ``fields``) if the table allows it; else refused."""
        with self._lock:
            w = self.workers[rank]
            if not WORKER.allowed(w.state, new):
                WORKER.step(w.state, new, f"worker-{rank}")  # logs the refusal
                return False
            self.update_worker(rank, state=new, **fields)
            return True

    def move_phase(self, new: Phase) -> bool:
        """The run's phase → ``new`` if the table allows it; else logged and refused."""
        with self._lock:
            self.phase = PHASE.step(self.phase, new, f"run {self.run_id}")
            return self.phase == new

    def set(self, **fields: Any) -> None:
        with self._lock:
            if "phase" in fields:
                self.move_phase(fields.pop("phase"))
            for k, v in fields.items():
                setattr(self, k, v)

    def record_losses(self, origin: int, first_step: int, losses: list[float]) -> None:
        with self._lock:
            for k, loss in enumerate(losses):
                self.losses.setdefault(first_step + k, {})[origin] = loss
            self.step = max(self.step, first_step + len(losses))

    def record_eval(self, rnd: int, step: int, origin_losses: dict[int, float]) -> None:
        with self._lock:
            per = [origin_losses[s] for s in sorted(origin_losses)]
            self.evals.append(
                {"round": rnd, "step": step, "loss": sum(per) / len(per), "origin_losses": per}
            )
            self.totals["evaluations"] += 1

    def record_round(
        self,
        rnd: int,
        seconds: float,
        worker_seconds: float,
        snapshot_s: float = 0.0,
        *,
        workers: dict[int, dict[str, Any]] | None = None,
        steps: int = 0,
        tokens: float = 0.0,
    ) -> None:
        """A training round ended; ``workers``: rank → its figures for the round (``train_s``,
        and where reported ``wait_s``, ``compute_s``, ``bytes_sent``, ``frames_sent``)."""
        workers = workers or {}
        with self._lock:
            self.rounds.append(
                {
                    "round": rnd,
                    "seconds": seconds,
                    "train_s": worker_seconds,
                    "overhead_s": max(0.0, seconds - worker_seconds),
                    "snapshot_s": snapshot_s,  # the slowest worker's in-memory barrier copy
                    "steps": steps,
                    "workers": {str(r): dict(v) for r, v in sorted(workers.items())},
                }
            )
            self.totals["rounds"] += 1
            self.totals["tokens"] += tokens
            for rank, fig in workers.items():
                w = self.workers[rank]
                train_s = fig.get("train_s")
                w.train_s, w.wait_s = train_s, fig.get("wait_s")
                w.compute_s = fig.get("compute_s")
                w.step_compute_s = w.block_s = None
                if w.compute_s is not None and steps:
                    w.step_compute_s = w.compute_s / steps
                    if w.layers:
                        w.block_s = w.step_compute_s / (self.loops * self.P * w.layers)
                w.wait_share = w.bytes_per_s = None
                if train_s:
                    if w.wait_s is not None:
                        w.wait_share = min(1.0, w.wait_s / train_s)
                    if fig.get("bytes_sent") is not None:
                        w.bytes_per_s = fig["bytes_sent"] / train_s
                w.train_s_total += train_s or 0.0
                w.wait_s_total += w.wait_s or 0.0
                w.bytes_sent_total += fig.get("bytes_sent") or 0.0
                w.sync_bytes_total += fig.get("sync_bytes") or 0.0
                w.er_bytes_total += fig.get("er_bytes") or 0.0
        if self._metrics is not None:
            self._metrics.observe_round(seconds, steps, workers)

    def count_heartbeat(self) -> None:
        with self._lock:
            self.totals["heartbeats"] += 1

    def open_incident(self, **fields: Any) -> IncidentModel:
        """Record an open incident; a training run is recovering from that moment on."""
        with self._lock:
            inc = IncidentModel(id=len(self.incidents) + 1, **fields)
            self.incidents.append(inc)
            if self.phase == Phase.TRAINING:
                self.move_phase(Phase.RECOVERING)
            return inc

    def lose_worker(self, rank: int, incident: dict[str, Any] | None) -> IncidentModel | None:
        """Worker ``rank`` → lost and, with ``incident``'s fields, its incident opened: one
        change, so no reader sees a lost worker in a run that is still training."""
        with self._lock:
            self.move_worker(rank, WorkerState.LOST, incidents=self.workers[rank].incidents + 1)
            return None if incident is None else self.open_incident(**incident)

    def record_handover(self, rank: int, replaced: str, standby: str, why: str) -> None:
        """Rank ``rank`` was handed to ``standby`` (its round comes at :meth:`handed_over`).
        Clips and refusals are counted per site, so the standby starts clean and the
        replaced site's record stays."""
        with self._lock:
            self.handovers.append(
                HandoverModel(
                    rank=rank, replaced=replaced, standby=standby, why=why, at=time.time()
                )
            )
        self._handovers_changed()

    def handed_over(self, rnd: int, evaluates: bool) -> None:
        """The ring resumes from round ``rnd``: every pending handover took that round (and
        evaluates it again when it ``evaluates`` and its evaluation is not in the history)."""
        with self._lock:
            again = evaluates and rnd > 0 and all(e["round"] != rnd for e in self.evals)
            pending = [h for h in self.handovers if h.round is None]
            for h in pending:
                h.round, h.evaluated_round = rnd, again
        if pending:
            self._handovers_changed()

    def restore_handovers(self, saved: list[HandoverModel], rnd: int) -> None:
        """A resumed run's earlier handovers (the coordinator's record on disk), the run
        starting again from round ``rnd``: a handover that took a later round is pending
        again (the standby takes the group from ``rnd``'s state, the handover's round then)."""
        with self._lock:
            self.handovers = [
                h
                if h.round is not None and h.round <= rnd
                else h.model_copy(update={"round": None, "evaluated_round": False})
                for h in saved
            ]

    def _handovers_changed(self) -> None:
        if self.handover_sink is not None:
            with self._lock:
                copies = [h.model_copy() for h in self.handovers]
            self.handover_sink(copies)

    def update_incident(self, incident: IncidentModel, **fields: Any) -> None:
        """Set ``incident``'s fields; a ``state`` goes through its machine's table."""
        with self._lock:
            _apply(incident, INCIDENT, f"incident {incident.id}", fields)

    def rollback(self, end_step: int, rnd: int) -> None:
        """Forget every record past round ``rnd`` (its steps end at ``end_step``)."""
        with self._lock:
            self.losses = {n: v for n, v in self.losses.items() if n < end_step}
            self.evals = [e for e in self.evals if e["round"] <= rnd]
            self.rounds = [r for r in self.rounds if r["round"] <= rnd]
            self.round, self.step = rnd, end_step

    def finish(self, phase: Phase, error: str | None = None) -> None:
        """The run ended: every worker not lost shows ``finished`` (done) or ``stopped``."""
        with self._lock:
            self.move_phase(phase)
            self.error, self.finished_at = error, time.time()
            final = WorkerState.FINISHED if phase == Phase.DONE else WorkerState.STOPPED
            for w in self.workers.values():
                if w.state not in (WorkerState.LOST, WorkerState.EXPECTED):
                    _apply(w, WORKER, f"worker-{w.rank}", {"state": final})
                elif w.state == WorkerState.EXPECTED and phase != Phase.DONE:
                    _apply(w, WORKER, f"worker-{w.rank}", {"state": WorkerState.STOPPED})

    @property
    def ended(self) -> bool:
        return self.phase in ENDED_PHASES

    @property
    def succeeded(self) -> bool:
        """The run ended done."""
        return self.phase == Phase.DONE

    # ------------------------------------------------------------- reports
    def status_doc(self) -> dict[str, Any]:
        with self._lock:
            now = time.time()
            last_eval = self.evals[-1] if self.evals else None
            return {
                "run_id": self.run_id,
                "phase": self.phase,
                "round": self.round,
                "num_rounds": self.num_rounds,
                "step": self.step,
                "steps": self.steps,
                "strategy": self.strategy,
                "error": self.error,
                "checkpoint": self.checkpoint,
                "started_at": self.started_at,
                "finished_at": self.finished_at,
                "eval_loss": last_eval["loss"] if last_eval else None,
                "eval_origin_losses": last_eval["origin_losses"] if last_eval else None,
                "server_time": now,
                "rings": self.rings,
                "ring": (edges := self._ring_doc()),
                "ring_health": self._ring_health(edges),
                "incidents": [i.model_dump() for i in self.incidents],
                "handovers": [h.model_dump() for h in self.handovers],
                "standby": None if self.standby is None else self.standby(),
                "config": self.config,
                "pace": self._pace(),
                "privacy": self._privacy_block(),
                "bounds": self._bounds_block(),
                "train_loss": self._train_loss(),
                "workers": [
                    {
                        **w.model_dump(),
                        "heartbeat_age_s": None
                        if w.last_heartbeat is None
                        else max(0.0, now - w.last_heartbeat),
                    }
                    for w in (self.workers[i] for i in sorted(self.workers))
                ],
            }

    def _pace(self) -> dict[str, Any] | None:
        """The slowest worker by compute per step, and the next slowest's share of it."""
        per = {r: w.step_compute_s for r, w in self.workers.items()}
        if self.P < 2 or any(v is None or v <= 0 for v in per.values()):
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

    def site(self, rank: int) -> str:
        """The name of the site that holds ``rank`` now (worker-<rank>, or its standby)."""
        return node_name_of(self.workers[rank].identity)

    def record_clip(self, rank: int, why: str, suspect_after: int) -> bool:
        """Site ``rank``'s E/R update was clipped at a barrier (docs/security.md, "Bounds
        on what a site sends"); ``suspect_after`` clips make it a suspect. True when this
        clip did."""
        return self._count(self.clipped, rank, why, suspect_after, "of its E/R updates clipped")

    def record_refusal(self, rank: int, why: str, suspect_after: int) -> bool:
        """A worker refused a frame that site ``rank`` sent (its error reply names the
        sender); ``suspect_after`` refusals make it a suspect. True when this one did."""
        return self._count(self.refused, rank, why, suspect_after, "of its frames refused")

    def _count(
        self, counts: dict[str, int], rank: int, why: str, suspect_after: int, what: str
    ) -> bool:
        with self._lock:
            site = self.site(rank)
            counts[site] = counts.get(site, 0) + 1
            self.clip_last[site] = why
            self.suspect_after = suspect_after
            if counts[site] != suspect_after:
                return False
        log.error("%s (rank %d) is suspect: %d %s", site, rank, suspect_after, what)
        return True

    def _bounds_block(self) -> dict[str, Any] | None:
        """E/R updates clipped and frames refused per site, and the suspects (None while
        nothing was clipped or refused)."""
        if not self.clipped and not self.refused:
            return None
        n = self.suspect_after
        bad = {s for s, k in self.clipped.items() if k >= n}
        bad |= {s for s, k in self.refused.items() if k >= n}
        return {
            "er_clipped": dict(sorted(self.clipped.items())),
            "frames_refused": dict(sorted(self.refused.items())),
            "last": dict(sorted(self.clip_last.items())),
            "suspects": sorted(bad),
        }

    def _privacy_block(self) -> dict[str, Any] | None:
        if self.privacy is None:
            return None
        try:
            return self.privacy(self.step)
        except Exception as exc:  # status must answer whatever the report does
            log.warning("privacy status block failed: %r", exc)
            return {"error": f"privacy report failed: {exc!r}"}

    @property
    def ring_size(self) -> int:
        """Block groups (workers) per ring."""
        return self.P // self.rings

    def ring_of(self, rank: int) -> int:
        return rank // self.ring_size

    def _train_loss(self) -> float | None:
        """Mean over origins of the latest step every origin reported."""
        for n in sorted(self.losses, reverse=True):
            per = self.losses[n]
            if len(per) == self.P:
                return sum(per.values()) / self.P
        return None

    def _ring_doc(self) -> list[dict[str, Any]]:
        """Each ring edge i → i+1 as its sender reports it (unknown until it does)."""
        edges = []
        for i in range(self.P):
            w, j = self.workers[i], ring_successor(i, self.ring_size)
            lost = w.state in DOWN_STATES or self.workers[j].state in DOWN_STATES
            out = w.edges.get("out", {}) if w.state not in DOWN_STATES else {}
            state = EdgeState.DOWN if lost else out.get("state", EdgeState.UNKNOWN)
            if self.phase in ENDED_PHASES and not lost:
                state = EdgeState.CLOSED  # the run ended: links were closed on purpose
            edges.append(
                {
                    "edge": f"worker-{i} → worker-{j}",
                    "state": state,
                    "reconnects": out.get("reconnects", 0),
                    "down_s": out.get("down_s", 0.0),
                    "bytes_per_s": w.bytes_per_s,  # what its sender reported
                    "path": out.get("path"),  # direct | reversed | relayed (reachability)
                    "tunnel_bytes_per_s": out.get("tunnel_bytes_per_s"),
                    "wait_share": self.workers[j].wait_share,  # its receiver waiting on it
                }
            )
        return edges

    def _ring_health(self, edges: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each ring's health from its workers' and its edges' states, worst first."""
        out = []
        for r in range(self.rings):
            ranks = list(range(r * self.ring_size, (r + 1) * self.ring_size))
            members = [self.workers[g] for g in ranks]
            own = [edges[g] for g in ranks]  # edge g is worker-g's out-edge, in its ring
            down = [f"worker-{w.rank} {w.state}" for w in members if w.state in DOWN_STATES]
            down += [f"{e['edge']} down" for e in own if e["state"] == EdgeState.DOWN]
            restoring = [f"worker-{w.rank} restoring" for w in members
                         if w.state == WorkerState.RESTORING]  # fmt: skip
            waiting = [f"worker-{w.rank} not registered" for w in members
                       if w.state == WorkerState.EXPECTED]  # fmt: skip
            again = [f"{e['edge']} reconnecting" for e in own
                     if e["state"] == EdgeState.RECONNECTING]  # fmt: skip
            state, why = RingState.HEALTHY, None
            for s, reasons in (
                (RingState.STALLED, down),
                (RingState.RESTORING, restoring),
                (RingState.WAITING, waiting),
                (RingState.RECONNECTING, again),
            ):
                if reasons:
                    state, why = s, "; ".join(reasons)
                    break
            else:
                if self.phase in ENDED_PHASES:
                    state = RingState.ENDED
            out.append(
                {
                    "ring": r,
                    "workers": ranks,
                    "state": state,
                    "healthy": state == RingState.HEALTHY,
                    "step": min(w.step for w in members),
                    "edges_up": sum(e["state"] == EdgeState.UP for e in own),
                    "edges": len(own),
                    "reason": why,
                }
            )
        return out

    def history_doc(self) -> dict[str, Any]:
        with self._lock:
            steps = []
            for n in sorted(self.losses):
                per = self.losses[n]
                origin = [per.get(s) for s in range(self.P)]
                known = [x for x in origin if x is not None]
                mean = sum(known) / self.P if len(known) == self.P else None
                steps.append({"step": n, "loss": mean, "origin_losses": origin})
            return {
                "run_id": self.run_id,
                "steps": steps,
                "evals": list(self.evals),
                "rounds": list(self.rounds),
                "incidents": [i.model_dump() for i in self.incidents],
                "handovers": [h.model_dump() for h in self.handovers],
            }

    @property
    def metrics(self) -> Any:
        """This run's :class:`~mobius_fed.coordinator.metrics.CoordinatorMetrics`."""
        with self._lock:
            if self._metrics is None:
                from mobius_fed.coordinator.metrics import CoordinatorMetrics

                self._metrics = CoordinatorMetrics(self)
            return self._metrics

    def snapshot(self) -> tuple[StatusModel, dict[str, float]]:
        """The status model and the run's counters, one consistent snapshot (``/metrics``)."""
        with self._lock:
            return StatusModel.model_validate(self.status_doc()), dict(self.totals)

    def prometheus(self) -> str:
        """Prometheus text exposition format (version 0.0.4), by ``prometheus_client``."""
        return self.metrics.render().decode()


def _apply(record: Any, machine: Machine, name: str, fields: dict[str, Any]) -> None:
    """Set ``record``'s fields; a ``state`` goes through ``machine``'s table."""
    if "state" in fields:
        record.state = machine.step(record.state, fields.pop("state"), name)
    for k, v in fields.items():
        setattr(record, k, v)


def json_safe(doc: Any) -> Any:
    """``doc`` with every non-finite float (NaN, ±inf) replaced by None (strict JSON)."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: json_safe(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [json_safe(v) for v in doc]
    return doc
