"""Audits by recomputation, in one process (docs/audits.md): the secret draw, the site's
bounded store, the upload's checks against the commitments, and the replay of an honest
round equal, frame for frame, to what its site sent. Over processes and mTLS:
tests/test_audits_ring.py."""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.auditor import FAILED, MISMATCH, Kept, audit
from mobius_fed.coordinator.audits import AuditDraw, Audits
from mobius_fed.data import SiteData
from mobius_fed.engine.audit_replay import decode_frame, state_digest, unauditable
from mobius_fed.messages import AUDIT_STATE, AUDIT_UPLOAD, Signed
from mobius_fed.transport.certs import init_certs
from mobius_fed.transport.codec import encode_frames
from mobius_fed.transport.commitments import RECEIVED, SENT, TRAIN, Commitment, sign
from mobius_fed.transport.flower_wire import worker_node_id
from mobius_fed.transport.tls import certificate_identity
from mobius_fed.worker.audits import AuditStore, frame_name, frame_of, parse_asks, state_body
from mobius_fed.worker.commitments import FrameLedger
from mobius_fed.worker.executor import RingExecutor
from mobius_fed.worker.frames import FORWARD, FrameKey

pytestmark = pytest.mark.usefixtures("one_torch_thread")
P = 2
RING = "ring-a"
CFG = dict(preset="cpu-tiny", batch_size=4, optimizer="adamw", sync_every=1, eval_every=0)


# ------------------------------------------------------------------- the draw


def test_the_draw_takes_its_rate_and_is_a_secret() -> None:
    """About ``rate`` of all (round, rank) pairs are drawn; another secret draws others,
    and nothing public (round, rank, run id) gives them."""
    pairs = [(r, k) for r in range(2000) for k in range(5)]
    a, b = AuditDraw(0.05, b"a" * 32), AuditDraw(0.05, b"b" * 32)
    drawn_a = {p for p in pairs if a.drawn(*p)}
    drawn_b = {p for p in pairs if b.drawn(*p)}
    assert 400 < len(drawn_a) < 600 and 400 < len(drawn_b) < 600
    assert len(drawn_a & drawn_b) < 60  # independent: about 5 % of 5 %
    assert drawn_a == {p for p in pairs if AuditDraw(0.05, b"a" * 32).drawn(*p)}
    fresh = [AuditDraw(0.05) for _ in range(2)]  # a random secret per coordinator
    assert {p for p in pairs if fresh[0].drawn(*p)} != {p for p in pairs if fresh[1].drawn(*p)}
    assert not any(AuditDraw(0.0).drawn(*p) for p in pairs[:500])
    assert all(AuditDraw(1.0).drawn(*p) for p in pairs[:500])


def test_asks_parse_and_bad_parts_are_left_out() -> None:
    assert parse_asks("2:7,0:3") == [(2, 7), (0, 3)]
    assert parse_asks("") == [] and parse_asks("x:1,2:,3:4") == [(3, 4)]


# ------------------------------------------------------------ an in-process ring


class _Links:
    """Ring links in memory: a frame's pieces, encoded as the wire encodes them, go into
    the sender's and the receiver's ledgers (digests and, for audits, pieces), its tensor
    into the receiver's inbox."""

    def __init__(self, ring: _Ring, rank: int) -> None:
        self.ring, self.rank = ring, rank
        self.inbox = self

    def get(self, key: FrameKey, timeout: float, what: str) -> torch.Tensor:
        return self.ring.boxes[self.rank][key].get(timeout=timeout)

    def send_tensor(self, key: FrameKey, tensor: torch.Tensor) -> None:
        cfg = self.ring.cfg
        ex = self.ring.executors[self.rank]
        dest = ex.rules.consumer(key.origin, key.tick)
        if key.direction != FORWARD:
            dest = ex.rules.producer(key.origin, key.tick)
        header = dict(
            run_id=RING, step=key.step, origin=key.origin, tick=key.tick, micro=key.micro,
            direction=key.direction, phase=key.phase,
        )  # fmt: skip
        pieces = list(encode_frames(tensor=tensor, wire=cfg.wire_dtype, chunk_bytes=4096, **header))
        digest = hashlib.sha256(b"".join(pieces)).hexdigest()
        self.ring.ledgers[self.rank].record(key, SENT, dest, digest, list(pieces))
        theirs = self.ring.ledgers[dest]
        for k, data in enumerate(pieces):
            theirs.piece(key.direction, key, k, len(pieces), data)
        theirs.record(key, RECEIVED, self.rank, digest)
        got = decode_frame(cfg, frame_of(key), pieces)
        self.ring.boxes[dest][key].put(got)


