"""Audits by recomputation over real processes and mTLS (docs/audits.md): a coordinator and
3 ``mobius-worker`` processes, every round of every site audited (``audit.rate = 1``). A
clean run equals the reference engine exactly with every audit passed; a site that lies
from its first frame and commits what it sent (the commitments agree on every hop) is
named ``audit failed``, and with ``--evict-suspects`` its rank goes to a standby. Unit
tests of the pieces: tests/test_audits.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from mobius_fed.config import TrainConfig
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.run_reader import checkpoint_dir
from tests.test_commitments_ring import _EvilFederation, _run
from tests.test_er_sync_ring import check_exact

logging.getLogger("flwr").setLevel(logging.WARNING)
BASE: dict[str, Any] = dict(
    preset="cpu-tiny", batch_size=4, optimizer="adamw", sync_every=1, eval_every=0,
    audit={"rate": 1.0},
)  # fmt: skip


@pytest.mark.slow(reason="a coordinator and 3 worker processes, 4 rounds")
def test_a_clean_run_with_every_round_audited_equals_the_reference(tmp_path: Path) -> None:
    """Rounds 1..3 of each of the 3 sites are asked for and replayed (the last round has no
    next order to ask in): every frame each group sent is recomputed bit for bit, no
    incident, and the run's losses are the reference engine's."""
    train = TrainConfig(**BASE, workers=3, steps=4)
    fed = LocalFederation(tmp_path, train, threads=1)
    final, hist = _run(fed)
    a = final["audits"]
    assert a["incidents"] == [] and a["suspects"] == [] and a["pending"] == 0, a
    assert a["asked"] == 9 and a["passed"] == 9, a
    assert a["frames_compared"] == 9 * 5, a  # F_i sends on 3 hidden states, 2 gradients
    assert final["commitments"]["incidents"] == []
    check_exact(fed, hist)


@pytest.mark.slow(reason="a coordinator and 3 worker processes, 4 rounds")
def test_a_sign_flip_from_the_first_frame_fails_its_first_audit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """worker-2 flips the sign of every gradient it sends from step 0 and commits the
    bytes it sent: no bound refuses them and sender and receiver agree on every hop, but
    the replay of its group's round 1 names it, at its first step. Its neighbours, which
    computed honestly on what it sent, pass their audits."""
    monkeypatch.setenv("EVIL_GRAD", "-1")
    monkeypatch.setenv("EVIL_FROM", "0")
    train = TrainConfig(**BASE, workers=3, steps=4)
    final, _ = _run(_EvilFederation(tmp_path, train, threads=1))
    assert final["commitments"]["incidents"] == [], final["commitments"]
    a = final["audits"]
    assert a["suspects"] == ["worker-2"], a
    first = a["incidents"][0]
    assert (first["kind"], first["site"], first["round"], first["step"]) == (
        "audit failed", "worker-2", 1, 0,
    ), first  # fmt: skip
    assert "BACKWARD" in first["what"], first
    assert {i["site"] for i in a["incidents"]} == {"worker-2"}
    assert a["passed"] == 6, a  # worker-0's and worker-1's rounds 1..3


def _scaling_site_with_a_standby(
    root: Path, monkeypatch: pytest.MonkeyPatch, start: int, steps: int
) -> LocalFederation:
    """3 workers, a checkpoint every round, one standby, ``--evict-suspects``; worker-2
    scales the hidden states it sends ×10 from step ``start`` on (and commits them)."""
    monkeypatch.setenv("EVIL_SCALE", "10")
    monkeypatch.setenv("EVIL_FROM", str(start))
    monkeypatch.setenv("MOBIUS_EVICT_SUSPECTS", "true")
    train = TrainConfig(**BASE, workers=3, steps=steps)
    return _EvilFederation(root, train, checkpoint_every=1, threads=1, standbys=1)


@pytest.mark.slow(reason="a coordinator, 3 worker processes and a standby")
def test_a_site_scaling_its_states_from_the_first_frame_is_evicted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """worker-2 scales every hidden state it sends ×10 from step 0 (its first frames set
    the bounds' medians: nothing is refused) and commits them. Its round-1 audit fails;
    with ``--evict-suspects`` standby-0 takes rank 2 and the run finishes."""
    final, _ = _run(_scaling_site_with_a_standby(tmp_path, monkeypatch, start=0, steps=5))
    a = final["audits"]
    assert a["suspects"] == ["worker-2"], a
    assert a["incidents"][0]["kind"] == "audit failed", a
    assert "FORWARD" in a["incidents"][0]["what"], a
    (h,) = final["handovers"]
    assert h["rank"] == 2 and "audit failed" in h["why"], h
    assert final["workers"][2]["identity"] == h["standby"]


@pytest.mark.slow(reason="a coordinator, 3 worker processes and a standby, 10 rounds")
def test_an_eviction_for_a_failed_audit_rolls_back_before_the_audited_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """worker-2 is honest for rounds 1-2 and scales its hidden states ×10 from step 2
    (round 3) on. Round 3's audit fails a few rounds later; the eviction rolls the run
    back to round 2, the newest checkpoint before the audited round (not the newest one,
    which holds the lie's effect on the honest groups), and redoes every step since."""
    fed = _scaling_site_with_a_standby(tmp_path, monkeypatch, start=2, steps=10)
    final, _ = _run(fed)
    first = final["audits"]["incidents"][0]
    assert (first["kind"], first["site"], first["round"]) == ("audit failed", "worker-2", 3)
    (h,) = final["handovers"]
    assert h["rank"] == 2 and "before round 3" in h["why"], h
    (inc,) = [i for i in final["incidents"] if i["rank"] == 2]
    assert inc["state"] == "recovered" and inc["rollback_round"] == 2, inc
    in_flight = inc["round"] or inc["rollback_round"]
    assert in_flight > 3 and inc["steps_redone"] == in_flight - 2, inc  # sync_every 1
    rounds = sorted(int(d.name[6:]) for d in checkpoint_dir(fed.coordinator_out).glob("round-*"))
    assert rounds == list(range(1, 11)), rounds  # the lie's checkpoints redone, none left
    assert final["step"] == 10
