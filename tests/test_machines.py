"""The four state machines: every table edge is accepted, every other move is refused and
logged, and the states serialise as the words status, gRPC and metrics always carried."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from mobius_fed.coordinator.grid import IncidentRaised
from mobius_fed.coordinator.state import RunState
from mobius_fed.machines import (
    EDGE,
    INCIDENT,
    MACHINES,
    PHASE,
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
