"""The four state machines: every table edge is accepted, every other move is refused and
logged, and the states serialise as the words status, gRPC and metrics always carried."""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import time

import pytest

from mobius_fed.coordinator.grid import IncidentRaised
from mobius_fed.coordinator.state import RunState
from mobius_fed.machines import (
    EDGE,
    HEARTBEAT_SETS,
    INCIDENT,
    MACHINES,
    PHASE,
    REPORTED_STATES,
    WORKER,
    EdgeState,
    IncidentState,
    Machine,
    Phase,
    WorkerState,
)


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_every_edge_of_the_table_is_taken_and_every_other_refused(machine: Machine, caplog):
    for old, new in itertools.product(machine.states, repeat=2):
        caplog.clear()
        with caplog.at_level(logging.ERROR, "mobius.machines"):
            got = machine.step(old, new, "x")
        if old == new or new in machine.edges[old]:
            assert got == new and not caplog.records, (old, new)
        else:
            assert got == old, (old, new)
            assert f"illegal {machine.name} transition of x: {old} → {new}" in caplog.text


def test_the_tables_hold_the_recovery_path_and_end_for_good():
    assert [PHASE.allowed(a, b) for a, b in [("waiting", "training"), ("done", "training")]] == [
        True,
        False,
    ]
    walk = ["training", "lost", "rejoining", "restoring", "recovered", "training", "finished"]
    assert all(WORKER.allowed(a, b) for a, b in itertools.pairwise(walk))
    for ended in (WorkerState.FINISHED, WorkerState.STOPPED):
        assert WORKER.edges[ended] == frozenset()
    assert INCIDENT.edges[IncidentState.RECOVERED] == frozenset()
    assert EDGE.allowed("up", "reconnecting") and not EDGE.allowed("down", "reconnecting")


def test_states_serialise_as_their_words():
    doc = {"phase": Phase.RECOVERING, "state": WorkerState.LOST, "edge": EdgeState.UP}
    assert json.loads(json.dumps(doc)) == {"phase": "recovering", "state": "lost", "edge": "up"}
    assert [p.value for p in Phase] == ["waiting", "training", "recovering", "done", "failed",
                                        "stopped"]  # fmt: skip
    assert len(WorkerState) == 12 and {s.value for s in IncidentState} == {
        "open",
        "recovered",
        "failed",
    }


def test_run_state_refuses_an_illegal_move_and_keeps_the_figures(caplog):
    st = RunState(run_id="r", P=2, steps=4, strategy="fedavg")
    with caplog.at_level(logging.ERROR, "mobius.machines"):
        assert not st.move_worker(0, WorkerState.RECOVERED, step=3)
    assert st.workers[0].state == "expected" and st.workers[0].step == 0
    assert "illegal worker state transition of worker-0: expected → recovered" in caplog.text
    st.update_worker(0, state="training", last_loss=1.5)  # refused; the loss is kept
    assert st.workers[0].state == "expected" and st.workers[0].last_loss == 1.5
    assert st.move_worker(0, WorkerState.REGISTERED) and st.move_worker(1, WorkerState.REGISTERED)
    assert st.move_phase(Phase.TRAINING) and not st.move_phase(Phase.WAITING)
    st.finish(Phase.DONE)
    assert st.status_doc()["phase"] == "done"
    assert [w["state"] for w in st.status_doc()["workers"]] == ["finished", "finished"]
    inc = st.open_incident(
        kind="worker lost", what="w", rank=0, edge=None, round=1, detected_at=0.0, detection_s=None
    )
    st.update_incident(inc, state=IncidentState.RECOVERED)
    st.update_incident(inc, state=IncidentState.OPEN)  # refused: recovered is final
    assert inc.state == "recovered"


def test_an_incident_carries_the_culprits_last_sign_of_life_as_a_field():
    raised = IncidentRaised("worker lost", "worker-1 lost", 1, last_seen=12.5)
    assert raised.last_seen == 12.5 and IncidentRaised("k", "w", None).last_seen is None


