"""The coordinator's mTLS gRPC control service: register, heartbeat, session, status."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable

import grpc

from mobius_fed.coordinator.grid import ControlGrid, IncidentRaised, RunFailed
from mobius_fed.coordinator.replies import in_range
from mobius_fed.coordinator.standby import STANDBY, StandbyPool
from mobius_fed.coordinator.state import RunState, json_safe
from mobius_fed.coordinator.status_model import HandoverModel
from mobius_fed.machines import (
    HEARTBEAT_SETS,
    LIVE_PHASES,
    OFF_STATES,
    REPORTED_STATES,
    EdgeState,
    Phase,
    WorkerState,
)
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.relay.plan import (
    DIRECT,
    PATHS,
    RingEntry,
    RingPlanError,
    check_known_edges,
    is_host_port,
)
from mobius_fed.transport.tls import (
    COORDINATOR_IDENTITY,
    OPERATOR_IDENTITY,
    identity_of_node_name,
    node_name_of,
    parse_identity,
    peer_identity_or_reason,
    require_peer,
    revoked_peer,
    worker_identity,
)

log = logging.getLogger("mobius.coordinator")
_END = object()


class ControlService(control_pb2_grpc.ControlServicer):
    """Enrols exactly the P worker identities and serves status to enrolled callers."""

    def __init__(
        self,
        state: RunState,
        grid: ControlGrid,
        *,
        fingerprint: str,
        run_spec: Callable[[int], control_pb2.RunSpec],
        crl: Callable[[], bytes] = bytes,
        settings: str = "",
    ) -> None:
        self.state, self.grid, self.fingerprint = state, grid, fingerprint
        self.settings = settings  # named in a config-mismatch refusal (e.g. the rings')
        self.crl = crl  # the revocation list every heartbeat reply carries
        self.run_spec, self.P = run_spec, state.P
        self._registered: dict[int, str] = {}
        self._data: dict[int, tuple[str, int]] = {}  # rank -> its data's (tokenizer, vocab)
        self._cond = threading.Condition()
        self.enrolled = {worker_identity(i) for i in range(self.P)}
        self.enrolled |= {COORDINATOR_IDENTITY, OPERATOR_IDENTITY}
        self.tunnel_key = secrets.token_bytes(32)  # signs tunnels at workers' rendezvous ports
        self.pool = StandbyPool()  # standby sites and handed-over ranks
        self.heartbeat_interval = 1.0  # what run specs tell workers (set by the server)

    # ------------------------------------------------------------- identity
    def _rank_of(self, who: str | None) -> int | None:
        """The rank ``who`` holds now (a worker's own, or a standby's handed-over one)."""
        try:
            rank = self.pool.rank_of(who)
        except ValueError:
            return None
        return rank if rank is not None and rank < self.P else None

    def _worker_rank(self, context: grpc.ServicerContext) -> int:
        """The caller's rank from its certificate; abort unless it holds a rank of this run."""
        who, why = peer_identity_or_reason(context)
        gone = revoked_peer(context) if who is None else None
        if (gone_rank := self._rank_of(gone)) is not None:  # revoked: out of the ring now
            self.mark_lost(gone_rank, "its certificate is revoked (mobius-fed certs revoke)")
            self.hand_over(gone_rank, "its certificate was revoked")  # when a standby waits
        rank = self._rank_of(who)
        if rank is not None:
            return rank
        msg = self.pool.refusal(who) or not_enrolled(who, why, self.P, self.state.rings)
        if (
            who is not None
            and who.startswith(f"mobius://{STANDBY}/")
            and who not in self.pool.replaced
        ):
            msg = f"{node_name_of(who)} is a standby without a rank: it registers and waits"
        log.warning("refused: %s", msg)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, msg)
        raise AssertionError("context.abort raises")  # grpc is untyped: no NoReturn for it

    # ------------------------------------------------------------- register
    def _check_data(self, rank: int | None, request, context, who: str = "") -> None:
        """Refuse a site whose data's tokenizer/vocabulary differs from another site's
        (docs/data.md#sites-must-agree); a site that does not say is not checked. ``rank``
        None: a standby (``who``), checked against every worker's site."""
        mine = (request.data_tokenizer, request.data_vocab)
        for other, theirs in sorted(self._data.items()):
            if other != rank and mine[0] and theirs != mine:
                msg = (
                    f"data mismatch: {who or f'worker-{rank}'}'s site uses tokenizer {mine[0]} "
                    f"(vocab {mine[1]}), worker-{other}'s uses {theirs[0]} (vocab {theirs[1]}); "
                    "all sites must prepare their data with the same tokenizer"
                )
                log.error("refused: %s", msg)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)
        if mine[0] and rank is not None:
            self._data[rank] = mine

    def _check_fingerprint(self, who: str, request, context) -> None:
        if request.config_fingerprint and request.config_fingerprint != self.fingerprint:
            msg = (
                f"config mismatch: {who} runs config {request.config_fingerprint}, "
                f"the coordinator runs {self.fingerprint}"
                + (f" ({self.settings})" if self.settings else "")
            )
            log.error("refused: %s", msg)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)

    def _standby_caller(self, request, context) -> str | None:
        """The caller's identity when it registers as a standby still without a rank; abort
        a standby claim from a certificate that names a worker rank."""
        who, _ = peer_identity_or_reason(context)
        try:
            role, _index = parse_identity(who or "")
        except ValueError:
            return None
        if request.standby and role != STANDBY:
            msg = (
                f"refused: {who} registers as a standby, but its certificate names "
                f"{node_name_of(who or '')}: a standby's certificate names a standby identity "
                "(mobius://standby/<n>, certs init --standbys), never a worker rank"
            )
            log.error(msg)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, msg)
        if role == STANDBY and who not in self.pool.replaced and self._rank_of(who) is None:
            return who
        return None

    def _register_standby(self, who: str, request, context) -> control_pb2.RunSpec:
        """Put a standby in the pool (again): same config and data as the run's sites."""
        name = node_name_of(who)
        self._check_fingerprint(name, request, context)
        with self._cond:
            self._check_data(None, request, context, who=name)
            fresh = who not in self.pool.waiting
            self.pool.offer(who, (request.data_tokenizer, request.data_vocab))
        if fresh:
            log.info("%s (%s) registered as a standby", name, who)
        return control_pb2.RunSpec(
            run_id=self.state.run_id,
            standby=True,
            heartbeat_interval_s=self.heartbeat_interval,
            crl=self.crl(),
        )

    def Register(self, request, context):
        """Enrol the caller's rank (again, after it was lost) and answer the run spec at once.

        The ring's addresses and the state to start from come later, as a restore message,
        once every rank holds a session.
        """
        standby = self._standby_caller(request, context)
        if self.state.phase not in LIVE_PHASES:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run {self.state.run_id} has ended ({self.state.phase}"
                f"{': ' + self.state.error if self.state.error else ''}); "
                "restart the coordinator (with --resume to continue)",
            )
        if standby is not None:
            return self._register_standby(standby, request, context)
        rank = self._worker_rank(context)
        who = self.pool.identity_of(rank)
        self._check_fingerprint(f"worker-{rank}", request, context)
        address = request.listen_address
        if not (is_host_port(address) and len(address) < 256):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker-{rank}: listen_address {address[:80]!r} is not host:port",
            )
        entry = self._ring_entry(rank, request, context)
        with self._cond:
            self._check_data(rank, request, context)
            w = self.state.workers[rank]
            if rank in self._registered and w.state not in _UNJOINED:
                msg = (
                    f"worker-{rank} is already registered from {self._registered[rank]}; "
                    "refusing a second process with the same identity"
                )
                log.error("refused: %s", msg)
                context.abort(grpc.StatusCode.ALREADY_EXISTS, msg)
            rejoin = w.state == WorkerState.LOST
            self._check_edges(rank, entry, context)
            self._registered[rank] = entry
            self.state.move_worker(
                rank,
                WorkerState.REJOINING if rejoin else WorkerState.REGISTERED,
                address=address,
                last_heartbeat=time.time(),
                registered_at=time.time(),
                identity=who,
            )
            log.info(
                "worker-%d %s (ring address %s)%s",
                rank,
                "re-registered after it was lost" if rejoin else "registered",
                address,
                "" if who.startswith("mobius://worker/") else f": {who}, handed this rank",
            )
            self._cond.notify_all()
        self.grid.notify()
        spec = self.run_spec(rank)
        spec.tunnel_key = self.tunnel_key
        return spec

    def _check_edges(self, rank: int, entry: str, context: grpc.ServicerContext) -> None:
        """Refuse an entry that leaves an edge to a registered neighbour unconnectable."""
        peers = [entry if i == rank else self._registered.get(i, "") for i in range(self.P)]
        first = rank - rank % self.state.ring_size  # its own ring's entries (R rings)
        try:
            check_known_edges(peers[first : first + self.state.ring_size])
        except RingPlanError as exc:
            log.error("refused worker-%d: %s", rank, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    @staticmethod
    def _ring_entry(rank: int, request, context: grpc.ServicerContext) -> str:
        """The worker's ring entry: its address and how it can be reached (relay/plan.py)."""
        if ";" in request.listen_address:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker-{rank}: listen_address may not contain ';'",
            )
        for what in ("rendezvous", "relay"):
            value = getattr(request, what)
            if value and (not is_host_port(value) or ";" in value):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"worker-{rank}: {what} {value[:80]!r} is not host:port",
                )
        return RingEntry(
            request.listen_address, not request.unreachable, request.rendezvous, request.relay
        ).encode()

    def peers(self) -> list[str]:
        with self._cond:
            return [self._registered.get(i, "") for i in range(self.P)]

    # ------------------------------------------------------------ heartbeat
    def Heartbeat(self, request, context):
        reply = self._heartbeat(request, context)
        reply.crl = self.crl()
        return reply

    def _heartbeat(self, request, context) -> control_pb2.HeartbeatReply:
        rank = self._worker_rank(context)
        w = self.state.workers[rank]
        problem = heartbeat_problem(request, self.state.steps)
        if problem:
            log.warning("worker-%d: heartbeat refused: %s", rank, problem)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"heartbeat refused: {problem}")
        fields: dict = dict(last_heartbeat=time.time(), step=request.step)
        if request.step:
            fields["last_loss"] = request.last_loss
        fields["tokens_per_s"] = request.tokens_per_s
        if request.links_json:
            fields["edges"] = json.loads(request.links_json)
        with self._cond:  # never over a "lost" that mark_lost wrote meanwhile
            if w.state in _UNJOINED:  # a frozen or cut-off worker coming back
                return control_pb2.HeartbeatReply(
                    stop=False,
                    rejoin=True,
                    reason=f"worker-{rank} was counted lost; register again",
                )
            if (
                w.state != WorkerState.REJOINING
                and request.state in HEARTBEAT_SETS  # "registered" is ours to say, at Register
                and not self.state.ended  # after the end it shows finished/stopped
            ):
                fields["state"] = request.state
            self.state.update_worker(rank, **fields)
        self.state.count_heartbeat()
        if failure := self.grid.failure:
            return control_pb2.HeartbeatReply(stop=True, reason=failure)
        if self.state.ended:
            return control_pb2.HeartbeatReply(stop=True, reason=self.state.error or "done")
        return control_pb2.HeartbeatReply(stop=False)

    # -------------------------------------------------------------- session
    def Session(self, request_iterator, context):
        rank = self._worker_rank(context)
        if rank not in self._registered or self.state.workers[rank].state in _UNJOINED:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker-{rank} must register first")
        try:
            box = self.grid.open_session(rank)
        except RunFailed as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        if self.state.workers[rank].state != WorkerState.REJOINING and not self.state.ended:
            self.state.move_worker(rank, WorkerState.READY, last_heartbeat=time.time())
        log.info("worker-%d session open", rank)

        def receive() -> None:
            try:
                for env in request_iterator:
                    if env.flower_message:
                        self.grid.deliver(rank, env.flower_message)
            except grpc.RpcError as exc:
                log.debug("worker-%d session ended: %r", rank, exc)
            except Exception as exc:  # a reply it should not send: lost, named
                log.error("worker-%d session: %s", rank, exc)
                self.mark_lost(rank, f"its session sent something unusable: {exc}")
            finally:
                if (closed := self.grid.close_session(rank, box)) is box and closed is not None:
                    closed.put(_END)
                    if not self.state.ended:
                        self.mark_lost(rank, "its session closed (process gone or network cut)")

        threading.Thread(target=receive, daemon=True, name=f"session-{rank}").start()
        while True:
            env = box.get()
            if env is _END:
                return
            yield env

    def mark_lost(self, rank: int, why: str, identity: str | None = None) -> None:
        """Count ``rank`` lost: close its session (it must register again) and, if a round
        may be waiting for it, open its incident in the same change and raise it.
        ``identity``: the site lost, when a handover already gave the rank to a standby."""
        identity = identity or self.pool.identity_of(rank)
        reason = f"worker-{rank} ({identity}) lost: {why}"
        with self._cond:
            w = self.state.workers[rank]
            if w.state in OFF_STATES:
                return
            raised = IncidentRaised("worker lost", reason, rank, last_seen=w.last_heartbeat)
            raised.site = node_name_of(identity)
            running = self.state.phase in _RUNNING  # before the session goes: a round sees it
            training = self.state.phase == Phase.TRAINING  # recovering: no round in flight
            in_flight = self.state.round + 1 if training else 0
            raised.opened = self.state.lose_worker(
                rank, raised.fields(self.state.ring_size, in_flight) if running else None
            )
        log.error(reason)
        if running:
            self.grid.raise_incident(raised)
        box = self.grid.close_session(rank)
        if box is not None:
            box.put(_END)

    def expire_silent(self, timeout: float) -> None:
        """Count lost every worker whose last heartbeat is older than ``timeout`` seconds."""
        now = time.time()
        for w in list(self.state.workers.values()):
            if w.state in OFF_STATES or w.last_heartbeat is None:
                continue
            if now - w.last_heartbeat > timeout:
                self.mark_lost(
                    w.rank,
                    f"no heartbeat for {now - w.last_heartbeat:.1f}s (timeout {timeout:.1f}s)",
                )

    # ------------------------------------------------------------- handover
    def hand_over(self, rank: int, why: str, standby: str | None = None) -> str | None:
        """Hand lost ``rank`` to a live standby (``standby``, or any): its identity holds
        the rank from now on, the one it replaces is refused. The standby's name, or None
        when there is none to hand it to."""
        with self._cond:
            chosen = self.pool.pick(standby)
            if chosen is None:
                return None
            old = self.pool.assign(rank, chosen, why)
            self.state.record_handover(rank, old, chosen.identity, why)
            self._cond.notify_all()
        log.warning(
            "handover: worker-%d goes to %s (%s) because %s; %s is refused from now on",
            rank,
            chosen.name,
            chosen.identity,
            why,
            old,
        )
        return chosen.name

    def restore_handovers(self, saved: list[HandoverModel]) -> None:
        """A resumed run's earlier handovers, in order: each standby holds its rank again
        and each replaced identity stays refused (before any registration is answered)."""
        for h in saved:
            self.pool.restore(h.rank, h.standby, h.replaced, h.why)
            log.warning(
                "resumed handover: worker-%d is held by %s (since round %s); %s stays refused",
                h.rank,
                node_name_of(h.standby),
                "?" if h.round is None else h.round,
                h.replaced,
            )

    def forget_handovers(self) -> None:
        """The resumed run started afresh after all: its earlier handovers do not hold."""
        self.pool = StandbyPool(self.pool.alive_s)

    def replace(self, worker: str, standby: str, force: bool) -> str:
        """``mobius-fed replace``: hand ``worker``'s rank to ``standby``; ValueError naming
        why not (an unknown name, no such standby waiting, a live worker without force)."""
        rank = _rank_of_name(worker, self.P)
        if identity_of_node_name(standby) is None or not standby.startswith("standby-"):
            raise ValueError(f"{standby!r} is not a standby's name (standby-<n>)")
        if self.state.phase not in LIVE_PHASES:
            raise ValueError(f"run {self.state.run_id} has ended ({self.state.phase})")
        if self.pool.pick(standby) is None:
            waiting = ", ".join(self.pool.names()) or "none"
            raise ValueError(
                f"{standby} is not registered with the coordinator as a waiting standby "
                f"(standbys waiting: {waiting})"
            )
        w = self.state.workers[rank]
        alive = w.state not in OFF_STATES
        if alive and not force:
            raise ValueError(
                f"{worker} is alive (state {w.state}): replacing it takes its rank from a "
                "working site; pass --force to replace it anyway (its process is then refused)"
            )
        why = "the operator replaced it (mobius-fed replace" + (" --force)" if alive else ")")
        replaced = self.pool.identity_of(rank)
        if self.hand_over(rank, why, standby) is None:
            raise ValueError(f"{standby} left the pool meanwhile")
        if alive:
            self.mark_lost(rank, f"replaced by {standby} (mobius-fed replace --force)", replaced)
        return f"{worker} handed over to {standby}" + (" (it was alive: forced)" if alive else "")

    def Replace(self, request, context):
        require_peer(context, {OPERATOR_IDENTITY})
        try:
            done = self.replace(request.worker, request.standby, request.force)
        except ValueError as exc:
            log.error("replace refused: %s", exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replace refused: {exc}")
        return control_pb2.ReplaceReply(message=done)

    def identities(self) -> list[str]:
        """Who holds each rank now: what a ring order tells the neighbours."""
        return [self.pool.identity_of(rank) for rank in range(self.P)]

    # --------------------------------------------------------------- status
    def GetStatus(self, request, context):
        require_peer(context, self.enrolled)
        return control_pb2.StatusReply(json=json.dumps(json_safe(self.state.status_doc())))


_UNJOINED = (WorkerState.LOST, WorkerState.EXPECTED)
_RUNNING = (Phase.TRAINING, Phase.RECOVERING)


_EDGE_NUMBERS = (
    ("reconnects", 1e9),
    ("down_s", 1e9),
    ("tunnel_bytes", 1e18),
    ("tunnel_bytes_per_s", 1e12),
)


def heartbeat_problem(request: control_pb2.HeartbeatRequest, steps: int) -> str | None:
    """Why a heartbeat cannot go into status or metrics (None: it can)."""
    if request.state and request.state not in REPORTED_STATES:
        return f"state {request.state[:40]!r} (expected one of {', '.join(REPORTED_STATES)})"
    if request.step > steps:
        return f"step {request.step} (the run has {steps} steps)"
    if request.step and not in_range(request.last_loss, 1e4):
        return f"last_loss {request.last_loss!r} (expected a finite loss in [0, 1e4))"
    if not in_range(request.tokens_per_s, 1e12):
        return f"tokens_per_s {request.tokens_per_s!r} (expected finite, in [0, 1e12))"
    if request.links_json:
        if len(request.links_json) > 4096:
            return "links_json longer than 4096 characters"
        try:
            links = json.loads(request.links_json)
        except ValueError:
            return "links_json is not JSON"
        if not isinstance(links, dict) or not set(links) <= {"in", "out"}:
            return "links_json must be an object with 'in' and/or 'out'"
        for side, edge in links.items():
            if not isinstance(edge, dict) or edge.get("state", "unknown") not in tuple(EdgeState):
                return f"links_json.{side}: unknown state"
            if edge.get("path", DIRECT) not in PATHS:  # reachability (relay/plan.py)
                return f"links_json.{side}.path: {str(edge.get('path'))[:20]!r}"
            for key, top in _EDGE_NUMBERS:
                v = edge.get(key, 0)
                if not in_range(v, top):
                    return f"links_json.{side}.{key}: {v!r}"
    return None


def _rank_of_name(worker: str, workers: int) -> int:
    """The rank of ``worker-<i>``; ValueError for another name or a rank past the run's."""
    identity = identity_of_node_name(worker)
    role, index = parse_identity(identity) if identity else ("", None)
    if role != "worker" or index is None:
        raise ValueError(f"{worker!r} is not a worker's name (worker-<i>)")
    if index >= workers:
        raise ValueError(f"{worker} is not a worker of this run (P={workers})")
    return index


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