class _Ring:
    def __init__(self, cfg: TrainConfig, sites: list[Path], lie: float = 1.0) -> None:
        self.cfg = cfg
        self.executors = [
            RingExecutor(cfg, i, SiteData(sites[i], cfg.model().seq_len), RING) for i in range(P)
        ]
        self.stores = [AuditStore(keep=2) for _ in range(P)]
        self.ledgers = [FrameLedger(0, store) for store in self.stores]
        self.boxes: list[dict[FrameKey, queue.Queue]] = [_Boxes() for _ in range(P)]
        self.digests: dict[tuple[int, int], str] = {}
        for ex, store in zip(self.executors, self.stores):
            ex.links = _Links(self, ex.rank)  # type: ignore[assignment]
            ex.audit = store
        if lie != 1.0:  # the last worker scales what it sends, and commits what it sent
            liar = self.executors[-1]
            send = liar._send
            liar._send = lambda key, t: send(key, t * lie)  # type: ignore[method-assign]

    def round(self, rnd: int, steps: int = 1) -> None:
        first = self.executors[0].step
        for ex, store in zip(self.executors, self.stores):
            self.digests[ex.rank, rnd] = store.open_round(RING, rnd, first, ex.group_state())
        threads = [
            threading.Thread(target=lambda e=ex: [e.train_step() for _ in range(steps)])
            for ex in self.executors
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for store in self.stores:
            store.close_round(first + steps)

    def kept(self, rank: int, rnd: int, first: int, end: int) -> Kept:
        entries = {(e.frame, e.way): e for e in self.ledgers[rank].take(TRAIN, first, end)}
        return Kept("w", RING, first, end, entries, self.digests[rank, rnd])


class _Boxes(dict):
    def __missing__(self, key: FrameKey) -> queue.Queue:
        self[key] = q = queue.Queue()
        return q


def _upload(ring: _Ring, rank: int, rnd: int) -> dict[str, Any]:
    up = ring.stores[rank].upload(rnd)
    assert up is not None
    return dict(up)


@pytest.fixture(scope="module")
def honest(site_dirs: list[Path]) -> tuple[_Ring, list[Kept], list[dict[str, Any]]]:
    """Two rounds of one step each on an honest ring of 2: round 0's commitments and
    uploads."""
    cfg = TrainConfig(**CFG, workers=P)
    ring = _Ring(cfg, site_dirs)
    ring.round(0)
    kept = [ring.kept(i, 0, 0, 1) for i in range(P)]
    ring.round(1)
    return ring, kept, [_upload(ring, i, 0) for i in range(P)]


def test_an_honest_round_replays_to_the_frames_its_site_sent(honest: Any) -> None:
    """Every frame each honest worker's group sent in round 0 is recomputed from its
    uploaded state and received frames bit for bit, and the state after the round is the
    one it signed at round 1's start."""
    ring, kept, uploads = honest
    for i in range(P):
        found = audit(ring.cfg, i, 0, kept[i], uploads[i], ring.digests[i, 1])
        assert found.kind is None, found
        assert found.compared == 3  # F_i: two states and one gradient leave it
    assert unauditable(ring.cfg) is None


def test_an_upload_other_than_the_commitment_is_a_mismatch(honest: Any) -> None:
    ring, kept, uploads = honest
    up = dict(uploads[1])
    name = next(k for k in up if k.startswith("received|"))
    piece = bytearray(up[name][0])
    piece[-1] ^= 1
    up[name] = [bytes(piece), *up[name][1:]]
    found = audit(ring.cfg, 1, 0, kept[1], up)
    assert found.kind == MISMATCH and "is not what it committed" in found.what, found
    other = Kept(**{**kept[1].__dict__, "state": "0" * 64})
    assert audit(ring.cfg, 1, 0, other, uploads[1]).kind == MISMATCH
    lacking = {k: v for k, v in uploads[1].items() if not k.startswith("received|")}
    found = audit(ring.cfg, 1, 0, kept[1], lacking)
    assert found.kind == MISMATCH and "lacks" in found.what, found
    assert audit(ring.cfg, 1, 1, kept[1], uploads[1]).kind == MISMATCH  # another round


def test_a_state_that_is_not_what_the_round_made_fails(honest: Any) -> None:
    ring, kept, uploads = honest
    found = audit(ring.cfg, 0, 0, kept[0], uploads[0], next_state="f" * 64)
    assert found.kind == FAILED and "next round" in found.what, found


def test_the_store_keeps_only_its_last_rounds() -> None:
    store = AuditStore(keep=2)
    state = {"group": {"w": torch.ones(2)}, "group_opts": []}
    for rnd in range(5):
        assert store.open_round(RING, rnd, rnd, state) == state_digest(state)
        store.frame((rnd, TRAIN, FORWARD, 0, 1, 0), SENT, [b"x"])
        store.frame((rnd + 1, TRAIN, FORWARD, 0, 1, 0), RECEIVED, [b"early"])  # next step's
        store.close_round(rnd + 1)
    assert store.rounds == [3, 4] and store.upload(2) is None
    up = store.upload(4)
    assert up is not None
    assert up[frame_name(SENT, (4, TRAIN, FORWARD, 0, 1, 0))] == [b"x"]
    assert up[frame_name(RECEIVED, (4, TRAIN, FORWARD, 0, 1, 0))] == [b"early"]


def test_a_consistent_liar_fails_its_audit(site_dirs: list[Path]) -> None:
    """Worker 1 scales every tensor it sends ×10 and commits what it sent (the
    commitments agree on every hop); the replay of its group names the first frame."""
    cfg = TrainConfig(**CFG, workers=P)
    ring = _Ring(cfg, site_dirs, lie=10.0)
    ring.round(0)
    found = audit(cfg, 1, 0, ring.kept(1, 0, 0, 1), _upload(ring, 1, 0))
    assert found.kind == FAILED and "other values" in found.what, found
    assert found.step == 0


# ------------------------------------------------------------ the coordinator's desk


def _desk_reply(rank: int, content: dict[str, Any]) -> Any:
    return SimpleNamespace(
        metadata=SimpleNamespace(src_node_id=worker_node_id(rank)), content=RecordDict(content)
    )


def test_the_desk_asks_audits_and_names_a_refusal(site_dirs: list[Path], tmp_path: Path) -> None:
    """Rate 1, the last round 1 (nothing drawn after it): both sites are asked for round
    0; worker-0's upload passes its audit in the background, worker-1 sends none and is
    named ``audit refused`` (a suspect, reported once). A garbled upload is a named
    mismatch, never a crash; one that comes after ``timeout_s`` is ``audit timed out``."""
    init_certs(tmp_path / "certs", P)
    nodes = tmp_path / "certs" / "nodes"
    keys = [(nodes / f"worker-{r}" / "tls.key").read_bytes() for r in range(P)]
    certs = [(nodes / f"worker-{r}" / "tls.crt").read_bytes() for r in range(P)]
    cfg = TrainConfig(**{**CFG, "audit": {"rate": 1.0}}, workers=P)
    ring = _Ring(cfg, site_dirs)
    ring.round(0)
    named: list[tuple[int, str]] = []
    desk = Audits(
        cfg, certs.__getitem__, lambda r: f"worker-{r}", lambda r, w, n: named.append((r, w)), 1
    )
    replies = []
    for r in range(P):
        identity = certificate_identity(certs[r])
        entries = tuple(ring.ledgers[r].take(TRAIN, 0, 1))
        desk.commitment(r, 0, Commitment(RING, 0, TRAIN, 0, 1, r, identity, entries))
        body = state_body(RING, 0, 0, r, identity, ring.digests[r, 0])
        replies.append(_desk_reply(r, {AUDIT_STATE: Signed(body, sign(keys[r], body)).to_record()}))
    desk.after_train(0, replies)
    assert desk.asks() == "0:0,1:0"
    assert desk.oldest_open() == 0  # a failure would roll back before round 0's end
    up = ring.stores[0].upload(0)
    desk.after_train(1, [_desk_reply(0, {AUDIT_UPLOAD: up}), _desk_reply(1, {})])
    desk.wait()
    assert desk.oldest_open() is None  # both verdicts out
    st = desk.status()
    assert (st["asked"], st["passed"], st["frames_compared"]) == (2, 1, 3), st
    assert st["by_kind"] == {"audit refused": 1} and st["suspects"] == ["worker-1"], st
    assert [r for r, _ in named] == [1] and "did not upload round 0" in named[0][1]
    desk._asks[0, 0] = time.time()  # asked again: a garbled upload
    desk.after_train(2, [_desk_reply(0, {AUDIT_UPLOAD: ConfigRecord({"round": 0, "state": b"x"})})])
    desk.wait()
    assert desk.status()["by_kind"] == {"audit refused": 1, "upload mismatch": 1}
    desk._asks[0, 0] = time.time() - 2 * cfg.audit.timeout_s  # asked long ago: late
    desk.after_train(3, [_desk_reply(0, {AUDIT_UPLOAD: up})])
    desk.wait()
    assert desk.status()["by_kind"]["audit timed out"] == 1
    assert desk.status()["suspects"] == ["worker-0", "worker-1"]
    desk.close()


def test_an_ordered_ring_with_micro_batches_replays_too(site_dirs: list[Path]) -> None:
    """Order ``ordered`` with 2 micro-batches: worker-1's group hands stream 1's last slot
    to its own home and takes its gradient back without a hop (the upload's local
    frames); two steps in one round replay equal, and a window of one step replays it."""
    cfg = TrainConfig(**{**CFG, "sync_every": 2}, workers=P, order="ordered", micro_batches=2)
    ring = _Ring(cfg, site_dirs)
    ring.round(0, steps=2)
    for i in range(P):
        found = audit(cfg, i, 0, ring.kept(i, 0, 0, 2), _upload(ring, i, 0))
        assert found.kind is None and found.compared > 0, found
    ring.stores[1].window = 1
    up = _upload(ring, 1, 0)
    assert up["end"] == 1


def test_a_round_trained_again_after_a_rollback_is_the_newest_kept() -> None:
    store = AuditStore(keep=2)
    state = {"group": {"w": torch.zeros(1)}, "group_opts": []}
    for rnd in (3, 4, 5, 3):  # rounds 3..5, then a rollback to round 2: round 3 again
        store.open_round(RING, rnd, rnd, state)
        store.close_round(rnd + 1)
    assert store.rounds == [3, 5]


def test_what_cannot_be_audited_says_why() -> None:
    base = dict(preset="cpu-tiny", workers=2)
    assert unauditable(TrainConfig(**base)) is None
    assert "device 'auto'" in str(unauditable(TrainConfig(**base, device="auto")))
    lossy = TrainConfig(**base, wire={"fwd": "int8", "bwd": "fp8"})
    assert "hop stages" in str(unauditable(lossy))


def test_a_drawn_site_that_withholds_its_state_digest_is_named(tmp_path: Path) -> None:
    """A site drawn for a round it signed a commitment for, but no state digest: it
    cannot be audited, and is named ``audit refused``."""
    init_certs(tmp_path / "certs", P)
    certs = [
        (tmp_path / "certs" / "nodes" / f"worker-{r}" / "tls.crt").read_bytes() for r in range(P)
    ]
    cfg = TrainConfig(**{**CFG, "audit": {"rate": 1.0}}, workers=P)
    named: list[int] = []
    desk = Audits(
        cfg, certs.__getitem__, lambda r: f"worker-{r}", lambda r, w, n: named.append(r), 5
    )
    identity = certificate_identity(certs[1])
    desk.commitment(1, 0, Commitment(RING, 0, TRAIN, 0, 1, 1, identity, ()))
    desk.after_train(0, [_desk_reply(1, {}), _desk_reply(0, {})])  # worker-0: no commitment
    st = desk.status()
    assert st["by_kind"] == {"audit refused": 1} and named == [1], st
    garbled = {AUDIT_STATE: ConfigRecord({"body": b"{", "signature": b"x"})}
    desk.commitment(0, 1, Commitment(RING, 1, TRAIN, 1, 2, 0, certificate_identity(certs[0]), ()))
    desk.after_train(1, [_desk_reply(0, garbled)])  # unreadable: no state, named; no crash
    assert named == [1, 0]
    assert "signed no state digest" in st["incidents"][0]["what"]
    assert desk.asks() == ""
    desk.close()


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param({"optimizer": "muon"}, id="muon"),
        pytest.param({"loops": 2, "micro_batches": 2}, id="loops-2-M2"),
        pytest.param({"memory": {"recompute": True}}, id="recompute"),
    ],
)
def test_honest_rounds_replay_equal_in_other_settings(
    site_dirs: list[Path], setting: dict[str, Any]
) -> None:
    """Muon (its bf16 Newton–Schulz step), two loops over the ring with 2 micro-batches,
    activations recomputed in backward: two rounds of one step, each group's round 0
    replayed equal, and the state it leaves the one it signed at round 1."""
    cfg = TrainConfig(**{**CFG, **setting}, workers=P)
    ring = _Ring(cfg, site_dirs)
    ring.round(0)
    kept = [ring.kept(i, 0, 0, 1) for i in range(P)]
    ring.round(1)
    for i in range(P):
        found = audit(cfg, i, 0, kept[i], _upload(ring, i, 0), ring.digests[i, 1])
        assert found.kind is None and found.compared > 0, found


