"""``mobius-worker --coordinator ADDR``: register, join the ring, serve Flower rounds.

The worker's rank comes from its certificate; the coordinator answers with the run spec
(ring order, peer addresses, training config, resume point). The worker then opens its
ring links and one ``Control.Session`` stream, and runs its Flower ClientApp in-process
for every instruction until the coordinator says stop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

import grpc
from flwr.app import Context, Error, Message, RecordDict

from mobius_fed.checkpoint import load_checkpoint, sha256_of
from mobius_fed.config import ConfigError, TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.transport.flower_wire import (
    FLOWER_RUN_ID,
    message_from_bytes,
    message_to_bytes,
    set_task_identity,
    worker_node_id,
)
from mobius_fed.transport.tls import open_channel
from mobius_fed.worker.config import WorkerConfig
from mobius_fed.worker.daemon import open_ring
from mobius_fed.worker.executor import RingExecutor, WorkerStep
from mobius_fed.worker.flower_client import make_client_app
from mobius_fed.worker.link import PeerError

log = logging.getLogger("mobius.worker")
_FATAL = (
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


class RunStopped(RuntimeError):
    """The coordinator stopped the run (or could not be reached)."""


def register(stub: control_pb2_grpc.ControlStub, cfg: WorkerConfig) -> control_pb2.RunSpec:
    """Register, retrying with backoff while the coordinator is not up yet."""
    own = cfg.train.fingerprint() if cfg.verify_train else ""
    deadline = time.monotonic() + cfg.peer_timeout
    delay = 0.2
    while True:
        try:
            return stub.Register(
                control_pb2.RegisterRequest(
                    listen_address=cfg.advertise_address,
                    config_fingerprint=own,
                ),
                timeout=None,
            )
        except grpc.RpcError as exc:
            if exc.code() in _FATAL:
                raise ConfigError(f"coordinator refused registration: {exc.details()}") from exc
            if time.monotonic() > deadline:
                raise RunStopped(
                    f"coordinator {cfg.coordinator} unreachable after "
                    f"{cfg.peer_timeout:.0f}s: {exc.code().name}"
                ) from exc
            log.info("waiting for coordinator at %s (%s)", cfg.coordinator, exc.code().name)
            time.sleep(delay)
            delay = min(2 * delay, 2.0)


class _Heartbeats(threading.Thread):
    def __init__(self, stub: control_pb2_grpc.ControlStub, interval: float, on_stop) -> None:
        super().__init__(daemon=True, name="heartbeats")
        self.stub, self.interval, self.on_stop = stub, interval, on_stop
        self.state, self.step, self.loss, self.tps = "ready", 0, float("nan"), 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while True:
            try:
                reply = self.stub.Heartbeat(
                    control_pb2.HeartbeatRequest(
                        state=self.state,
                        step=self.step,
                        last_loss=self.loss,
                        tokens_per_s=self.tps,
                    ),
                    timeout=max(5.0, 3 * self.interval),
                )
            except grpc.RpcError as exc:
                log.warning("heartbeat failed: %s", exc.code().name)
                if self.done.wait(self.interval):
                    return
                continue
            if reply.stop:
                self.on_stop(reply.reason or "stopped by the coordinator")
            if self.done.wait(self.interval):
                return


def run_with_coordinator(cfg: WorkerConfig) -> int:
    """Serve the coordinator's rounds; 0 when the run completed, else a RunStopped error."""
    channel = open_channel(
        cfg.coordinator,
        cfg.tls(),
        insecure=cfg.insecure,  # type: ignore[arg-type]
        target_name="coordinator",
    )
    stub = control_pb2_grpc.ControlStub(channel)
    spec = register(stub, cfg)
    train = TrainConfig.model_validate_json(spec.train_config_json)
    cfg = cfg.model_copy(
        update={"rank": spec.rank, "peers": list(spec.peers), "train": train, "run_id": spec.run_id}
    )
    log.info(
        "worker-%d registered with run %s: P=%d, peers %s",
        cfg.rank,
        spec.run_id,
        train.P,
        ", ".join(spec.peers),
    )
    site = SiteData(cfg.data_dir, train.model().seq_len, train.encoding)
    executor = RingExecutor(train, cfg.rank, site, spec.run_id, cfg.peer_timeout)  # type: ignore[arg-type]
    if spec.resume_round:
        path = Path(spec.resume_checkpoint)
        executor.load_state_dict(load_checkpoint(path))
        log.info(
            "worker-%d resumed from %s (round %d, step %d, sha256 %s)",
            cfg.rank,
            path,
            spec.resume_round,
            executor.step,
            sha256_of(path)[:12],
        )
    set_task_identity(worker_node_id(cfg.rank))  # type: ignore[arg-type]
    links = open_ring(cfg, executor)

    instructions: queue.Queue = queue.Queue()
    stop_reason: list[str] = []

    def stop(reason: str) -> None:
        if not stop_reason:
            stop_reason.append(reason)
            if links is not None and reason != "done":  # wake a ring wait at once
                links.inbox.fail(PeerError(f"run stopped by the coordinator: {reason}"))
            instructions.put(None)

    beats = _Heartbeats(stub, spec.heartbeat_interval_s or 1.0, stop)
    beats.start()

    def on_step(r: WorkerStep) -> None:
        beats.step, beats.loss = r.step + 1, r.loss
        beats.tps = train.batch_size * train.model().seq_len / max(r.seconds, 1e-9)

    def on_state(s: str) -> None:
        beats.state = s

    app = make_client_app(executor, Path(cfg.out_dir) / "checkpoints", on_step, on_state)
    context = Context(
        run_id=FLOWER_RUN_ID,
        node_id=worker_node_id(cfg.rank),  # type: ignore[arg-type]
        node_config={},
        state=RecordDict(),
        run_config={},
    )
    outbox: queue.Queue = queue.Queue()
    outbox.put(control_pb2.Envelope(note="hello"))
    responses = stub.Session(iter(outbox.get, None))

    def read_session() -> None:
        try:
            for env in responses:
                if env.note == "stop":
                    stop(env.flower_message.decode() or "stopped")
                    return
                instructions.put(env.flower_message)
            stop("the coordinator closed the session")
        except grpc.RpcError as exc:
            stop(f"lost the coordinator: {exc.code().name} {exc.details()}")

    threading.Thread(target=read_session, daemon=True, name="session").start()
    try:
        while (data := instructions.get()) is not None:
            msg = message_from_bytes(data)
            try:
                reply = app(msg, context)
            except Exception as exc:  # the round fails; the coordinator names this worker
                log.error("worker-%d: %s failed: %s", cfg.rank, msg.metadata.message_type, exc)
                reply = Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            outbox.put(control_pb2.Envelope(flower_message=message_to_bytes(reply)))
    finally:
        beats.done.set()
        reason = stop_reason[0] if stop_reason else "stopped"
        if links is not None:
            if reason == "done":
                links.finish(timeout=min(cfg.peer_timeout, 30.0))
            else:
                links.close()
        outbox.put(None)
        channel.close()
    if reason != "done":
        raise RunStopped(reason)
    log.info("worker-%d finished run %s", cfg.rank, spec.run_id)
    return 0