def test_a_lost_worker_and_its_incident_are_one_change_of_the_status(caplog):
    """Whoever reads the status sees a lost worker only together with its open incident and
    the run recovering: never a lost worker in a run that still says training."""
    st = RunState(run_id="r", P=3, steps=4, strategy="fedavg")
    for r in range(3):
        st.move_worker(r, WorkerState.REGISTERED)
        st.move_worker(r, WorkerState.READY)
    st.move_phase(Phase.TRAINING)
    seen: list[tuple] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            doc = st.status_doc()
            seen.append((doc["workers"][2]["state"], doc["phase"], len(doc["incidents"])))

    reader = threading.Thread(target=read)
    reader.start()
    raised = IncidentRaised("worker lost", "worker-2 lost", 2, last_seen=time.time())
    inc = st.lose_worker(2, raised.fields(3, 1))
    stop.set()
    reader.join()
    assert inc is not None and inc.rank == 2 and inc.edge.startswith("worker-1 → worker-2")
    assert st.phase == "recovering" and st.workers[2].state == "lost"
    assert all(ph == "recovering" and n == 1 for s, ph, n in seen if s == "lost"), seen
    assert all(ph == "training" and n == 0 for s, ph, n in seen if s != "lost"), seen


def test_a_heartbeat_word_never_takes_a_worker_back_to_registered(caplog):
    """``registered`` is the coordinator's word (no session yet): a late heartbeat sent
    between two sessions must not move a ready worker back to it."""
    assert "registered" in REPORTED_STATES and "registered" not in HEARTBEAT_SETS
    with caplog.at_level(logging.ERROR, "mobius.machines"):
        assert WORKER.step(WorkerState.READY, WorkerState.REGISTERED) == WorkerState.READY
    assert "ready → registered" in caplog.text


# ------------------------------------------------------------- the worker's own machine
def test_an_illegal_move_of_a_state_cell_raises_and_keeps_the_state():
    from mobius_fed.machines import OWN_WORKER, IllegalTransition, StateCell

    own = StateCell(OWN_WORKER, WorkerState.REGISTERED, "worker-1")
    with pytest.raises(IllegalTransition, match=r"of worker-1: registered → training"):
        own.move(WorkerState.TRAINING)  # no session yet: nothing to train in
    assert own.state == WorkerState.REGISTERED
    own.move(WorkerState.READY)
    own.move(WorkerState.TRAINING)
    assert own.state == "training"
    with pytest.raises(IllegalTransition, match=r"training → evaluating \(allowed: ready, "):
        own.move(WorkerState.EVALUATING)
    for theirs in (WorkerState.LOST, WorkerState.RECOVERED, WorkerState.FINISHED):
        with pytest.raises(IllegalTransition):  # the coordinator's words, never the worker's
            own.move(theirs)
    assert own.state == WorkerState.TRAINING
    assert set(OWN_WORKER.edges[WorkerState.READY]) <= set(REPORTED_STATES)


@pytest.mark.slow
def test_the_worker_machine_walks_a_real_runs_states(tmp_path, monkeypatch):
    """A real coordinated run (coordinator + 2 worker processes over mTLS): each worker's
    own state moves through its table only, from registration to the end of the run."""
    from mobius_fed.cli.up import LocalFederation
    from mobius_fed.config import TrainConfig

    monkeypatch.setenv("MOBIUS_LOG_LEVEL", "DEBUG")  # the workers log each move
    train = TrainConfig(preset="cpu-tiny", workers=2, steps=2, batch_size=2, eval_every=2)
    fed = LocalFederation(tmp_path, train, threads=1)
    fed.prepare().start()
    try:
        final = fed.wait(timeout=300)
        assert final["phase"] == "done", (final, fed.tail("coordinator"))
    finally:
        fed.stop()
    for rank in range(2):
        log = (tmp_path / "logs" / f"worker-{rank}.log").read_text()
        assert "illegal" not in log
        moves = re.findall(rf"worker's own state of worker-{rank}: (\w+) → (\w+)", log)
        walk = [moves[0][0]] + [new for _, new in moves]
        assert all(old == prev for (old, _), prev in zip(moves, walk)), moves  # one chain
        assert walk[:4] == ["registered", "ready", "restoring", "ready"], walk  # ring opened
        assert walk.count("training") == 2 and "evaluating" in walk, walk  # 2 rounds, 1 eval
        assert walk[-2:] == ["ready", "registered"], walk  # the session ended with the run
