"""The auditor: one site's round replayed and compared with what it committed
(docs/audits.md). Pure functions of the site's commitment, its signed state digest and its
upload; :mod:`mobius_fed.coordinator.audits` decides what to audit and runs them.

An upload (:meth:`mobius_fed.worker.audits.AuditStore.upload`) holds the group's state at
the round's start, the pieces of every ring frame the site sent and received in the
audited steps and the tensors its own home passed its own group. Each must be what the
site committed: the state's digest the one it signed with its reply, each frame's sha256
the one its commitment lists (else ``upload mismatch``). Then the group is rebuilt from
the state and its steps replayed (:class:`~mobius_fed.engine.audit_replay.GroupReplay`) on
the frames it received: every frame its group computed and sent must equal, bit for bit,
the one it sent (else ``audit failed``, naming the first that differs); with the whole
round replayed, the group's state afterwards must be the one it signed at the next round's
start, and a run's first round must start from the seed's state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mobius_fed.config import TrainConfig
from mobius_fed.engine.audit_replay import (
    GroupReplay,
    decode_frame,
    initial_state,
    load_state,
    state_digest,
)
from mobius_fed.transport.codec import FrameError
from mobius_fed.transport.commitments import RECEIVED, SENT, Entry, Frame

FAILED, MISMATCH = "audit failed", "upload mismatch"


@dataclass
class Kept:
    """What site ``identity`` committed for one round: its frames' digests (by frame and
    way) and, with audits on, its group state's digest at the round's start."""

    identity: str = ""
    ring: str = ""
    first: int = 0
    end: int = 0
    entries: dict[tuple[Frame, str], Entry] = field(default_factory=dict)
    state: str | None = None
    site: str = ""  # its name when it committed (worker-2)


@dataclass
class Finding:
    """An audit's verdict: ``kind`` None when it passed."""

    kind: str | None
    what: str = ""
    step: int | None = None
    compared: int = 0


class _Refused(Exception):
    def __init__(self, kind: str, what: str, step: int | None = None) -> None:
        super().__init__(what)
        self.kind, self.what, self.step = kind, what, step


def parse_frame_name(name: str) -> tuple[str, Frame] | None:
    """``sent|3.1.2.0.4.0`` → (way, frame); None for any other key."""
    way, sep, rest = name.partition("|")
    parts = rest.split(".")
    if not sep or way not in (SENT, RECEIVED, "local") or len(parts) != 6:
        return None
    if not all(p.isdigit() for p in parts):
        return None
    a, b, c, d, e, f = (int(p) for p in parts)
    return way, (a, b, c, d, e, f)


def audit(
    train: TrainConfig,
    rank: int,
    rnd: int,
    kept: Kept,
    upload: dict[str, Any],
    next_state: str | None = None,
) -> Finding:
    """Audit round ``rnd`` of the site holding global ``rank`` (its group is F_{rank mod
    P}). ``next_state``: the state digest it signed at the next round's start when that
    round follows on the same ring without a ring sync (else None)."""
    try:
        first, end = _scope(kept, upload, rnd)
        state = _state(kept, upload)
        try:
            replay = GroupReplay(train, rank % train.P, state)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise _Refused(MISMATCH, f"the uploaded state is not its group's ({exc})") from None
        received, sent = _frames(train, kept, upload, replay)
        try:
            return _replay(train, replay, first, end, received, sent, kept, next_state)
        except _Refused:
            raise
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as exc:
            # what it signed does not even run (a state or a local tensor of another shape)
            raise _Refused(MISMATCH, f"its upload cannot be replayed ({exc})") from None
    except _Refused as r:
        return Finding(r.kind, r.what, r.step)


def _scope(kept: Kept, upload: dict[str, Any], rnd: int) -> tuple[int, int]:
    first, end = upload.get("first"), upload.get("end")
    if upload.get("round") != rnd or upload.get("ring") != kept.ring or first != kept.first:
        raise _Refused(MISMATCH, f"the upload is not of round {rnd} on ring {kept.ring!r}")
    if not isinstance(end, int) or not first < end <= kept.end:
        raise _Refused(MISMATCH, f"the upload's steps {first}..{end} are not round {rnd}'s")
    return first, end


