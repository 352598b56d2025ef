"""The coordinator's check of the sites' commitments (docs/security.md "Commitments").

Every train and evaluate reply carries its site's signed list of the ring frames it sent
and received in the round (:mod:`mobius_fed.transport.commitments`). Once a round's
replies are in, :class:`CommitmentAudit` verifies each signature against the certificate
the site presented on its mTLS session, checks that the list is this round's, and then
walks every hop the schedule says the round's frames took: the sender's digest and the
receiver's must be equal, and a relay must pass on the bytes it took in. What differs is
an incident naming the hop (sender → receiver) or the site; a forged, missing, late or
malformed commitment is an incident naming its site, and that site's hops go unchecked for
the round. Nothing here fails a round or the run: the round's math is already done, and an
honest site loses nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import pairwise
from typing import Any

from flwr.app import Message

from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.status_model import CommitmentIncidentModel
from mobius_fed.messages import COMMITMENT, Signed
from mobius_fed.transport.commitments import (
    EVAL,
    RECEIVED,
    SENT,
    Commitment,
    CommitmentError,
    Entry,
    Frame,
    frame_hops,
    verify,
)
from mobius_fed.transport.flower_wire import rank_of_node
from mobius_fed.transport.tls import certificate_identity

log = logging.getLogger("mobius.coordinator")
KEEP = 100  # incidents status keeps (the latest)
MISMATCH, RELAY = "digest mismatch", "relay altered"
MISSING, FORGED = "missing commitment", "forged commitment"
LATE, MALFORMED = "late commitment", "malformed commitment"
Claim = tuple[Frame, str, int]


class CommitmentAudit:
    """Checks each round's commitments and keeps what it found for status.

    ``certificate(rank)``: the PEM certificate the site holding ``rank`` presented on its
    mTLS session (None if none); ``ring()``: the ring incarnation training runs on;
    ``site(rank)``: the name of the site holding ``rank`` (worker-2, or its standby)."""

    def __init__(
        self,
        train: TrainConfig,
        certificate: Callable[[int], bytes | None],
        ring: Callable[[], str],
        site: Callable[[int], str],
    ) -> None:
        self.train, self.certificate, self.ring, self.site = train, certificate, ring, site
        self.incidents: list[CommitmentIncidentModel] = []
        self.by_kind: dict[str, int] = {}
        self.sites: set[str] = set()
        self.replies = self.frames = 0
        self._lock = threading.Lock()
        # audits: told of each verified train commitment (rank, round, its commitment)
        self.on_commitment: Callable[[int, int, Commitment], None] | None = None

    # ------------------------------------------------------------------ check
    def check(
        self, rnd: int, phase: int, first: int, end: int, replies: Iterable[Message]
    ) -> list[CommitmentIncidentModel]:
        """Check the commitments ``replies`` carry for round ``rnd``'s ``phase`` frames at
        steps [first, end); the incidents found (also kept for status). Never raises."""
        found, have = _Found(rnd, phase), {}
        try:
            for reply in replies:
                rank = rank_of_node(reply.metadata.src_node_id)
                c = self._read(reply, rank, rnd, phase, first, end, found)
                if c is not None:
                    have[rank] = {(e.frame, e.way, e.peer): e for e in c.entries}
                    if self.on_commitment is not None and phase != EVAL:
                        self.on_commitment(rank, rnd, c)
            checked = self._compare(have, phase, first, end, found)
        except Exception as exc:  # a bug here must not end the run
            log.exception("round %d: the commitments could not be checked", rnd)
            found.add(MALFORMED, f"the commitments could not be checked: {exc!r}")
            checked = 0
        named = found.incidents()
        with self._lock:
            self.replies += len(have)
            self.frames += checked
            for inc, sites in named:
                self.by_kind[inc.kind] = self.by_kind.get(inc.kind, 0) + 1
                self.sites |= set(sites)
            self.incidents = (self.incidents + [inc for inc, _ in named])[-KEEP:]
        for inc, _ in named:
            log.error("round %d commitments: %s: %s", rnd, inc.kind, inc.what)
        return [inc for inc, _ in named]

    def _read(
        self, reply: Message, rank: int, rnd: int, phase: int, first: int, end: int, found: _Found
    ) -> Commitment | None:
        """``rank``'s commitment in ``reply`` if it is signed by its site, well formed and
        this round's; else None, with the incident that says why."""
        site, what = self.site(rank), _scope(rnd, phase, first, end)
        if COMMITMENT not in reply.content:
            found.add(MISSING, f"{site} sent no commitment with its reply to {what}", site=site)
            return None
        try:
            signed = Signed.of(reply.content[COMMITMENT])
        except (KeyError, TypeError, ValueError) as exc:
            found.add(MALFORMED, f"{site}'s commitment record is unusable ({exc!r})", site=site)
            return None
        cert = self.certificate(rank)
        why = "no certificate on record for it" if cert is None else None
        why = why or verify(cert or b"", signed.body, signed.signature)
        if why is not None:
            found.add(FORGED, f"{site}'s commitment for {what} is refused: {why}", site=site)
            return None
        try:
            c = Commitment.decode(signed.body)
        except CommitmentError as exc:
            found.add(MALFORMED, f"{site}'s commitment for {what}: {exc}", site=site)
            return None
        identity = certificate_identity(cert or b"")
        if c.rank != rank or c.identity != identity:
            msg = f"{site}'s commitment names {c.identity} as rank {c.rank}, not {identity}"
            found.add(MALFORMED, msg + f" as rank {rank}", site=site)
            return None
        ring = self.ring()
        if (c.ring, c.round, c.phase, c.first, c.end) != (ring, rnd, phase, first, end):
            theirs = _scope(c.round, c.phase, c.first, c.end)
            msg = f"{site}'s commitment is for {theirs} of ring {c.ring!r}, its reply answers "
            found.add(LATE, msg + f"{what} of ring {ring!r}", site=site)
            return None
        return c

    def _compare(
        self,
        have: dict[int, dict[Claim, Entry]],
        phase: int,
        first: int,
        end: int,
        found: _Found,
    ) -> int:
        """Walk every hop of the round's frames in every ring; the hops that matched."""
        t, checked = self.train, 0
        micros = t.micro_batches * (t.eval_batches if phase == EVAL else 1)
        expected: dict[int, set[Claim]] = defaultdict(set)
        for base in range(0, t.workers, t.P):  # R rings of P
            for step in range(first, end):
                for frame, route in frame_hops(t.order, t.P, t.loops, micros, phase, step):
                    hops = [base + r for r in route]
                    checked += self._hop(have, frame, hops, expected, found)
        for rank, entries in sorted(have.items()):
            extra = [c for c in entries if c not in expected[rank]]
            if extra:
                site, f = self.site(rank), extra[0]
                msg = f"{site} commits {len(extra)} frame(s) that take no hop of its "
                found.add(MALFORMED, msg + f"(e.g. {_show(f)})", site=site, frames=len(extra))
        return checked

    def _hop(
        self,
        have: dict[int, dict[Claim, Entry]],
        frame: Frame,
        hops: list[int],
        expected: dict[int, set[Claim]],
        found: _Found,
    ) -> int:
        """Check one frame along its route (global ranks); 1 per matching hop."""
        matched = 0
        for a, b in pairwise(hops):
            expected[a].add((frame, SENT, b))
            expected[b].add((frame, RECEIVED, a))
            if a not in have or b not in have:
                continue  # a site without a usable commitment was named already
            sent, got = have[a].get((frame, SENT, b)), have[b].get((frame, RECEIVED, a))
            for rank, entry in ((a, sent), (b, got)):
                if entry is None:
                    site = self.site(rank)
                    msg = f"{site}'s commitment lacks frames it {_way(rank == a)}"
                    found.add(MISSING, msg, site=site, step=frame[0], first=frame, key=msg)
            if sent is None or got is None:
                continue
            if sent.sha256 != got.sha256:
                edge = f"worker-{a} → worker-{b}"
                msg = (
                    f"{self.site(a)} committed other bytes than {self.site(b)} received on "
                    f"the hop {edge}: one of them lies"
                )
                sites = (self.site(a), self.site(b))
                found.add(MISMATCH, msg, edge=edge, step=frame[0], first=frame, sites=sites)
            else:
                matched += 1
        for prev, relay, nxt in zip(hops, hops[1:], hops[2:]):
            if relay not in have:
                continue
            took = have[relay].get((frame, RECEIVED, prev))
            gave = have[relay].get((frame, SENT, nxt))
            if took is not None and gave is not None and took.sha256 != gave.sha256:
                site = self.site(relay)
                msg = f"{site} relayed other bytes than it took in (worker-{prev} → {site} → "
                found.add(RELAY, msg + f"worker-{nxt})", site=site, step=frame[0], first=frame)
        return matched

    # ----------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        """Status's ``commitments`` block (:class:`CommitmentStatusModel`)."""
        with self._lock:
            return {
                "replies_checked": self.replies,
                "frames_checked": self.frames,
                "incidents": [i.model_dump() for i in self.incidents],
                "by_kind": dict(sorted(self.by_kind.items())),
                "sites": sorted(self.sites),
            }


