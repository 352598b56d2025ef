"""``mobius-coordinator``: Flower's Strategy.start over our mTLS Grid, plus status.

One Flower round is one step barrier: the strategy sends the averaged E/R arrays and the
round's step range to every worker, each worker trains those steps on the ring and answers
with its E/R arrays, and the strategy aggregates them (FedAvg by default).
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import logging
import secrets
import shutil
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mobius_fed.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    sha256_of,
    write_bytes_atomic,
)
from mobius_fed.coordinator.config import CoordinatorConfig
from mobius_fed.coordinator.control import ControlService
from mobius_fed.coordinator.grid import ControlGrid, GridTimeout, IncidentRaised, RunFailed
from mobius_fed.coordinator.state import Incident, RunState, json_safe
from mobius_fed.machines import LIVE_PHASES, IncidentState, Phase
from mobius_fed.machines import WorkerState as W
from mobius_fed.model import build_replica
from mobius_fed.privacy.er_dp import ErPrivacy
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.strategies import (
    RoundPlan,
    from_plain,
    make_strategy,
    restore_server_state,
    server_state,
    to_plain,
)
from mobius_fed.transport.flower_wire import (
    COORDINATOR_NODE_ID,
    rank_of_node,
    set_task_identity,
    worker_node_id,
)
from mobius_fed.transport.safe_arrays import UnsafeArrayError, spec_of, validate_array_record
from mobius_fed.transport.tls import GRPC_OPTIONS, add_port, check_node_secrets, worker_identity

log = logging.getLogger("mobius.coordinator")
MANIFEST = "manifest.json"
ER_FILE = "er.ckpt"
METRICS_FILE = "metrics.jsonl"
HISTORY_FILE = "history.json"
OPTIONAL_FIGURES = {  # a worker's train reply metric → the coordinator's name for it
    "wait-seconds": "wait_s",
    "compute-seconds": "compute_s",
    "bytes-sent": "bytes_sent",
    "frames-sent": "frames_sent",
}


def checkpoint_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def manifest_problem(path: Path, doc: dict[str, Any], plan: RoundPlan | None = None) -> str | None:
    """Why the manifest at ``path`` cannot be used (None: it can)."""
    try:
        rnd = int(doc["round"])
        if path.parent.name != f"round-{rnd:06d}":
            return f"it names round {rnd} but lies in {path.parent.name}"
        if plan is not None and int(doc["step"]) != plan.steps_of(rnd)[1]:
            return f"round {rnd} ends at step {plan.steps_of(rnd)[1]}, it says {doc['step']}"
        er = path.parent / doc["er"]
        if not er.is_file():
            return f"{er} is missing"
        if "er_sha256" in doc and sha256_of(er) != doc["er_sha256"]:
            return f"{er}: sha256 {sha256_of(er)} does not match the manifest's {doc['er_sha256']}"
        if not isinstance(doc["workers"], dict):
            return "no worker table"
    except (KeyError, TypeError, ValueError) as exc:
        return f"malformed ({exc!r})"
    return None


def complete_manifests(out_dir: Path, plan: RoundPlan | None = None) -> list[Path]:
    """Every complete, verified manifest, newest first; unusable ones are logged and skipped."""
    found = []
    for path in sorted(checkpoint_dir(out_dir).glob("round-*/" + MANIFEST), reverse=True):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            log.warning("skipping manifest %s: %s", path, exc)
            continue
        problem = manifest_problem(path, doc, plan)
        if problem:
            log.warning("skipping manifest %s: %s", path, problem)
            continue
        found.append(path)
    return found


def latest_manifest(out_dir: Path) -> Path | None:
    """The newest complete manifest (its E/R file present and verified), or None."""
    found = complete_manifests(out_dir)
    return found[0] if found else None


@dataclass
class RoundState:
    """The coordinator's side of the ring state after round ``round``: averaged E/R, the
    strategy's server state and the history so far. Round 0 is the start."""

    round: int
    arrays: ArrayRecord
    server_state: dict[str, Any]
    history: dict[str, Any] | None = None  # only when it came from disk
    manifest: dict[str, Any] | None = None  # the manifest that holds this round, if any


