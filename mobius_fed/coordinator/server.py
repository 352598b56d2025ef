"""``mobius-coordinator``: Flower's Strategy.start over our mTLS Grid, plus status.

One Flower round is one step barrier (docs/architecture.md §6.2, §9). This is the daemon
shell: it owns the servers and the run's start and end, and hands off to
:class:`~mobius_fed.coordinator.recovery.Recovery` (the recovery driver),
:class:`~mobius_fed.coordinator.rounds.RoundStore` (snapshots, checkpoints, manifests) and
:class:`~mobius_fed.coordinator.recorder.RunRecorder` (status, metrics.jsonl, history.json).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
from flwr.app import ArrayRecord, ConfigRecord, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mobius_fed.checkpoint import CheckpointError
from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.audits import Audits
from mobius_fed.coordinator.commitments import CommitmentAudit
from mobius_fed.coordinator.config import CoordinatorConfig
from mobius_fed.coordinator.control import ControlService
from mobius_fed.coordinator.grid import ControlGrid, RunFailed, names
from mobius_fed.coordinator.recorder import RunRecorder
from mobius_fed.coordinator.recovery import Recovery
from mobius_fed.coordinator.replies import validate_reply
from mobius_fed.coordinator.rounds import RoundState, RoundStore
from mobius_fed.coordinator.state import RunState
from mobius_fed.defences.er_dp import ErPrivacy
from mobius_fed.defences.report import status_block
from mobius_fed.defences.secagg import SecAgg
from mobius_fed.er_sync import payload_spec
from mobius_fed.machines import LIVE_PHASES, IncidentState, Phase
from mobius_fed.model import build_group, build_replica
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.strategies import (
    ErClip,
    RingPlan,
    RoundPlan,
    UpdateClip,
    make_strategy,
    restore_server_state,
    server_state,
    sync_strategy,
    wrapper_of,
)
from mobius_fed.transport.commitments import EVAL, TRAIN
from mobius_fed.transport.compress import Codec
from mobius_fed.transport.flower_wire import COORDINATOR_NODE_ID, set_task_identity
from mobius_fed.transport.revocation import CrlSource
from mobius_fed.transport.safe_arrays import spec_of
from mobius_fed.transport.tls import add_port, check_node_secrets, grpc_options

if TYPE_CHECKING:  # loaded when REST starts (FastAPI, uvicorn)
    from mobius_fed.coordinator.rest import RestServer

log = logging.getLogger("mobius.coordinator")


class Coordinator:
    """Registers P workers, runs the strategy over them, recovers from incidents, writes
    checkpoints and serves status."""

    def __init__(self, cfg: CoordinatorConfig) -> None:
        check_node_secrets(cfg.tls(), role="coordinator")
        self.crl = CrlSource(cfg.tls()).watch()  # crl.pem beside ca.crt (docs/security.md)
        self.cfg, self.train = cfg, cfg.train
        self.plan = RoundPlan.of(cfg.train, cfg.checkpoint_round_interval())
        self.er_privacy = ErPrivacy.of(cfg.train)  # reads the E/R noise key now: fail early
        self.secagg = SecAgg.of(cfg.train)  # only the sum of the sites' E/R updates
        self.state = RunState(
            run_id=cfg.run_id,
            P=cfg.train.workers,
            steps=cfg.train.steps,
            rings=cfg.train.rings,
            strategy=sync_strategy(cfg.strategy, cfg.strategy_options, cfg.train)[0],
            num_rounds=self.plan.num_rounds,
            layers=cfg.train.model().group_layers,
            loops=cfg.train.loops,
        )
        self.state.config = run_config_doc(cfg)
        self.state.privacy = privacy_source(cfg.train)
        self.state.metrics  # noqa: B018 - histograms exist before the first round ends
        replica = build_replica(cfg.train.model(), cfg.train.seed)
        spec = spec_of(replica.shared_state_dict())  # no private home layer
        if cfg.train.sync.codec != "none":  # a train reply's E/R: the codec's exact payloads
            spec = payload_spec(spec, cfg.train.sync.codec)
        groups = group_specs(cfg.train)
        self.grid = ControlGrid(
            cfg.train.workers,
            validate_reply=lambda rank, reply: validate_reply(
                rank, reply, spec, self.secagg, groups
            ),
            on_refused=self._frame_refused,
        )
        self.store = RoundStore(cfg, self.plan, self.state)
        self.recorder = RunRecorder(cfg.out_dir, self.state, self.plan)
        self.service = ControlService(
            self.state,
            self.grid,
            fingerprint=cfg.train.fingerprint(),
            run_spec=self._run_spec,
            crl=lambda: self.crl.data,
            settings=cfg.train.ring_settings(),
        )
        self.service.heartbeat_interval = cfg.heartbeat_interval
        # A resumed run's handovers hold before any registration is answered.
        self._handovers = self.store.saved_handovers()
        self.service.handovers.restore(self._handovers)
        self.state.handover_sink = self.store.save_handovers
        # while a standby waits, checkpoint copies often enough to hand a rank over cheaply
        self.store.cadence.standby_waiting = lambda: bool(self.service.pool.live())
        self.state.standby = lambda: self.store.cadence.status(self.service.pool.live())
        self.recovery = Recovery(cfg, self.state, self.grid, self.service, self.store)
        self.commitments = commitment_audit(self)
        self.audits = recomputation_audits(self)
        self.strategy: Any = None
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self.rest: RestServer | None = None
        self.metrics_server: RestServer | None = None

    # -------------------------------------------------------------- servers
    def start(self) -> None:
        logging.getLogger("flwr").setLevel(logging.WARNING)  # our own log says what matters
        pool = futures.ThreadPoolExecutor(max_workers=4 * self.train.workers + 8)
        self._server = grpc.server(pool, options=grpc_options())
        control_pb2_grpc.add_ControlServicer_to_server(self.service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        if not add_port(self._server, self.cfg.listen, self.cfg.tls()):
            raise OSError(f"cannot listen on {self.cfg.listen}")
        self._server.start()
        for name in ("", "mobius_fed.control.v1.Control"):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "coordinator listening on %s (run %s, %d workers: R=%d rings of P=%d, %d rounds)",
            self.cfg.listen,
            self.cfg.run_id,
            self.train.workers,
            self.train.rings,
            self.train.P,
            self.plan.num_rounds,
        )
        if self.cfg.rest_mode != "off":
            self._start_rest()
        if self.cfg.metrics_listen:
            self._start_metrics_listener(self.cfg.metrics_listen)
        threading.Thread(target=self._watch_heartbeats, daemon=True, name="heartbeats").start()

    def _start_rest(self) -> None:
        from mobius_fed.coordinator.rest import RestServer

        host, port = self.cfg.rest_listen.rsplit(":", 1)
        local = self.cfg.rest_mode == "local"
        self.rest = rest = RestServer(
            self.state,
            host,
            int(port),
            tls=None if local else self.cfg.tls(),
            allowed=lambda who: who in self.service.enrolled,
            local=local,
        ).start()
        scheme = "http" if local else "https"
        log.info("REST status on %s://%s:%s/v1/status", scheme, host, rest.port)

    def _start_metrics_listener(self, listen: str) -> None:
        """The opt-in plain listener: /metrics, /healthz, /readyz, read-only dashboard."""
        from mobius_fed.coordinator.rest import RestServer

        host, port = listen.rsplit(":", 1)
        host = host.strip("[]")
        self.metrics_server = server = RestServer(
            self.state, host, int(port), tls=None, allowed=None, metrics=True
        ).start()
        log.info("metrics on http://%s:%s/metrics", host, server.port)

    def stop(self) -> None:
        for rest in (self.rest, self.metrics_server):
            if rest is not None:
                rest.stop()
        if self._server is not None:  # open worker sessions would use up any longer grace
            self._server.stop(grace=0.5).wait()

    def _run_spec(self, rank: int) -> control_pb2.RunSpec:
        return control_pb2.RunSpec(
            run_id=self.cfg.run_id,
            rank=rank,
            peers=self.service.peers(),
            train_config_json=self.train.model_dump_json(),
            config_fingerprint=self.train.fingerprint(),
            heartbeat_interval_s=self.cfg.heartbeat_interval,
            crl=self.crl.data,
        )

    def _watch_heartbeats(self) -> None:
        while self.state.phase in LIVE_PHASES:
            self.service.expire_silent(self.cfg.heartbeat_timeout)
            time.sleep(min(0.5, self.cfg.heartbeat_interval))

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        """Train to the end; 0 when done, 1 when the run failed (the error is in status)."""
        self.start()
        try:
            rc = self._train()
            self._linger()
            return rc
        finally:
            self.recorder.flush(history=True)  # a stop signal: history.json as of now
            self.stop()

    def _linger(self) -> None:
        """Keep serving the final status for ``linger`` seconds (-1: until interrupted)."""
        if self.cfg.linger:
            log.info(
                "run finished; serving status %s",
                "until interrupted" if self.cfg.linger < 0 else f"for {self.cfg.linger:.0f}s",
            )
            deadline = None if self.cfg.linger < 0 else time.monotonic() + self.cfg.linger
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.2)

    def _train(self) -> int:
        set_task_identity(COORDINATOR_NODE_ID)
        try:
            start = self.store.start_state(self.recorder)
        except (CheckpointError, RunFailed) as exc:
            return self._fail(str(exc))
        if self.store.fresh and self._handovers:  # no manifest loaded: a fresh run after all
            self.service.handovers.forget()
        else:
            self.state.restore_handovers(self._handovers, start.round)
        if start.round >= self.plan.num_rounds:  # resumed a finished run: nothing to train
            self.state.finish(Phase.DONE)
            log.info(
                "run %s was already complete (round %d); serving its status",
                self.cfg.run_id,
                start.round,
            )
            self.grid.broadcast("stop", "done")
            return 0
        missing = self.grid.wait_for_sessions(self.cfg.registration_timeout)
        if missing:
            return self._fail(
                f"workers never joined within {self.cfg.registration_timeout}s: {names(missing)}"
            )
        self.state.move_phase(Phase.TRAINING)
        log.info("all %d workers joined", self.train.workers)
        try:
            self.recovery.drive(self._run_strategy)
        except (RunFailed, CheckpointError) as exc:
            return self._fail(str(exc))
        except Exception as exc:  # a bug must end the run with a status, not a traceback
            log.exception("run %s: internal error", self.cfg.run_id)
            return self._fail(f"internal error in the coordinator: {exc!r}")
        if self.audits is not None:  # the audits asked of the last rounds, in the status
            self.audits.wait()
        self.state.finish(Phase.DONE)
        self.recorder.flush(history=True)
        self.grid.broadcast("stop", "done")
        self._await_workers_leaving(timeout=30)
        log.info(
            "run %s done: %d steps, checkpoint %s",
            self.cfg.run_id,
            self.state.step,
            self.state.checkpoint,
        )
        return 0

    def _make_strategy(self, rnd: int) -> Any:
        """The run's Flower strategy from round ``rnd`` on, wired to this coordinator."""
        if self.secagg is not None:  # this ring incarnation's keys; its id keeps masks fresh
            keys = self.recovery.public_keys
            missing = [r for r in range(self.train.workers) if r not in keys]
            if missing:
                raise RunFailed(
                    f"{names(missing)} sent no SecAgg public key (privacy.er_secagg is on)"
                )
            self.secagg.relay([keys[r] for r in range(self.train.P)], self.recovery.ring_id)
        name, options = sync_strategy(self.cfg.strategy, self.cfg.strategy_options, self.train)
        return make_strategy(
            name,
            self.train.workers,
            self.plan,
            options,
            round_offset=rnd,
            hooks=self,
            er_privacy=self.er_privacy,
            secagg=self.secagg,
            rings=RingPlan.of(self.train),
            update_clip=UpdateClip.of(self.train),
            er_codec=self.train.sync.codec,
            er_down_codec=self.train.sync.down_codec,
            state_copy=self.cfg.state_copy == "coordinator",
            barrier_snapshots=self.cfg.barrier_snapshots,
            checkpoints=self.store.cadence.order,
            # One more file than manifests: a worker writes round r before its manifest commits.
            keep_checkpoints=self.store.keep_checkpoints + 1 if self.store.keep_checkpoints else 0,
        )

    def _run_strategy(self, snap: RoundState) -> None:
        """Flower's Strategy.start from round ``snap.round`` on (its evaluation first, if
        missed)."""
        rnd = snap.round
        self.strategy = strategy = self._make_strategy(rnd)
        restore_server_state(strategy, snap.server_state)
        evaluated = {e["round"] for e in self.state.evals}
        if rnd and self.plan.evaluates(rnd) and rnd not in evaluated:
            log.info("round %d: its evaluation was interrupted; evaluating again", rnd)
            msgs = strategy.configure_evaluate(
                0, copy.deepcopy(snap.arrays), ConfigRecord(), self.grid
            )
            strategy.aggregate_evaluate(
                0, self.grid.send_and_receive(msgs, timeout=self.cfg.round_timeout)
            )
        if rnd >= self.plan.num_rounds:
            return
        log.info(
            "training rounds %d..%d with %s", rnd + 1, self.plan.num_rounds, type(strategy).__name__
        )
        self.recorder.restart_clock()
        strategy.start(
            grid=self.grid,
            initial_arrays=copy.deepcopy(snap.arrays),
            num_rounds=self.plan.num_rounds - rnd,
            timeout=self.cfg.round_timeout,
            train_config=ConfigRecord(),
            evaluate_config=ConfigRecord(),
        )

    def _fail(self, reason: str) -> int:
        log.error("run %s failed: %s", self.cfg.run_id, reason)
        self.grid.fail(reason)
        self.state.finish(Phase.FAILED, reason)
        self.recorder.flush(history=True)
        for inc in self.state.incidents:
            if inc.state == IncidentState.OPEN:
                self.state.update_incident(inc, state=IncidentState.FAILED)
        self.grid.broadcast("stop", reason)
        self._await_workers_leaving(timeout=10)
        return 1

    def _await_workers_leaving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.grid.open_sessions() and time.monotonic() < deadline:
            time.sleep(0.1)

    # ------------------------------------------------------ strategy hooks
    def before_train(self, rnd: int) -> None:
        self.recovery.in_flight = rnd

    def after_train(self, rnd: int, replies: list[Message], arrays: ArrayRecord | None) -> None:
        self.recorder.record_train(rnd, replies)
        if self.commitments is not None:  # what each site signed it sent and received
            first, end = self.plan.steps_of(rnd)
            self.commitments.check(rnd, TRAIN, first, end, replies)
        if self.audits is not None:  # state digests, uploads asked, the next draw
            self.audits.after_train(rnd, replies)
        clip = wrapper_of(self.strategy, ErClip)
        for rank, why in clip.round_clipped.items() if clip is not None else ():
            if self.state.record_clip(rank, why, self.train.bounds.suspect_after):
                self._evict_suspect(rank)
        self.recovery.in_flight = 0
        if arrays is not None:
            self.store.keep(rnd, arrays, server_state(self.strategy), replies)
            if self.store.last_manifest_round == rnd:  # the status on disk as new as it
                self.recorder.write_history()
        self.recorder.restart_clock()

    def _frame_refused(self, rank: int, why: str) -> None:
        """A worker refused a frame of ``rank``'s (a bound, a non-finite value): counted
        against the sender; ``suspect_after`` refusals make it a suspect."""
        if self.state.record_refusal(rank, why, self.train.bounds.suspect_after):
            self._evict_suspect(rank, "of its frames refused by its neighbours")

    def _evict_suspect(
        self,
        rank: int,
        what: str = "of its E/R updates clipped",
        reason: str | None = None,
        audited: int | None = None,
    ) -> None:
        """``--evict-suspects``: hand a new suspect's rank to a waiting standby and count
        the suspect lost (its process is refused from now on), as ``replace --force``.
        ``reason``: why, when not ``suspect_after`` counts of ``what`` (an audit of round
        ``audited``: the run then rolls back to a round before it, docs/audits.md)."""
        if not self.cfg.evict_suspects:
            return
        if self.state.step >= self.train.steps:  # a verdict after the last step: no round
            log.error("worker-%d is suspect after the last step: named, not evicted", rank)
            return  # is left to hand over (a handover now would leave the run recovering)
        n = self.train.bounds.suspect_after
        why = f"evicted as a suspect ({reason or f'{n} {what}'}; --evict-suspects)"
        if audited is not None:
            why += f"; the run rolls back to a round before round {audited}"
        replaced = self.service.pool.identity_of(rank)
        if self.service.handovers.hand_over(rank, why) is None:
            log.error("worker-%d is suspect but no standby waits: it stays in the ring", rank)
            return
        if audited is not None:  # before the incident: its restore must see the cap
            self.recovery.roll_back_before(audited)
        self.service.mark_lost(rank, why, replaced)

    def after_evaluate(self, rnd: int, replies: list[Message]) -> None:
        self.recorder.record_eval(rnd, replies)
        if self.commitments is not None:
            step = self.plan.steps_of(rnd)[1]
            self.commitments.check(rnd, EVAL, step, step + 1, replies)


