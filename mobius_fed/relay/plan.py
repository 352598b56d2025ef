"""Which way each ring edge connects (``direct``, ``reversed``, ``relayed``), from what every
worker declared at registration (the paths: docs/reachability.md, first table).

A worker's *ring entry* travels in the ring order's peer list as one string: plain
``host:port`` for a reachable worker with nothing else to say (as before), otherwise
``host:port;reachable=no;rendezvous=host:port;relay=host:port``. A ``relayed`` edge uses the
successor's relay, else the predecessor's.
"""

from __future__ import annotations

from dataclasses import dataclass

DIRECT, REVERSED, RELAYED = "direct", "reversed", "relayed"
PATHS = (DIRECT, REVERSED, RELAYED)


class RingPlanError(ValueError):
    """A ring edge that cannot connect as declared (the message names it)."""


@dataclass(frozen=True)
class RingEntry:
    """What one worker told the coordinator about reaching it."""

    address: str
    reachable: bool = True
    rendezvous: str = ""  # where outbound-only successors open their tunnels
    relay: str = ""  # the relay this worker uses for edges where neither end accepts

    def encode(self) -> str:
        if self.reachable and not self.rendezvous and not self.relay:
            return self.address
        parts = [self.address, f"reachable={'yes' if self.reachable else 'no'}"]
        parts += [
            f"{k}={v}" for k, v in (("rendezvous", self.rendezvous), ("relay", self.relay)) if v
        ]
        return ";".join(parts)

    @classmethod
    def parse(cls, text: str) -> RingEntry:
        address, *fields = text.split(";")
        kv: dict[str, str] = {}
        for f in fields:
            key, sep, value = f.partition("=")
            if not sep or key not in ("reachable", "rendezvous", "relay") or key in kv:
                raise RingPlanError(f"ring entry {text[:120]!r}: bad field {f[:40]!r}")
            kv[key] = value
        if kv.get("reachable", "yes") not in ("yes", "no"):
            raise RingPlanError(f"ring entry {text[:120]!r}: reachable must be yes or no")
        for key in ("rendezvous", "relay"):
            if kv.get(key) and not is_host_port(kv[key]):
                raise RingPlanError(f"ring entry {text[:120]!r}: {key} is not host:port")
        return cls(address, kv.pop("reachable", "yes") == "yes", **kv)  # rendezvous, relay


@dataclass(frozen=True)
class EdgePlan:
    """How edge ``pred`` → ``succ`` connects: its path and where the two ends meet."""

    pred: int
    succ: int
    path: str
    meet: str  # direct: succ's address; reversed: pred's rendezvous; relayed: the relay

    @property
    def name(self) -> str:
        return f"worker-{self.pred} → worker-{self.succ}"


def plan_edge(pred: int, succ: int, a: RingEntry, b: RingEntry) -> EdgePlan:
    """The path of edge ``pred`` → ``succ`` given their entries ``a`` and ``b``."""
    name = f"worker-{pred} → worker-{succ}"
    if b.reachable:
        return EdgePlan(pred, succ, DIRECT, b.address)
    if a.reachable and a.rendezvous:
        return EdgePlan(pred, succ, REVERSED, a.rendezvous)
    relay = b.relay or a.relay
    if not relay and a.reachable:
        raise RingPlanError(
            f"ring edge {name}: worker-{succ} only dials out, worker-{pred} opens no "
            f"rendezvous port (give worker-{pred} --tunnel-listen / MOBIUS_TUNNEL_LISTEN) "
            "and neither names a relay (--relay)"
        )
    if not relay:
        raise RingPlanError(
            f"ring edge {name}: neither worker accepts connections (both --reachable no) "
            "and neither names a relay; run mobius-relay somewhere both reach and give "
            "both --relay HOST:PORT (MOBIUS_RELAY)"
        )
    return EdgePlan(pred, succ, RELAYED, relay)


def plan_ring(entries: list[str]) -> list[EdgePlan]:
    """Every edge i → i+1 of the ring whose peer list is ``entries`` (index = rank)."""
    parsed = [RingEntry.parse(e) for e in entries]
    P = len(parsed)
    return [plan_edge(i, (i + 1) % P, parsed[i], parsed[(i + 1) % P]) for i in range(P)]


def check_known_edges(entries: list[str]) -> None:
    """Refuse (RingPlanError naming the edge) any edge between registered workers that
    cannot connect; an empty entry is a worker not registered yet."""
    P = len(entries)
    for i in range(P):
        j = (i + 1) % P
        if P > 1 and entries[i] and entries[j]:
            plan_edge(i, j, RingEntry.parse(entries[i]), RingEntry.parse(entries[j]))


def is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