def test_status_shows_the_audit_incidents() -> None:
    from rich.console import Console

    from mobius_fed.cli.status import render_status
    from mobius_fed.coordinator.status_model import AuditStatusModel

    inc = {"kind": "audit failed", "what": "worker-2, round 1: it sent other values",
           "site": "worker-2", "round": 1, "step": 0, "detected_at": 0.0}  # fmt: skip
    block = {"rate": 1.0, "asked": 3, "passed": 2, "frames_compared": 10, "pending": 0,
             "incidents": [inc], "by_kind": {"audit failed": 1}}  # fmt: skip
    AuditStatusModel.model_validate(block)
    console = Console(record=True, width=250)
    render_status({"run_id": "t", "audits": block}, console)
    text = console.export_text()
    assert "audits (2 of 3 passed)" in text and "audit failed" in text and "worker-2" in text


def test_a_received_frame_cannot_be_passed_off_as_the_homes_own(honest: Any) -> None:
    """Only what a site's home hands its own group without a hop may come as a local
    tensor: a received frame left out of the upload and given as local instead is
    missing. A frame it did not commit (one that came in after the seal) is left out."""
    from mobius_fed.engine.audit_replay import load_state, state_bytes

    ring, kept, uploads = honest
    up = dict(uploads[1])
    name = next(k for k in up if k.startswith("received|"))
    local = load_state(up["local"])
    local[name.replace("received|", "local|")] = torch.zeros(1)
    up["local"] = state_bytes(local)
    del up[name]
    found = audit(ring.cfg, 1, 0, kept[1], up)
    assert found.kind == MISMATCH and "lacks" in found.what, found
    extra = {**uploads[1], "received|0.1.1.1.2.1": [b"late"]}
    assert audit(ring.cfg, 1, 0, kept[1], extra).kind is None
    junk = {**uploads[1], "state": state_bytes({"group": {}, "group_opts": []})}
    assert audit(ring.cfg, 1, 0, Kept(**{**kept[1].__dict__, "state": state_digest(
        {"group": {}, "group_opts": []})}), junk).kind == MISMATCH  # fmt: skip


