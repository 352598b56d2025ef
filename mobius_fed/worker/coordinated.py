"""``mobius-worker --coordinator ADDR``: register, serve Flower messages, survive incidents.

The rank comes from the certificate. The ring is not opened at registration but by
``query.restore`` (the round, 0: the seed) and ``query.ring``; an ``abort`` note abandons the
round in flight; a worker that loses its session keeps its process and snapshots and
registers again (docs/architecture.md §9, §11).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from flwr.app import Context, Error, Message, RecordDict

from mobius_fed.checkpoint import CheckpointError
from mobius_fed.config import ConfigError, TrainConfig
from mobius_fed.data import SiteData, site_identity
from mobius_fed.machines import OWN_WORKER, StateCell, WorkerState
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.transport.flower_wire import (
    ERROR_FATAL,
    ERROR_INTERNAL,
    ERROR_RING,
    FLOWER_RUN_ID,
    message_from_bytes,
    message_to_bytes,
    set_task_identity,
    worker_node_id,
)
from mobius_fed.transport.revocation import CrlSource, apply_crl
from mobius_fed.transport.tls import (
    SecretsError,
    certificate_identity,
    check_node_secrets,
    open_channel,
)
from mobius_fed.worker.commitments import Commitments
from mobius_fed.worker.config import WorkerConfig
from mobius_fed.worker.daemon import make_links
from mobius_fed.worker.executor import RingExecutor, WorkerStep
from mobius_fed.worker.flower_client import Snapshots, WorkerHandlers, make_client_app
from mobius_fed.worker.link import PeerError, RingLinks

log = logging.getLogger("mobius.worker")
_FATAL = (
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INVALID_ARGUMENT,
)


class RunStopped(RuntimeError):
    """The coordinator stopped the run (or could not be reached)."""


def register(
    stub: control_pb2_grpc.ControlStub, cfg: WorkerConfig, rejoin: bool = False
) -> control_pb2.RunSpec:
    """Register, retrying with backoff while the coordinator is not there (yet, or again).

    When rejoining, "already registered" is retried too: the coordinator has not yet
    noticed that this worker's previous session is gone."""
    own = cfg.train.fingerprint() if cfg.verify_train else ""
    tokenizer, vocab = site_identity(cfg.data_dir)
    deadline = time.monotonic() + cfg.peer_timeout
    # A replacement process (a rescheduled pod, a host that vanished without closing its
    # connections) waits until the coordinator counts the old one lost.
    duplicate_until = time.monotonic() + min(cfg.peer_timeout, 45.0)
    delay = 0.2
    while True:
        try:
            return stub.Register(
                control_pb2.RegisterRequest(
                    listen_address=cfg.advertise_address,
                    config_fingerprint=own,
                    unreachable=cfg.reachable == "no",
                    rendezvous=cfg.rendezvous_address,
                    relay=cfg.relay or "",
                    data_tokenizer=tokenizer,
                    data_vocab=vocab,
                    standby=cfg.standby,
                ),
                timeout=30,
            )
        except grpc.RpcError as exc:
            retry = exc.code() == grpc.StatusCode.ALREADY_EXISTS and (
                rejoin or time.monotonic() < duplicate_until
            )
            if exc.code() in _FATAL and not retry:
                mine = f" (this worker: {cfg.train.ring_settings()})" if own else ""
                raise ConfigError(
                    f"coordinator refused registration: {exc.details()}{mine}"
                ) from exc
            if time.monotonic() > deadline:
                raise RunStopped(
                    f"coordinator {cfg.coordinator} unreachable after "
                    f"{cfg.peer_timeout:.0f}s: {exc.code().name}"
                ) from exc
            log.info("waiting for coordinator at %s (%s)", cfg.coordinator, exc.code().name)
            time.sleep(delay)
            delay = min(2 * delay, 2.0)


