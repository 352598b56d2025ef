"""The coordinator's mTLS gRPC control service: register, heartbeat, session, status."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable

import grpc

from mobius_fed.coordinator.enrolment import (
    check_data,
    check_edges,
    check_fingerprint,
    not_enrolled,
    ring_entry,
)
from mobius_fed.coordinator.grid import ControlGrid, IncidentRaised, RunFailed
from mobius_fed.coordinator.handovers import Handovers
from mobius_fed.coordinator.replies import heartbeat_problem
from mobius_fed.coordinator.standby import STANDBY, StandbyPool
from mobius_fed.coordinator.state import RunState, json_safe
from mobius_fed.machines import HEARTBEAT_SETS, LIVE_PHASES, OFF_STATES, Phase, WorkerState
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.transport.tls import (
    COORDINATOR_IDENTITY,
    OPERATOR_IDENTITY,
    node_name_of,
    parse_identity,
    peer_certificate,
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
        # rank -> the certificate its site registered with (it verifies its commitments)
        self.certificates: dict[int, bytes] = {}
        self._cond = threading.Condition()
        self.enrolled = {worker_identity(i) for i in range(self.P)}
        self.enrolled |= {COORDINATOR_IDENTITY, OPERATOR_IDENTITY}
        self.tunnel_key = secrets.token_bytes(32)  # signs tunnels at workers' rendezvous ports
        self.handovers = Handovers(state, self._cond, self.mark_lost)  # standby sites
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
            self.handovers.hand_over(gone_rank, "its certificate was revoked")  # a standby?
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
        check_fingerprint(self.fingerprint, self.settings, name, request, context)
        with self._cond:
            check_data(self._data, None, request, context, who=name)
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
        check_fingerprint(self.fingerprint, self.settings, f"worker-{rank}", request, context)
        address = request.listen_address
        entry = ring_entry(rank, request, context)
        with self._cond:
            check_data(self._data, rank, request, context)
            w = self.state.workers[rank]
            if rank in self._registered and w.state not in _UNJOINED:
                msg = (
                    f"worker-{rank} is already registered from {self._registered[rank]}; "
                    "refusing a second process with the same identity"
                )
                log.error("refused: %s", msg)
                context.abort(grpc.StatusCode.ALREADY_EXISTS, msg)
            rejoin = w.state == WorkerState.LOST
            peers = [entry if i == rank else self._registered.get(i, "") for i in range(self.P)]
            check_edges(peers, rank, self.state.ring_size, context)
            self._registered[rank] = entry
            if (cert := peer_certificate(context)) is not None:
                self.certificates[rank] = cert
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
    @property
    def pool(self) -> StandbyPool:
        """Standby sites and the ranks handed to them (:class:`Handovers`)."""
        return self.handovers.pool

    def Replace(self, request, context):
        require_peer(context, {OPERATOR_IDENTITY})
        try:
            done = self.handovers.replace(request.worker, request.standby, request.force)
        except ValueError as exc:
            log.error("replace refused: %s", exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replace refused: {exc}")
        return control_pb2.ReplaceReply(message=done)

    # --------------------------------------------------------------- status
    def GetStatus(self, request, context):
        require_peer(context, self.enrolled)
        return control_pb2.StatusReply(json=json.dumps(json_safe(self.state.status_doc())))


_UNJOINED = (WorkerState.LOST, WorkerState.EXPECTED)
_RUNNING = (Phase.TRAINING, Phase.RECOVERING)
