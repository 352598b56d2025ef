"""Audits by recomputation, the coordinator's side (docs/audits.md).

After each train round the coordinator draws, in secret, which sites' rounds it audits:
round r of the site holding rank k is drawn when HMAC-SHA256(secret, "r:k") falls below
``audit.rate``, the secret being 32 random bytes this process never writes anywhere (so no
site can tell beforehand which of its rounds will be replayed). The next train order asks
the site for that round (``audit-asks``); its reply carries the upload, and a background
thread (:func:`~mobius_fed.coordinator.auditor.audit`) replays it: training never waits
on an audit. A failed audit, an upload that is not what the site committed, or one that
is refused or late is an incident naming the site, and the site a suspect (with
``--evict-suspects`` its rank goes to a waiting standby and the run rolls back to before
the audited round). The auditor's own failure names no one. :meth:`Audits.oldest_open` is
the oldest round whose verdict may still come: the checkpoint before it is kept.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flwr.app import Message

from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.auditor import FAILED, MISMATCH, Finding, Kept, audit
from mobius_fed.coordinator.status_model import AuditIncidentModel
from mobius_fed.engine.audit_replay import unauditable
from mobius_fed.messages import AUDIT_STATE, AUDIT_UPLOAD, Signed
from mobius_fed.transport.commitments import Commitment, verify
from mobius_fed.transport.flower_wire import rank_of_node
from mobius_fed.transport.tls import certificate_identity

log = logging.getLogger("mobius.coordinator")
KEEP = 100  # incidents status keeps
QUEUE = 4  # audits asked or waiting for the auditor, at least: no new draw beyond
AUDITOR_NICE = 10  # the replay yields the CPU to training where it shares a machine with it
REFUSED, TIMED_OUT, ERROR = "audit refused", "audit timed out", "audit error"
NAMING = (FAILED, MISMATCH, REFUSED, TIMED_OUT)  # the kinds that make a site a suspect


def _yield_cpu() -> None:
    """Lower this thread's priority (the auditor's; Linux sets it per thread) by
    ``AUDITOR_NICE``: the coordinator's other threads, and any site on its machine, go first."""
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + AUDITOR_NICE)
        )
    except (OSError, AttributeError):  # not Linux, or not allowed: it runs as it is
        log.debug("the auditor runs at the coordinator's priority")


class AuditDraw:
    """Which rounds of which ranks are audited: a keyed hash of (round, rank) under a
    secret the sites never see, below ``rate``."""

    def __init__(self, rate: float, secret: bytes | None = None) -> None:
        self.rate = rate
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def drawn(self, rnd: int, rank: int) -> bool:
        if self.rate <= 0:
            return False
        d = hmac.new(self._secret, f"{rnd}:{rank}".encode(), hashlib.sha256).digest()
        return int.from_bytes(d[:8], "big") < self.rate * 2.0**64