def group_specs(train: TrainConfig) -> Callable[[int], Any] | None:
    """R > 1: worker ``rank``'s F_i names, shapes and dtypes (what its ring sync sends:
    with a ring codec, each tensor's uint8 payload of the codec's exact size)."""
    if train.rings == 1:
        return None
    model = train.model()
    specs = [
        spec_of(dict(build_group(model, i, train.seed).named_parameters())) for i in range(train.P)
    ]
    if train.ring_codec != "none":
        codec = Codec(train.ring_codec)
        specs = [
            {n: ((codec.payload_bytes(shape),), "uint8") for n, (shape, _) in spec.items()}
            for spec in specs
        ]
    return lambda rank: specs[rank % train.P]


def run_config_doc(cfg: CoordinatorConfig) -> dict[str, Any]:
    """The run's configuration as status and the dashboard show it (no key material)."""
    return {
        "run_id": cfg.run_id,
        "strategy": cfg.strategy,
        "strategy_options": dict(cfg.strategy_options),
        "checkpoint_every": cfg.checkpoint_every,
        "fingerprint": cfg.train.fingerprint(),
        "train": cfg.train.model_dump(mode="json"),
    }


def privacy_source(train: Any):
    """``step → privacy status block`` (the privacy report's)."""
    return lambda step: status_block(train, step)


