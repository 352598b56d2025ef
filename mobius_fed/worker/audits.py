"""A site's side of audits by recomputation (docs/audits.md).

:class:`AuditStore` keeps, for the last ``audit.keep_rounds`` train rounds, what an
auditor needs to replay the site's block group: the group's state at the round's start
(its digest goes, signed, with the round's reply), every ring frame's pieces as they came
off or went on the wire (the bytes its commitment digests) and the tensors its own
embedding passed its own group without a hop. When the coordinator asks for a round (the
next train order's ``audit-asks``), :meth:`AuditStore.upload` is what the reply carries.
Memory is bounded by the rounds kept; nothing here changes the math.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from flwr.app import ConfigRecord
from torch import Tensor

from mobius_fed.engine.audit_replay import state_bytes, state_digest
from mobius_fed.transport.commitments import Frame

__all__ = ["AuditStore", "frame_name", "frame_of", "parse_asks", "state_body"]


def frame_of(key: Any) -> Frame:
    """A :class:`~mobius_fed.worker.frames.FrameKey` as a commitment names its frame."""
    return (key.step, key.phase, key.direction, key.origin, key.tick, key.micro)


def frame_name(way: str, frame: Frame) -> str:
    """An uploaded frame's record key: ``sent|3.1.2.0.4.0`` (way | the frame's fields)."""
    return f"{way}|{'.'.join(str(v) for v in frame)}"


def parse_asks(text: str) -> list[tuple[int, int]]:
    """``audit-asks`` of a train order: "rank:round,…" → [(rank, round), …] (bad parts
    are left out)."""
    out = []
    for part in text.split(","):
        rank, _, rnd = part.partition(":")
        if rank.isdigit() and rnd.isdigit():
            out.append((int(rank), int(rnd)))
    return out


def state_body(ring: str, rnd: int, first: int, rank: int, identity: str, digest: str) -> bytes:
    """The canonical body a site signs for its group's state at the start of a round."""
    doc = {
        "v": 1, "kind": "state", "ring": ring, "round": rnd, "first": first, "rank": rank,
        "identity": identity, "sha256": digest,
    }  # fmt: skip
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class _Round:
    def __init__(self, ring: str, rnd: int, first: int, state: bytes) -> None:
        self.ring, self.rnd, self.first, self.end = ring, rnd, first, first
        self.state = state
        self.frames: dict[tuple[Frame, str], list[bytes]] = {}
        self.local: dict[Frame, Tensor] = {}


class AuditStore:
    """The last ``keep`` train rounds of one site, for its auditor. The ring links (frames
    sent and received), the executor (its home's local frames) and the reply handler
    (rounds opened, closed and uploaded) call it."""

    def __init__(self, keep: int, window: int = 0) -> None:
        self.keep, self.window = keep, window
        self._frames: dict[tuple[Frame, str], list[bytes]] = {}
        self._local: dict[Frame, Tensor] = {}
        self._rounds: dict[int, _Round] = {}
        self._open: _Round | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ feed
    def frame(self, frame: Frame, way: str, pieces: list[bytes]) -> None:
        """Frame ``frame`` ``way`` (sent or received) as these pieces (a frame of the next
        step may come in before its round opens)."""
        with self._lock:
            self._frames[frame, way] = pieces

    def local(self, frame: Frame, tensor: Tensor) -> None:
        """A frame the site's home passed its own group (slot 0) or the group its home."""
        with self._lock:
            self._local[frame] = tensor.detach().clone()

    def clear(self) -> None:
        """A new ring incarnation: frames not yet in a closed round are dropped."""
        with self._lock:
            self._frames.clear()
            self._local.clear()
            self._open = None

    # ---------------------------------------------------------------- rounds
    def open_round(self, ring: str, rnd: int, first: int, state: dict[str, Any]) -> str:
        """Round ``rnd`` starts at step ``first`` from the group ``state``: its digest."""
        digest = state_digest(state)
        data = state_bytes(state)
        with self._lock:
            self._frames = {k: v for k, v in self._frames.items() if k[0][0] >= first}
            self._local = {k: v for k, v in self._local.items() if k[0] >= first}
            self._open = _Round(ring, rnd, first, data)
        return digest

    def close_round(self, end: int) -> None:
        """The open round's steps ended at ``end``: keep its frames, drop the oldest."""
        with self._lock:
            r = self._open
            if r is None:
                return
            r.end = end
            r.frames = {k: v for k, v in self._frames.items() if k[0][0] < end}
            r.local = {k: v for k, v in self._local.items() if k[0] < end}
            self._frames = {k: v for k, v in self._frames.items() if k[0][0] >= end}
            self._local = {k: v for k, v in self._local.items() if k[0] >= end}
            self._open = None
            self._rounds.pop(r.rnd, None)  # a round trained again (after a rollback) is new
            self._rounds[r.rnd] = r
            while len(self._rounds) > self.keep:  # the oldest kept, not the lowest number
                del self._rounds[next(iter(self._rounds))]

    @property
    def rounds(self) -> list[int]:
        with self._lock:
            return sorted(self._rounds)

    def upload(self, rnd: int) -> ConfigRecord | None:
        """Round ``rnd``'s upload (its first ``window`` steps), None if not kept."""
        with self._lock:
            r = self._rounds.get(rnd)
            if r is None:
                return None
            end = r.end if self.window == 0 else min(r.end, r.first + self.window)
            rec: dict[str, Any] = {
                "round": r.rnd, "ring": r.ring, "first": r.first, "end": end, "state": r.state,
            }  # fmt: skip
            for (frame, way), pieces in sorted(r.frames.items()):
                if frame[0] < end:
                    rec[frame_name(way, frame)] = list(pieces)
            local = {frame_name("local", f): t for f, t in r.local.items() if f[0] < end}
        rec["local"] = state_bytes(local)
        return ConfigRecord(rec)
