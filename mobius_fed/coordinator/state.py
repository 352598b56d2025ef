"""The coordinator's view of a run: phase, rounds, workers, history (thread-safe)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("waiting", "training", "recovering", "done", "failed", "stopped")
WORKER_STATES = (
    "expected",  # not registered yet
    "registered",  # registered, no session yet
    "ready",  # session open, idle
    "training",
    "evaluating",
    "lost",  # session closed, heartbeat timeout or reported by a ring peer
    "rejoining",  # lost, then registered again: waiting for the restore
    "restoring",  # loading the rollback state
    "recovered",  # back in the ring after an incident (until its next heartbeat)
    "done",
)
REPORTED_STATES = ("registered", "ready", "training", "evaluating", "restoring")
"""States a worker may report about itself in a heartbeat (the rest are the coordinator's)."""


@dataclass
class Incident:
    """One loss of a worker or a ring edge, from detection to recovery."""

    id: int
    kind: str  # "worker lost" | "ring edge down" | "worker error"
    what: str
    rank: int | None
    edge: str | None  # "worker-1 → worker-2" when a ring edge is involved
    round: int  # the round in flight when it was detected
    detected_at: float  # unix time
    detection_s: float | None  # detected_at − the last sign of life of the culprit
    state: str = "open"  # open | recovered | failed
    rollback_round: int | None = None
    steps_redone: int | None = None
    recovered_at: float | None = None
    recovery_s: float | None = None  # detection → training resumed
    rejoin_s: float | None = None  # the culprit's re-registration → training resumed


@dataclass
class WorkerStatus:
    rank: int
    identity: str
    address: str = ""
    state: str = "expected"
    step: int = 0
    last_heartbeat: float | None = None  # unix time
    registered_at: float | None = None  # unix time of its latest registration
    last_loss: float | None = None
    tokens_per_s: float = 0.0
    incidents: int = 0  # incidents in which this worker was the one lost
    edges: dict[str, Any] = field(default_factory=dict)  # its ring links as it reports them


@dataclass
class RunState:
    """Everything the status endpoints report; mutate only through the methods."""

    run_id: str
    P: int
    steps: int
    strategy: str
    num_rounds: int = 0
    phase: str = "waiting"
    round: int = 0
    step: int = 0
    error: str | None = None
    checkpoint: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    workers: dict[int, WorkerStatus] = field(default_factory=dict)
    losses: dict[int, dict[int, float]] = field(default_factory=dict)  # step → origin → loss
    evals: list[dict[str, Any]] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __post_init__(self) -> None:
        for i in range(self.P):
            self.workers.setdefault(i, WorkerStatus(rank=i, identity=f"mobius://worker/{i}"))

    # ------------------------------------------------------------- updates
    def update_worker(self, rank: int, **fields: Any) -> None:
        with self._lock:
            w = self.workers[rank]
            for k, v in fields.items():
                setattr(w, k, v)

    def set(self, **fields: Any) -> None:
        with self._lock:
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

    def record_round(
        self, rnd: int, seconds: float, worker_seconds: float, snapshot_s: float = 0.0
    ) -> None:
        with self._lock:
            self.rounds.append(
                {
                    "round": rnd,
                    "seconds": seconds,
                    "train_s": worker_seconds,
                    "overhead_s": max(0.0, seconds - worker_seconds),
                    "snapshot_s": snapshot_s,  # the slowest worker's in-memory barrier copy
                }
            )

    def open_incident(self, **fields: Any) -> Incident:
        with self._lock:
            inc = Incident(id=len(self.incidents) + 1, **fields)
            self.incidents.append(inc)
            return inc

    def update_incident(self, incident: Incident, **fields: Any) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(incident, k, v)

    def rollback(self, end_step: int, rnd: int) -> None:
        """Forget every record past round ``rnd`` (its steps end at ``end_step``)."""
        with self._lock:
            self.losses = {n: v for n, v in self.losses.items() if n < end_step}
            self.evals = [e for e in self.evals if e["round"] <= rnd]
            self.rounds = [r for r in self.rounds if r["round"] <= rnd]
            self.round, self.step = rnd, end_step

    def finish(self, phase: str, error: str | None = None) -> None:
        with self._lock:
            self.phase, self.error, self.finished_at = phase, error, time.time()

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
                "ring": self._ring_doc(),
                "incidents": [asdict(i) for i in self.incidents],
                "workers": [
                    {
                        **asdict(w),
                        "heartbeat_age_s": None
                        if w.last_heartbeat is None
                        else max(0.0, now - w.last_heartbeat),
                    }
                    for w in (self.workers[i] for i in sorted(self.workers))
                ],
            }

    def _ring_doc(self) -> list[dict[str, Any]]:
        """Each ring edge i → i+1 as its sender reports it (unknown until it does)."""
        edges = []
        for i in range(self.P):
            w, j = self.workers[i], (i + 1) % self.P
            out = w.edges.get("out", {}) if w.state not in ("lost", "rejoining") else {}
            state = out.get("state", "unknown")
            if w.state in ("lost", "rejoining") or self.workers[j].state in ("lost", "rejoining"):
                state = "down"
            edges.append(
                {
                    "edge": f"worker-{i} → worker-{j}",
                    "state": state,
                    "reconnects": out.get("reconnects", 0),
                    "down_s": out.get("down_s", 0.0),
                }
            )
        return edges

    def history_doc(self) -> dict[str, Any]:
        with self._lock:
            steps = []
            for n in sorted(self.losses):
                per = self.losses[n]
                origin = [per.get(s) for s in range(self.P)]
                mean = sum(origin) / self.P if None not in origin else None  # type: ignore[arg-type]
                steps.append({"step": n, "loss": mean, "origin_losses": origin})
            return {
                "run_id": self.run_id,
                "steps": steps,
                "evals": list(self.evals),
                "rounds": list(self.rounds),
                "incidents": [asdict(i) for i in self.incidents],
            }

    def prometheus(self) -> str:
        """Prometheus text exposition format (version 0.0.4).

        Every family is ``# HELP``, ``# TYPE``, then all of its samples, contiguously;
        label values and help texts are escaped and non-finite values spelled as
        Prometheus expects (``NaN``, ``+Inf``, ``-Inf``).
        """
        with self._lock:
            now = time.time()
            run = (("run_id", self.run_id),)
            workers = [self.workers[i] for i in sorted(self.workers)]
            fams: list[tuple[str, str, list[tuple[tuple[tuple[str, object], ...], object]]]] = [
                ("mobius_step", "Training steps completed.", [(run, self.step)]),
                ("mobius_steps_target", "Training steps the run will take.", [(run, self.steps)]),
                ("mobius_round", "Flower rounds (step barriers) started.", [(run, self.round)]),
                ("mobius_num_rounds", "Flower rounds the run will take.", [(run, self.num_rounds)]),
                (
                    "mobius_phase",
                    "Run phase (1 for the current one).",
                    [((*run, ("phase", p)), int(p == self.phase)) for p in PHASES],
                ),
                (
                    "mobius_worker_up",
                    "Worker alive (1) or lost / not yet registered (0).",
                    [
                        ((*run, ("rank", w.rank)), int(w.state not in ("lost", "expected")))
                        for w in workers
                    ],
                ),
                (
                    "mobius_worker_step",
                    "Last step the worker reported.",
                    [((*run, ("rank", w.rank)), w.step) for w in workers],
                ),
                (
                    "mobius_worker_loss",
                    "Last training loss of the worker's own origin.",
                    [
                        ((*run, ("rank", w.rank)), w.last_loss)
                        for w in workers
                        if w.last_loss is not None
                    ],
                ),
                (
                    "mobius_worker_tokens_per_second",
                    "Worker throughput.",
                    [((*run, ("rank", w.rank)), w.tokens_per_s) for w in workers],
                ),
                (
                    "mobius_worker_heartbeat_age_seconds",
                    "Seconds since the last heartbeat.",
                    [
                        ((*run, ("rank", w.rank)), round(now - w.last_heartbeat, 3))
                        for w in workers
                        if w.last_heartbeat is not None
                    ],
                ),
            ]
            recovered = sum(i.state == "recovered" for i in self.incidents)
            counters = [
                (
                    "mobius_incidents_total",
                    "Incidents (a worker or ring edge lost).",
                    [(run, len(self.incidents))],
                ),
                (
                    "mobius_incidents_recovered_total",
                    "Incidents the run recovered from.",
                    [(run, recovered)],
                ),
                (
                    "mobius_steps_redone_total",
                    "Training steps redone after rollbacks.",
                    [(run, sum(i.steps_redone or 0 for i in self.incidents))],
                ),
            ]
            if self.evals:
                fams.append(
                    (
                        "mobius_eval_loss",
                        "Latest validation loss (paper Eq. 8).",
                        [(run, self.evals[-1]["loss"])],
                    )
                )
            if self.rounds:
                fams.append(
                    (
                        "mobius_round_seconds",
                        "Wall time of the latest round.",
                        [(run, self.rounds[-1]["seconds"])],
                    )
                )
        lines: list[str] = []
        typed = [(f, "gauge") for f in fams] + [(f, "counter") for f in counters]
        for (name, help_, samples), kind in typed:
            lines.append(f"# HELP {name} {escape_help(help_)}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lbl = ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in labels)
                lines.append(f"{name}{{{lbl}}} {format_sample(value)}")
        return "\n".join(lines) + "\n"


def escape_label_value(value: str) -> str:
    """Escape a Prometheus label value: backslash, double quote and line feed."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """Escape a Prometheus HELP text: backslash and line feed."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_sample(value: object) -> str:
    """A sample value as Prometheus text: ints as-is, floats by repr, NaN/+Inf/-Inf."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    v = float(value)  # type: ignore[arg-type]
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def json_safe(doc: Any) -> Any:
    """``doc`` with every non-finite float (NaN, ±inf) replaced by None (strict JSON)."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: json_safe(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [json_safe(v) for v in doc]
    return doc
