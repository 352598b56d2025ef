"""Prometheus metrics of a coordinator, with ``prometheus_client`` (docs/operations.md §5).

One :class:`CollectorRegistry` per coordinator (tests run several in one process).
:class:`RunStateCollector` renders gauges and ``*_total`` counters from the run's
:class:`StatusModel` at scrape time; histograms are observed as rounds end. Counters never
go down: redone steps count too (``mobius_steps_redone_total``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mobius_fed.coordinator.status_model import StatusModel, WorkerModel
from mobius_fed.machines import EdgeState, IncidentState, Phase, RingState, WorkerState
from mobius_fed.transport.tls import node_name_of


class Snapshots(Protocol):
    """What the metrics read of a run (the coordinator's ``RunState`` is one): its id, and
    the status and the counters in one consistent snapshot."""

    run_id: str

    def snapshot(self) -> tuple[StatusModel, dict[str, float]]: ...


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""What :func:`generate_latest` writes (the classic text format every scraper reads)."""
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300)
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300, 900, 3600)
FRAME_BUCKETS = tuple(float(4**k * 256) for k in range(11))  # 256 B … 256 MiB


NOT_UP = (WorkerState.LOST, WorkerState.EXPECTED, WorkerState.FINISHED, WorkerState.STOPPED)
"""Worker states in which ``mobius_worker_up`` is 0."""


def _gauge(name: str, help_: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_, labels=["run_id", *labels])


def _counter(name: str, help_: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_, labels=["run_id", *labels])


_RUN_GAUGES = (
    ("mobius_step", "Training steps completed.", "step"),
    ("mobius_steps_target", "Training steps the run will take.", "steps"),
    ("mobius_round", "Flower rounds (step barriers) started.", "round"),
    ("mobius_num_rounds", "Flower rounds the run will take.", "num_rounds"),
)
_RUN_COUNTERS = (
    ("mobius_incidents", "Incidents (a worker or ring edge lost).", "incidents"),
    ("mobius_incidents_recovered", "Incidents the run recovered from.", "recovered"),
    ("mobius_steps_redone", "Training steps redone after rollbacks.", "steps_redone"),
    ("mobius_rounds", "Training rounds completed (redone ones included).", "rounds"),
    ("mobius_evaluations", "Evaluation rounds completed (Eq. 8).", "evaluations"),
    ("mobius_tokens", "Tokens trained on, all origins (redone steps included).", "tokens"),
    ("mobius_heartbeats", "Heartbeats accepted from workers.", "heartbeats"),
)
# fmt: skip below keeps the table one metric to a row group: name, help, figure, kind.
_WORKER_FIGURES: tuple[tuple[str, str, Callable[[WorkerModel], float | None], str], ...] = (
    ("mobius_worker_up", "Worker alive (1) or lost / not registered (0).",
     lambda w: int(w.state not in NOT_UP), "g"),
    ("mobius_worker_step", "Last step the worker reported.", lambda w: w.step, "g"),
    ("mobius_worker_loss", "Last training loss of the worker's own origin.",
     lambda w: w.last_loss, "g"),
    ("mobius_worker_tokens_per_second", "Worker throughput.", lambda w: w.tokens_per_s, "g"),
    ("mobius_worker_heartbeat_age_seconds", "Seconds since the last heartbeat.",
     lambda w: None if w.heartbeat_age_s is None else round(w.heartbeat_age_s, 3), "g"),
    ("mobius_worker_wait_share",
     "Share of the latest round the worker spent waiting for frames.",
     lambda w: w.wait_share, "g"),
    ("mobius_worker_layers", "Blocks of the worker's group F_i (the split).",
     lambda w: w.layers, "g"),
    ("mobius_worker_step_compute_seconds",
     "Compute seconds per training step in the latest round (the site's pace).",
     lambda w: w.step_compute_s, "g"),
    ("mobius_worker_block_seconds",
     "Compute seconds per block application (forward and backward) in the latest round.",
     lambda w: w.block_s, "g"),
    ("mobius_worker_train_seconds", "Seconds spent training steps.",
     lambda w: w.train_s_total, "c"),
    ("mobius_worker_wait_seconds",
     "Seconds spent waiting for ring frames (as the worker reports).",
     lambda w: w.wait_s_total if w.wait_s is not None else None, "c"),
    ("mobius_worker_sent_bytes", "Bytes the worker sent on its ring links (as it reports).",
     lambda w: w.bytes_sent_total if w.bytes_per_s is not None else None, "c"),
)  # fmt: skip


