"""Prometheus metrics of a coordinator, with ``prometheus_client``.

One :class:`CollectorRegistry` per coordinator (tests run several in one process):

* process and platform metrics (``process_*``, ``python_*``) from the library's collectors;
* :class:`RunStateCollector`: gauges and ``*_total`` counters read from :class:`RunState`
  at scrape time (phase, step, workers, ring edges, incidents, figures workers report);
* histograms observed as rounds end: ``mobius_step_seconds`` (per worker),
  ``mobius_round_seconds`` and ``mobius_frame_bytes`` (mean frame size a worker reports).

Every sample carries ``run_id``. Counters never go down: they count work done, including
steps redone after a rollback (``mobius_steps_redone_total`` says how many).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from mobius_fed.coordinator.state import RunState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""What :func:`generate_latest` writes (the classic text format every scraper reads)."""
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300)
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300, 900, 3600)
FRAME_BUCKETS = tuple(float(4**k * 256) for k in range(11))  # 256 B … 256 MiB


class RunStateCollector(Collector):
    """Gauges and counters from a :class:`RunState`, read at scrape time."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        doc = self.state.metrics_doc()
        run = doc["run_id"]

        def gauge(name: str, help_: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, help_, labels=["run_id", *labels])

        def counter(name: str, help_: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(name, help_, labels=["run_id", *labels])

        for name, help_, key in (
            ("mobius_step", "Training steps completed.", "step"),
            ("mobius_steps_target", "Training steps the run will take.", "steps"),
            ("mobius_round", "Flower rounds (step barriers) started.", "round"),
            ("mobius_num_rounds", "Flower rounds the run will take.", "num_rounds"),
        ):
            g = gauge(name, help_)
            g.add_metric([run], doc[key])
            yield g
        g = gauge("mobius_phase", "Run phase (1 for the current one).", ("phase",))
        for phase, on in doc["phases"].items():
            g.add_metric([run, phase], on)
        yield g
        if doc["train_loss"] is not None:
            g = gauge("mobius_train_loss", "Training loss of the latest step (mean over origins).")
            g.add_metric([run], doc["train_loss"])
            yield g
        if doc["eval_loss"] is not None:
            g = gauge("mobius_eval_loss", "Latest validation loss (paper Eq. 8).")
            g.add_metric([run], doc["eval_loss"])
            yield g
            g = gauge("mobius_eval_origin_loss", "Latest validation loss per origin.", ("origin",))
            for origin, loss in enumerate(doc["eval_origin_losses"]):
                if loss is not None:
                    g.add_metric([run, str(origin)], loss)
            yield g
        yield from self._workers(doc, gauge, counter)
        yield from self._edges(doc, gauge, counter)
        for name, help_, key in (
            ("mobius_incidents", "Incidents (a worker or ring edge lost).", "incidents"),
            ("mobius_incidents_recovered", "Incidents the run recovered from.", "recovered"),
            ("mobius_steps_redone", "Training steps redone after rollbacks.", "steps_redone"),
            ("mobius_rounds", "Training rounds completed (redone ones included).", "rounds"),
            ("mobius_evaluations", "Evaluation rounds completed (Eq. 8).", "evaluations"),
            ("mobius_tokens", "Tokens trained on, all origins (redone steps included).", "tokens"),
            ("mobius_heartbeats", "Heartbeats accepted from workers.", "heartbeats"),
        ):
            c = counter(name, help_)
            c.add_metric([run], doc["totals"][key])
            yield c

    def _workers(self, doc: dict[str, Any], gauge, counter) -> Iterator[Metric]:
        run, workers = doc["run_id"], doc["workers"]
        rows: list[tuple[str, str, str, str]] = [
            ("mobius_worker_up", "Worker alive (1) or lost / not registered (0).", "up", "g"),
            ("mobius_worker_step", "Last step the worker reported.", "step", "g"),
            ("mobius_worker_loss", "Last training loss of the worker's own origin.", "loss", "g"),
            ("mobius_worker_tokens_per_second", "Worker throughput.", "tokens_per_s", "g"),
            (
                "mobius_worker_heartbeat_age_seconds",
                "Seconds since the last heartbeat.",
                "heartbeat_age_s",
                "g",
            ),
            (
                "mobius_worker_wait_share",
                "Share of the latest round the worker spent waiting for frames.",
                "wait_share",
                "g",
            ),
            ("mobius_worker_train_seconds", "Seconds spent training steps.", "train_s", "c"),
            (
                "mobius_worker_wait_seconds",
                "Seconds spent waiting for ring frames (as the worker reports).",
                "wait_s",
                "c",
            ),
            (
                "mobius_worker_sent_bytes",
                "Bytes the worker sent on its ring links (as it reports).",
                "bytes_sent",
                "c",
            ),
        ]
        for name, help_, key, kind in rows:
            fam = (gauge if kind == "g" else counter)(name, help_, ("rank",))
            for w in workers:
                if w.get(key) is not None:
                    fam.add_metric([run, str(w["rank"])], w[key])
            yield fam
        g = gauge("mobius_worker_state", "Worker state (1 for the current one).", ("rank", "state"))
        for w in workers:
            g.add_metric([run, str(w["rank"]), w["state"]], 1)
        yield g

    def _edges(self, doc: dict[str, Any], gauge, counter) -> Iterator[Metric]:
        run = doc["run_id"]
        up = gauge("mobius_edge_up", "Ring edge up (1) or not (0).", ("edge",))
        rate = gauge("mobius_edge_bytes_per_second", "Bytes/s its sender reports.", ("edge",))
        rec = counter("mobius_edge_reconnects", "Reconnects within the link grace.", ("edge",))
        for e in doc["ring"]:
            up.add_metric([run, e["edge"]], int(e["state"] == "up"))
            rec.add_metric([run, e["edge"]], e["reconnects"])
            if e.get("bytes_per_s") is not None:
                rate.add_metric([run, e["edge"]], e["bytes_per_s"])
        yield from (up, rate, rec)


class CoordinatorMetrics:
    """The registry a coordinator serves on ``/metrics``, and its histograms."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(RunStateCollector(state))
        self.step_seconds = Histogram(
            "mobius_step_seconds",
            "Training step wall time per worker (its round's training time / steps).",
            ["run_id", "rank"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.round_seconds = Histogram(
            "mobius_round_seconds",
            "Wall time of a training round (step barrier), coordinator clock.",
            ["run_id"],
            buckets=ROUND_BUCKETS,
            registry=self.registry,
        )
        self.frame_bytes = Histogram(
            "mobius_frame_bytes",
            "Ring frame size on the wire (each frame a worker reports, at its round's mean).",
            ["run_id", "rank"],
            buckets=FRAME_BUCKETS,
            registry=self.registry,
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