def commitment_audit(coordinator: Coordinator) -> CommitmentAudit | None:
    """audit.commitments: the check of each round's signed frame digests, its findings
    in status (docs/security.md "Commitments")."""
    if not coordinator.train.audit.commitments:
        return None
    audit = CommitmentAudit(
        coordinator.train,
        certificate=coordinator.service.certificates.get,
        ring=lambda: coordinator.recovery.ring_id,
        site=coordinator.state.site,
    )
    coordinator.state.commitments = audit.status
    return audit


def recomputation_audits(coordinator: Coordinator) -> Audits | None:
    """audit.rate: audits by recomputation beside the commitments (docs/audits.md)."""
    if coordinator.commitments is None or coordinator.train.audit.rate <= 0:
        return None
    audits = Audits(
        coordinator.train,
        certificate=coordinator.service.certificates.get,
        site=coordinator.state.site,
        on_suspect=lambda rank, why, rnd: coordinator._evict_suspect(rank, reason=why, audited=rnd),
        rounds=coordinator.plan.num_rounds,
    )
    coordinator.store.audit_open = audits.oldest_open  # its checkpoint before stays
    coordinator.store.rolled_back = audits.rolled_back
    coordinator.commitments.on_commitment = audits.commitment
    coordinator.state.audits = audits.status
    return audits
