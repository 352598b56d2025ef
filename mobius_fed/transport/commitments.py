"""Commitments: what a site signs about the ring frames it sent and received
(docs/security.md "Commitments", docs/architecture.md §7).

A commitment covers one reply: the ring incarnation (the frames' run id), the round, the
phase (TRAIN: the round's steps; EVAL: the evaluation at one step) and the signer's global
rank and certificate identity. Each :class:`Entry` names one frame (step, phase, direction,
origin, slot, micro-batch), whether the signer sent or received it, the peer at the other
end of that hop (a global rank) and the sha256 of the frame as it went on or came off the
wire: the serialized bytes of each of its pieces, in order. A relay forwards the very
bytes it received, and a resent piece is the piece kept for resending, so an honest
sender's digest and its receiver's are equal bit for bit.

The body is canonical JSON (sorted keys, no spaces, entries sorted, ASCII): one document
has one encoding, and :meth:`Commitment.decode` refuses any other. The signature is the
site's TLS private key's over the body's bytes (ECDSA with SHA-256 for EC keys, as
``certs init`` makes them; Ed25519; RSA-PSS with SHA-256), checked against the
certificate the site presented on its mTLS session.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from mobius_fed import schedule
from mobius_fed.proto import ring_pb2

VERSION = 1
SENT, RECEIVED = "sent", "received"
TRAIN, EVAL = ring_pb2.TRAIN, ring_pb2.EVAL
FORWARD, BACKWARD = ring_pb2.FORWARD, ring_pb2.BACKWARD
MAX_BODY_BYTES = 64 << 20
"""A body larger than this is refused before it is parsed (a round of a large run's
entries takes a few hundred kilobytes)."""
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIELDS = ("v", "ring", "round", "phase", "first", "end", "rank", "identity", "entries")

Frame = tuple[int, int, int, int, int, int]
"""(step, phase, direction, origin, slot, micro): one frame of a ring, ring-local."""


class CommitmentError(ValueError):
    """A commitment body that is not one this module writes (named field, named reason)."""


@dataclass(frozen=True, order=True)
class Entry:
    """One frame a site sent or received: its key, the hop's other end, its digest."""

    step: int
    phase: int
    direction: int
    origin: int
    slot: int
    micro: int
    way: str  # SENT or RECEIVED
    peer: int  # the global rank at the other end of the hop
    sha256: str  # hex digest of the frame's pieces as serialized on the wire

    @property
    def frame(self) -> Frame:
        return (self.step, self.phase, self.direction, self.origin, self.slot, self.micro)

    def describe(self) -> str:
        p = "TRAIN" if self.phase == TRAIN else "EVAL"
        d = "FORWARD" if self.direction == FORWARD else "BACKWARD"
        return f"{p} {d} step {self.step} origin {self.origin} slot {self.slot} micro {self.micro}"

    def row(self) -> list[Any]:
        return [*self.frame, self.way, self.peer, self.sha256]


