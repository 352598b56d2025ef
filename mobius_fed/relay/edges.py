"""One worker's tunnelled ring edges for one ring incarnation, from the ring plan."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

from mobius_fed.relay.plan import DIRECT, RELAYED, REVERSED, EdgePlan, RingPlanError, plan_ring
from mobius_fed.relay.rendezvous import Rendezvous
from mobius_fed.relay.splice import ACCEPT, DIAL, Intro, close_quietly, confirm_pairing
from mobius_fed.relay.tunnels import Forwarder, TunnelKeeper, relay_dialer

PAIR_TIMEOUT_S = 5.0  # a gRPC connection waits this long for a parked tunnel


@dataclass(frozen=True)
class TunnelKeys:
    """``run``: the coordinator's per-run key (reversed edges, from the run spec);
    ``relay``: the relay's shared key (relayed edges, --relay-key)."""

    run: bytes = b""
    relay: bytes = b""


class EdgeTunnels:
    """Worker ``rank``'s ends of its two ring edges as ``peers`` (ring entries) plan them."""

    def __init__(
        self,
        peers: list[str],
        rank: int,
        ring_id: str,
        keys: TunnelKeys,
        tunnel_listen: str | None = None,
    ) -> None:
        plan = plan_ring(peers)
        P = len(plan)
        self.rank, self.ring_id, self.keys = rank, ring_id, keys
        self.out: EdgePlan = plan[rank]
        self.inn: EdgePlan = plan[(rank - 1) % P]
        self.rendezvous: Rendezvous | None = None
        self.forwarder: Forwarder | None = None
        self.keeper: TunnelKeeper | None = None
        self.successor_address = self.out.meet
        if self.out.path == REVERSED:
            self._open_rendezvous(tunnel_listen)
        if self.out.path != DIRECT:
            self.forwarder = Forwarder(self._tunnel_opener(), self.out.name)
            self.successor_address = self.forwarder.address

    def _key(self, edge: EdgePlan) -> bytes:
        key = self.keys.relay if edge.path == RELAYED else self.keys.run
        if not key:
            what = "--relay-key (MOBIUS_RELAY_KEY)" if edge.path == RELAYED else "a run key"
            raise RingPlanError(
                f"ring edge {edge.name} is {edge.path} but this worker has no {what}"
            )
        return key

    def _open_rendezvous(self, listen: str | None) -> None:
        if not listen:
            raise RingPlanError(
                f"ring edge {self.out.name} is reversed but worker-{self.rank} has no "
                "rendezvous port to listen on (--tunnel-listen)"
            )
        edge = self.out.name

        def check(intro: Intro) -> str | None:
            if intro.run != self.ring_id:
                return f"run {intro.run[:60]!r} is not this ring ({self.ring_id})"
            if intro.edge != edge or intro.role != ACCEPT:
                return f"{intro.role} for {intro.edge[:60]!r} is not served here (only {edge})"
            return None

        self.rendezvous = Rendezvous(
            listen, self._key(self.out), check=check, name=f"rendezvous worker-{self.rank}"
        )

    def _tunnel_opener(self) -> Callable[[], socket.socket | None]:
        if self.out.path == REVERSED:
            rv, run, edge, key = self.rendezvous, self.ring_id, self.out.name, self._key(self.out)
            if rv is None:  # a reversed edge listens: its rendezvous was made first
                raise RuntimeError(f"edge {edge}: reversed, but no rendezvous is listening")

            def take() -> socket.socket | None:
                paired = rv.take(run, edge, PAIR_TIMEOUT_S)
                if paired is None:
                    return None
                try:  # the parked tunnel proves its own fresh introduction, or is closed
                    confirm_pairing(paired.sock, key, DIAL, paired.accept_nonce, paired.dial_nonce)
                except OSError:
                    close_quietly(paired.sock)
                    raise
                return paired.sock

            return take
        return relay_dialer(self.out.meet, self._key(self.out), self.ring_id, self.out.name)

    def start_keeper(self, local: str) -> None:
        """Once this worker's gRPC server listens on ``local``: keep the in-edge's tunnels."""
        if self.inn.path != DIRECT:
            self.keeper = TunnelKeeper(
                self.inn.meet, self._key(self.inn), self.ring_id, self.inn.name, local
            )

    def describe(self, side: str) -> dict:
        """``{"path": …, "meet": …, "tunnel_bytes_per_s": …}`` of the ``in`` or ``out`` edge."""
        edge = self.out if side == "out" else self.inn
        doc: dict = {"path": edge.path}
        end = self.forwarder if side == "out" else self.keeper
        if end is not None:
            doc["meet"] = edge.meet
            doc["tunnel_bytes"] = end.counter.total
            doc["tunnel_bytes_per_s"] = round(end.counter.rate(), 1)
            if end.last_error:
                doc["tunnel_error"] = end.last_error[:200]
        return doc

    def out_error(self) -> str:
        """Why the out-edge's latest connection got no tunnel ('' when it did)."""
        return self.forwarder.last_error if self.forwarder is not None else ""

    def close(self) -> None:
        for part in (self.keeper, self.forwarder, self.rendezvous):
            if part is not None:
                part.close()
