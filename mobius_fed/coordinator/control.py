"""The coordinator's mTLS gRPC control service: register, heartbeat, session, status."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import grpc

from mobius_fed.coordinator.grid import ControlGrid, RunFailed
from mobius_fed.coordinator.state import RunState, json_safe
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.transport.tls import (
    COORDINATOR_IDENTITY,
    OPERATOR_IDENTITY,
    parse_identity,
    peer_identity,
    require_peer,
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
        registration_timeout: float,
    ) -> None:
        self.state, self.grid, self.fingerprint = state, grid, fingerprint
        self.run_spec, self.registration_timeout = run_spec, registration_timeout
        self.P = state.P
        self._registered: dict[int, str] = {}
        self._cond = threading.Condition()
        self.enrolled = {worker_identity(i) for i in range(self.P)}
        self.enrolled |= {COORDINATOR_IDENTITY, OPERATOR_IDENTITY}

    # ------------------------------------------------------------- identity
    def _worker_rank(self, context: grpc.ServicerContext) -> int:
        """The caller's rank from its certificate; abort unless it is an enrolled worker."""
        who = peer_identity(context)
        try:
            role, index = parse_identity(who or "")
        except ValueError:
            role, index = "", None
        if role != "worker" or index is None or index >= self.P:
            msg = f"identity {who or '<none>'} is not an enrolled worker of this run (P={self.P})"
            log.warning("refused: %s", msg)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, msg)
        return index  # type: ignore[return-value]

    # ------------------------------------------------------------- register
    def Register(self, request, context):
        rank = self._worker_rank(context)
        if self.state.phase not in ("waiting", "training"):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run {self.state.run_id} has ended ({self.state.phase}"
                f"{': ' + self.state.error if self.state.error else ''}); "
                "restart the coordinator (with --resume to continue)",
            )
        if request.config_fingerprint and request.config_fingerprint != self.fingerprint:
            msg = (
                f"config mismatch: worker-{rank} runs config {request.config_fingerprint}, "
                f"the coordinator runs {self.fingerprint}"
            )
            log.error("refused: %s", msg)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)
        with self._cond:
            w = self.state.workers[rank]
            if rank in self._registered and w.state not in ("lost", "expected"):
                msg = (
                    f"worker-{rank} is already registered from {self._registered[rank]}; "
                    "refusing a second process with the same identity"
                )
                log.error("refused: %s", msg)
                context.abort(grpc.StatusCode.ALREADY_EXISTS, msg)
            self._registered[rank] = request.listen_address
            self.state.update_worker(
                rank, address=request.listen_address, state="registered", last_heartbeat=time.time()
            )
            log.info("worker-%d registered (ring address %s)", rank, request.listen_address)
            self._cond.notify_all()
            ok = self._cond.wait_for(
                lambda: len(self._registered) == self.P, self.registration_timeout
            )
        if not ok:
            missing = sorted(set(range(self.P)) - set(self._registered))
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"workers never registered: {', '.join(f'worker-{m}' for m in missing)}",
            )
        return self.run_spec(rank)

    def peers(self) -> list[str]:
        with self._cond:
            return [self._registered[i] for i in range(self.P)]

    # ------------------------------------------------------------ heartbeat
    def Heartbeat(self, request, context):
        rank = self._worker_rank(context)
        fields = dict(last_heartbeat=time.time(), step=request.step)
        if self.state.workers[rank].state != "lost":
            fields["state"] = request.state or "ready"
        if request.last_loss == request.last_loss and request.step:  # not NaN
            fields["last_loss"] = request.last_loss
        fields["tokens_per_s"] = request.tokens_per_s
        self.state.update_worker(rank, **fields)
        failure = self.grid.failure
        if failure:
            return control_pb2.HeartbeatReply(stop=True, reason=failure)
        if self.state.phase in ("done", "failed", "stopped"):
            return control_pb2.HeartbeatReply(stop=True, reason=self.state.error or "done")
        return control_pb2.HeartbeatReply(stop=False)

    # -------------------------------------------------------------- session
    def Session(self, request_iterator, context):
        rank = self._worker_rank(context)
        if rank not in self._registered:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker-{rank} must register first")
        try:
            box = self.grid.open_session(rank)
        except RunFailed as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        self.state.update_worker(rank, state="ready", last_heartbeat=time.time())
        log.info("worker-%d session open", rank)

        def receive() -> None:
            try:
                for env in request_iterator:
                    if env.flower_message:
                        self.grid.deliver(rank, env.flower_message)
            except grpc.RpcError as exc:
                log.debug("worker-%d session ended: %r", rank, exc)
            except Exception as exc:  # a bad reply fails the run, naming the worker
                log.error("worker-%d session: %s", rank, exc)
                self.grid.fail(f"worker-{rank}: {exc}")
            finally:
                self.grid.close_session(rank, box)
                box.put(_END)
                if self.state.phase == "training":
                    self.mark_lost(rank, "its session closed (process gone or network cut)")

        threading.Thread(target=receive, daemon=True, name=f"session-{rank}").start()
        while True:
            env = box.get()
            if env is _END:
                return
            yield env

    def mark_lost(self, rank: int, why: str) -> None:
        if self.state.workers[rank].state == "lost":
            return
        self.state.update_worker(rank, state="lost")
        reason = f"worker-{rank} ({worker_identity(rank)}) lost: {why}"
        log.error(reason)
        self.grid.fail(reason)

    # --------------------------------------------------------------- status
    def GetStatus(self, request, context):
        require_peer(context, self.enrolled)
        return control_pb2.StatusReply(json=json.dumps(json_safe(self.state.status_doc())))