class Audits:
    """Draws, asks, audits and keeps what it found for status. ``certificate(rank)``: the
    PEM certificate of the site holding ``rank``; ``site(rank)``: its name;
    ``on_suspect(rank, why, rnd)``: a site an audit of its round ``rnd`` named; ``rounds``:
    the run's last round (no order after it asks for anything)."""

    def __init__(
        self,
        train: TrainConfig,
        certificate: Callable[[int], bytes | None],
        site: Callable[[int], str],
        on_suspect: Callable[[int, str, int], None],
        rounds: int,
        secret: bytes | None = None,
    ) -> None:
        self.train, self.certificate, self.site = train, certificate, site
        self.on_suspect, self.rounds = on_suspect, rounds
        self.queue = max(QUEUE, 4 * train.workers)  # four rounds of every site
        self.draw = AuditDraw(train.audit.rate, secret)
        whys = {unauditable(train, i) for i in range(train.P)} - {None}
        self.why_not = sorted(w for w in whys if w)[0] if whys else None
        self._kept: dict[tuple[int, int], Kept] = {}  # (rank, round) → its commitments
        self._asks: dict[tuple[int, int], float] = {}  # (rank, round) → asked at
        self._open: dict[int, int] = {}  # round → its uploads queued, verdicts still to come
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="auditor", initializer=_yield_cpu)
        self._queued = self.asked = self.passed = self.compared = self.skipped = 0
        self.incidents: list[AuditIncidentModel] = []
        self.by_kind: dict[str, int] = {}
        self.suspects: set[str] = set()
        self._lock = threading.Lock()
        if self.why_not is not None:
            log.warning("no audits by recomputation: %s", self.why_not)

    @property
    def on(self) -> bool:
        return self.draw.rate > 0 and self.why_not is None

    # ------------------------------------------------------------- commitments
    def commitment(self, rank: int, rnd: int, c: Commitment) -> None:
        """A verified train commitment of ``rank`` for round ``rnd`` (CommitmentAudit)."""
        entries = {(e.frame, e.way): e for e in c.entries}
        k = Kept(c.identity, c.ring, c.first, c.end, entries, site=self.site(rank))
        with self._lock:  # a new record: an audit under way keeps the one it was given
            self._kept[rank, rnd] = k  # its signed state digest comes with the same reply
            old = rnd - self.train.audit.keep_rounds - 1
            for key in [key for key in self._kept if key[1] < old and key not in self._asks]:
                del self._kept[key]

    def asks(self) -> str:
        """The train order's ``audit-asks``: "rank:round,…" ("" for none); the upload's
        time (``timeout_s``) counts from this order."""
        now = time.time()
        with self._lock:
            for key in self._asks:
                self._asks[key] = now
            return ",".join(f"{k}:{r}" for k, r in sorted(self._asks))

    # ------------------------------------------------------------------ replies
    def after_train(self, rnd: int, replies: Iterable[Message]) -> None:
        """Round ``rnd``'s replies: their state digests, the uploads asked, the next draw.
        Never raises."""
        if not self.on:
            return
        ranks = []
        for reply in replies:
            try:
                rank = rank_of_node(reply.metadata.src_node_id)
                ranks.append(rank)
                self._state(reply, rank, rnd)
                self._answer(reply, rank)
            except Exception:  # one reply's trouble (or a bug) must not end the run
                log.exception("round %d: a reply's audit records could not be handled", rnd)
        try:
            self._draw(rnd, ranks)
        except Exception:
            log.exception("round %d: no audits drawn", rnd)

    def _state(self, reply: Message, rank: int, rnd: int) -> None:
        """The signed digest of ``rank``'s group state at round ``rnd``'s start."""
        if AUDIT_STATE not in reply.content:
            return
        cert = self.certificate(rank)
        try:
            signed = Signed.of(reply.content[AUDIT_STATE])
            why = None if cert is None else verify(cert, signed.body, signed.signature)
            doc = json.loads(signed.body.decode("ascii")) if why is None else None
        except (KeyError, TypeError, ValueError) as exc:
            why, doc = f"unreadable ({exc!r})", None
        if cert is None or not isinstance(doc, dict):
            log.error("round %d: %s's state digest is refused: %s", rnd, self.site(rank), why)
            return
        identity = certificate_identity(cert)
        with self._lock:
            k = self._kept.get((rank, rnd))
            if k is None or (doc.get("round"), doc.get("rank")) != (rnd, rank):
                return
            if (doc.get("identity"), doc.get("ring"), doc.get("first")) == (
                identity,
                k.ring,
                k.first,
            ):
                k.state = str(doc.get("sha256"))

    def _answer(self, reply: Message, rank: int) -> None:
        """The upload ``rank``'s reply carries for its asked round, queued for the auditor;
        or the refusal, or the lateness, named."""
        with self._lock:
            asked = [(key, at) for key, at in self._asks.items() if key[0] == rank]
        for (_, r), at in asked:
            with self._lock:
                del self._asks[rank, r]
                kept = self._kept.get((rank, r))
            cert = self.certificate(rank)
            if kept is None or cert is None or certificate_identity(cert) != kept.identity:
                log.info("audit of round %d of rank %d dropped: another site holds it", r, rank)
                continue
            up = reply.content.get(AUDIT_UPLOAD)
            site = kept.site
            if up is None or up.get("round") != r or "missing" in up:
                why = "no upload" if up is None else str(up.get("missing", "another round"))
                refused = Finding(REFUSED, f"{site} did not upload round {r}: {why}")
                self._found(rank, r, refused, kept)
            elif time.time() - at > self.train.audit.timeout_s:
                late = f"{site} uploaded round {r} {time.time() - at:.0f} s after it was asked"
                self._found(rank, r, Finding(TIMED_OUT, late), kept)
            else:
                nxt = self._next_state(rank, r, kept)
                with self._lock:
                    self._queued += 1
                    self._open[r] = self._open.get(r, 0) + 1
                self._pool.submit(self._run, rank, r, kept, dict(up), nxt)

    def _next_state(self, rank: int, rnd: int, kept: Kept) -> str | None:
        """The state digest ``rank`` signed at round ``rnd`` + 1's start, where that round
        goes on from this one's end (the same site, ring, no ring sync)."""
        with self._lock:
            n = self._kept.get((rank, rnd + 1))
        if n is None or self.train.rings > 1:
            return None
        same = (n.identity, n.ring, n.first) == (kept.identity, kept.ring, kept.end)
        return n.state if same else None

    def _draw(self, rnd: int, ranks: list[int]) -> None:
        """Draw round ``rnd`` of each rank that replied; a drawn site that signed its
        commitment but no state digest cannot be audited: it is named, as if it refused
        (one without a valid commitment is named by the commitments' check)."""
        if rnd >= self.rounds:
            return
        now, unsigned = time.time(), []
        with self._lock:
            busy = {k for k, _ in self._asks}
            for rank in sorted(ranks):
                if rank in busy or not self.draw.drawn(rnd, rank):
                    continue
                k = self._kept.get((rank, rnd))
                if k is None:  # no valid commitment: the commitments' check names it
                    continue
                if k.state is None:  # a commitment, but no signed state to restore
                    unsigned.append(rank)
                    continue
                if self._queued + len(self._asks) >= self.queue:  # the auditor lags
                    self.skipped += 1
                    continue
                self._asks[rank, rnd] = now
                self.asked += 1
        for rank in unsigned:
            site = self.site(rank)
            what = f"{site} signed no state digest for round {rnd}: it cannot be audited"
            self._found(
                rank, rnd, Finding(REFUSED, what), Kept(site=site, identity=self._who(rank))
            )

    def _who(self, rank: int) -> str:
        cert = self.certificate(rank)
        return "" if cert is None else certificate_identity(cert)

    # ---------------------------------------------------------------- auditor
    def _run(
        self, rank: int, rnd: int, kept: Kept, upload: dict[str, Any], nxt: str | None
    ) -> None:
        try:
            found = audit(self.train, rank, rnd, kept, upload, nxt)
        except Exception as exc:
            log.exception("the audit of round %d of rank %d failed", rnd, rank)
            found = Finding(ERROR, f"the auditor could not replay round {rnd}: {exc!r}")
        finally:
            with self._lock:
                self._queued -= 1
        try:
            self._found(rank, rnd, found, kept)
        finally:  # open until its verdict (and any eviction) is out
            with self._lock:
                self._open[rnd] -= 1
                if not self._open[rnd]:
                    del self._open[rnd]

    def rolled_back(self, rnd: int) -> None:
        """The run rolled back to round ``rnd`` past newer rounds (a failed audit): the
        audits asked are dropped (counted ``skipped``: a site may no longer hold the round
        as it trained it), and so are the commitments of the rounds after ``rnd``."""
        with self._lock:
            self.skipped += len(self._asks)
            self._asks.clear()
            self._kept = {k: v for k, v in self._kept.items() if k[1] <= rnd}

    def oldest_open(self) -> int | None:
        """The oldest round an audit asked or under way may still fail (None: none): a
        failure rolls the run back before it, so its checkpoint must stay."""
        with self._lock:
            return min([r for _, r in self._asks] + list(self._open), default=None)

    def _found(self, rank: int, rnd: int, f: Finding, kept: Kept) -> None:
        """Keep what audit of ``kept`` (round ``rnd`` of ``rank``) found; a site it names
        is a suspect, evicted only while it still holds the rank (never its standby)."""
        site = kept.site
        if f.kind is None:
            with self._lock:
                self.passed += 1
                self.compared += f.compared
            log.info("audit of %s's round %d passed: %d frames equal", site, rnd, f.compared)
            return
        what = f.what if f.kind == ERROR else f"{site}, round {rnd}: {f.what}"
        named = None if f.kind == ERROR else site
        inc = AuditIncidentModel(
            kind=f.kind, what=what, site=named, round=rnd, step=f.step, detected_at=time.time()
        )
        with self._lock:
            self.by_kind[f.kind] = self.by_kind.get(f.kind, 0) + 1
            self.incidents = [*self.incidents, inc][-KEEP:]
            new = named is not None and named not in self.suspects
            if named is not None:
                self.suspects.add(named)
        log.error("audit: %s: %s", f.kind, what)
        cert = self.certificate(rank)
        if new and cert is not None and certificate_identity(cert) == kept.identity:
            self.on_suspect(rank, f"{f.kind}: {what}", rnd)

    # ----------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        """Status's ``audits`` block (:class:`AuditStatusModel`)."""
        with self._lock:
            return {
                "rate": self.draw.rate,
                "asked": self.asked,
                "passed": self.passed,
                "frames_compared": self.compared,
                "pending": len(self._asks) + self._queued,
                "skipped": self.skipped,
                "incidents": [i.model_dump() for i in self.incidents],
                "by_kind": dict(sorted(self.by_kind.items())),
                "suspects": sorted(self.suspects),
                "unauditable": self.why_not,
            }

    def wait(self, timeout: float = 60.0) -> None:
        """Until the audits queued are done (the run's end, tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._queued == 0:
                    return
            time.sleep(0.05)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
