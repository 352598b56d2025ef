"""Prometheus metrics: every series the Grafana dashboard queries exists, with its type."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from mobius_fed.cli.status import render_status, ring_summary
from mobius_fed.coordinator.state import RunState
from mobius_fed.machines import Phase

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy/monitoring/grafana/dashboards"


def busy_state() -> RunState:
    st = RunState(run_id="r", P=2, steps=4, strategy="fedavg", num_rounds=4)
    st.metrics  # noqa: B018 - the histograms exist before the first round
    st.set(phase="training")
    for rank in range(2):
        st.update_worker(rank, state="registered")  # a worker registers before it trains
        st.update_worker(rank, state="training", last_heartbeat=1.0, last_loss=4.0)
        st.record_losses(rank, 0, [4.0, 3.9])
    fig = {"train_s": 0.5, "wait_s": 0.1, "bytes_sent": 4096.0, "frames_sent": 4.0}
    st.record_round(1, 0.7, 0.5, workers={0: fig, 1: {"train_s": 0.4}}, steps=2, tokens=64)
    st.record_eval(1, 2, {0: 3.5, 1: 3.7})
    return st


def test_dashboard_queries_only_exported_series() -> None:
    fams = {f.name: f for f in text_string_to_metric_families(busy_state().prometheus())}
    samples = {s.name for f in fams.values() for s in f.samples}
    doc = json.loads((DASHBOARD / "mobius-fed.json").read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\b((?:mobius|process)_[a-z_]+)\b", e)}
    assert names and names <= samples, sorted(names - samples)


def test_counters_histograms_and_values() -> None:
    fams = {f.name: f for f in text_string_to_metric_families(busy_state().prometheus())}
    assert fams["mobius_tokens"].type == "counter"
    assert fams["mobius_tokens"].samples[0].value == 64
    hist = {(s.name, s.labels.get("rank"), s.labels.get("le")): s.value
            for s in fams["mobius_step_seconds"].samples}  # fmt: skip
    assert hist[("mobius_step_seconds_count", "0", None)] == 2  # 2 steps at 0.25 s
    assert hist[("mobius_step_seconds_bucket", "0", "0.25")] == 2
    assert hist[("mobius_step_seconds_bucket", "0", "0.1")] == 0
    frames = {(s.name, s.labels.get("le")): s.value for s in fams["mobius_frame_bytes"].samples}
    assert frames[("mobius_frame_bytes_count", None)] == 4  # worker-0 reported 4 frames
    assert frames[("mobius_frame_bytes_bucket", "1024.0")] == 4
    share = {s.labels["rank"]: s.value for s in fams["mobius_worker_wait_share"].samples}
    assert share == {"0": 0.2}  # worker-1 reported no wait time
    assert fams["mobius_eval_loss"].samples[0].value == 3.6


def test_the_slowest_site_and_its_cost_in_status_and_metrics() -> None:
    """Each worker's compute per step and per block application (its group's size known
    from the split), the slowest named with the share of the others' pace it leaves."""
    st = RunState(
        run_id="r", P=3, steps=4, strategy="fedavg", num_rounds=2, layers=(6, 4, 2), loops=2
    )
    assert st.status_doc()["pace"] is None  # nothing measured yet
    figures = {0: {"compute_s": 1.2}, 1: {"compute_s": 2.4}, 2: {"compute_s": 0.6}}
    st.record_round(1, 1.5, 1.4, workers={r: {"train_s": 1.4, **f} for r, f in figures.items()},
                    steps=2)  # fmt: skip
    doc = st.status_doc()
    w1 = doc["workers"][1]
    assert w1["layers"] == 4 and w1["step_compute_s"] == 1.2
    assert w1["block_s"] == 1.2 / (2 * 3 * 4)  # L · P applications of 4 blocks per step
    assert doc["pace"] == {
        "slowest": "worker-1",
        "share": 0.5,
        "step_compute_s": 1.2,
        "others_s": 0.6,
        "summary": "worker-1 holds the ring to 0.50 of the others' pace",
    }
    fams = {f.name: f for f in text_string_to_metric_families(st.prometheus())}
    (pace,) = fams["mobius_ring_pace_share"].samples
    assert pace.labels["slowest"] == "worker-1" and pace.value == 0.5
    blocks = {s.labels["rank"]: s.value for s in fams["mobius_worker_block_seconds"].samples}
    assert blocks["2"] == 0.3 / (2 * 3 * 2)
    console = Console(record=True, width=200)
    render_status(doc, console)
    text = console.export_text()
    assert "pace: worker-1 holds the ring to 0.50 of the others' pace" in text
    assert "ms/block" in text and "50" in text  # worker-1: 1.2 s / 24 applications


