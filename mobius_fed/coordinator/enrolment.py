"""What a site's registration must hold before the control service enrols it: the same
training config and data as the run's other sites, a ring entry that is a reachable
host:port, and an identity that is one of the run's ranks. Each check aborts the RPC with
the reason (docs/security.md, docs/data.md#sites-must-agree)."""

from __future__ import annotations

import logging

import grpc

from mobius_fed.relay.plan import RingEntry, RingPlanError, check_known_edges, is_host_port
from mobius_fed.transport.tls import parse_identity

log = logging.getLogger("mobius.coordinator")


def check_data(
    data: dict[int, tuple[str, int]], rank: int | None, request, context, who: str = ""
) -> None:
    """Refuse a site whose data's tokenizer/vocabulary differs from another site's in
    ``data`` (rank → its (tokenizer, vocab)); a site that does not say is not checked, and
    is recorded in ``data`` once it does. ``rank`` None: a standby (``who``), checked
    against every worker's site."""
    mine = (request.data_tokenizer, request.data_vocab)
    for other, theirs in sorted(data.items()):
        if other != rank and mine[0] and theirs != mine:
            msg = (
                f"data mismatch: {who or f'worker-{rank}'}'s site uses tokenizer {mine[0]} "
                f"(vocab {mine[1]}), worker-{other}'s uses {theirs[0]} (vocab {theirs[1]}); "
                "all sites must prepare their data with the same tokenizer"
            )
            log.error("refused: %s", msg)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)
    if mine[0] and rank is not None:
        data[rank] = mine


def check_fingerprint(fingerprint: str, settings: str, who: str, request, context) -> None:
    """Refuse a site whose training config hashes differently (``settings``: the ones a
    refusal names, e.g. the rings')."""
    if request.config_fingerprint and request.config_fingerprint != fingerprint:
        msg = (
            f"config mismatch: {who} runs config {request.config_fingerprint}, "
            f"the coordinator runs {fingerprint}" + (f" ({settings})" if settings else "")
        )
        log.error("refused: %s", msg)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)


def ring_entry(rank: int, request, context: grpc.ServicerContext) -> str:
    """The worker's ring entry: its address and how it can be reached (relay/plan.py)."""
    address = request.listen_address
    if not (is_host_port(address) and len(address) < 256):
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"worker-{rank}: listen_address {address[:80]!r} is not host:port",
        )
    if ";" in address:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"worker-{rank}: listen_address may not contain ';'"
        )
    for what in ("rendezvous", "relay"):
        value = getattr(request, what)
        if value and (not is_host_port(value) or ";" in value):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker-{rank}: {what} {value[:80]!r} is not host:port",
            )
    return RingEntry(address, not request.unreachable, request.rendezvous, request.relay).encode()


def check_edges(peers: list[str], rank: int, ring_size: int, context: grpc.ServicerContext) -> None:
    """Refuse ``rank``'s entry (in ``peers``, every rank's so far) when it leaves an edge
    to a registered neighbour of its own ring unconnectable."""
    first = rank - rank % ring_size  # its own ring's entries (R rings)
    try:
        check_known_edges(peers[first : first + ring_size])
    except RingPlanError as exc:
        log.error("refused worker-%d: %s", rank, exc)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def not_enrolled(who: str | None, why: str, workers: int, rings: int = 1) -> str:
    """Why ``who`` may not register: not a worker identity, or a rank past the run's R·P
    workers (with R > 1, the ring that rank would be in, which the run does not have)."""
    msg = f"identity {who or '<none>'} is not an enrolled worker of this run (P={workers}"
    if rings > 1:
        P = workers // rings
        msg += f": workers 0–{workers - 1}, {rings} rings of {P}"
        try:
            role, index = parse_identity(who or "")
        except ValueError:
            role, index = "", None
        if role == "worker" and index is not None:
            msg += (
                f"; its certificate's rank {index} would be ring {index // P}, which this "
                "run does not have"
            )
    msg += ")"
    if who is None:
        msg += f" ({why})"
    return msg
