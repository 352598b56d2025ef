"""``mobius-coordinator``: Flower's Strategy.start over our mTLS Grid, plus status.

One Flower round is one step barrier: the strategy sends the averaged E/R arrays and the
round's step range to every worker, each worker trains those steps on the ring and answers
with its E/R arrays, and the strategy aggregates them (FedAvg by default).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from flwr.app import ArrayRecord, ConfigRecord, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mobius_fed.checkpoint import load_checkpoint, save_checkpoint
from mobius_fed.coordinator.config import CoordinatorConfig
from mobius_fed.coordinator.control import ControlService
from mobius_fed.coordinator.grid import ControlGrid, RunFailed
from mobius_fed.coordinator.state import RunState
from mobius_fed.model import build_replica
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.strategies import RoundPlan, make_strategy, restore_server_state, server_state
from mobius_fed.transport.flower_wire import COORDINATOR_NODE_ID, rank_of_node, set_task_identity
from mobius_fed.transport.tls import GRPC_OPTIONS, add_port, worker_identity

log = logging.getLogger("mobius.coordinator")
MANIFEST = "manifest.json"


def checkpoint_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_manifest(out_dir: Path) -> Path | None:
    """The newest complete manifest (its E/R file present), or None."""
    rounds = sorted(checkpoint_dir(out_dir).glob("round-*/" + MANIFEST))
    for path in reversed(rounds):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if (path.parent / doc["er"]).is_file():
            return path
    return None


class Coordinator:
    """Registers P workers, runs the strategy over them, writes checkpoints, serves status."""

    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self.train = cfg.train
        self.plan = RoundPlan.of(cfg.train, cfg.checkpoint_every)
        self.state = RunState(
            run_id=cfg.run_id,
            P=cfg.train.P,
            steps=cfg.train.steps,
            strategy=cfg.strategy,
            num_rounds=self.plan.num_rounds,
        )
        self.grid = ControlGrid(cfg.train.P)
        self.resume_from: dict[str, Any] | None = None
        if cfg.resume:
            path = latest_manifest(cfg.out_dir)
            if path is None:
                raise FileNotFoundError(
                    f"--resume: no complete checkpoint manifest under {checkpoint_dir(cfg.out_dir)}"
                )
            self.resume_from = {**json.loads(path.read_text()), "dir": str(path.parent)}
            if self.resume_from["fingerprint"] != cfg.train.fingerprint():
                raise ValueError(f"--resume: {path} was written by a different train config")
        self.service = ControlService(
            self.state,
            self.grid,
            fingerprint=cfg.train.fingerprint(),
            run_spec=self._run_spec,
            registration_timeout=cfg.registration_timeout,
        )
        self._round_started = 0.0
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self.rest = None
        self.port = 0

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

    def _set_health(self, status: int) -> None:
        for name in ("", "mobius_fed.control.v1.Control"):
            self._health.set(name, status)

    def stop(self) -> None:
        if self.rest is not None:
            self.rest.stop()
        if self._server is not None:
            self._server.stop(grace=2).wait()

    # ------------------------------------------------------------- run spec
    def _run_spec(self, rank: int) -> control_pb2.RunSpec:
        spec = control_pb2.RunSpec(
            run_id=self.cfg.run_id,
            rank=rank,
            peers=self.service.peers(),
            train_config_json=self.train.model_dump_json(),
            config_fingerprint=self.train.fingerprint(),
            heartbeat_interval_s=self.cfg.heartbeat_interval,
        )
        if self.resume_from:
            w = self.resume_from["workers"][str(rank)]
            spec.resume_round = self.resume_from["round"]
            spec.resume_checkpoint = w["path"]
        return spec

    def _watch_heartbeats(self) -> None:
        while self.state.phase in ("waiting", "training"):
            now = time.time()
            for w in list(self.state.workers.values()):
                if (
                    self.state.phase == "training"
                    and w.last_heartbeat is not None
                    and w.state != "lost"
                    and now - w.last_heartbeat > self.cfg.heartbeat_timeout
                ):
                    self.service.mark_lost(
                        w.rank,
                        f"no heartbeat for {now - w.last_heartbeat:.1f}s "
                        f"(timeout {self.cfg.heartbeat_timeout:.1f}s)",
                    )
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
        offset = self.resume_from["round"] if self.resume_from else 0
        strategy = make_strategy(
            self.cfg.strategy,
            self.train.P,
            self.plan,
            self.cfg.strategy_options,
            round_offset=offset,
        )
        strategy.hooks = self
        self.strategy = strategy
        if self.resume_from:
            saved = load_checkpoint(Path(self.resume_from["dir"]) / self.resume_from["er"])
            initial = saved["arrays"]
            restore_server_state(strategy, saved["server_state"])
            self._restore_history(saved.get("history", {}))
        else:
            replica = build_replica(self.train.model(), self.train.seed)
            initial = ArrayRecord({k: v.detach().clone() for k, v in replica.state_dict().items()})
        missing = self.grid.wait_for_sessions(self.cfg.registration_timeout)
        if missing:
            names = ", ".join(f"worker-{m}" for m in missing)
            return self._fail(
                f"workers never joined within {self.cfg.registration_timeout}s: {names}"
            )
        self.state.set(phase="training", round=offset, step=self.plan.steps_of(offset + 1)[0])
        log.info(
            "all %d workers joined; training rounds %d..%d with %s",
            self.train.P,
            offset + 1,
            self.plan.num_rounds,
            type(strategy).__name__,
        )
        self._round_started = time.perf_counter()
        try:
            strategy.start(
                grid=self.grid,
                initial_arrays=initial,
                num_rounds=self.plan.num_rounds - offset,
                timeout=self.cfg.round_timeout,
                train_config=ConfigRecord(),
                evaluate_config=ConfigRecord(),
            )
        except RunFailed as exc:
            return self._fail(str(exc))
        self.state.finish("done")
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

    def _fail(self, reason: str) -> int:
        log.error("run %s failed: %s", self.cfg.run_id, reason)
        self.grid.fail(reason)
        self.state.finish("failed", reason)
        self.grid.broadcast_stop(reason)
        self._await_workers_leaving(timeout=10)
        return 1

    def _await_workers_leaving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.grid.open_sessions() and time.monotonic() < deadline:
            time.sleep(0.1)

    # ------------------------------------------------------ strategy hooks
    def after_train(self, rnd: int, replies: list[Message], arrays: ArrayRecord | None) -> None:
        seconds = time.perf_counter() - self._round_started
        start, end = self.plan.steps_of(rnd)
        worker_seconds = 0.0
        for reply in replies:
            rank = rank_of_node(reply.metadata.src_node_id)
            metrics = reply.content["metrics"]
            losses = list(metrics["losses"])
            self.state.record_losses(rank, start, losses)
            self.state.update_worker(rank, last_loss=losses[-1], step=end)
            worker_seconds = max(worker_seconds, float(metrics["train-seconds"]))
        self.state.record_round(rnd, seconds, worker_seconds)
        self.state.set(round=rnd, step=end)
        if self.plan.checkpoints(rnd) and arrays is not None:
            self._write_checkpoint(rnd, replies, arrays)
        self._round_started = time.perf_counter()

    def after_evaluate(self, rnd: int, replies: list[Message]) -> None:
        per = {
            rank_of_node(r.metadata.src_node_id): float(r.content["metrics"]["eval-loss"])
            for r in replies
        }
        self.state.record_eval(rnd, self.plan.steps_of(rnd)[1], per)
        log.info("round %d: validation loss (Eq. 8) %.4f", rnd, sum(per.values()) / len(per))
        self._round_started = time.perf_counter()

    def _write_checkpoint(self, rnd: int, replies: list[Message], arrays: ArrayRecord) -> None:
        """E/R and server state first, then the manifest: the manifest is the commit point."""
        workers = {}
        for reply in replies:
            rank = rank_of_node(reply.metadata.src_node_id)
            if "checkpoint" not in reply.content:
                raise RunFailed(f"worker-{rank} did not confirm its round-{rnd} checkpoint")
            ck = reply.content["checkpoint"]
            workers[str(rank)] = {
                "identity": worker_identity(rank),
                "path": ck["path"],
                "sha256": ck["sha256"],
            }
        if len(workers) != self.train.P:
            raise RunFailed(f"only {len(workers)} of {self.train.P} workers confirmed round {rnd}")
        rdir = checkpoint_dir(self.cfg.out_dir) / f"round-{rnd:06d}"
        er = save_checkpoint(
            rdir / "er.pt",
            {
                "arrays": arrays,
                "server_state": server_state(self.strategy),
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
            "workers": workers,
            "written_at": time.time(),
        }
        tmp = rdir / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, rdir / MANIFEST)
        self.state.set(checkpoint=str(rdir / MANIFEST))
        log.info("round %d: checkpoint manifest %s", rnd, rdir / MANIFEST)

    def _restore_history(self, history: dict[str, Any]) -> None:
        for row in history.get("steps", []):
            for origin, loss in enumerate(row["origin_losses"]):
                if loss is not None:
                    self.state.record_losses(origin, row["step"], [loss])
        for ev in history.get("evals", []):
            self.state.record_eval(ev["round"], ev["step"], dict(enumerate(ev["origin_losses"])))
