"""Commitments over real processes and mTLS (docs/security.md "Commitments"): a coordinator
and P ``mobius-worker`` processes sign and check the digests of every ring frame. A clean
run equals the reference engine exactly and records no incident; a site that sends a
frame other than the one it commits is named with its hop within that step; a forged,
missing or late commitment is a named incident, and the run neither fails nor waits.
Unit tests of the pieces: tests/test_commitments.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from mobius_fed.config import TrainConfig
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.transport.commitments import EVAL, TRAIN, frame_hops
from tests.test_er_sync_ring import check_exact

pytestmark = pytest.mark.slow  # a coordinator and 2-3 worker processes (6 s each here)
logging.getLogger("flwr").setLevel(logging.WARNING)
BASE = dict(preset="cpu-tiny", batch_size=4, optimizer="adamw", sync_every=1)


class _EvilFederation(LocalFederation):
    """The last worker runs tests/evil_worker.py (its lie in ``EVIL_*`` of the env)."""

    def worker_cmd(self, i: int) -> list[str]:
        cmd = super().worker_cmd(i)
        if i == self.train.workers - 1:
            cmd[1:3] = ["-m", "tests.evil_worker"]
        return cmd


def _run(fed: LocalFederation) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start ``fed``, wait for its end; the final status (done) and the history."""
    fed.prepare().start()
    try:
        final = fed.wait(timeout=300)
        hist = fed.rest("/v1/history")
    finally:
        fed.stop()
    assert final["phase"] == "done", (final.get("error"), fed.tail("coordinator", 40))
    return final, hist


def _hops(train: TrainConfig, phase: int, steps: list[int]) -> int:
    micros = train.micro_batches * (train.eval_batches if phase == EVAL else 1)
    return sum(
        len(route) - 1
        for n in steps
        for _, route in frame_hops(train.order, train.P, train.loops, micros, phase, n)
    )


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param({"order": "ordered", "micro_batches": 2}, id="ordered-relays-M2"),
        pytest.param({"wire": {"fwd": "int8", "bwd": "fp8"}}, id="cyclic-lossy-wire"),
    ],
)
def test_a_clean_run_commits_every_frame_and_equals_the_reference(
    tmp_path: Path, setting: dict[str, Any]
) -> None:
    """An ordered ring of 3 (frames relayed round the ring) with 2 micro-batches, and a
    cyclic one whose frames carry a lossy codec's payloads: every hop of every train and
    eval frame is compared and equal, no incident, and the losses are the reference
    engine's bit for bit."""
    train = TrainConfig(**BASE, workers=3, steps=4, eval_every=2, **setting)
    fed = LocalFederation(tmp_path, train, threads=1)
    final, hist = _run(fed)
    c = final["commitments"]
    assert c["incidents"] == [] and c["by_kind"] == {} and c["sites"] == [], c
    evals = [e["step"] for e in hist["evals"]]
    assert evals == [2, 4]
    want = _hops(train, TRAIN, list(range(4))) + _hops(train, EVAL, evals)
    assert c["frames_checked"] == want and c["replies_checked"] == 3 * (4 + 2), c
    # each train reply reports its commitment's size: an entry (a 64-hex-digit digest and
    # the frame's key) per hop end, each train hop's two ends signed by its two sites
    sizes = [f["commitment_bytes"] for r in hist["rounds"] for f in r["workers"].values()]
    assert len(sizes) == 3 * 4 and min(sizes) > 0, hist["rounds"]
    ends = 2 * _hops(train, TRAIN, list(range(4)))
    assert 64 * ends < sum(sizes) < 200 * ends + 600 * len(sizes), (sizes, ends)
    check_exact(fed, hist)


def test_a_site_that_sends_other_bytes_than_it_commits_is_named_with_its_hop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """worker-2 flips the sign of every gradient it sends back from step 3 (inside every
    bound: nothing refuses it), but commits the digest of the gradient it should have sent.
    Its receiver, worker-1, commits what arrived: round 4 (step 3) names the hop
    worker-2 → worker-1, and no round before it names anything."""
    monkeypatch.setenv("EVIL_GRAD", "-1")
    monkeypatch.setenv("EVIL_FROM", "3")
    monkeypatch.setenv("EVIL_COMMIT", "cover")
    train = TrainConfig(**BASE, workers=3, steps=5, eval_every=0)
    final, _ = _run(_EvilFederation(tmp_path, train, threads=1))
    incidents = final["commitments"]["incidents"]
    assert incidents, final["commitments"]
    first = incidents[0]
    assert (first["kind"], first["edge"], first["round"], first["step"]) == (
        "digest mismatch",
        "worker-2 → worker-1",
        4,
        3,
    ), first
    assert all(i["round"] >= 4 and i["kind"] == "digest mismatch" for i in incidents)
    assert {i["edge"] for i in incidents} == {"worker-2 → worker-1"}
    assert final["commitments"]["sites"] == ["worker-1", "worker-2"]


def test_a_site_that_lies_consistently_is_not_caught_by_commitments_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit (docs/security.md "Commitments"): worker-2 flips its gradients' sign from
    step 3 and commits the bytes it really sent. Sender and receiver agree on every hop:
    no incident. Catching this lie takes recomputing what it should have sent."""
    monkeypatch.setenv("EVIL_GRAD", "-1")
    monkeypatch.setenv("EVIL_FROM", "3")
    train = TrainConfig(**BASE, workers=3, steps=5, eval_every=0)
    fed = _EvilFederation(tmp_path, train, threads=1)
    final, hist = _run(fed)
    assert final["commitments"]["incidents"] == [], final["commitments"]
    with pytest.raises(AssertionError):  # and yet the run is not the honest one
        check_exact(fed, hist)


def test_forged_missing_and_late_commitments_are_named_and_lose_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """worker-1 of 2 signs round 2's commitment with another key, sends none with round 3
    and replays round 2's with round 4: three incidents naming it, in those rounds; the
    run ends done, its losses the reference's bit for bit."""
    monkeypatch.setenv("EVIL_COMMIT", "forge@2,omit@3,late@4")
    train = TrainConfig(**BASE, workers=2, steps=5, eval_every=5)
    fed = _EvilFederation(tmp_path, train, threads=1)
    final, hist = _run(fed)
    named = [(i["round"], i["kind"], i["site"]) for i in final["commitments"]["incidents"]]
    assert named == [
        (2, "forged commitment", "worker-1"),
        (3, "missing commitment", "worker-1"),
        (4, "late commitment", "worker-1"),
    ], final["commitments"]
    check_exact(fed, hist)
