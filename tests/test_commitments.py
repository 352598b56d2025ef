"""Commitments (docs/security.md "Commitments"): each site signs, with its own TLS key, the
sha256 of every ring frame it sent and received, and the coordinator compares each hop's
two ends. Here, without processes: the canonical body and its refusals, signatures and
their verification, the hops the schedule gives, the worker's ledger where frames go on
and come off the wire, and the coordinator's check of a round's replies, honest and lying.
The same over real processes and mTLS: tests/test_commitments_ring.py."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.commitments import CommitmentAudit
from mobius_fed.messages import COMMITMENT, Signed
from mobius_fed.transport.certs import init_certs
from mobius_fed.transport.codec import encode_frames
from mobius_fed.transport.commitments import (
    EVAL,
    RECEIVED,
    SENT,
    TRAIN,
    Commitment,
    CommitmentError,
    Entry,
    frame_hops,
    own_entries,
    sign,
    verify,
)
from mobius_fed.transport.flower_wire import worker_node_id
from mobius_fed.worker.commitments import Commitments, FrameLedger
from mobius_fed.worker.frames import BACKWARD, FORWARD, FrameKey, FrameRules
from mobius_fed.worker.link_session import FrameRouter, Inbox

RING = "run/0.1"
HEX = "ab" * 32


def _body(**kw: Any) -> Commitment:
    entries = (
        Entry(3, TRAIN, FORWARD, 1, 2, 0, SENT, 2, HEX),
        Entry(2, TRAIN, BACKWARD, 0, 1, 1, RECEIVED, 0, "cd" * 32),
    )
    fields = dict(ring=RING, round=3, phase=TRAIN, first=2, end=4, rank=1,
                  identity="mobius://worker/1", entries=entries)  # fmt: skip
    return Commitment(**{**fields, **kw})  # type: ignore[arg-type]


def test_the_body_is_canonical_and_round_trips() -> None:
    c = _body()
    data = c.encode()
    assert Commitment.decode(data) == replace(c, entries=tuple(sorted(c.entries)))
    # one document, one encoding: entry order, key order and spacing do not matter to it
    assert _body(entries=tuple(reversed(c.entries))).encode() == data
    doc = json.loads(data)
    assert list(doc) == sorted(doc) and b" " not in data
    assert doc["entries"][0] == [2, TRAIN, BACKWARD, 0, 1, 1, RECEIVED, 0, "cd" * 32]


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda d: json.dumps(d).encode(), "canonical"),  # spaces
        (lambda d: _dump({**d, "extra": 1}), "exactly the fields"),
        (lambda d: _dump({**d, "v": 2}), "version 2"),
        (lambda d: _dump({**d, "round": True}), "round must be an integer"),
        (lambda d: _dump({**d, "round": -1}), "round must be an integer"),
        (lambda d: _dump({**d, "entries": d["entries"][::-1]}), "canonical"),
        (lambda d: _dump({**d, "entries": d["entries"] * 2}), "repeat"),
        (lambda d: _dump({**d, "entries": [d["entries"][0][:8]]}), "9 fields"),
        (lambda d: _dump({**d, "entries": [[*d["entries"][0][:6], "kept", 0, HEX]]}), "way"),
        (lambda d: _dump({**d, "entries": [[*d["entries"][0][:8], "AB" * 32]]}), "lowercase"),
        (lambda d: b"\xff" + _dump(d), "ASCII JSON"),
        (lambda d: b"[]", "exactly the fields"),
    ],
)
def test_a_body_that_is_not_canonical_or_well_formed_is_refused(edit: Any, why: str) -> None:
    doc = json.loads(_body().encode())
    with pytest.raises(CommitmentError, match=why):
        Commitment.decode(edit(doc))


def _dump(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _cert_for(key: Any) -> bytes:
    """A self-signed certificate of ``key``'s public key (verification reads only the key)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "t")])
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
    )  # fmt: skip
    digest = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, digest).public_bytes(serialization.Encoding.PEM)


def _pem(key: Any) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: ec.generate_private_key(ec.SECP256R1()),
        ed25519.Ed25519PrivateKey.generate,
        lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
    ],
    ids=["ec-p256", "ed25519", "rsa"],
)
def test_a_signature_verifies_only_with_its_key_and_its_body(make: Any) -> None:
    key, other = make(), make()
    data = _body().encode()
    sig = sign(_pem(key), data)
    assert verify(_cert_for(key), data, sig) is None
    assert "not the site's certificate key" in (verify(_cert_for(other), data, sig) or "")
    assert "not the site's certificate key" in (verify(_cert_for(key), data + b" ", sig) or "")
    # garbage never raises: it is a reason
    for bad in (b"", b"\x00" * 64, b"junk"):
        assert verify(_cert_for(key), data, bad) is not None
    assert "cannot be read" in (verify(b"not a certificate", data, sig) or "")