class _Found:
    """The incidents of one check, one per (kind, site or hop): its frames counted and
    the first frame named."""

    def __init__(self, rnd: int, phase: int) -> None:
        self.rnd, self.phase = rnd, "eval" if phase == EVAL else "train"
        self._by: dict[tuple[str, str], dict[str, Any]] = {}

    def add(
        self,
        kind: str,
        what: str,
        *,
        site: str | None = None,
        edge: str | None = None,
        step: int | None = None,
        first: Frame | None = None,
        frames: int = 1,
        key: str | None = None,
        sites: tuple[str, ...] = (),
    ) -> None:
        """One more frame (or ``frames``) of the incident ``kind`` keyed by ``key`` (else
        the site, the hop or the text); ``sites``: the sites it names (else ``site``)."""
        k = (kind, key or site or edge or what)
        entry = self._by.get(k)
        if entry is None:
            named = sites or ((site,) if site else ())
            self._by[k] = dict(
                kind=kind, what=what, site=site, edge=edge, step=step, first=first,
                frames=frames, sites=named,
            )  # fmt: skip
        else:
            entry["frames"] += frames

    def incidents(self) -> list[tuple[CommitmentIncidentModel, tuple[str, ...]]]:
        """Each incident with the sites it names."""
        out, now = [], time.time()
        for e in self._by.values():
            what = e["what"]
            if e["first"] is not None:
                what += f"; {e['frames']} frame(s), the first {_show_frame(e['first'])}"
            inc = CommitmentIncidentModel(
                kind=e["kind"],
                what=what,
                round=self.rnd,
                phase=self.phase,
                step=e["step"],
                edge=e["edge"],
                site=e["site"],
                frames=e["frames"],
                detected_at=now,
            )
            out.append((inc, e["sites"]))
        return out


def _scope(rnd: int, phase: int, first: int, end: int) -> str:
    if phase == EVAL:
        return f"round {rnd}'s evaluation at step {first}"
    return f"round {rnd} (train steps {first}..{end - 1})"


def _way(sent: bool) -> str:
    return "sent" if sent else "received"


def _show_frame(frame: Frame) -> str:
    step, phase, direction, origin, slot, micro = frame
    return Entry(step, phase, direction, origin, slot, micro, SENT, 0, "0" * 64).describe()


def _show(claim: Claim) -> str:
    frame, way, peer = claim
    return f"{_show_frame(frame)} {way} {'to' if way == SENT else 'from'} worker-{peer}"