def test_a_local_tensor_of_another_shape_is_a_mismatch_not_an_error(honest: Any) -> None:
    from mobius_fed.engine.audit_replay import load_state, state_bytes

    ring, kept, uploads = honest
    up = dict(uploads[0])
    local = load_state(up["local"])
    assert local, "worker-0's home hands its own group slot 0 (cyclic order)"
    up["local"] = state_bytes({k: torch.zeros(3) for k in local})
    found = audit(ring.cfg, 0, 0, kept[0], up)
    assert found.kind == MISMATCH and "cannot be replayed" in found.what, found


def test_a_worker_uploads_only_what_it_is_asked_and_says_what_it_lacks() -> None:
    """The reply handler: the round's signed state digest always; the upload of a round
    the order asks of this rank; for a round it no longer holds, why."""
    from mobius_fed.messages import TrainOrder
    from mobius_fed.worker.flower_client import WorkerHandlers

    store = AuditStore(keep=1)
    state = {"group": {"w": torch.ones(1)}, "group_opts": []}
    handler = SimpleNamespace(commitments=SimpleNamespace(store=store, rank=1))
    sealed = Signed(b"{}", b"sig")
    for rnd in (1, 2):
        store.open_round(RING, rnd, rnd - 1, state)
        reply = RecordDict({})
        order = TrainOrder(rnd, rnd - 1, rnd, False, audit_asks="0:1,1:1")
        WorkerHandlers._audit_reply(handler, reply, order, sealed)  # type: ignore[arg-type]
        assert AUDIT_STATE in reply
        up = reply[AUDIT_UPLOAD]
        assert up["round"] == 1
        assert ("missing" in up) == (rnd == 2), dict(up)  # round 2 closed: 1 is gone
    reply = RecordDict({})
    WorkerHandlers._audit_reply(handler, reply, TrainOrder(3, 2, 3, False, audit_asks="0:2"), None)  # type: ignore[arg-type]
    assert AUDIT_UPLOAD not in reply and AUDIT_STATE not in reply


def test_the_auditor_thread_yields_the_cpu_to_training() -> None:
    """The replay runs in a thread of its own at a lower priority (Linux: per thread), so
    that on a machine it shares with training it takes what training leaves."""
    import os

    from mobius_fed.coordinator.audits import AUDITOR_NICE

    desk = Audits(TrainConfig(**CFG, workers=2), lambda r: None, str, lambda r, w, n: None, 1)
    try:
        here = os.getpriority(os.PRIO_PROCESS, 0)
        there = desk._pool.submit(os.getpriority, os.PRIO_PROCESS, 0).result(timeout=30)
    finally:
        desk.close()
    assert there == min(19, here + AUDITOR_NICE) and here == os.getpriority(os.PRIO_PROCESS, 0)
