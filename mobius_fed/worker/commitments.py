"""A worker's commitments (docs/security.md "Commitments"): the sha256 of every ring frame
it sends and receives, taken where the bytes go on and come off the wire, and the signed
list it sends with each train and evaluate reply (the format:
:mod:`mobius_fed.transport.commitments`).

:class:`FrameLedger` is fed by the ring links (:class:`~mobius_fed.worker.link.RingLinks`
as it sends, :class:`~mobius_fed.worker.link_session.FrameRouter` as it delivers or relays);
:class:`Commitments` takes a reply's entries out of it, waits for the relayed frames the
schedule says are still on their way, and signs them with the site's TLS key.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from mobius_fed.config import TrainConfig
from mobius_fed.engine.audit_replay import unauditable
from mobius_fed.messages import Signed
from mobius_fed.transport.commitments import (
    EVAL,
    RECEIVED,
    SENT,
    TRAIN,
    Commitment,
    Entry,
    Frame,
    frame_hops,
    own_entries,
    sign,
)
from mobius_fed.worker.audits import AuditStore, state_body
from mobius_fed.worker.frames import FrameKey

__all__ = ["RECEIVED", "SENT", "Commitments", "FrameLedger"]
log = logging.getLogger("mobius.worker")
Claim = tuple[Frame, str, int]  # (frame, way, global peer)


def frame_of(key: FrameKey) -> Frame:
    return (key.step, key.phase, key.direction, key.origin, key.tick, key.micro)


class FrameLedger:
    """The frames this worker's ring links sent and received in the current ring
    incarnation, each with its digest: what its next commitments list. ``base``: the
    global rank of its ring's worker 0 (peers are recorded by global rank). The executor
    (sending), both link threads (receiving) and the reply handler (taking) call it."""

    def __init__(self, base: int = 0, store: AuditStore | None = None) -> None:
        self.base = base
        self.store = store  # audits: the train frames' pieces are kept for an upload
        self._entries: dict[Claim, str] = {}
        self._partial: dict[tuple[int, FrameKey], Any] = {}  # (side, key) → its sha256 so far
        self._pieces: dict[tuple[int, FrameKey], list[bytes]] = {}  # audits: pieces so far
        self._whole: dict[FrameKey, list[bytes]] = {}  # audits: a received frame's pieces
        self._cond = threading.Condition()

    @property
    def keeping(self) -> bool:
        return self.store is not None

    def piece(self, side: int, key: FrameKey, chunk: int, chunks: int, data: bytes) -> str | None:
        """Fold one received piece (a validated one, in order) of frame ``key`` that came
        in on ``side`` into its digest; the hex digest once ``chunk`` is the last."""
        with self._cond:
            h = hashlib.sha256() if chunk == 0 else self._partial.pop((side, key), None)
            if h is None:  # cannot happen after validation: the pieces come in order
                return None
            h.update(data)
            if self.store is not None and key.phase == TRAIN:
                held = [] if chunk == 0 else self._pieces.pop((side, key), [])
                held.append(bytes(data))
                if chunk + 1 < chunks:
                    self._pieces[side, key] = held
                else:
                    self._whole[key] = held
            if chunk + 1 < chunks:
                self._partial[side, key] = h
                return None
            return h.hexdigest()

    def record(
        self, key: FrameKey, way: str, peer: int, digest: str, pieces: list[bytes] | None = None
    ) -> None:
        """Frame ``key`` was ``way`` (SENT or RECEIVED) to or from ring-local ``peer``
        (``pieces``: a sent frame's, for an audit)."""
        with self._cond:
            self._entries[frame_of(key), way, self.base + peer] = digest
            if way == RECEIVED:
                pieces = self._whole.pop(key, None)
            self._cond.notify_all()
        if self.store is not None and pieces is not None and key.phase == TRAIN:
            self.store.frame(frame_of(key), way, pieces)

    def clear(self) -> None:
        """A new ring incarnation: nothing of the old one is committed."""
        with self._cond:
            self._entries.clear()
            self._partial.clear()
            self._pieces.clear()
            self._whole.clear()
        if self.store is not None:
            self.store.clear()

    def wait_for(
        self, claims: set[Claim], timeout: float, abandoned: Callable[[], bool]
    ) -> set[Claim]:
        """Wait until every claim is recorded, the links are ``abandoned()`` or ``timeout``
        seconds passed; the claims still missing."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                missing = claims - self._entries.keys()
                left = deadline - time.monotonic()
                if not missing or left <= 0 or abandoned():
                    return missing
                self._cond.wait(min(left, 0.2))

    def take(self, phase: int, first: int, end: int) -> list[Entry]:
        """The entries of ``phase`` at steps [first, end), removed (with older ones of that
        phase, which no reply will carry any more)."""
        out = []
        with self._cond:
            for claim in list(self._entries):
                (step, ph, *_), way, peer = claim
                if ph != phase or step >= end:
                    continue
                digest = self._entries.pop(claim)
                if step >= first:
                    out.append(Entry(*claim[0], way, peer, digest))
        return sorted(out)


class Commitments:
    """Worker ``rank``'s (global; ``local`` in its ring) commitments, signed with
    ``key_pem``, the private key of its certificate ``identity``. ``timeout``: how long a
    reply waits for frames it should relay that are still on their way."""

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        local: int,
        identity: str,
        key_pem: bytes,
        timeout: float,
    ) -> None:
        self.cfg, self.rank, self.local, self.identity = cfg, rank, local, identity
        self._key, self.timeout = key_pem, timeout
        a = cfg.audit
        why = unauditable(cfg, local) if a.rate > 0 else "audit.rate = 0"
        if why is not None and a.rate > 0:
            log.info("worker-%d: no audits by recomputation: %s", rank, why)
        # audits (docs/audits.md): the last rounds' frames and group states, for an upload
        self.store = AuditStore(a.keep_rounds, a.window) if why is None else None
        self.ledger = FrameLedger(base=rank - local, store=self.store)

    def expected(self, phase: int, first: int, end: int) -> set[Claim]:
        """What this worker must commit for ``phase`` at steps [first, end)."""
        c = self.cfg
        micros = c.micro_batches * (c.eval_batches if phase == EVAL else 1)
        out: set[Claim] = set()
        for step in range(first, end):
            hops = frame_hops(c.order, c.P, c.loops, micros, phase, step)
            out |= own_entries(hops, self.local, self.ledger.base)
        return out

    def seal(
        self,
        ring: str,
        rnd: int,
        phase: int,
        first: int,
        end: int,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> Signed:
        """The signed commitment of round ``rnd``'s ``phase`` frames at steps [first, end)
        on ring incarnation ``ring``. A frame this worker relays may still be on its way
        when its own steps are done: it waits for those (up to ``timeout``)."""
        expected = self.expected(phase, first, end)
        missing = self.ledger.wait_for(expected, self.timeout, abandoned)
        if missing:
            log.warning(
                "worker-%d: round %d's commitment goes without %d frame(s) that never came "
                "through (e.g. %s)",
                self.rank,
                rnd,
                len(missing),
                sorted(missing)[0],
            )
        entries = tuple(self.ledger.take(phase, first, end))
        body = Commitment(ring, rnd, phase, first, end, self.rank, self.identity, entries)
        data = body.encode()
        return Signed(data, self.sign(data))

    def seal_state(self, ring: str, rnd: int, first: int, digest: str) -> Signed:
        """The signed digest of this worker's group state at the start of round ``rnd``
        (step ``first``) on ring incarnation ``ring``: what an audit restores."""
        data = state_body(ring, rnd, first, self.rank, self.identity, digest)
        return Signed(data, self.sign(data))

    def sign(self, data: bytes) -> bytes:
        return sign(self._key, data)