class Coordinator:
    """Registers P workers, runs the strategy over them, recovers from incidents, writes
    checkpoints and serves status."""

    def __init__(self, cfg: CoordinatorConfig) -> None:
        check_node_secrets(cfg.tls())
        self.cfg = cfg
        self.train = cfg.train
        self.plan = RoundPlan.of(cfg.train, cfg.checkpoint_round_interval())
        self.er_privacy = ErPrivacy.of(cfg.train)  # reads the E/R noise key now: fail early
        self.state = RunState(
            run_id=cfg.run_id,
            P=cfg.train.P,
            steps=cfg.train.steps,
            strategy=cfg.strategy,
            num_rounds=self.plan.num_rounds,
        )
        self.state.config = run_config_doc(cfg)
        self.state.privacy = privacy_source(cfg.train)
        self.state.metrics  # noqa: B018 - histograms exist before the first round ends
        self._pending_line: dict[str, Any] | None = None
        replica = build_replica(cfg.train.model(), cfg.train.seed)
        self.replica_spec = spec_of(replica.shared_state_dict())  # no private home layer
        self.grid = ControlGrid(cfg.train.P, validate_reply=self._validate_reply)
        self.manifests = complete_manifests(cfg.out_dir, self.plan) if cfg.resume else []
        if cfg.resume is True and not self.manifests:
            raise FileNotFoundError(
                f"--resume: no complete checkpoint manifest under {checkpoint_dir(cfg.out_dir)}"
            )
        for path in self.manifests:
            doc = json.loads(path.read_text())
            if doc["fingerprint"] != cfg.train.fingerprint():
                raise ValueError(f"--resume: {path} was written by a different train config")
        self.service = ControlService(
            self.state,
            self.grid,
            fingerprint=cfg.train.fingerprint(),
            run_spec=self._run_spec,
            registration_timeout=cfg.registration_timeout,
        )
        self.snapshots: dict[int, RoundState] = {}
        self._fresh = False  # a fresh start: workers set an earlier run's files aside
        self.last_manifest_round = 0
        self.in_flight = 0  # the train round in flight (0: none)
        self.ring_epoch = 0
        self.boot = secrets.token_hex(3)  # ring ids differ from any earlier coordinator's
        self._round_started = 0.0
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self.rest = None
        self.metrics_server = None
        self.port = 0

    def _validate_reply(self, rank: int, reply: Message) -> None:
        """What a worker answers must be well formed before the strategy or status sees it:
        E/R arrays exactly the replica's names, shapes and dtypes; losses finite; the
        records each message type needs. RunFailed names the worker."""
        who = f"worker-{rank} ({worker_identity(rank)})"
        content = reply.content
        if "arrays" in content:
            try:
                validate_array_record(content["arrays"], expected=self.replica_spec)
            except UnsafeArrayError as exc:
                raise RunFailed(f"{who} sent bad arrays: {exc}") from None
        problem = reply_problem(reply.metadata.message_type, content)
        if problem:
            raise RunFailed(
                f"{who} sent an unusable {reply.metadata.message_type} reply: {problem}"
            )

    # -------------------------------------------------------------- servers
    def start(self) -> None:
        logging.getLogger("flwr").setLevel(logging.WARNING)  # our own log says what matters
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4 * self.train.P + 8), options=GRPC_OPTIONS
        )
        control_pb2_grpc.add_ControlServicer_to_server(self.service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = add_port(
            self._server, self.cfg.listen, self.cfg.tls(), insecure=self.cfg.insecure
        )
        if not self.port:
            raise OSError(f"cannot listen on {self.cfg.listen}")
        self._server.start()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "coordinator listening on %s (run %s, P=%d, %d rounds)",
            self.cfg.listen,
            self.cfg.run_id,
            self.train.P,
            self.plan.num_rounds,
        )
        if self.cfg.rest_mode != "off":
            self._start_rest()
        if getattr(self.cfg, "metrics_listen", None):
            self._start_metrics_listener(self.cfg.metrics_listen)  # type: ignore[attr-defined]
        threading.Thread(target=self._watch_heartbeats, daemon=True, name="heartbeats").start()

    def _start_rest(self) -> None:
        from mobius_fed.coordinator.rest import RestServer

        host, port = self.cfg.rest_listen.rsplit(":", 1)
        local = self.cfg.rest_mode == "local"
        self.rest = RestServer(
            self.state,
            host,
            int(port),
            tls=None if local else self.cfg.tls(),
            allowed=lambda who: who in self.service.enrolled,
            local=local,
        )
        self.rest.start()
        log.info(
            "REST status on %s://%s:%s/v1/status",
            "http" if local else "https",
            host,
            self.rest.port,
        )

    def _start_metrics_listener(self, listen: str) -> None:
        """The opt-in plain listener: /metrics, /healthz, /readyz, read-only dashboard."""
        from mobius_fed.coordinator.rest import RestServer

        host, port = listen.rsplit(":", 1)
        host = host.strip("[]")
        self.metrics_server = RestServer(
            self.state, host, int(port), tls=None, allowed=None, metrics=True
        )
        self.metrics_server.start()
        log.info("metrics on http://%s:%s/metrics", host, self.metrics_server.port)

    def _set_health(self, status: int) -> None:
        for name in ("", "mobius_fed.control.v1.Control"):
            self._health.set(name, status)

    def stop(self) -> None:
        if self.rest is not None:
            self.rest.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self._server is not None:  # open worker sessions would use up any longer grace
            self._server.stop(grace=0.5).wait()

    # ------------------------------------------------------------- run spec
    def _run_spec(self, rank: int) -> control_pb2.RunSpec:
        return control_pb2.RunSpec(
            run_id=self.cfg.run_id,
            rank=rank,
            peers=self.service.peers(),
            train_config_json=self.train.model_dump_json(),
            config_fingerprint=self.train.fingerprint(),
            heartbeat_interval_s=self.cfg.heartbeat_interval,
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
            start = self._start_state()
        except (CheckpointError, RunFailed) as exc:
            return self._fail(str(exc))
        self.snapshots[start.round] = start
        if start.round >= self.plan.num_rounds:  # resumed a finished run: nothing to train
            self.state.finish(Phase.DONE)
            log.info(
                "run %s was already complete (round %d); serving its status",
                self.cfg.run_id,
                start.round,
            )
            self.grid.broadcast_stop("done")
            return 0
        missing = self.grid.wait_for_sessions(self.cfg.registration_timeout)
        if missing:
            names = ", ".join(f"worker-{m}" for m in missing)
            return self._fail(
                f"workers never joined within {self.cfg.registration_timeout}s: {names}"
            )
        self.state.move_phase(Phase.TRAINING)
        log.info("all %d workers joined", self.train.P)
        incident: Incident | None = None
        while True:
            try:
                rnd = self._restore_ring(incident)
                if incident is not None:
                    self._close_incidents(rnd)
                    incident = None
                self._run_strategy(rnd)
                break
            except IncidentRaised as exc:
                try:
                    incident = self._handle_incident(exc)
                except RunFailed as failed:
                    return self._fail(str(failed))
            except (RunFailed, CheckpointError) as exc:
                return self._fail(str(exc))
            except Exception as exc:  # a bug must end the run with a status, not a traceback
                log.exception("run %s: internal error", self.cfg.run_id)
                return self._fail(f"internal error in the coordinator: {exc!r}")
        self.state.finish(Phase.DONE)
        self._flush_line()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.grid.broadcast_stop("done")
        self._await_workers_leaving(timeout=30)
        log.info(
            "run %s done: %d steps, checkpoint %s",
            self.cfg.run_id,
            self.state.step,
            self.state.checkpoint,
        )
        return 0

    # ------------------------------------------------------------ the start
    def _start_state(self) -> RoundState:
        """Round 0 from the seed, or the newest manifest whose E/R file verifies."""
        for path in self.manifests:
            doc = json.loads(path.read_text())
            try:
                state = self._load_round(path, doc)
            except CheckpointError as exc:
                log.error("cannot resume from %s: %s; trying the previous manifest", path, exc)
                continue
            self._restore_history(state.history or {})
            self.last_manifest_round = state.round
            self.state.set(checkpoint=str(path))
            log.info("resuming from %s (round %d, step %d)", path, doc["round"], doc["step"])
            return state
        if self.cfg.resume is True:
            raise RunFailed(
                f"--resume: no manifest under {checkpoint_dir(self.cfg.out_dir)} could be loaded"
            )
        # A fresh run: an earlier run's files (here and on the workers) are moved aside,
        # never reused, never pruned as this run's own.
        self._fresh = True
        ckpts = checkpoint_dir(self.cfg.out_dir)
        if ckpts.is_dir() and any(ckpts.iterdir()):
            aside = ckpts.with_name(f"{ckpts.name}.{int(time.time())}")
            ckpts.rename(aside)
            log.warning("an earlier run's checkpoints moved to %s", aside)
        for name in (METRICS_FILE, HISTORY_FILE):
            old = Path(self.cfg.out_dir) / name
            if old.is_file():
                aside = old.with_name(f"{name}.{int(time.time())}")
                old.rename(aside)
                log.warning("an earlier run's %s moved to %s", name, aside)
        return self._seed_state()

    def _seed_state(self) -> RoundState:
        """Round 0: E/R from the seed, a strategy with no server state yet."""
        replica = build_replica(self.train.model(), self.train.seed)
        shared = replica.shared_state_dict()  # E/R only: home layers never leave their site
        arrays = ArrayRecord({k: v.detach().clone() for k, v in shared.items()})
        return RoundState(0, arrays, {})

    def _load_round(self, path: Path, doc: dict[str, Any]) -> RoundState:
        saved = load_checkpoint(path.parent / doc["er"], doc.get("er_sha256"))
        return RoundState(
            int(doc["round"]),
            from_plain(saved["arrays"]),
            from_plain(saved["server_state"]),
            history=saved.get("history", {}),
            manifest={**doc, "dir": str(path.parent)},
        )

    # ------------------------------------------------------------ incidents
    def _handle_incident(self, exc: IncidentRaised) -> Incident:
        """Record the incident, abort the round in flight everywhere, and wait until every
        rank holds a session again. RunFailed past the budget or the rejoin timeout."""
        raised = self.grid.take_incident() or exc
        incident = self._record(raised)
        self.state.move_phase(Phase.RECOVERING)
        self.grid.broadcast("abort", raised.what)
        deadline = time.monotonic() + self.cfg.rejoin_timeout
        while True:
            self._check_budget(incident)
            missing = self.grid.wait_for_sessions(
                min(1.0, max(0.0, deadline - time.monotonic())),
                ready=lambda: all(w.state != W.LOST for w in self.state.workers.values()),
            )
            extra = self.grid.take_incident()  # another loss while waiting: same recovery
            if extra is not None:
                self._record(extra)
                self.grid.broadcast("abort", extra.what)
                continue
            lost = [w.rank for w in self.state.workers.values() if w.state == W.LOST]
            if not missing and not lost:
                return incident
            if time.monotonic() >= deadline:
                gone = sorted(set(missing) | set(lost))
                raise RunFailed(
                    f"{_names(gone)} did not rejoin within {self.cfg.rejoin_timeout:.0f}s after: "
                    f"{raised.what} (ring edges {_edges(gone, self.train.P)})"
                )

    def _record(self, raised: IncidentRaised) -> Incident:
        now = time.time()
        last_seen = raised.last_seen
        edge = raised.edge
        if edge is None and raised.rank is not None:
            edge = _edges([raised.rank], self.train.P)
        incident = self.state.open_incident(
            kind=raised.kind,
            what=raised.what,
            rank=raised.rank,
            edge=edge,
            round=self.in_flight,
            detected_at=now,
            detection_s=None if last_seen is None else max(0.0, now - last_seen),
        )
        log.error("incident %d: %s (round %d in flight)", incident.id, raised.what, self.in_flight)
        return incident

    def _check_budget(self, incident: Incident) -> None:
        if len(self.state.incidents) > self.cfg.max_incidents:
            raise RunFailed(
                f"{len(self.state.incidents)} incidents, more than --max-incidents "
                f"{self.cfg.max_incidents}; the last: {incident.what} (ring edges {incident.edge})"
            )

    def _close_incidents(self, rnd: int) -> None:
        now = time.time()
        end = self.plan.steps_of(rnd)[1]  # round 0 ends at step 0
        for inc in self.state.incidents:
            if inc.state != IncidentState.OPEN:
                continue
            in_flight_end = self.plan.steps_of(inc.round)[1] if inc.round else end
            rank_w = self.state.workers.get(inc.rank) if inc.rank is not None else None
            back = rank_w.registered_at if rank_w and rank_w.registered_at else None
            self.state.update_incident(
                inc,
                state=IncidentState.RECOVERED,
                rollback_round=rnd,
                steps_redone=max(0, in_flight_end - end),
                recovered_at=now,
                recovery_s=now - inc.detected_at,
                rejoin_s=None if back is None or back < inc.detected_at else now - back,
            )
            log.info(
                "incident %d recovered in %.1fs: rolled back to round %d, %d step(s) redone",
                inc.id,
                now - inc.detected_at,
                rnd,
                max(0, in_flight_end - end),
            )
        for w in self.state.workers.values():
            if w.state in (W.REJOINING, W.RESTORING):
                self.state.move_worker(w.rank, W.RECOVERED)

    # -------------------------------------------------------------- restore
    def _restore_ring(self, incident: Incident | None) -> int:
        """Bring every worker to the newest round all of them (and this coordinator) can
        restore, on a fresh ring incarnation; return that round."""
        have = self._ask_rounds()
        log.info(
            "rounds each worker can restore: %s",
            "; ".join(f"worker-{r}: {sorted(v)}" for r, v in sorted(have.items())),
        )
        refused: dict[int, set[int]] = {r: set() for r in range(self.train.P)}
        while True:
            rnd, sources = self._choose_round(have, refused)
            for rank in range(self.train.P):
                if self.state.workers[rank].state in (W.REJOINING, W.LOST):
                    self.state.move_worker(rank, W.RESTORING)
            log.info("restoring round %d (%s)", rnd, sources)
            replies = self._send_all(
                "query.restore",
                lambda rank, rnd=rnd: self._restore_content(rank, rnd, rnd in have[rank]),
                self.cfg.restore_timeout,
                "load the rollback state",
            )
            failed = {
                rank_of_node(r.metadata.src_node_id): str(r.content["config"]["reason"])
                for r in replies
                if not bool(r.content["config"]["ok"])
            }
            if not failed:
                break
            for rank, reason in failed.items():
                log.error("worker-%d cannot restore round %d: %s", rank, rnd, reason)
                refused[rank].add(rnd)
        self.ring_epoch += 1
        ring_id = f"{self.cfg.run_id}/{self.boot}.{self.ring_epoch}"
        log.info("round %d restored everywhere; opening ring %s", rnd, ring_id)
        peers = self.service.peers()
        self._send_all(
            "query.ring",
            lambda rank: RecordDict({"config": ConfigRecord({"ring-id": ring_id, "peers": peers})}),
            self.cfg.restore_timeout,
            "join the ring",
        )
        snap = self.snapshots.get(rnd)
        if snap is None and rnd == 0:
            snap = self._seed_state()
        elif snap is None:  # an older manifest from disk
            manifest = self._manifest_path(rnd)
            if manifest is None:
                raise RunFailed(f"round {rnd}: its manifest disappeared during the restore")
            snap = self._load_round(manifest, json.loads(manifest.read_text()))
        self.snapshots = {r: v for r, v in self.snapshots.items() if r <= rnd}  # a redo
        self.snapshots[rnd] = snap
        self._fresh = False
        end = self.plan.steps_of(rnd)[1]  # round 0 ends at step 0
        self.state.rollback(end, rnd)
        self.state.move_phase(Phase.TRAINING)
        self._round_state = snap
        return rnd

    def _ask_rounds(self) -> dict[int, set[int]]:
        replies = self._send_all(
            "query.state",
            lambda rank: RecordDict({"config": ConfigRecord({})}),
            self.cfg.restore_timeout,
            "report the rounds it can restore",
        )
        return {
            rank_of_node(r.metadata.src_node_id): {int(x) for x in r.content["config"]["rounds"]}
            | {0}
            for r in replies
        }

    def _coordinator_rounds(self) -> list[int]:
        disk = {_round_of(m) for m in self.manifests}
        return sorted(set(self.snapshots) | disk | {0}, reverse=True)

    def _choose_round(
        self, have: dict[int, set[int]], refused: dict[int, set[int]]
    ) -> tuple[int, str]:
        for rnd in self._coordinator_rounds():
            manifest = self._manifest_doc(rnd)
            sources = []
            for rank in range(self.train.P):
                entry = manifest["workers"].get(str(rank), {}) if manifest else {}
                if rnd in refused[rank]:
                    break
                if rnd in have[rank]:
                    sources.append(f"worker-{rank}: own")
                elif entry.get("copy"):
                    sources.append(f"worker-{rank}: copy")
                else:
                    if entry:
                        log.error(
                            "round %d: worker-%d's checkpoint %s is missing and there is no "
                            "copy; trying an earlier round",
                            rnd,
                            rank,
                            entry["path"],
                        )
                    break
            else:
                return rnd, ", ".join(sources)
        why = "; ".join(f"worker-{r} refused round(s) {sorted(v)}" for r, v in refused.items() if v)
        raise RunFailed(f"no round every worker can restore, not even the start ({why})")

    def _manifest_doc(self, rnd: int) -> dict[str, Any] | None:
        snap = self.snapshots.get(rnd)
        if snap is not None and snap.manifest is not None:
            return snap.manifest
        m = self._manifest_path(rnd)
        return None if m is None else {**json.loads(m.read_text()), "dir": str(m.parent)}

    def _manifest_path(self, rnd: int) -> Path | None:
        return next((m for m in self.manifests if _round_of(m) == rnd), None)

    def _restore_content(self, rank: int, rnd: int, has_it: bool) -> RecordDict:
        end = self.plan.steps_of(rnd)[1]  # round 0 ends at step 0
        conf = ConfigRecord({"round": rnd, "step": end, "sha256": "", "fresh": self._fresh})
        manifest = self._manifest_doc(rnd)
        entry = manifest["workers"].get(str(rank)) if manifest else None
        if entry:
            conf["sha256"] = entry["sha256"]
            conf["file"] = Path(entry["path"]).name
            if entry.get("copy") and not has_it:  # only to a worker that needs it
                copy = Path(manifest["dir"]) / entry["copy"]
                conf["copy-sha256"] = entry["copy_sha256"]
                if copy.is_file():
                    conf["copy"] = copy.read_bytes()
        return RecordDict({"config": conf})

    def _send_all(self, kind: str, content, timeout: float, what: str) -> list[Message]:
        messages = [
            Message(content(rank), worker_node_id(rank), kind) for rank in range(self.train.P)
        ]
        try:
            return list(self.grid.send_and_receive(messages, timeout=timeout))
        except GridTimeout as exc:
            raise RunFailed(
                f"{_names(exc.ranks)} did not {what} within {timeout:.0f}s (watchdog)"
            ) from exc

    # ------------------------------------------------------------- strategy
    def _run_strategy(self, rnd: int) -> None:
        """Flower's Strategy.start from round ``rnd`` on (its evaluation first, if missed)."""
        snap = self._round_state
        strategy = make_strategy(
            self.cfg.strategy,
            self.train.P,
            self.plan,
            self.cfg.strategy_options,
            round_offset=rnd,
        )
        strategy.hooks = self
        strategy.er_privacy = self.er_privacy
        strategy.state_copy = self.cfg.state_copy == "coordinator"
        strategy.barrier_snapshots = self.cfg.barrier_snapshots
        # One more file than manifests: a worker writes round r before its manifest commits.
        strategy.keep_checkpoints = (
            self.cfg.keep_checkpoints + 1 if self.cfg.keep_checkpoints else 0
        )
        restore_server_state(strategy, snap.server_state)
        self.strategy = strategy
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
            "training rounds %d..%d with %s",
            rnd + 1,
            self.plan.num_rounds,
            type(strategy).__name__,
        )
        self._round_started = time.perf_counter()
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
        self._flush_line()
        for inc in self.state.incidents:
            if inc.state == IncidentState.OPEN:
                self.state.update_incident(inc, state=IncidentState.FAILED)
        self.grid.broadcast_stop(reason)
        self._await_workers_leaving(timeout=10)
        return 1

    def _await_workers_leaving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.grid.open_sessions() and time.monotonic() < deadline:
            time.sleep(0.1)

    # ------------------------------------------------------ strategy hooks
    def before_train(self, rnd: int) -> None:
        self.in_flight = rnd

    def after_train(self, rnd: int, replies: list[Message], arrays: ArrayRecord | None) -> None:
        seconds = time.perf_counter() - self._round_started
        start, end = self.plan.steps_of(rnd)
        worker_seconds = snapshot_seconds = tokens = 0.0
        figures: dict[int, dict[str, float]] = {}
        for reply in replies:
            rank = rank_of_node(reply.metadata.src_node_id)
            metrics = reply.content["metrics"]
            losses = list(metrics["losses"])
            self.state.record_losses(rank, start, losses)
            self.state.update_worker(rank, last_loss=losses[-1], step=end)
            worker_seconds = max(worker_seconds, float(metrics["train-seconds"]))
            snapshot_seconds = max(snapshot_seconds, float(metrics.get("snapshot-seconds", 0.0)))
            tokens += float(metrics["num-examples"])
            figures[rank] = {"train_s": float(metrics["train-seconds"])}
            for key, name in OPTIONAL_FIGURES.items():
                if key in metrics:
                    figures[rank][name] = float(metrics[key])  # type: ignore[arg-type]
        self.state.record_round(
            rnd,
            seconds,
            worker_seconds,
            snapshot_seconds,
            workers=figures,
            steps=end - start,
            tokens=tokens,
        )
        self.state.set(round=rnd, step=end)
        self._round_line(rnd, start, end, seconds, figures)
        self.in_flight = 0
        if arrays is not None:
            snap = RoundState(rnd, copy.deepcopy(arrays), server_state(self.strategy))
            if self.plan.checkpoints(rnd):
                snap.manifest = self._write_checkpoint(rnd, replies, snap)
                self.last_manifest_round = rnd
            self.snapshots[rnd] = snap
            # The two newest rounds (a worker may have finished one its peers did not)
            # and the newest manifest's.
            keep = {*sorted(self.snapshots, reverse=True)[:2], self.last_manifest_round}
            for old in [r for r in self.snapshots if r not in keep]:
                del self.snapshots[old]
        self._round_started = time.perf_counter()

    def after_evaluate(self, rnd: int, replies: list[Message]) -> None:
        per = {
            rank_of_node(r.metadata.src_node_id): float(r.content["metrics"]["eval-loss"])
            for r in replies
        }
        self.state.record_eval(rnd, self.plan.steps_of(rnd)[1], per)
        log.info("round %d: validation loss (Eq. 8) %.4f", rnd, sum(per.values()) / len(per))
        self._eval_line(rnd, per)
        self._round_started = time.perf_counter()

    # ------------------------------------------------------ metrics on disk
    def _round_line(
        self, rnd: int, start: int, end: int, seconds: float, figures: dict[int, dict[str, float]]
    ) -> None:
        """metrics.jsonl: one line per round; an evaluating round's waits for its Eq. 8."""
        self._flush_line()
        hist = self.state.history_doc()
        steps = [row for row in hist["steps"] if start <= row["step"] < end]
        self._pending_line = {
            "round": rnd,
            "step": end,
            "time": time.time(),
            "seconds": seconds,
            "losses": [row["loss"] for row in steps],
            "origin_losses": [row["origin_losses"] for row in steps],
            "loss": steps[-1]["loss"] if steps else None,
            "workers": {str(r): f for r, f in sorted(figures.items())},
        }
        if not self.plan.evaluates(rnd):
            self._flush_line()

    def _eval_line(self, rnd: int, per: dict[int, float]) -> None:
        line = self._pending_line
        if line is None or line["round"] != rnd:  # an evaluation redone after a restore
            self._flush_line()
            line = self._pending_line = {"round": rnd, "step": self.plan.steps_of(rnd)[1]}
        line["eval_loss"] = sum(per.values()) / len(per)
        line["eval_origin_losses"] = [per[s] for s in sorted(per)]
        self._flush_line()

    def _flush_line(self) -> None:
        """Append the pending round line to metrics.jsonl and rewrite history.json."""
        line, self._pending_line = self._pending_line, None
        out = Path(self.cfg.out_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
            if line is not None:
                with open(out / METRICS_FILE, "a") as f:
                    f.write(json.dumps(json_safe(line), allow_nan=False) + "\n")
            doc = {**self.state.history_doc(), "status": self.state.status_doc()}
            write_bytes_atomic(
                out / HISTORY_FILE, json.dumps(json_safe(doc), allow_nan=False).encode()
            )
        except (OSError, CheckpointError) as exc:  # metrics on disk never end a run
            log.error("cannot write the run's metrics in %s: %s", out, exc)

    # ---------------------------------------------------------- checkpoints
    def _write_checkpoint(
        self, rnd: int, replies: list[Message], snap: RoundState
    ) -> dict[str, Any]:
        """Worker copies and E/R first, then the manifest: the manifest is the commit point.
        A write error names the path and fails the run; the previous manifest stays."""
        rdir = checkpoint_dir(self.cfg.out_dir) / f"round-{rnd:06d}"
        workers = {}
        for reply in replies:
            rank = rank_of_node(reply.metadata.src_node_id)
            if "checkpoint" not in reply.content:
                raise RunFailed(f"worker-{rank} did not confirm its round-{rnd} checkpoint")
            ck = reply.content["checkpoint"]
            entry = {"identity": worker_identity(rank), "path": ck["path"], "sha256": ck["sha256"]}
            if "copy" in ck:
                data = bytes(ck["copy"])
                digest = hashlib.sha256(data).hexdigest()
                if digest != ck["sha256"]:
                    raise RunFailed(
                        f"worker-{rank}'s copy of its round-{rnd} checkpoint does not match its "
                        f"sha256 (expected {ck['sha256']}, got {digest})"
                    )
                name = f"worker-{rank}.ckpt"
                write_bytes_atomic(rdir / name, data)
                entry.update(copy=name, copy_sha256=digest, copy_bytes=len(data))
            workers[str(rank)] = entry
        if len(workers) != self.train.P:
            raise RunFailed(f"only {len(workers)} of {self.train.P} workers confirmed round {rnd}")
        er = save_checkpoint(
            rdir / ER_FILE,
            {
                "arrays": to_plain(snap.arrays),
                "server_state": to_plain(snap.server_state),
                "history": self.state.history_doc(),
            },
        )
        manifest = {
            "run_id": self.cfg.run_id,
            "round": rnd,
            "step": self.plan.steps_of(rnd)[1],
            "fingerprint": self.train.fingerprint(),
            "strategy": self.cfg.strategy,
            "train": self.train.model_dump(mode="json"),
            "er": er.name,
            "er_sha256": sha256_of(er),
            "workers": workers,
            "written_at": time.time(),
        }
        write_bytes_atomic(rdir / MANIFEST, json.dumps(manifest, indent=2).encode())
        self.state.set(checkpoint=str(rdir / MANIFEST))
        self.manifests = [rdir / MANIFEST, *[m for m in self.manifests if m.parent != rdir]]
        log.info("round %d: checkpoint manifest %s", rnd, rdir / MANIFEST)
        if self.cfg.keep_checkpoints:
            self._prune(self.cfg.keep_checkpoints)
        return {**manifest, "dir": str(rdir)}

    def _prune(self, keep: int) -> None:
        """Keep the ``keep`` newest complete manifests' round directories."""
        rounds = sorted(checkpoint_dir(self.cfg.out_dir).glob("round-*"), reverse=True)
        complete = [d for d in rounds if (d / MANIFEST).is_file()]
        if len(complete) <= keep:
            return
        oldest_kept = complete[keep - 1].name
        for d in rounds:
            if d.name < oldest_kept:
                shutil.rmtree(d, ignore_errors=True)
                log.info("pruned %s (--keep-checkpoints %d)", d, keep)
        self.manifests = [m for m in self.manifests if m.parent.exists()]

    def _restore_history(self, history: dict[str, Any]) -> None:
        for row in history.get("steps", []):
            for origin, loss in enumerate(row["origin_losses"]):
                if loss is not None:
                    self.state.record_losses(origin, row["step"], [loss])
        for ev in history.get("evals", []):
            self.state.record_eval(ev["round"], ev["step"], dict(enumerate(ev["origin_losses"])))


def _round_of(manifest: Path) -> int:
    """The round of ``checkpoints/round-<r>/manifest.json``."""
    return int(manifest.parent.name.removeprefix("round-"))


def _names(ranks) -> str:
    return ", ".join(f"worker-{r}" for r in ranks)


def _edges(ranks, P: int) -> str:
    """The ring edges that touch ``ranks``."""
    edges = []
    for r in ranks:
        edges += [f"worker-{(r - 1) % P} → worker-{r}", f"worker-{r} → worker-{(r + 1) % P}"]
    return ", ".join(dict.fromkeys(edges))


def _finite_loss(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e4


def _finite_figure(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e18


def reply_problem(kind: str, content: Any) -> str | None:
    """Why a worker's reply of message type ``kind`` is unusable (None: it is fine)."""
    try:
        if kind == "train":
            m = content["metrics"]
            losses = list(m["losses"])
            if not losses or not all(_finite_loss(v) for v in losses):
                return "losses must be a non-empty list of finite losses in [0, 1e4)"
            if not float(m["num-examples"]) > 0 or not float(m["train-seconds"]) >= 0:
                return "num-examples must be > 0 and train-seconds ≥ 0"
            for key in OPTIONAL_FIGURES:
                if key in m and not _finite_figure(m[key]):
                    return f"{key} must be a finite number ≥ 0"
        elif kind == "evaluate":
            if not _finite_loss(content["metrics"]["eval-loss"]):
                return "eval-loss must be a finite loss in [0, 1e4)"
        elif kind == "query.state":
            rounds = list(content["config"]["rounds"])
            if not all(isinstance(r, int) and r >= 0 for r in rounds):
                return "rounds must be non-negative integers"
        elif kind == "query.restore":
            if not isinstance(content["config"]["ok"], bool):
                return "ok must be a boolean"
            str(content["config"]["reason"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"missing or malformed field ({exc!r})"
    return None


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
    """``step → privacy status block`` from ``mobius_fed.privacy.report`` if it exists."""
    try:
        report = importlib.import_module("mobius_fed.privacy.report")
    except ImportError:
        return None
    block = getattr(report, "status_block", None)
    if block is None:
        return None
    return lambda step: block(train, step)