class WorkerNode:
    """One worker process across sessions: executor, snapshots and ring links survive a
    lost session; only the session and the ring incarnation are replaced."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        if not cfg.insecure:
            role = "standby" if cfg.standby else "worker"
            try:
                check_node_secrets(cfg.node_tls(), role=role)
            except SecretsError as exc:
                if cfg.standby:  # a standby never claims a rank: it is handed one
                    raise SecretsError(
                        f"--standby needs a standby certificate (mobius://standby/<n>, from "
                        f"certs init --standbys): {exc}"
                    ) from None
                raise
            CrlSource(cfg.node_tls()).watch()  # docs/security.md "Revocation"
        self.channel = open_channel(
            cfg.coordinator_address,
            cfg.tls(),
            insecure=cfg.insecure,
            target_name="coordinator",
        )
        self.stub = control_pb2_grpc.ControlStub(self.channel)
        self.executor: RingExecutor | None = None
        self.links: RingLinks | None = None
        self.commitments: Commitments | None = None  # audit.commitments: signed digests
        self.snapshots = Snapshots(Path(cfg.out_dir) / "checkpoints")
        # its own state (its heartbeats report it), moved through machines.OWN_WORKER's table
        self.own = StateCell(OWN_WORKER, WorkerState.REGISTERED, "this worker")
        self.loss, self.tps = 0.0, 0.0
        self._links_lock = threading.Lock()
        self._aborts = 0  # aborts so far: a ring join that saw one gives up
        self._session_end: Callable[[str, str], None] | None = None  # (outcome, reason)
        self.generation = 0  # registrations so far: a reply to an older one is stale
        self.run_key = b""  # signs tunnel introductions (docs/reachability.md)

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        rejoin = False
        stop_beats = threading.Event()
        try:
            while True:
                spec = self._wait_for_rank() if self.cfg.standby else None
                spec = spec or register(self.stub, self.cfg, rejoin=rejoin)
                if spec.crl and not self.cfg.insecure:
                    apply_crl(spec.crl, self.cfg.node_tls(), "the coordinator")
                self.run_key = spec.tunnel_key  # new with every coordinator process
                self.generation += 1
                if self.generation == 1:  # from now on the coordinator expects heartbeats
                    threading.Thread(
                        target=self._heartbeats,
                        args=(spec.heartbeat_interval_s or 1.0, stop_beats),
                        daemon=True,
                        name="heartbeats",
                    ).start()
                if self.executor is None:
                    self._build(spec)
                elif spec.config_fingerprint != self.executor.cfg.fingerprint():
                    raise ConfigError(
                        f"the coordinator now runs config {spec.config_fingerprint}, this "
                        f"worker's state is for {self.executor.cfg.fingerprint()}; restart "
                        "the worker to join that run"
                    )
                how = "re-registered with" if rejoin else "registered with"
                log.info("worker-%d %s run %s", self.cfg.rank, how, spec.run_id)
                outcome, reason = self._serve(spec)
                if outcome == "done":
                    log.info("worker-%d finished run %s", self.cfg.rank, spec.run_id)
                    return 0
                if outcome == "stopped":
                    raise RunStopped(reason)
                log.warning("worker-%d: %s; registering again", self.cfg.rank, reason)
                rejoin = True
        finally:
            stop_beats.set()
            self.close_links()
            self.channel.close()

    def _wait_for_rank(self) -> control_pb2.RunSpec | None:
        """A standby: register again every heartbeat interval until the coordinator hands
        this site a rank; its run spec then (None once it holds one already)."""
        if self.executor is not None:
            return None  # it holds a rank: rejoining is a worker's ordinary rejoin
        waited = False
        while (spec := register(self.stub, self.cfg)).standby:
            if not waited:
                log.info("standby: registered with run %s; waiting for a rank", spec.run_id)
                waited = True
            time.sleep(spec.heartbeat_interval_s or 1.0)
        log.warning(
            "standby: the coordinator handed this site worker-%d's rank (a handover)", spec.rank
        )
        return spec

    def _heartbeats(self, interval: float, stop: threading.Event) -> None:
        """Heartbeats from registration on, across sessions; replies go to :meth:`on_reply`."""
        while not stop.is_set():
            edges = getattr(self.links, "edge_states", None)
            generation = self.generation
            try:
                reply = self.stub.Heartbeat(
                    control_pb2.HeartbeatRequest(
                        state=self.own.state,
                        step=self.executor.step if self.executor else 0,
                        last_loss=self.loss,
                        tokens_per_s=self.tps,
                        links_json=json.dumps(edges()) if edges else "",
                    ),
                    timeout=max(5.0, 3 * interval),
                )
            except grpc.RpcError as exc:
                log.warning("heartbeat failed: %s", exc.code().name)
            except Exception:  # never let the heartbeats die with the process alive
                log.exception("heartbeat failed")
            else:
                self.on_reply(reply, generation)
            stop.wait(interval)

    def on_reply(self, reply: control_pb2.HeartbeatReply, generation: int) -> None:
        """A heartbeat's answer: end the session to rejoin, or because the run ended. A
        ``rejoin`` sent before this worker registered again is stale and ignored."""
        if reply.crl and not self.cfg.insecure:  # the coordinator's revocation list
            apply_crl(reply.crl, self.cfg.node_tls(), "the coordinator")
        end = self._session_end
        if end is None:
            return
        if reply.rejoin and generation != self.generation:
            return
        if reply.rejoin:
            end("rejoin", reply.reason or "the coordinator counts this worker lost")
        elif reply.stop:
            end("done" if reply.reason == "done" else "stopped", reply.reason)

    def _build(self, spec: control_pb2.RunSpec) -> None:
        train = TrainConfig.model_validate_json(spec.train_config_json)
        self.cfg = self.cfg.model_copy(
            update={"rank": spec.rank, "train": train, "run_id": spec.run_id}
        )
        log.info(
            "worker-%d joined run %s: ring %d of %d, P=%d",
            spec.rank,
            spec.run_id,
            spec.rank // train.P,
            train.rings,
            train.P,
        )
        self.own.who = f"worker-{spec.rank}"
        site = SiteData(self.cfg.data_dir, train.model().seq_len, train.encoding)
        # R rings: worker g = r·P + i runs F_i of ring r (its executor's rank is i)
        i = spec.rank % train.P
        self.executor = RingExecutor(train, i, site, spec.run_id, self.cfg.peer_timeout)
        self.executor.slowdown = self.cfg.emulate_slowdown
        set_task_identity(worker_node_id(spec.rank))
        if train.audit.commitments and not self.cfg.insecure:  # signed with its TLS key
            tls = self.cfg.node_tls().load()
            self.commitments = Commitments(
                train, spec.rank, i, certificate_identity(tls.cert), tls.key, self.cfg.peer_timeout
            )

    # ----------------------------------------------------------------- ring
    def rejoin_ring(
        self, ring_id: str, peers: list[str], identities: list[str] | None = None
    ) -> None:
        """Close the ring links (if any) and join ring incarnation ``ring_id``; after a
        handover, ``identities`` says who holds each rank (the coordinator assigned it)."""
        assert self.executor is not None
        aborts = self._aborts
        self.close_links()
        self.executor.set_run_id(ring_id)
        P = self.executor.cfg.P  # R rings: the peers of this worker's own ring
        base = (self.cfg.rank or 0) - self.executor.rank
        self.cfg = self.cfg.model_copy(update={"peers": peers[base : base + P]})
        ledger = None if self.commitments is None else self.commitments.ledger
        if ledger is not None:
            ledger.clear()  # a new incarnation: the old one's frames are never committed
        links = make_links(self.cfg, self.executor, self.run_key, identities or (), ledger)
        if links is None:
            return
        links.start_server()
        with self._links_lock:  # published before the dial, so that an abort can cancel it
            if self._aborts != aborts:  # an abort came while the links were being built
                links.close()
                raise PeerError(f"joining ring {ring_id} abandoned: the round was aborted")
            self.links = links
        links.connect()
        self.executor.links = links

    def close_links(self) -> None:
        with self._links_lock:
            links, self.links = self.links, None
        if links is not None:
            links.close()
        if self.executor is not None:
            self.executor.links = None

    def _abort(self, why: str) -> None:
        """Abandon the round in flight: wake the executor and close the ring links."""
        with self._links_lock:
            self._aborts += 1
            links = self.links
        if links is not None:
            links.inbox.fail(PeerError(f"round abandoned: {why}"))
        self.close_links()

    # -------------------------------------------------------------- session
    def _serve(self, spec: control_pb2.RunSpec) -> tuple[str, str]:
        """Serve one session; ("done" | "stopped" | "rejoin", reason) when it ends."""
        executor = self.executor
        assert executor is not None
        instructions: queue.Queue = queue.Queue()
        ended: list[tuple[str, str]] = []
        outbox: queue.Queue = queue.Queue()
        outbox.put(control_pb2.Envelope(note="hello"))
        responses = self.stub.Session(iter(outbox.get, None))

        def end(outcome: str, reason: str) -> None:
            if not ended:
                ended.append((outcome, reason))
                if outcome != "done":
                    self._abort(reason)
                instructions.put(None)
                if outcome == "rejoin":
                    responses.cancel()

        tokens = executor.cfg.batch_size * executor.cfg.model().seq_len  # per step and site

        def on_step(r: WorkerStep) -> None:
            self.loss, self.tps = r.loss, tokens / max(r.seconds, 1e-9)

        worker = WorkerHandlers(
            executor, self.snapshots, self.rejoin_ring, on_step, self.own.move, self.commitments
        )
        app = make_client_app(worker)
        context = Context(
            run_id=FLOWER_RUN_ID,
            node_id=worker_node_id(self.cfg.rank or 0),
            node_config={},
            state=RecordDict(),
            run_config={},
        )
        self.own.move(WorkerState.READY)  # the session is open; the handlers say what is next
        self._session_end = end
        threading.Thread(
            target=self._read_session,
            args=(responses, instructions, end),
            daemon=True,
            name="session",
        ).start()
        try:
            while (data := instructions.get()) is not None:
                msg = message_from_bytes(data)
                reply = self._handle(app, msg, context)
                if not ended:
                    outbox.put(control_pb2.Envelope(flower_message=message_to_bytes(reply)))
        finally:
            self._session_end = None
            outbox.put(None)
        outcome, reason = ended[0]
        if outcome == "done" and self.links is not None:
            self.links.finish(timeout=min(self.cfg.peer_timeout, 30.0))
        self.close_links()
        self.own.move(WorkerState.REGISTERED)
        return outcome, reason

    def _read_session(self, responses, instructions: queue.Queue, end) -> None:
        """The coordinator's side of the session: notes are acted on, messages queued."""
        try:
            for env in responses:
                if env.note == "stop":
                    reason = env.flower_message.decode() or "stopped"
                    end("done" if reason == "done" else "stopped", reason)
                    return
                if env.note == "abort":
                    log.warning("worker-%d: abort: %s", self.cfg.rank, env.flower_message)
                    _drain(instructions)
                    self._abort(env.flower_message.decode())
                    continue
                if env.flower_message:
                    instructions.put(env.flower_message)
            end("rejoin", "the coordinator closed the session")
        except grpc.RpcError as exc:
            end("rejoin", f"lost the coordinator: {exc.code().name} {exc.details()}")
        except Exception as exc:  # never leave the main loop waiting
            log.exception("worker-%d: session reader failed", self.cfg.rank)
            end("rejoin", f"session reader failed: {exc!r}")

    def _handle(self, app, msg: Message, context: Context) -> Message:
        """Run one message; an exception becomes a Flower Error the coordinator can act on."""
        try:
            return app(msg, context)
        except PeerError as exc:  # the ring: an incident, named by the link's message
            code, text = ERROR_RING, str(exc)
        except CheckpointError as exc:  # e.g. a full disk: retrying cannot help
            code, text = ERROR_FATAL, f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            code, text = ERROR_INTERNAL, f"{type(exc).__name__}: {exc}"
        log.error("worker-%d: %s failed: %s", self.cfg.rank, msg.metadata.message_type, text)
        if self.executor is not None:
            self.executor.abandon_step()
        self.own.move(WorkerState.READY)  # idle again, whatever the handler was doing
        return Message(Error(code=code, reason=text), reply_to=msg)


def _drain(q: queue.Queue) -> None:
    with contextlib.suppress(queue.Empty):
        while True:
            q.get_nowait()


def run_with_coordinator(cfg: WorkerConfig) -> int:
    """Serve the coordinator's rounds; 0 when the run completed, else a RunStopped error."""
    return WorkerNode(cfg).run()
