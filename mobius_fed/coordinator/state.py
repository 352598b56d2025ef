"""The coordinator's view of a run: phase, rounds, workers, history (thread-safe)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mobius_fed.coordinator.status_doc import history_doc, status_doc, step_rows
from mobius_fed.coordinator.status_model import (
    HandoverModel,
    IncidentModel,
    StatusModel,
    WorkerModel,
)
from mobius_fed.machines import (
    ENDED_PHASES,
    INCIDENT,
    PHASE,
    WORKER,
    Machine,
    Phase,
    WorkerState,
)
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
    commitments: Callable[[], dict[str, Any]] | None = None  # audit.commitments block
    audits: Callable[[], dict[str, Any]] | None = None  # audit.rate: audits by recomputation
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
        """The status document (:mod:`mobius_fed.coordinator.status_doc`)."""
        return status_doc(self)

    def history_doc(self) -> dict[str, Any]:
        """Every step's losses, the evaluations, rounds, incidents and handovers."""
        return history_doc(self)

    def step_rows(self, start: int, end: int) -> list[dict[str, Any]]:
        """The steps ``start ≤ n < end`` of :meth:`history_doc`, without building it."""
        return step_rows(self, start, end)

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

    @property
    def ring_size(self) -> int:
        """Block groups (workers) per ring."""
        return self.P // self.rings

    def ring_of(self, rank: int) -> int:
        return rank // self.ring_size

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