def _state(kept: Kept, upload: dict[str, Any]) -> dict[str, Any]:
    data = upload.get("state")
    if not isinstance(data, bytes):
        raise _Refused(MISMATCH, "the upload holds no group state")
    try:
        state = load_state(data)
    except Exception as exc:
        raise _Refused(MISMATCH, f"the uploaded group state cannot be read ({exc})") from None
    if kept.state is None or state_digest(state) != kept.state:
        raise _Refused(MISMATCH, "the uploaded group state is not the one it signed")
    return state


def _frames(
    train: TrainConfig, kept: Kept, upload: dict[str, Any], replay: GroupReplay
) -> tuple[dict[Frame, Tensor], dict[Frame, Tensor]]:
    """The received frames (and what its home passed its own group without a hop) and
    the sent ones, decoded, each checked against its committed digest. A frame it did
    not commit is left out (one that came in after its commitment was sealed)."""
    received: dict[Frame, Tensor] = {}
    sent: dict[Frame, Tensor] = {}
    local = upload.get("local")
    try:
        homes = load_state(local) if isinstance(local, bytes) else {}
    except Exception as exc:
        raise _Refused(MISMATCH, f"the uploaded local frames cannot be read ({exc})") from None
    for name, t in homes.items():
        parsed = parse_frame_name(str(name))
        if parsed is not None and isinstance(t, Tensor) and replay.from_home(parsed[1]):
            if t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
                raise _Refused(MISMATCH, f"local frame {name} is not a finite float32 tensor")
            received[parsed[1]] = t
    for name, pieces in upload.items():
        parsed = parse_frame_name(name)
        if parsed is None or parsed[0] == "local":
            continue
        way, frame = parsed
        entry = kept.entries.get((frame, way))
        if entry is None:
            continue
        if not isinstance(pieces, list) or not all(isinstance(p, bytes) for p in pieces):
            raise _Refused(MISMATCH, f"frame {name} is not a list of pieces", frame[0])
        if hashlib.sha256(b"".join(pieces)).hexdigest() != entry.sha256:
            raise _Refused(MISMATCH, f"{_show(frame, way)} is not what it committed", frame[0])
        try:
            tensor = decode_frame(train, frame, pieces)
        except FrameError as exc:
            raise _Refused(MISMATCH, f"{_show(frame, way)} does not decode: {exc}") from None
        (received if way == RECEIVED else sent)[frame] = tensor
    return received, sent


def _replay(
    train: TrainConfig,
    replay: GroupReplay,
    first: int,
    end: int,
    received: dict[Frame, Tensor],
    sent: dict[Frame, Tensor],
    kept: Kept,
    next_state: str | None,
) -> Finding:
    if first == 0 and state_digest(initial_state(train, replay.rank)) != kept.state:
        raise _Refused(FAILED, "its group state at step 0 is not the seed's", 0)
    compared = 0

    def take(frame: Frame) -> Tensor:
        if frame not in received:
            raise _Refused(MISMATCH, f"the upload lacks {_show(frame, RECEIVED)}", frame[0])
        return received[frame]

    for n in range(first, end):
        out = replay.step(n, take)
        for frame, want in sorted(out.items()):
            if (frame, SENT) not in kept.entries:
                continue  # not committed: the commitments' check names it
            got = sent.get(frame)
            if got is None:
                raise _Refused(MISMATCH, f"the upload lacks {_show(frame, SENT)}", n)
            if not torch.equal(got, want):
                what = f"it sent other values than its group computes: {_show(frame, SENT)}"
                if got.shape == want.shape:
                    what += f" (largest difference {(got - want).abs().max().item():.3g})"
                raise _Refused(FAILED, what, n)
            compared += 1
    if next_state is not None and end == kept.end and state_digest(replay.state()) != next_state:
        what = "its group state at the next round's start is not what this round's steps make"
        raise _Refused(FAILED, what, end)
    return Finding(None, compared=compared)


def _show(frame: Frame, way: str) -> str:
    return Entry(*frame, way, 0, "0" * 64).describe() + f" ({way})"