@pytest.mark.parametrize(("order", "P", "loops"), [("cyclic", 3, 1), ("ordered", 4, 2)])
def test_the_hops_are_the_frame_rules_routes(order: str, P: int, loops: int) -> None:
    cfg = TrainConfig(preset="cpu-tiny", workers=P, order=order, loops=loops, micro_batches=2)
    rules = FrameRules(cfg, 0, RING, lambda: 0)
    hops = list(frame_hops(cfg.order, P, loops, 2, TRAIN, 5))
    want = {}
    for direction in (FORWARD, BACKWARD):
        for origin in range(P):
            for slot in range(cfg.K + 1):
                route = rules.route(direction, origin, slot)
                if len(route) > 1:
                    for micro in range(2):
                        want[5, TRAIN, direction, origin, slot, micro] = route
    assert dict(hops) == want and len(hops) == len(want)
    assert all(d == FORWARD for (_, _, d, *_), _ in frame_hops(cfg.order, P, loops, 3, EVAL, 0))
    # every hop is one site's SENT and the next one's RECEIVED, peers by global rank
    claims = [own_entries(iter(hops), r, base=10) for r in range(P)]
    sent = sum(w == SENT for c in claims for _, w, _ in c)
    assert sent == sum(w == RECEIVED for c in claims for _, w, _ in c)
    assert sent == sum(len(route) - 1 for _, route in hops)
    assert all(10 <= peer < 10 + P for c in claims for _, _, peer in c)


# ----------------------------------------------------------------- the worker's ledger
CFG = TrainConfig(preset="cpu-tiny", workers=4, batch_size=4, order="ordered")


class _Out:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def put(self, data: bytes) -> int:
        self.sent.append(data)
        return len(self.sent)


def _frames(origin: int, slot: int, direction: int = FORWARD) -> list[bytes]:
    t = torch.randn(CFG.batch_size, CFG.model().seq_len, CFG.model().d_model)
    return list(
        encode_frames(
            run_id=RING, step=0, origin=origin, tick=slot, micro=0, direction=direction,
            tensor=t, chunk_bytes=1 << 13,
        )
    )  # fmt: skip


def test_the_ledger_digests_what_came_off_the_wire_and_what_a_relay_passed_on() -> None:
    """Worker-1 of an ordered ring of 4 takes slot 1 of stream 1 from worker-0 (delivered)
    and relays slot K of stream 2 from worker-0 to worker-2: each is recorded with the
    sha256 of its pieces as received, and the relayed one as sent on with the same bytes."""
    rules = FrameRules(CFG, 1, RING, lambda: 0)
    ledger, out = FrameLedger(base=4), _Out()
    inbox = Inbox(rules.current_step, frozenset({0, 2, 3}))
    router = FrameRouter(rules, inbox, lambda d: out, None, 8, ledger=ledger)  # type: ignore[arg-type,return-value]
    s = router.new_session("worker-0", FORWARD)
    mine, relayed = _frames(0, 1), _frames(2, CFG.K)
    assert len(mine) > 1  # chunked: the digest runs over every piece
    assert rules.route(FORWARD, 0, 1) == [0, 1] and rules.route(FORWARD, 2, CFG.K) == [3, 0, 1, 2]
    for data in mine + relayed:
        router.accept(data, FORWARD, s)
    assert out.sent == relayed
    entries = {(e.origin, e.way, e.peer): e.sha256 for e in ledger.take(TRAIN, 0, 1)}
    whole = hashlib.sha256(b"".join(mine)).hexdigest()
    passed = hashlib.sha256(b"".join(relayed)).hexdigest()
    assert entries == {(0, RECEIVED, 4): whole, (2, RECEIVED, 4): passed, (2, SENT, 6): passed}
    assert ledger.take(TRAIN, 0, 1) == []  # taken once


def test_a_seal_waits_for_what_it_relays_and_signs_the_rounds_frames(tmp_path: Path) -> None:
    init_certs(tmp_path / "certs", 2)
    node = tmp_path / "certs" / "nodes" / "worker-1"
    key, cert = (node / "tls.key").read_bytes(), (node / "tls.crt").read_bytes()
    cfg = TrainConfig(preset="cpu-tiny", workers=2)
    c = Commitments(cfg, 1, 1, "mobius://worker/1", key, timeout=0.3)
    expected = c.expected(TRAIN, 0, 1)
    assert len(expected) == 2 * 2 * 2  # P = 2: slots 1 and 2 leave home, both ways
    first = sorted(expected)[0]
    frame, way, peer = first
    key0 = FrameKey(frame[1], frame[0], frame[2], frame[3], frame[4], frame[5])
    c.ledger.record(key0, way, peer, HEX)
    signed = c.seal(RING, 1, TRAIN, 0, 1)  # the others never come: it waits 0.3 s, then signs
    assert verify(cert, signed.body, signed.signature) is None
    body = Commitment.decode(signed.body)
    assert [e.frame for e in body.entries] == [frame] and body.rank == 1
    assert (body.ring, body.round, body.first, body.end) == (RING, 1, 0, 1)