@dataclass(frozen=True)
class Commitment:
    """One signed list: the scope it covers and its entries (sorted, no duplicates)."""

    ring: str
    round: int
    phase: int
    first: int  # the first step it covers
    end: int  # one past the last
    rank: int
    identity: str
    entries: tuple[Entry, ...]

    def encode(self) -> bytes:
        """The canonical body: the bytes a site signs."""
        doc = {
            "v": VERSION,
            "ring": self.ring,
            "round": self.round,
            "phase": self.phase,
            "first": self.first,
            "end": self.end,
            "rank": self.rank,
            "identity": self.identity,
            "entries": [e.row() for e in sorted(self.entries)],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Commitment:
        """Parse a body; :class:`CommitmentError` unless it is exactly what
        :meth:`encode` writes (so a signature covers one meaning only)."""
        if not isinstance(data, bytes) or len(data) > MAX_BODY_BYTES:
            raise CommitmentError(f"body is not bytes of at most {MAX_BODY_BYTES}")
        try:
            doc = json.loads(data.decode("ascii"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CommitmentError(f"body is not ASCII JSON ({exc})") from None
        if not isinstance(doc, dict) or sorted(doc) != sorted(_FIELDS):
            raise CommitmentError(f"body must hold exactly the fields {', '.join(_FIELDS)}")
        if doc["v"] != VERSION:
            raise CommitmentError(f"version {doc['v']!r} (expected {VERSION})")
        for name in ("round", "phase", "first", "end", "rank"):
            _integer(doc[name], name)
        for name in ("ring", "identity"):
            if not isinstance(doc[name], str) or len(doc[name]) > 256:
                raise CommitmentError(f"{name} must be a string of at most 256 characters")
        if not isinstance(doc["entries"], list):
            raise CommitmentError("entries must be a list")
        entries = tuple(_entry(row, k) for k, row in enumerate(doc["entries"]))
        if len(set(entries)) != len(entries):
            raise CommitmentError("entries repeat")
        fields = {k: doc[k] for k in _FIELDS if k not in ("v", "entries")}
        out = cls(**fields, entries=entries)
        if out.encode() != data:
            raise CommitmentError("body is not in canonical form (sorted, compact)")
        return out


def _integer(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 53:
        raise CommitmentError(f"{name} must be an integer in [0, 2^53)")
    return value


def _entry(row: Any, k: int) -> Entry:
    if not isinstance(row, list) or len(row) != 9:
        raise CommitmentError(f"entry {k} must be a list of 9 fields")
    names = ("step", "phase", "direction", "origin", "slot", "micro")
    step, phase, direction, origin, slot, micro = (
        _integer(v, f"entry {k} {n}") for v, n in zip(row[:6], names)
    )
    way, peer, digest = row[6], row[7], row[8]
    if way not in (SENT, RECEIVED):
        raise CommitmentError(f"entry {k}: way {str(way)[:20]!r} (expected sent or received)")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise CommitmentError(f"entry {k}: sha256 must be 64 lowercase hex digits")
    peer = _integer(peer, f"entry {k} peer")
    return Entry(step, phase, direction, origin, slot, micro, way, peer, digest)


# ------------------------------------------------------------------ signatures


def sign(key_pem: bytes, data: bytes) -> bytes:
    """``data`` signed with the PEM private key ``key_pem`` (EC, Ed25519 or RSA)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa

    key = serialization.load_pem_private_key(key_pem, password=None)
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey):
        return key.sign(data)
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, _pss(padding, hashes), hashes.SHA256())
    raise CommitmentError(f"cannot sign with a {type(key).__name__}")


def verify(cert_pem: bytes, data: bytes, signature: bytes) -> str | None:
    """None when ``signature`` is the signature of ``data`` by the key of the PEM
    certificate ``cert_pem``; else why not (never raises)."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa

    try:
        key = x509.load_pem_x509_certificate(cert_pem).public_key()
    except ValueError as exc:
        return f"the site's certificate cannot be read ({exc})"
    if not isinstance(signature, bytes) or not signature:
        return "no signature"
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
            key.verify(signature, data)
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, _pss(padding, hashes), hashes.SHA256())
        else:
            return f"a {type(key).__name__} certificate cannot sign commitments"
    except InvalidSignature:
        return "the signature is not the site's certificate key's over this body"
    except ValueError as exc:  # a malformed DER signature
        return f"the signature cannot be read ({exc})"
    return None


def _pss(padding: Any, hashes: Any) -> Any:
    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


# ---------------------------------------------------------------------- hops


def frame_hops(
    order: schedule.Order, P: int, loops: int, micros: int, phase: int, step: int
) -> Iterator[tuple[Frame, list[int]]]:
    """Every frame of one ring's ``phase`` at ``step`` that leaves its producer, with its
    route in travel order (ring-local ranks, producer first, at least two): the slot's
    hidden state from producer to consumer and, in TRAIN, its gradient back. ``micros``:
    micro-batches per stream in this phase (EVAL: M · eval_batches). The rule is the
    frame rules' (docs/architecture.md §6.4)."""
    K = P * loops
    directions = (FORWARD, BACKWARD) if phase == TRAIN else (FORWARD,)
    for origin in range(P):
        path = schedule.path(order, origin, P, loops)
        for slot in range(K + 1):
            a = schedule.producer(path, origin, slot)
            b = schedule.consumer(path, origin, slot)
            if a == b:
                continue
            route = schedule.ring_route(a, b, P)
            for direction in directions:
                hops = route if direction == FORWARD else route[::-1]
                for micro in range(micros):
                    yield (step, phase, direction, origin, slot, micro), hops


def own_entries(
    hops: Iterator[tuple[Frame, list[int]]], rank: int, base: int = 0
) -> set[tuple[Frame, str, int]]:
    """What ring-local ``rank`` must commit for ``hops``: (frame, way, global peer) for each
    hop it sends or receives (``base``: the global rank of its ring's worker 0)."""
    out: set[tuple[Frame, str, int]] = set()
    for frame, route in hops:
        for a, b in pairwise(route):
            if a == rank:
                out.add((frame, SENT, base + b))
            if b == rank:
                out.add((frame, RECEIVED, base + a))
    return out
