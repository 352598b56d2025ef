"""A failed audit's rollback, the pieces (docs/audits.md "Eviction and rollback"): which
checkpoint the run rolls back to, and which manifests pruning keeps for it. The whole
path over real processes: tests/test_audits_ring.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mobius_fed.coordinator.recovery import Recovery
from mobius_fed.coordinator.rounds import RoundStore, held_for_audit
from mobius_fed.run_reader import MANIFEST, checkpoint_dir, round_dir


def _store(tmp_path: Path, rounds: list[int], open_round: int | None = None) -> RoundStore:
    """A RoundStore over complete manifests of ``rounds`` (nothing else of a run)."""
    store = RoundStore.__new__(RoundStore)
    store.cfg = SimpleNamespace(out_dir=tmp_path)  # type: ignore[assignment]
    store.state = SimpleNamespace(set=lambda **kw: None)  # type: ignore[assignment]
    store.snapshots, store.last_manifest_round = {}, max(rounds)
    store.audit_open = lambda: open_round
    store.rolled_back = lambda rnd: None
    store.cadence = SimpleNamespace(copy_round=max(rounds))  # type: ignore[assignment]
    store.manifests = []
    for r in sorted(rounds):
        d = round_dir(tmp_path, r)
        d.mkdir(parents=True)
        (d / MANIFEST).write_text(json.dumps({"round": r, "workers": {}}))
        store.manifests.insert(0, d / MANIFEST)
    return store


def _on_disk(tmp_path: Path) -> list[int]:
    return sorted(int(d.name[6:]) for d in checkpoint_dir(tmp_path).glob("round-*"))


def test_the_manifest_held_for_an_audit_is_the_newest_before_its_round(tmp_path: Path) -> None:
    complete = [round_dir(tmp_path, r) for r in (8, 6, 4, 2)]  # newest first
    assert held_for_audit(complete, None) is None  # no audit open: nothing held
    assert held_for_audit(complete, 5) == round_dir(tmp_path, 4)
    assert held_for_audit(complete, 4) == round_dir(tmp_path, 2)  # before, never at, r
    assert held_for_audit(complete, 9) == round_dir(tmp_path, 8)
    assert held_for_audit(complete, 2) is None  # none before: the start, round 0


def test_pruning_keeps_the_checkpoint_an_open_audit_may_roll_back_to(tmp_path: Path) -> None:
    """keep 2 of rounds 1..6 with round 3's audit open: 5, 6 and 2 (the one before 3)."""
    store = _store(tmp_path, [1, 2, 3, 4, 5, 6], open_round=3)
    store.prune(2)
    assert _on_disk(tmp_path) == [2, 5, 6]
    assert sorted(int(m.parent.name[6:]) for m in store.manifests) == [2, 5, 6]
    store.audit_open = lambda: None  # its verdict came (passed): the next prune drops it
    store.prune(2)
    assert _on_disk(tmp_path) == [5, 6]


def test_pruning_holds_nothing_more_when_the_kept_ones_cover_the_audit(tmp_path: Path) -> None:
    store = _store(tmp_path, [1, 2, 3, 4], open_round=4)  # round 3 is kept anyway
    store.prune(2)
    assert _on_disk(tmp_path) == [3, 4]


def test_a_rollback_before_newer_checkpoints_drops_them(tmp_path: Path) -> None:
    store = _store(tmp_path, [1, 2, 3, 4])
    store.forget_after(2)
    assert _on_disk(tmp_path) == [1, 2]
    assert [m.parent.name for m in store.manifests] == ["round-000002", "round-000001"]
    assert store.last_manifest_round == 2
    assert store.cadence.copy_round is None  # status: no copy until the next checkpoint


def _recovery(store: Any, before: int | None) -> Recovery:
    rec = Recovery.__new__(Recovery)
    rec.store, rec.P, rec.before = store, 2, before
    return rec


def test_the_round_restored_after_a_failed_audit_is_before_the_audited_one(
    tmp_path: Path,
) -> None:
    """Manifests of rounds 2, 4 and 6 (every worker holds them): no cap takes 6; a failed
    audit of round 6 takes 4, of round 4 takes 2, of round 2 the start."""
    store = _store(tmp_path, [2, 4, 6])
    have = {0: {0, 2, 4, 6}, 1: {0, 2, 4, 6}}
    refused: dict[int, set[int]] = {0: set(), 1: set()}
    assert _recovery(store, None)._choose_round(have, refused)[0] == 6
    assert _recovery(store, 6)._choose_round(have, refused)[0] == 4
    assert _recovery(store, 5)._choose_round(have, refused)[0] == 4
    assert _recovery(store, 4)._choose_round(have, refused)[0] == 2
    assert _recovery(store, 2)._choose_round(have, refused)[0] == 0


def test_two_failed_audits_roll_back_before_the_older() -> None:
    rec = Recovery.__new__(Recovery)
    rec.before = None
    rec.roll_back_before(7)
    rec.roll_back_before(4)
    rec.roll_back_before(9)
    assert rec.before == 4


def test_a_rollback_drops_the_audits_asked_and_the_later_commitments() -> None:
    """After a rollback to round 4 no site is asked for a round it may no longer hold as it
    trained it (no false ``audit refused``); those asks count as skipped."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.coordinator.audits import Audits

    desk = Audits(TrainConfig(preset="cpu-tiny", workers=2), lambda r: None, str, print, 9)
    desk._asks = {(0, 3): 0.0, (1, 6): 0.0}
    desk._kept = {(0, 3): None, (0, 5): None, (1, 6): None}  # type: ignore[dict-item]
    desk.rolled_back(4)
    assert desk.asks() == "" and desk.skipped == 2 and desk.oldest_open() is None
    assert list(desk._kept) == [(0, 3)]
    desk.close()


def test_a_worker_forgets_every_later_round_on_disk_when_it_restores_an_earlier_one(
    tmp_path: Path,
) -> None:
    """After a rollback to round 3 a worker keeps no file of rounds 4 and 5 (a timeline being
    redone): kept, they would outrank the redone rounds' new checkpoints when pruning, which
    would then delete each new one as it is written."""
    from mobius_fed.worker.flower_client import Snapshots, barrier_path, checkpoint_path

    snaps = Snapshots(tmp_path)
    for rnd in (2, 3, 4, 5):
        checkpoint_path(tmp_path, rnd).write_bytes(b"x")
        barrier_path(tmp_path, rnd).write_bytes(b"x")
        snaps.memory[rnd] = {}
    snaps.forget_after(3)
    assert snaps.rounds() == {0, 2, 3} and set(snaps.memory) == {2, 3}
    checkpoint_path(tmp_path, 4).write_bytes(b"x")  # the redone round 4
    snaps.prune_disk(2)
    assert sorted(p.name for p in tmp_path.glob("round-*")) == [
        "round-000003.ckpt",
        "round-000004.ckpt",
    ]