# ------------------------------------------------------------ the coordinator's check
P = 3


class _Sites:
    """P sites of an ordered ring (relays included) and their certificates: each commits
    what the schedule says it sent and received, with the digest of the frame's name."""

    def __init__(self, tmp: Path, order: str = "ordered") -> None:
        init_certs(tmp / "certs", P)
        nodes = tmp / "certs" / "nodes"
        self.keys = [(nodes / f"worker-{r}" / "tls.key").read_bytes() for r in range(P)]
        self.certs = [(nodes / f"worker-{r}" / "tls.crt").read_bytes() for r in range(P)]
        self.cfg = TrainConfig(preset="cpu-tiny", workers=P, order=order, sync_every=2)
        self.audit = CommitmentAudit(self.cfg, self.certs.__getitem__, lambda: RING, _name)

    def entries(self, rank: int, first: int, end: int) -> list[Entry]:
        c = self.cfg
        claims: set = set()
        for step in range(first, end):
            claims |= own_entries(frame_hops(c.order, P, 1, 1, TRAIN, step), rank)
        return [Entry(*f, w, p, hashlib.sha256(repr(f).encode()).hexdigest()) for f, w, p in claims]

    def reply(self, rank: int, entries: list[Entry], *, rnd: int = 1, key: bytes | None = None,
              first: int = 0, end: int = 2, ring: str = RING) -> Any:  # fmt: skip
        body = Commitment(ring, rnd, TRAIN, first, end, rank, f"mobius://worker/{rank}",
                          tuple(entries)).encode()  # fmt: skip
        signed = Signed(body, sign(key or self.keys[rank], body))
        content = RecordDict({"metrics": MetricRecord({"loss": 1.0}),
                              COMMITMENT: signed.to_record()})  # fmt: skip
        return SimpleNamespace(metadata=SimpleNamespace(src_node_id=worker_node_id(rank)),
                               content=content)  # fmt: skip

    def honest(self, rnd: int = 1) -> list[Any]:
        first = 2 * (rnd - 1)
        return [self.reply(r, self.entries(r, first, first + 2), rnd=rnd, first=first,
                           end=first + 2) for r in range(P)]  # fmt: skip

    def check(self, replies: list[Any], rnd: int = 1) -> list[Any]:
        first = 2 * (rnd - 1)
        return self.audit.check(rnd, TRAIN, first, first + 2, replies)


def _name(rank: int) -> str:
    return f"worker-{rank}"


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> _Sites:
    return _Sites(tmp_path_factory.mktemp("commitments"))


def test_honest_commitments_match_on_every_hop(sites: _Sites) -> None:
    before = sites.audit.status()["frames_checked"]
    assert sites.check(sites.honest()) == []
    hops = sum(len(r) - 1 for s in (0, 1) for _, r in frame_hops("ordered", P, 1, 1, TRAIN, s))
    assert sites.audit.status()["frames_checked"] - before == hops


def test_a_digest_that_differs_names_the_hop_and_its_step(sites: _Sites) -> None:
    """worker-2 commits other bytes for the gradient it sent back at step 1 than its
    receiver saw: one incident naming the hop sender → receiver, within that step."""
    replies = sites.honest()
    mine = sites.entries(2, 0, 2)
    took = {e.frame for e in mine if e.way == RECEIVED}  # frames it relays: not its own
    lie = next(
        e
        for e in mine
        if e.way == SENT and e.direction == BACKWARD and e.step == 1 and e.frame not in took
    )
    mine = [replace(e, sha256=HEX) if e == lie else e for e in mine]
    replies[2] = sites.reply(2, mine)
    (inc,) = sites.check(replies)
    assert inc.kind == "digest mismatch" and inc.edge == f"worker-2 → worker-{lie.peer}"
    assert inc.step == 1 and inc.frames == 1 and "one of them lies" in inc.what
    assert "TRAIN BACKWARD step 1" in inc.what and inc.site is None
    assert {"worker-2", f"worker-{lie.peer}"} <= set(sites.audit.status()["sites"])


