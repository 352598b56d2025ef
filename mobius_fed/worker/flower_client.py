"""The worker's Flower ClientApp, run in-process by the daemon for each message.

Message kinds (``train``, ``evaluate``, ``query.state``, ``query.restore``, ``query.ring``)
and their answers: docs/architecture.md §9. With ``privacy.er_secagg`` a ``train`` reply
carries only this worker's masked E/R update (:mod:`mobius_fed.defences.secagg`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from mobius_fed.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    sha256_of,
    write_bytes_atomic,
)
from mobius_fed.defences.secagg import MASKED, PUBLIC_KEY, Round, SiteMasker
from mobius_fed.er_sync import ER_DOWN, FULL, GROUP_DOWN, DownLink, record_bytes, take_down
from mobius_fed.machines import WorkerState
from mobius_fed.messages import (
    ARRAYS,
    AUDIT_STATE,
    AUDIT_UPLOAD,
    COMMITMENT,
    CONFIG,
    GROUP,
    GROUP_BASE,
    METRICS,
    Checkpoint,
    EvaluatedRecords,
    RestoreOrder,
    RestoreReply,
    RingOrder,
    Signed,
    StateReply,
    TrainOrder,
    TrainReport,
)
from mobius_fed.strategies import encode_delta
from mobius_fed.transport.commitments import EVAL, TRAIN
from mobius_fed.transport.safe_arrays import array_record_to_torch, spec_of
from mobius_fed.worker.audits import parse_asks
from mobius_fed.worker.commitments import Commitments
from mobius_fed.worker.executor import RingExecutor, WorkerStep

COPY_LIMIT_BYTES = 192 << 20  # a state copy rides in one control message (limit 256 MiB)
CHECKPOINT_FILE = re.compile(r"^round-(\d{6})\.ckpt$")
BARRIER_FILE = re.compile(r"^barrier-(\d{6})\.ckpt$")
log = logging.getLogger("mobius.worker")


def replica_arrays(executor: RingExecutor) -> ArrayRecord:
    """The E/R arrays this worker sends: its shared state, never its private home layer."""
    shared = executor.replica.shared_state_dict()
    return ArrayRecord({k: v.detach().clone() for k, v in shared.items()})


_FLOATS = ("float16", "float32", "float64")


def replica_state(executor: RingExecutor, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """The averaged E/R arrays as tensors: exactly the replica's shared names and shapes
    (its private home layer is neither sent nor overwritten), any float dtype (a server
    optimizer such as FedAdam computes in float64)."""
    spec = spec_of(executor.replica.shared_state_dict())
    for name, array in arrays.items():
        if name in spec and spec[name][1] in _FLOATS and str(array.dtype) in _FLOATS:
            spec[name] = (spec[name][0], str(array.dtype))
    return dict(array_record_to_torch(arrays, expected=spec))


def load_replica(executor: RingExecutor, arrays: ArrayRecord) -> None:
    """Load the averaged E/R arrays (:func:`replica_state`), cast as the reference does."""
    state = replica_state(executor, arrays)
    with torch.no_grad():
        for name, p in executor.replica.shared_state_dict().items():
            p.copy_(state[name])


def group_arrays(executor: RingExecutor) -> ArrayRecord:
    """F_i's arrays for a ring sync (R > 1): every parameter of this worker's group."""
    return ArrayRecord({k: v.detach().clone() for k, v in executor.group.named_parameters()})


def load_group(
    executor: RingExecutor, msg: Message, down: DownLink | None = None
) -> dict[str, torch.Tensor] | None:
    """Load the synced F_i a ring sync sent (R > 1), if this message carries it: exactly the
    group's names and shapes, any float dtype, cast as the reference engine casts (with a
    ``ring_down_codec``, ``down`` decodes it). Returns the global F_i this message names
    (the synced one, or a ``GROUP_BASE``), if any."""
    own = dict(executor.group.named_parameters())
    key = GROUP_BASE if GROUP_BASE in msg.content else GROUP
    if key not in msg.content:
        return None
    state = _group_state(
        own, msg.content.array_records[key], down, msg.content.config_records[CONFIG]
    )
    if key == GROUP_BASE:
        return state
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(state[name])
    return state


def _group_state(
    own: dict[str, torch.Tensor], arrays: ArrayRecord, down: DownLink | None, config: ConfigRecord
) -> dict[str, torch.Tensor]:
    """``arrays`` as tensors, exactly F_i's names and shapes (any float dtype); with a
    down codec, the held F_i after the broadcast they bring."""
    spec = spec_of(own)
    if down is None or config.get(GROUP_DOWN[1]) == FULL:
        for name, array in arrays.items():
            if name in spec and str(array.dtype) in _FLOATS:
                spec[name] = (spec[name][0], str(array.dtype))
        state = dict(array_record_to_torch(arrays, expected=spec))
        if down is None:
            return state
    return take_down(down, arrays, config, GROUP_DOWN, set(spec))


def checkpoint_path(directory: Path, rnd: int) -> Path:
    return directory / f"round-{rnd:06d}.ckpt"


def barrier_path(directory: Path, rnd: int) -> Path:
    return directory / f"barrier-{rnd:06d}.ckpt"


class Snapshots:
    """This worker's state at recent barriers.

    In memory: the two newest barriers and the last checkpointed round; on disk: every
    checkpoint plus the two newest barriers (``barrier-<round>.ckpt``, with its payload's
    sha256), written in the background without an fsync. Why two: docs/recovery.md "What is
    kept, and what is redone".
    """

    KEEP_BARRIERS = 2

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.memory: dict[int, dict] = {}
        self.last_checkpoint = 0
        self._writer: threading.Thread | None = None

    def keep(self, rnd: int, state: dict, checkpointed: bool) -> None:
        self.memory[rnd] = state
        if checkpointed:
            self.last_checkpoint = rnd
        newest = sorted(self.memory, reverse=True)[: self.KEEP_BARRIERS]
        for old in [r for r in self.memory if r not in (*newest, self.last_checkpoint)]:
            del self.memory[old]

    def write_barrier(self, rnd: int, state: dict) -> None:
        """Write the barrier state of ``rnd`` in the background, one write at a time."""
        self.wait_written()

        def write() -> None:
            try:
                save_checkpoint(barrier_path(self.directory, rnd), state, durable=False)
            except CheckpointError as exc:  # only the fast path is lost
                log.error("barrier snapshot of round %d not written: %s", rnd, exc)
                return
            for old in sorted(self._matching(BARRIER_FILE), reverse=True)[self.KEEP_BARRIERS :]:
                barrier_path(self.directory, old).unlink(missing_ok=True)

        self._writer = threading.Thread(target=write, daemon=True, name="barrier-writer")
        self._writer.start()

    def wait_written(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def set_aside(self) -> None:
        """A fresh run: move an earlier run's files out of the way (never reused, never
        deleted) and forget what is in memory."""
        self.wait_written()
        self.memory.clear()
        self.last_checkpoint = 0
        if self.directory.is_dir() and any(self.directory.iterdir()):
            aside = self.directory.with_name(f"{self.directory.name}.{int(time.time())}")
            self.directory.rename(aside)
            log.warning("an earlier run's checkpoints moved to %s", aside)

    def _matching(self, pattern: re.Pattern) -> set[int]:
        if not self.directory.is_dir():
            return set()
        return {int(m.group(1)) for p in self.directory.iterdir() if (m := pattern.match(p.name))}

    def forget_after(self, rnd: int) -> None:
        """Forget every round after ``rnd``, in memory and on disk: a timeline being redone.
        Kept, its files would outrank the redone rounds' new checkpoints when pruning."""
        self.wait_written()
        for later in [r for r in self.memory if r > rnd]:
            del self.memory[later]
        for pattern, path in ((CHECKPOINT_FILE, checkpoint_path), (BARRIER_FILE, barrier_path)):
            for later in [r for r in self._matching(pattern) if r > rnd]:
                path(self.directory, later).unlink(missing_ok=True)

    def rounds(self) -> set[int]:
        disk = self._matching(CHECKPOINT_FILE) | self._matching(BARRIER_FILE)
        return set(self.memory) | disk | {0}

    def prune_disk(self, keep: int) -> None:
        """Keep the ``keep`` newest checkpoint files (0: all)."""
        if keep:
            for rnd in sorted(self._matching(CHECKPOINT_FILE), reverse=True)[keep:]:
                checkpoint_path(self.directory, rnd).unlink(missing_ok=True)


