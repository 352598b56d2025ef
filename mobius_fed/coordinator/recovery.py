"""The recovery driver: from a lost worker or ring edge back to training, with no restart
(docs/architecture.md §11).

::

         ┌──────────────────────────────── training ◄──────────────────────────────┐
         │ IncidentRaised (a session closed, a heartbeat expired, a worker        │
         ▼ reported its ring edge down)                                           │
      detect ──► abort ──► wait for sessions ──► choose round ──► restore ──► new ring ──► resume
      (open an  (every     (each lost rank        (the newest     (each       (a fresh ring
      incident,  worker    registers again;       round every     worker      id: workers
      phase      drops the more incidents on      worker and this loads it;   dial their
      recovering) round)   the way join this one) coordinator     a refusal   successor
                                                  can restore)    tries an    again)
                                                                  earlier one)

Every step may fail the run instead (``RunFailed``): more incidents than
``--max-incidents``, a rank that does not rejoin within ``--rejoin-timeout``, or no round
that every worker can restore. On resume the open incidents close as ``recovered`` with
the round rolled back to and the steps redone. An eviction for a failed audit of round r
(:meth:`Recovery.roll_back_before`) caps the choice below r: no group keeps what it trained
on the audited round. The phase, worker and incident states move only along the tables of
:mod:`mobius_fed.machines`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import cast

from flwr.app import ConfigRecord, Message, RecordDict

from mobius_fed.coordinator.config import CoordinatorConfig
from mobius_fed.coordinator.control import ControlService
from mobius_fed.coordinator.grid import (
    ControlGrid,
    GridTimeout,
    IncidentRaised,
    RunFailed,
    edges_of,
    names,
)
from mobius_fed.coordinator.rounds import RoundState, RoundStore
from mobius_fed.coordinator.state import RunState
from mobius_fed.coordinator.status_model import IncidentModel as Incident
from mobius_fed.defences.secagg import PUBLIC_KEY
from mobius_fed.machines import IncidentState, Phase
from mobius_fed.machines import WorkerState as W
from mobius_fed.messages import CONFIG, RestoreOrder, RestoreReply, RingOrder, StateReply
from mobius_fed.transport.flower_wire import rank_of_node, worker_node_id

log = logging.getLogger("mobius.coordinator")


class Recovery:
    """Runs the strategy on a restored ring, and brings the ring back after each incident."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        state: RunState,
        grid: ControlGrid,
        service: ControlService,
        store: RoundStore,
    ) -> None:
        self.cfg, self.state, self.grid, self.service, self.store = cfg, state, grid, service, store
        self.P, self.plan = cfg.train.workers, store.plan  # workers: all R·P sites
        self.in_flight = 0  # the train round in flight (0: none)
        self.ring_epoch = 0
        self.ring_id = ""  # the ring incarnation training runs on (SecAgg's attempt label)
        self.public_keys: dict[int, bytes] = {}  # SecAgg: each rank's key, as it last said
        self.boot = secrets.token_hex(3)  # ring ids differ from any earlier coordinator's
        self.before: int | None = None  # the next restore takes a round before this one

    def roll_back_before(self, rnd: int) -> None:
        """An audit of round ``rnd`` failed: the next restore takes the newest round before
        it that every worker can restore (round 0 at worst), whatever newer ones exist."""
        self.before = rnd if self.before is None else min(self.before, rnd)
        log.warning("the next restore rolls back to a round before round %d", self.before)

    def drive(self, train_from: Callable[[RoundState], None]) -> None:
        """Restore the ring and ``train_from`` its round, again after every incident, until
        training returns. RunFailed (or CheckpointError) when the run cannot go on."""
        incident: Incident | None = None
        while True:
            try:
                snap = self.restore_ring()
                if incident is not None:
                    self.close_incidents(snap.round)
                    incident = None
                train_from(snap)
                return
            except IncidentRaised as exc:
                incident = self.handle_incident(exc)

    # ------------------------------------------ detect, abort, wait for sessions
    def handle_incident(self, exc: IncidentRaised) -> Incident:
        """Record the incident, abort the round in flight everywhere, and wait until every
        rank holds a session again. RunFailed past the budget or the rejoin timeout."""
        raised = self.grid.take_incident() or exc
        incident = self._record(raised)  # an open incident puts the run in recovering
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
                continue
            lost = [w.rank for w in self.state.workers.values() if w.state == W.LOST]
            if not missing and not lost:
                return incident
            if time.monotonic() >= deadline and self._hand_over_lost(lost, set(missing)):
                deadline = time.monotonic() + self.cfg.rejoin_timeout  # for the standbys
            elif time.monotonic() >= deadline:
                gone = sorted(set(missing) | set(lost))
                raise RunFailed(
                    f"{names(gone)} did not rejoin within {self.cfg.rejoin_timeout:.0f}s after: "
                    f"{raised.what} (ring edges {edges_of(gone, self.state.ring_size)})"
                )

    def _hand_over_lost(self, lost: list[int], missing: set[int]) -> bool:
        """Past the rejoin timeout: hand every lost rank to a standby. False (nothing
        handed) unless every rank that is gone is lost and a standby took each."""
        if not lost or not missing <= set(lost):
            return False
        why = f"it did not rejoin within {self.cfg.rejoin_timeout:.0f}s"
        handed = [r for r in lost if self.service.handovers.hand_over(r, why) is not None]
        return len(handed) == len(lost)

    def _record(self, raised: IncidentRaised) -> Incident:
        """Record ``raised`` (unless its raiser opened it with the loss); abort its round."""
        incident = raised.opened
        if incident is None:
            incident = self.state.open_incident(
                **raised.fields(self.state.ring_size, self.in_flight)
            )
        else:
            self.state.update_incident(incident, round=self.in_flight)
        log.error("incident %d: %s (round %d in flight)", incident.id, raised.what, self.in_flight)
        self.grid.broadcast("abort", raised.what)
        return incident

    def _check_budget(self, incident: Incident) -> None:
        if len(self.state.incidents) > self.cfg.max_incidents:
            raise RunFailed(
                f"{len(self.state.incidents)} incidents, more than --max-incidents "
                f"{self.cfg.max_incidents}; the last: {incident.what} (ring edges {incident.edge})"
            )

    # ------------------------------------------------------------- resume
    def close_incidents(self, rnd: int) -> None:
        now = time.time()
        end = self.plan.steps_of(rnd)[1]  # round 0 ends at step 0
        for inc in self.state.incidents:
            if inc.state != IncidentState.OPEN:
                continue
            in_flight_end = self.plan.steps_of(inc.round)[1] if inc.round else end
            lost = None if inc.rank is None else self.state.workers.get(inc.rank)
            back = getattr(lost, "registered_at", None)
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
                inc.recovery_s,
                rnd,
                inc.steps_redone,
            )
        for w in self.state.workers.values():
            if w.state in (W.REJOINING, W.RESTORING):
                self.state.move_worker(w.rank, W.RECOVERED)

    # ------------------------------------------- choose round, restore, new ring
    def restore_ring(self) -> RoundState:
        """Bring every worker to the newest round all of them (and this coordinator) can
        restore, on a fresh ring incarnation; return that round's state."""
        have = self._ask_rounds()
        log.info(
            "rounds each worker can restore: %s",
            "; ".join(f"worker-{r}: {sorted(v)}" for r, v in sorted(have.items())),
        )
        refused: dict[int, set[int]] = {r: set() for r in range(self.P)}
        while True:
            rnd, sources = self._choose_round(have, refused)
            failed = self._restore(rnd, sources, have)
            if not failed:
                break
            for rank, reason in failed.items():
                log.error("worker-%d cannot restore round %d: %s", rank, rnd, reason)
                refused[rank].add(rnd)
        self._open_ring(rnd)
        if self.before is not None and rnd < self.before:  # (a cap set after the choice
            self.store.forget_after(rnd)  # waits for the restore its incident brings)
            self.before = None  # the rounds after it held the lie: none restores again
        self.state.handed_over(rnd, self.plan.evaluates(rnd))
        snap = self.store.restored(rnd)
        self.state.rollback(self.plan.steps_of(rnd)[1], rnd)  # round 0 ends at step 0
        self.state.move_phase(Phase.TRAINING)
        return snap

    def _ask_rounds(self) -> dict[int, set[int]]:
        replies = self.send_all(
            "query.state",
            lambda rank: ConfigRecord({}),
            self.cfg.restore_timeout,
            "report the rounds it can restore",
        )
        self.public_keys = {  # a restarted worker comes back with a new SecAgg key pair
            rank_of_node(r.metadata.src_node_id): bytes(
                cast(bytes, r.content.config_records[CONFIG][PUBLIC_KEY])
            )
            for r in replies
            if PUBLIC_KEY in r.content[CONFIG]
        }
        return {
            rank_of_node(r.metadata.src_node_id): {*StateReply.of(r.content[CONFIG]).rounds, 0}
            for r in replies
        }

    def _choose_round(
        self, have: dict[int, set[int]], refused: dict[int, set[int]]
    ) -> tuple[int, str]:
        for rnd in self.store.rounds():
            if self.before is not None and rnd >= self.before:
                continue  # it holds what an audit found a lie in
            manifest = self.store.manifest_doc(rnd)
            sources = []
            for rank in range(self.P):
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

    def _restore(self, rnd: int, sources: str, have: dict[int, set[int]]) -> dict[int, str]:
        """Ask every worker to load round ``rnd``; rank → reason for each that refused."""
        for rank in range(self.P):
            if self.state.workers[rank].state in (W.REJOINING, W.LOST):
                self.state.move_worker(rank, W.RESTORING)
        log.info("restoring round %d (%s)", rnd, sources)
        replies = self.send_all(
            "query.restore",
            lambda rank: self._restore_order(rank, rnd, rnd in have[rank]),
            self.cfg.restore_timeout,
            "load the rollback state",
        )
        answers = {
            rank_of_node(r.metadata.src_node_id): RestoreReply.of(r.content[CONFIG])
            for r in replies
        }
        return {rank: a.reason for rank, a in answers.items() if not a.ok}

    def _restore_order(self, rank: int, rnd: int, has_it: bool) -> RestoreOrder:
        order = RestoreOrder(rnd, self.plan.steps_of(rnd)[1], fresh=self.store.fresh)
        manifest = self.store.manifest_doc(rnd) or {"workers": {}}
        entry = manifest["workers"].get(str(rank))
        if not entry:
            return order
        order = replace(order, sha256=entry["sha256"], file=Path(entry["path"]).name)
        if entry.get("copy") and not has_it:  # only to a worker that needs it
            copy = Path(manifest["dir"]) / entry["copy"]
            data = copy.read_bytes() if copy.is_file() else None
            order = replace(order, copy_sha256=entry["copy_sha256"], copy=data)
        return order

    def _open_ring(self, rnd: int) -> None:
        self.ring_epoch += 1
        ring_id = self.ring_id = f"{self.cfg.run_id}/{self.boot}.{self.ring_epoch}"
        log.info("round %d restored everywhere; opening ring %s", rnd, ring_id)
        peers, identities = self.service.peers(), self.service.handovers.identities()
        handed = identities if self.state.handovers else None  # who neighbours accept
        self.send_all(
            "query.ring",
            lambda rank: RingOrder(ring_id, peers, handed),
            self.cfg.restore_timeout,
            "join the ring",
        )

    def send_all(self, kind: str, order, timeout: float, what: str) -> list[Message]:
        """``order(rank)`` (a typed message or a ConfigRecord) to every worker; the replies."""
        messages = []
        for rank in range(self.P):
            conf = order(rank)
            conf = conf if isinstance(conf, ConfigRecord) else conf.to_record()
            messages.append(Message(RecordDict({CONFIG: conf}), worker_node_id(rank), kind))
        try:
            return list(self.grid.send_and_receive(messages, timeout=timeout))
        except GridTimeout as exc:
            raise RunFailed(
                f"{names(exc.ranks)} did not {what} within {timeout:.0f}s (watchdog){exc.errors}"
            ) from exc
