"""The Prometheus metrics a coordinator serves as a page: name, type, labels, help, read
from its registry after one scrape of a run in which every metric has a value."""

from __future__ import annotations

from mobius_fed.cli.reference.markdown import NOTE, cell
from mobius_fed.coordinator.status_model import StatusModel

PAGE = "reference/metrics.md"
PREFIX = "mobius_"  # ours; the registry also holds prometheus_client's process_* and python_*
SUFFIX = {"counter": "_total"}


_WORKER = {
    "rank": 0,
    "identity": "mobius://worker/0",
    "last_loss": 1.0,
    "heartbeat_age_s": 1.0,
    "wait_s": 1.0,
    "wait_share": 0.1,
    "bytes_per_s": 1.0,
    "layers": 1,
    "step_compute_s": 1.0,
    "block_s": 1.0,
}
_EDGE = {"edge": "worker-0 → worker-0", "state": "up", "reconnects": 0, "down_s": 0.0}
_RING = {"ring": 0, "workers": [0], "state": "healthy", "healthy": True, "step": 1}
_PACE = {"slowest": "worker-0", "share": 1.0, "step_compute_s": 1.0, "others_s": 1.0}
_STATUS = {
    "run_id": "reference",
    "phase": "done",
    "round": 1,
    "num_rounds": 1,
    "step": 1,
    "steps": 1,
    "strategy": "fedavg",
    "started_at": 0.0,
    "eval_loss": 1.0,
    "eval_origin_losses": [1.0],
    "train_loss": 1.0,
    "ring": [_EDGE | {"bytes_per_s": 1.0}],
    "ring_health": [_RING | {"edges_up": 1, "edges": 1}],
    "pace": _PACE | {"summary": ""},
    "commitments": {"replies_checked": 1, "frames_checked": 1, "by_kind": {"late commitment": 1}},
    "audits": {
        "rate": 0.05,
        "asked": 1,
        "passed": 1,
        "frames_compared": 1,
        "pending": 0,
        "by_kind": {"audit failed": 1},
    },
    "timeline": {
        "round": 1,
        "step_s": 1.0,
        "compute_s": 0.5,
        "wait_s": 0.2,
        "other_s": 0.1,
        "barrier_s": 0.2,
        "summary": "",
    },
    "workers": [_WORKER],
}


class _Run:
    """A run at its end in which every metric has a value: one worker reporting every
    figure, one edge, one ring, a pace, a training and a validation loss, a commitment
    incident, an audit incident."""

    run_id = "reference"

    def snapshot(self) -> tuple[StatusModel, dict[str, float]]:
        status = StatusModel.model_validate(_STATUS)
        return status, {"rounds": 1, "evaluations": 1, "tokens": 1, "heartbeats": 1}


def metric_rows() -> list[tuple[str, str, list[str], str]]:
    """``(exposed name, type, labels, help)`` of every ``mobius_*`` metric, in the order a
    scrape lists them."""
    from mobius_fed.coordinator.metrics import CoordinatorMetrics

    metrics = CoordinatorMetrics(_Run())
    metrics.observe_round(1.0, 1, {0: {"train_s": 1.0, "frames_sent": 1, "bytes_sent": 1}})
    rows = []
    for family in metrics.registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        labels: list[str] = []
        for sample in family.samples:
            labels += [k for k in sample.labels if k != "le" and k not in labels]
        if not family.samples:
            raise ValueError(f"{family.name}: no value in the example run; give it one")
        name = family.name + SUFFIX.get(family.type, "")
        rows.append((name, family.type, labels, family.documentation))
    return rows


INTRO = """\
Every metric a coordinator serves at `/metrics` (Prometheus text format 0.0.4; how to
scrape it: [Status, dashboard, metrics](../operations.md)). Counters never go down: redone
steps count too. A histogram `NAME` is exposed as `NAME_bucket`, `NAME_sum` and
`NAME_count`. The registry also holds `prometheus_client`'s standard `process_*` and
`python_*` metrics, not listed here. The status document they are read from:
[Status and REST schema](status.md)."""


def metrics_page() -> str:
    """``reference/metrics.md``: one row per metric."""
    lines = ["# Metrics", "", NOTE, "", INTRO, ""]
    lines += ["| Metric | Type | Labels | Help |", "|---|---|---|---|"]
    for name, kind, labels, text in metric_rows():
        shown = ", ".join(f"`{label}`" for label in labels)
        lines.append(f"| `{name}` | {kind} | {shown} | {cell(text)} |")
    return "\n".join(lines) + "\n"