def test_where_a_steps_time_went_in_status_and_metrics() -> None:
    """The latest round per step: the slowest worker's compute, wait and other training
    time, and the barrier (the round's wall time outside the slowest worker's training)."""
    st = RunState(run_id="r", P=2, steps=8, strategy="fedavg", num_rounds=2)
    assert st.status_doc()["timeline"] is None
    slow = {"train_s": 2.0, "compute_s": 1.2, "wait_s": 0.4}
    st.record_round(1, 3.0, 2.0, workers={0: {"train_s": 1.5, "compute_s": 1.4}, 1: slow},
                    steps=4)  # fmt: skip
    t = st.status_doc()["timeline"]
    assert t["round"] == 1 and t["step_s"] == 0.75 and t["compute_s"] == 0.3
    assert t["wait_s"] == 0.1 and abs(t["other_s"] - 0.1) < 1e-12 and t["barrier_s"] == 0.25
    assert t["summary"] == "step 0.750 s: compute 0.300, wait 0.100, other 0.100, barrier 0.250"
    fams = {f.name: f for f in text_string_to_metric_families(st.prometheus())}
    parts = {s.labels["part"]: s.value for s in fams["mobius_step_part_seconds"].samples}
    assert parts == {"compute": 0.3, "wait": 0.1, "other": t["other_s"], "barrier": 0.25}
    console = Console(record=True, width=200)
    render_status(st.status_doc(), console)
    assert "time per step, round 1: step 0.750 s: compute 0.300" in console.export_text()