class RunStateCollector(Collector):
    """Gauges and counters rendered from the run's :class:`StatusModel` at scrape time."""

    def __init__(self, state: Snapshots) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        status, totals = self.state.snapshot()
        run = status.run_id
        for name, help_, key in _RUN_GAUGES:
            g = _gauge(name, help_)
            g.add_metric([run], getattr(status, key))
            yield g
        g = _gauge("mobius_phase", "Run phase (1 for the current one).", ("phase",))
        for phase in Phase:
            g.add_metric([run, phase], int(phase == status.phase))
        yield g
        yield from self._losses(status)
        yield from self._workers(status)
        yield from self._rings(status)
        if status.pace is not None:
            g = _gauge(
                "mobius_ring_pace_share",
                "The next slowest worker's compute per step over the slowest's (1: no cost).",
                ("slowest",),
            )
            g.add_metric([run, status.pace.slowest], status.pace.share)
            yield g
        if (t := status.timeline) is not None:
            g = _gauge(
                "mobius_step_part_seconds",
                "Seconds per step of the latest training round by part: the slowest worker's "
                "compute, wait (for ring frames) and other training time, and the barrier.",
                ("part",),
            )
            for part in ("compute", "wait", "other", "barrier"):
                if (v := getattr(t, f"{part}_s")) is not None:
                    g.add_metric([run, part], v)
            yield g
        yield from self._edges(status)
        yield from self._bounds(status)
        yield from self._commitments(status)
        yield from _audit_metrics(status)
        incidents = status.incidents
        totals = {
            **totals,
            "incidents": len(incidents),
            "recovered": sum(i.state == IncidentState.RECOVERED for i in incidents),
            "steps_redone": sum(i.steps_redone or 0 for i in incidents),
        }
        for name, help_, key in _RUN_COUNTERS:
            c = _counter(name, help_)
            c.add_metric([run], totals[key])
            yield c

    @staticmethod
    def _losses(status: StatusModel) -> Iterator[Metric]:
        run = status.run_id
        if status.train_loss is not None:
            g = _gauge("mobius_train_loss", "Training loss of the latest step (mean over origins).")
            g.add_metric([run], status.train_loss)
            yield g
        if status.eval_loss is not None:
            g = _gauge("mobius_eval_loss", "Latest validation loss (paper Eq. 8).")
            g.add_metric([run], status.eval_loss)
            yield g
            g = _gauge("mobius_eval_origin_loss", "Latest validation loss per origin.", ("origin",))
            for origin, loss in enumerate(status.eval_origin_losses or ()):
                if loss is not None:
                    g.add_metric([run, str(origin)], loss)
            yield g

    @staticmethod
    def _workers(status: StatusModel) -> Iterator[Metric]:
        run = status.run_id
        for name, help_, figure, kind in _WORKER_FIGURES:
            fam = (_gauge if kind == "g" else _counter)(name, help_, ("rank", "ring"))
            for w in status.workers:
                if (value := figure(w)) is not None:
                    fam.add_metric([run, str(w.rank), str(w.ring)], value)
            yield fam
        g = _gauge(
            "mobius_worker_state",
            "Worker state (1 for the current one).",
            ("rank", "ring", "state"),
        )
        for w in status.workers:
            g.add_metric([run, str(w.rank), str(w.ring), w.state], 1)
        yield g

    @staticmethod
    def _rings(status: StatusModel) -> Iterator[Metric]:
        """Each ring's health: R rings of P workers (docs/rings.md); one ring when R = 1."""
        run = status.run_id
        rings = _gauge("mobius_rings", "R: rings of P workers each.")
        rings.add_metric([run], status.rings)
        yield rings
        healthy = _gauge(
            "mobius_ring_healthy", "Ring healthy (1): every worker and edge of it up.", ("ring",)
        )
        stalled = _gauge(
            "mobius_ring_stalled",
            "Ring stalled (1): a worker of it lost or rejoining, or one of its edges down.",
            ("ring",),
        )
        state = _gauge(
            "mobius_ring_state", "Ring health (1 for the current state).", ("ring", "state")
        )
        step = _gauge("mobius_ring_step", "The least step the ring's workers reported.", ("ring",))
        up = _gauge("mobius_ring_edges_up", "The ring's edges up (of P).", ("ring",))
        for h in status.ring_health:
            r = str(h.ring)
            healthy.add_metric([run, r], int(h.healthy))
            stalled.add_metric([run, r], int(h.state == RingState.STALLED))
            for s in RingState:
                state.add_metric([run, r, s], int(s == h.state))
            step.add_metric([run, r], h.step)
            up.add_metric([run, r], h.edges_up)
        yield from (healthy, stalled, state, step, up)

    @staticmethod
    def _bounds(status: StatusModel) -> Iterator[Metric]:
        """Per site (each rank's holder, and any site a handover replaced): E/R updates
        clipped, frames refused, suspect or not (docs/security.md); the run's handovers."""
        run, b = status.run_id, status.bounds or {}
        clipped = _gauge(
            "mobius_site_er_clipped", "E/R updates of the site clipped at a barrier.", ("site",)
        )
        refused = _gauge(
            "mobius_site_frames_refused", "Ring frames of the site its neighbours refused.",
            ("site",),
        )  # fmt: skip
        suspect = _gauge(
            "mobius_site_suspect", "Site reported suspect (1): bounds.suspect_after reached.",
            ("site",),
        )  # fmt: skip
        suspects, clips, refusals = (
            set(b.get("suspects") or ()),
            b.get("er_clipped") or {},
            b.get("frames_refused") or {},
        )
        holders = [node_name_of(w.identity) for w in status.workers]
        for site in dict.fromkeys([*holders, *clips, *refusals]):
            clipped.add_metric([run, site], clips.get(site, 0))
            refused.add_metric([run, site], refusals.get(site, 0))
            suspect.add_metric([run, site], int(site in suspects))
        handovers = _counter("mobius_handovers", "Ranks handed to a standby site.")
        handovers.add_metric([run], len(status.handovers))
        yield from (clipped, refused, suspect, handovers)

    @staticmethod
    def _commitments(status: StatusModel) -> Iterator[Metric]:
        """audit.commitments (docs/security.md "Commitments"): frame hops whose two signed
        digests agreed, and the incidents per kind."""
        c = status.commitments
        if c is None:
            return
        run = status.run_id
        checked = _counter(
            "mobius_commitment_frames_checked",
            "Ring frame hops whose sender's and receiver's signed digests agreed.",
        )
        checked.add_metric([run], c.frames_checked)
        found = _counter(
            "mobius_commitment_incidents",
            "Commitment incidents (digest mismatch, relay altered, forged, missing, late, "
            "malformed).",
            ("kind",),
        )
        for kind, n in sorted(c.by_kind.items()):
            found.add_metric([run, kind], n)
        yield from (checked, found)

    @staticmethod
    def _edges(status: StatusModel) -> Iterator[Metric]:
        run = status.run_id
        up = _gauge("mobius_edge_up", "Ring edge up (1) or not (0).", ("edge",))
        rate = _gauge("mobius_edge_bytes_per_second", "Bytes/s its sender reports.", ("edge",))
        rec = _counter("mobius_edge_reconnects", "Reconnects within the link grace.", ("edge",))
        for e in status.ring:
            up.add_metric([run, e.edge], int(e.state == EdgeState.UP))
            rec.add_metric([run, e.edge], e.reconnects)
            if e.bytes_per_s is not None:
                rate.add_metric([run, e.edge], e.bytes_per_s)
        yield from (up, rate, rec)