def make_client_app(worker: WorkerHandlers) -> ClientApp:
    """The ClientApp that hands each message to ``worker``."""
    app = ClientApp()
    app.train()(lambda msg, context: worker.train(msg))
    app.evaluate()(lambda msg, context: worker.evaluate(msg))
    app.query("state")(lambda msg, context: worker.query_state(msg))
    app.query("restore")(lambda msg, context: worker.restore(msg))
    app.query("ring")(lambda msg, context: worker.join_ring(msg))
    return app


class WorkerHandlers:
    """What a worker does with each coordinator message (see :mod:`mobius_fed.messages`);
    ``rejoin_ring(ring_id, peers, identities)`` replaces the executor's ring links, ``on_step`` and
    ``on_state`` report each step and each state change; with ``commitments`` each train
    and evaluate reply carries the signed digests of the round's ring frames."""

    def __init__(
        self,
        executor: RingExecutor,
        snapshots: Snapshots,
        rejoin_ring: Callable[[str, list[str], list[str] | None], None],
        on_step: Callable[[WorkerStep], None],
        on_state: Callable[[WorkerState], None],
        commitments: Commitments | None = None,
    ) -> None:
        self.executor, self.snapshots, self.rejoin_ring = executor, snapshots, rejoin_ring
        self.on_step, self.on_state = on_step, on_state
        self.commitments = commitments  # audit.commitments: each reply carries one
        cfg = executor.cfg
        self.tokens_per_step = cfg.batch_size * cfg.model().seq_len
        # Secure Aggregation: a fresh key pair per process; the E/R update leaves masked.
        self.secagg = SiteMasker(cfg, executor.rank) if cfg.privacy.er_secagg else None
        self.group_base: dict[str, torch.Tensor] | None = None  # R > 1 with a ring codec
        self.evaluated = EvaluatedRecords()  # what the last evaluate brought, for the train
        self.down_bytes = 0  # array bytes received since the last train reply
        # a down codec: the E/R (and, R > 1, the F_i) this site holds, as the coordinator does
        down = cfg.sync.down_codec
        self.er_down = DownLink(down) if down != "fp32" else None
        down = cfg.ring_down_codec
        self.group_down = DownLink(down) if down != "fp32" and cfg.rings > 1 else None

    def _take_group(self, msg: Message) -> None:
        base = load_group(self.executor, msg, self.group_down)
        if base is not None:
            self.group_base = base

    def _er_state(self, msg: Message) -> dict[str, torch.Tensor]:
        """The global E/R a message brings (with a down codec: what this site holds after
        its broadcast, :class:`~mobius_fed.er_sync.DownLink`)."""
        record, config = msg.content.array_records[ARRAYS], msg.content[CONFIG]
        link = self.er_down
        if link is None or config.get(ER_DOWN[1]) == FULL:
            state = replica_state(self.executor, record)  # validated
            if link is None:
                return state
        names = set(self.executor.replica.shared_state_dict())
        return take_down(link, record, config, ER_DOWN, names)

    def _group_reply(self) -> ArrayRecord:
        """F_i for a ring sync: itself, or with a ring codec its encoded pseudo-gradient."""
        codec = self.executor.cfg.ring_codec
        if codec == "none":
            return group_arrays(self.executor)
        if self.group_base is None:
            raise RuntimeError("a ring sync with a codec, but no global F_i was ever sent")
        return encode_delta(self.executor.group, self.group_base, codec)

    def train(self, msg: Message) -> Message:
        self.down_bytes += sum(record_bytes(r) for r in msg.content.array_records.values())
        msg = self.evaluated.restore(msg)  # the synced model, if its evaluate brought it
        order, executor = TrainOrder.of(msg.content[CONFIG]), self.executor
        start, end, rnd = order.step_start, order.step_end, order.round
        if executor.step != start:
            raise RuntimeError(
                f"worker-{executor.rank} is at step {executor.step}, round asks for {start}..{end}"
            )
        masks = None if self.secagg is None else Round.of(msg.content[CONFIG], executor.cfg.P)
        sync = executor.cfg.sync.on_sites  # a codec or a delay: the site's ErSite decides
        if sync:
            state = self._er_state(msg)
            executor.er.start_round(executor.replica.shared_state_dict(), state)
        else:
            load_replica(executor, msg.content.array_records[ARRAYS])
        self._take_group(msg)
        self.on_state(WorkerState.TRAINING)
        sealed = self._audit_open(rnd, start)  # audits: the group's state as the round starts
        report = self._train_steps(start, end)
        # the E/R that leaves (τ = 1: merged first; a codec: its residual kept), before the
        # snapshot, so that a rollback to this barrier resumes after both
        er = executor.er.end_round(executor.replica.shared_state_dict()) if sync else None
        t0 = time.perf_counter()  # the barrier snapshot's cost on the critical path
        snap = copy.deepcopy(executor.state_dict())
        if not order.checkpoint and order.barrier_snapshot:
            self.snapshots.write_barrier(rnd, snap)
        report = dataclasses.replace(
            report, snapshot_s=time.perf_counter() - t0, down_bytes=float(self.down_bytes)
        )
        self.down_bytes = 0
        group = self._group_reply() if order.ring_sync else None  # R > 1: F_i goes back
        if group is not None:  # the ring sync's bytes, counted apart from the ring links'
            report = dataclasses.replace(report, sync_bytes=float(record_bytes(group)))
        if masks is None:  # SecAgg off
            er = replica_arrays(executor) if er is None else er
            report = dataclasses.replace(report, er_bytes=float(record_bytes(er)))
            reply = RecordDict({ARRAYS: er, METRICS: report.to_record()})
        else:  # only the masked update leaves: the coordinator can read just the sum
            assert self.secagg is not None  # masks are read only when SecAgg is on
            masked = self.secagg.masked(
                replica_arrays(executor), msg.content.array_records[ARRAYS], masks
            )
            report = dataclasses.replace(report, er_bytes=float(record_bytes(masked)))
            reply = RecordDict({MASKED: masked, METRICS: report.to_record()})
        if group is not None:  # to be averaged across the rings
            reply[GROUP] = group
        signed = self._commit(reply, rnd, TRAIN, start, end)
        if self.commitments is not None:  # 0 when none was signed: Flower aggregates
            # the sites' metrics only if every one has the same keys
            size = len(signed.body) + len(signed.signature) if signed else 0
            report = dataclasses.replace(report, commitment_bytes=float(size))
            reply[METRICS] = report.to_record()
        self._audit_reply(reply, order, sealed)
        if order.checkpoint:
            reply["checkpoint"] = self._checkpoint(order, snap).to_record()
            self.snapshots.prune_disk(order.keep_checkpoints)
        self.snapshots.keep(rnd, snap, order.checkpoint)
        self.on_state(WorkerState.READY)
        return Message(reply, reply_to=msg)

    def _train_steps(self, start: int, end: int) -> TrainReport:
        links_before = self.executor.links  # a new ring incarnation brings new links
        sent_before = links_before.bytes_sent if links_before is not None else 0
        steps = []
        for _ in range(start, end):
            r = self.executor.train_step()
            steps.append(r)
            self.on_step(r)
        links = self.executor.links
        sent = (
            0 if links is None else links.bytes_sent - (sent_before if links is links_before else 0)
        )
        return TrainReport(
            losses=[r.loss for r in steps],
            num_examples=self.tokens_per_step * (end - start),
            train_s=sum((r.seconds for r in steps), 0.0),
            wait_s=sum((r.wait_s for r in steps), 0.0),
            compute_s=sum((r.compute_s for r in steps), 0.0),
            bytes_sent=max(0, sent),
        )

    def _checkpoint(self, order: TrainOrder, snap: dict) -> Checkpoint:
        """Write round ``order.round``'s checkpoint; with a copy of it when asked and allowed."""
        executor, rnd = self.executor, order.round
        self.snapshots.wait_written()
        path = save_checkpoint(checkpoint_path(self.snapshots.directory, rnd), snap)
        ck = Checkpoint(str(path.resolve()), sha256_of(path))
        if not order.state_copy:
            return ck
        size = path.stat().st_size
        if executor.replica.private_parameters():
            why = "the checkpoint holds the private home layer, which never leaves this site"
        elif self.secagg is not None:
            why = "the checkpoint holds this site's own E/R, which Secure Aggregation keeps from it"
        elif size <= COPY_LIMIT_BYTES:
            return dataclasses.replace(ck, copy=path.read_bytes())
        else:
            why = f"{size} bytes exceed the control channel's {COPY_LIMIT_BYTES}"
        log.warning(
            "worker-%d: no copy of round %d for the coordinator: %s", executor.rank, rnd, why
        )
        return ck

    def evaluate(self, msg: Message) -> Message:
        executor = self.executor
        self.down_bytes += sum(record_bytes(r) for r in msg.content.array_records.values())
        state = self._er_state(msg)
        self._take_group(msg)
        self.evaluated.keep(msg)  # validated: the next train message may leave them out
        self.on_state(WorkerState.EVALUATING)
        t0 = time.perf_counter()
        # the global E/R; with τ = 1 the site's own comes back afterwards (it trains on)
        with executor.er.evaluating(executor.replica.shared_state_dict(), state):
            loss = executor.evaluate()
        self.on_state(WorkerState.READY)
        metrics = MetricRecord(
            {"num-examples": 1, "eval-loss": loss, "eval-seconds": time.perf_counter() - t0}
        )
        reply = RecordDict({METRICS: metrics})
        rnd = msg.content.get(CONFIG, ConfigRecord()).get("round", 0)
        rnd = rnd if isinstance(rnd, int) else 0
        self._commit(reply, rnd, EVAL, executor.step, executor.step + 1)
        return Message(reply, reply_to=msg)

    def _commit(
        self, reply: RecordDict, rnd: int, phase: int, first: int, end: int
    ) -> Signed | None:
        """Add this worker's signed commitment of the round's ``phase`` frames at steps
        [first, end) to ``reply`` (and return it). A failure to sign loses only the
        commitment (the coordinator names it missing), never the reply."""
        if self.commitments is None:
            return None
        executor = self.executor

        def abandoned() -> bool:
            links = executor.links
            return links is None or links.inbox.error is not None

        try:
            signed = self.commitments.seal(executor.run_id, rnd, phase, first, end, abandoned)
        except Exception:
            log.exception("worker-%d: round %d's commitment not signed", executor.rank, rnd)
            return None
        reply[COMMITMENT] = signed.to_record()
        return signed

    # ----------------------------------------------------------------- audits
    def _audit_open(self, rnd: int, first: int) -> Signed | None:
        """Audits (docs/audits.md): keep the group's state at the start of round ``rnd``;
        its signed digest, for the reply."""
        c, executor = self.commitments, self.executor
        if c is None or c.store is None:
            return None
        executor.audit = c.store
        try:
            digest = c.store.open_round(executor.run_id, rnd, first, executor.group_state())
            return c.seal_state(executor.run_id, rnd, first, digest)
        except Exception:
            log.exception("worker-%d: round %d's state not kept for audits", executor.rank, rnd)
            return None

    def _audit_reply(self, reply: RecordDict, order: TrainOrder, state: Signed | None) -> None:
        """The round's state digest, and the uploads the order asks of this site."""
        c = self.commitments
        if c is None or c.store is None:
            return
        c.store.close_round(order.step_end)
        if state is not None:
            reply[AUDIT_STATE] = state.to_record()
        for rank, rnd in parse_asks(order.audit_asks or ""):
            if rank != c.rank:
                continue
            upload = c.store.upload(rnd)
            if upload is None:  # an honest site that no longer holds it says so
                upload = ConfigRecord({"round": rnd, "missing": f"kept: {c.store.rounds}"})
            reply[AUDIT_UPLOAD] = upload
            log.info("worker-%d: round %d uploaded for an audit", c.rank, rnd)

    def query_state(self, msg: Message) -> Message:
        reply = StateReply(sorted(self.snapshots.rounds()), self.executor.step).to_record()
        if self.secagg is not None:  # relayed by the coordinator to the other sites
            reply[PUBLIC_KEY] = self.secagg.keys.public
        return Message(RecordDict({CONFIG: reply}), reply_to=msg)

    def restore(self, msg: Message) -> Message:
        order, executor = RestoreOrder.of(msg.content[CONFIG]), self.executor
        self.evaluated.forget()
        self.down_bytes = 0
        for link in (self.er_down, self.group_down):  # the next broadcast brings held itself
            if link is not None:
                link.forget()
        self.on_state(WorkerState.RESTORING)
        try:
            source = restore_round(executor, self.snapshots, order)
            if executor.step != order.step:
                raise CheckpointError(
                    f"the state loaded from {source} is at step {executor.step}, round "
                    f"{order.round} ends at step {order.step}"
                )
        except Exception as exc:  # any failure is a refusal, so an earlier round is tried
            executor.abandon_step()
            log.error("worker-%d cannot restore round %d: %s", executor.rank, order.round, exc)
            reply = RestoreReply(False, str(exc))
        else:
            log.info(
                "worker-%d restored round %d (step %d) from %s",
                executor.rank,
                order.round,
                executor.step,
                source,
            )
            reply = RestoreReply(True, "", source)
        return Message(RecordDict({CONFIG: reply.to_record()}), reply_to=msg)

    def join_ring(self, msg: Message) -> Message:
        order = RingOrder.of(msg.content[CONFIG])
        log.info("worker-%d joining ring %s", self.executor.rank, order.ring_id)
        self.rejoin_ring(order.ring_id, order.peers, order.identities)
        self.on_state(WorkerState.READY)
        return Message(RecordDict({CONFIG: ConfigRecord({"ok": True})}), reply_to=msg)