def test_each_rings_health_in_status_metrics_and_the_cli() -> None:
    """R = 2 rings of 2: per-worker series carry the ring; a lost worker of ring 1 stalls
    ring 1 (its edges down, named in the reason) while ring 0 stays healthy; once it
    restores ring 1 is restoring, and both read healthy when it is back."""
    st = RunState(run_id="r", P=4, steps=4, strategy="fedavg", num_rounds=4, rings=2)
    st.set(phase="training")
    health = st.status_doc()["ring_health"]
    assert [h["state"] for h in health] == ["waiting", "waiting"]
    assert health[1]["workers"] == [2, 3] and health[1]["reason"].startswith("worker-2 not")
    for g in range(4):
        st.update_worker(g, state="registered")
        st.update_worker(g, state="training", step=3 + g, edges={"out": {"state": "up"}})
    doc = st.status_doc()
    assert [(h["state"], h["step"], h["edges_up"]) for h in doc["ring_health"]] == [
        ("healthy", 3, 2),
        ("healthy", 5, 2),
    ]
    incident = dict(kind="worker lost", what="w3", rank=3, edge=None, round=1, detected_at=0.0,
                    detection_s=0.1)  # fmt: skip
    st.lose_worker(3, incident)
    doc = st.status_doc()
    ring0, ring1 = doc["ring_health"]
    assert ring0["state"] == "healthy" and ring0["healthy"]
    assert ring1["state"] == "stalled" and not ring1["healthy"] and ring1["edges_up"] == 0
    assert ring1["reason"] == ("worker-3 lost; worker-2 → worker-3 down; worker-3 → worker-2 down")
    fams = {f.name: f for f in text_string_to_metric_families(st.prometheus())}
    assert fams["mobius_rings"].samples[0].value == 2
    up = {(s.labels["rank"], s.labels["ring"]): s.value for s in fams["mobius_worker_up"].samples}
    assert up == {("0", "0"): 1, ("1", "0"): 1, ("2", "1"): 1, ("3", "1"): 0}
    for name, want in (("mobius_ring_healthy", {"0": 1, "1": 0}),
                       ("mobius_ring_stalled", {"0": 0, "1": 1}),
                       ("mobius_ring_edges_up", {"0": 2, "1": 0})):  # fmt: skip
        assert {s.labels["ring"]: s.value for s in fams[name].samples} == want, name
    states = {(s.labels["ring"], s.labels["state"]) for s in fams["mobius_ring_state"].samples
              if s.value == 1}  # fmt: skip
    assert states == {("0", "healthy"), ("1", "stalled")}
    console = Console(record=True, width=200)
    render_status(json.loads(json.dumps(doc)), console)
    text = console.export_text()
    assert "workers: 2 rings" in text and re.search(r"│ 1\s+│ 2–3\s+│ stalled\s+│ 5\s+│ 0/2", text)
    # the progress line of `up` and `testbed up`: only the rings that are not healthy
    assert ring_summary(doc) == f"ring 1 stalled ({ring1['reason']})"
    st.update_worker(3, state="rejoining")
    st.update_worker(3, state="restoring")
    assert [h["state"] for h in st.status_doc()["ring_health"]] == ["healthy", "restoring"]
    st.update_worker(3, state="recovered")
    assert [h["state"] for h in st.status_doc()["ring_health"]] == ["healthy", "healthy"]
    assert ring_summary(st.status_doc()) == ""
    st.set(phase="training")
    st.finish(Phase.DONE)
    assert [h["state"] for h in st.status_doc()["ring_health"]] == ["ended", "ended"]


def test_one_ring_reports_its_health_without_a_rings_table() -> None:
    st = busy_state()
    (h,) = st.status_doc()["ring_health"]
    assert h["ring"] == 0 and h["workers"] == [0, 1] and h["edges"] == 2
    console = Console(record=True, width=200)
    render_status(json.loads(json.dumps(st.status_doc(), default=str)), console)
    assert " rings " not in console.export_text() and ring_summary(st.status_doc()) == ""


def test_history_json_is_rewritten_at_most_every_interval_and_at_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """metrics.jsonl gets every round's line; history.json (the whole history) is rewritten
    at most every HISTORY_EVERY_S while the run goes, at once at a checkpoint and at the end,
    so a round's cost does not grow with the run's length; a round's line reads only its
    own steps, the same rows as the whole history's."""
    from mobius_fed.coordinator import recorder as rec
    from mobius_fed.strategies import RoundPlan

    now = [100.0]
    monkeypatch.setattr(rec.time, "monotonic", lambda: now[0])
    state = RunState(run_id="r", P=2, steps=40, strategy="fedavg", num_rounds=40)
    recorder = rec.RunRecorder(tmp_path, state, RoundPlan(40, 1, 0, checkpoint_every=0))
    history = tmp_path / rec.HISTORY_FILE
    written: list[int] = []
    for step in range(40):
        for origin in (0, 1):
            state.record_losses(origin, step, [float(step + origin)])
        recorder._pending_line = {"round": step + 1, "step": step + 1}
        recorder.flush()
        written.append(len(json.loads(history.read_text())["steps"]))
        now[0] += 0.25  # four rounds a second
    assert [r["round"] for r in map(json.loads, (tmp_path / rec.METRICS_FILE).open())] == list(
        range(1, 41)
    )
    assert written == [1 + 4 * (i // 4) for i in range(40)]  # once a second, not each round
    recorder.write_history()  # a checkpoint: at once
    assert len(json.loads(history.read_text())["steps"]) == 40
    assert state.step_rows(10, 13) == state.history_doc()["steps"][10:13]
    assert state.step_rows(10, 13)[0] == {"step": 10, "loss": 10.5, "origin_losses": [10.0, 11.0]}