def _audit_metrics(status: StatusModel) -> Iterator[Metric]:
    """audit.rate (docs/audits.md): audits asked and passed, frames recomputed equal, and
    the incidents per kind."""
    a = status.audits
    if a is None:
        return
    run = status.run_id
    done = _counter("mobius_audits", "Audits by recomputation, by outcome.", ("outcome",))
    done.add_metric([run, "asked"], a.asked)
    done.add_metric([run, "passed"], a.passed)
    done.add_metric([run, "skipped"], a.skipped)
    frames = _counter(
        "mobius_audit_frames_compared", "Sent frames recomputed by an audit and found equal."
    )
    frames.add_metric([run], a.frames_compared)
    found = _counter(
        "mobius_audit_incidents",
        "Audit incidents (audit failed, upload mismatch, audit refused, audit timed out, "
        "audit error).",
        ("kind",),
    )
    for kind, n in sorted(a.by_kind.items()):
        found.add_metric([run, kind], n)
    yield from (done, frames, found)


class CoordinatorMetrics:
    """The registry a coordinator serves on ``/metrics``, and its histograms."""

    def __init__(self, state: Snapshots) -> None:
        self.state = state
        self.registry = CollectorRegistry(auto_describe=True)
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self.registry.register(RunStateCollector(state))
        histogram = functools.partial(Histogram, registry=self.registry)
        self.step_seconds = histogram(
            "mobius_step_seconds",
            "Training step wall time per worker (its round's training time / steps).",
            ["run_id", "rank"],
            buckets=STEP_BUCKETS,
        )
        self.round_seconds = histogram(
            "mobius_round_seconds",
            "Wall time of a training round (step barrier), coordinator clock.",
            ["run_id"],
            buckets=ROUND_BUCKETS,
        )
        self.frame_bytes = histogram(
            "mobius_frame_bytes",
            "Ring frame size on the wire (each frame a worker reports, at its round's mean).",
            ["run_id", "rank"],
            buckets=FRAME_BUCKETS,
        )

    def observe_round(self, seconds: float, steps: int, workers: dict[int, dict]) -> None:
        """A training round ended: ``workers`` maps rank → the figures it reported."""
        run = self.state.run_id
        self.round_seconds.labels(run).observe(seconds)
        for rank, w in workers.items():
            if steps > 0 and w.get("train_s") is not None:
                per_step = w["train_s"] / steps
                hist = self.step_seconds.labels(run, str(rank))
                for _ in range(steps):
                    hist.observe(per_step)
            frames, sent = w.get("frames_sent"), w.get("bytes_sent")
            if frames and sent:
                hist = self.frame_bytes.labels(run, str(rank))
                for _ in range(min(int(frames), 100_000)):
                    hist.observe(sent / frames)

    def render(self) -> bytes:
        """Prometheus text exposition format 0.0.4."""
        return generate_latest(self.registry)