def test_a_relay_that_passes_on_other_bytes_is_named(sites: _Sites) -> None:
    """An ordered ring of 3 relays: a relay that commits honestly what it took in and what
    it gave out, but gave out other bytes, matches on both hops and is named by its own
    two entries."""
    hops = [(f, r) for f, r in frame_hops("ordered", P, 1, 1, TRAIN, 0) if len(r) > 2]
    frame, route = hops[0]
    relay, nxt = route[1], route[2]
    replies = sites.honest()
    altered = "ef" * 32
    mine = [replace(e, sha256=altered) if (e.frame, e.way) == (frame, SENT) else e
            for e in sites.entries(relay, 0, 2)]  # fmt: skip
    theirs = [replace(e, sha256=altered) if (e.frame, e.way, e.peer) == (frame, RECEIVED, relay)
              else e for e in sites.entries(nxt, 0, 2)]  # fmt: skip
    replies[relay], replies[nxt] = sites.reply(relay, mine), sites.reply(nxt, theirs)
    (inc,) = sites.check(replies)
    assert inc.kind == "relay altered" and inc.site == f"worker-{relay}" and inc.step == 0


def test_forged_missing_late_and_malformed_commitments_are_named_and_never_raise(
    sites: _Sites,
) -> None:
    other = ec.generate_private_key(ec.SECP256R1())
    cases = {
        "forged commitment": lambda r: sites.reply(r, sites.entries(r, 0, 2), key=_pem(other)),
        "missing commitment": lambda r: SimpleNamespace(
            metadata=SimpleNamespace(src_node_id=worker_node_id(r)), content=RecordDict({})
        ),
        "late commitment": lambda r: sites.reply(r, sites.entries(r, 0, 2), ring="run/0.0"),
        "malformed commitment": lambda r: _junk(r, sites.keys[r]),
    }
    for kind, make in cases.items():
        replies = sites.honest()
        replies[1] = make(1)
        (inc,) = sites.check(replies)
        assert inc.kind == kind and inc.site == "worker-1", (kind, inc)
    # a commitment that leaves frames out: those hops' frames, named
    replies = sites.honest()
    replies[0] = sites.reply(0, [e for e in sites.entries(0, 0, 2) if e.way == SENT])
    (inc,) = sites.check(replies)
    assert inc.kind == "missing commitment" and "lacks frames it received" in inc.what
    # one that claims a frame it has no hop for, and a record that is not one
    extra = Entry(0, TRAIN, FORWARD, 0, 0, 9, SENT, 1, HEX)
    replies = sites.honest()
    replies[0] = sites.reply(0, [*sites.entries(0, 0, 2), extra])
    assert [i.kind for i in sites.check(replies)] == ["malformed commitment"]
    replies = sites.honest()
    replies[2].content[COMMITMENT] = ConfigRecord({"body": 7})
    assert [i.kind for i in sites.check(replies)] == ["malformed commitment"]
    # the round after: everything honest again, nothing found
    assert sites.check(sites.honest(2), rnd=2) == []
    kinds = sites.audit.status()["by_kind"]
    assert set(cases) <= set(kinds)


def _junk(rank: int, key: bytes) -> Any:
    body = b'{"hello":"world"}'
    content = RecordDict({COMMITMENT: Signed(body, sign(key, body)).to_record()})
    return SimpleNamespace(
        metadata=SimpleNamespace(src_node_id=worker_node_id(rank)), content=content
    )


def test_the_setting_is_on_by_default_and_leaves_old_fingerprints_alone() -> None:
    assert TrainConfig().audit.commitments
    doc = TrainConfig(preset="cpu-tiny").model_dump(mode="json")
    del doc["audit"]  # a manifest written before commitments existed
    assert (
        TrainConfig.model_validate(doc).fingerprint()
        == TrainConfig(preset="cpu-tiny").fingerprint()
    )
    off = TrainConfig(preset="cpu-tiny", audit={"commitments": False})
    assert off.fingerprint() != TrainConfig(preset="cpu-tiny").fingerprint()


def test_status_shows_the_incidents(sites: _Sites) -> None:
    from rich.console import Console

    from mobius_fed.cli.status import render_status
    from mobius_fed.coordinator.status_model import CommitmentStatusModel

    replies = sites.honest()
    replies[2] = sites.reply(2, [replace(e, sha256=HEX) for e in sites.entries(2, 0, 2)])
    assert sites.check(replies)  # every hop of worker-2's differs
    block = sites.audit.status()
    CommitmentStatusModel.model_validate(block)
    console = Console(record=True, width=250)
    render_status({"run_id": "t", "commitments": block}, console)
    text = console.export_text()
    assert "commitments (" in text and "digest mismatch" in text and "worker-2 → worker-" in text