def restore_round(executor: RingExecutor, snapshots: Snapshots, order: RestoreOrder) -> str:
    """Load this worker's state at round ``rnd``; return where it came from.

    Order: memory; then, for a round with a manifest (its sha256 given), only the verified
    checkpoint file or the coordinator's copy; for a round without one, the barrier file
    (which checks its own payload hash). Snapshots of later rounds are forgotten: they
    belong to a timeline that is being redone."""
    rnd = order.round
    executor.abandon_step()
    snapshots.forget_after(rnd)
    if order.fresh:
        snapshots.set_aside()
    if rnd in snapshots.memory:
        executor.load_state_dict(copy.deepcopy(snapshots.memory[rnd]))
        return "memory"
    if rnd == 0:
        executor.load_state_dict(executor.initial_state())
        return "the seed"
    snapshots.wait_written()
    expected = order.sha256 or None
    path = checkpoint_path(snapshots.directory, rnd)
    barrier = barrier_path(snapshots.directory, rnd)
    if expected is None and barrier.is_file():
        executor.load_state_dict(load_checkpoint(barrier))  # checks its own payload hash
        snapshots.keep(rnd, copy.deepcopy(executor.state_dict()), False)
        return str(barrier)
    if path.is_file():
        try:
            executor.load_state_dict(load_checkpoint(path, expected))
            snapshots.keep(rnd, copy.deepcopy(executor.state_dict()), True)
            return str(path)
        except CheckpointError as exc:
            if order.copy is None:
                raise
            log.error("worker-%d: %s; using the coordinator's copy", executor.rank, exc)
    if order.copy is None:
        raise CheckpointError(
            f"no state for round {rnd}: {path} is missing and the coordinator keeps no copy"
        )
    data = order.copy
    digest = hashlib.sha256(data).hexdigest()
    if digest != order.copy_sha256:
        raise CheckpointError(
            f"the coordinator's copy of round {rnd}: sha256 {digest}, expected {order.copy_sha256}"
        )
    write_bytes_atomic(path, data)  # becomes this worker's own file again
    executor.load_state_dict(load_checkpoint(path, digest))
    snapshots.keep(rnd, copy.deepcopy(executor.state_dict()), True)
    return "the coordinator's copy"
