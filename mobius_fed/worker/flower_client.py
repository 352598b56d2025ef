"""The worker's Flower ClientApp, run in-process by the daemon for each message.

``train``: load the averaged E/R arrays, train the round's step range on the ring, keep an
in-memory snapshot of the state at the barrier, write a checkpoint when asked (and send a
copy of it when asked), and reply with this worker's E/R arrays and metrics.
``evaluate``: load the averaged E/R arrays and compute this origin's Eq. 8 term.
``query.state``: the rounds this worker can restore.
``query.restore``: roll back to a round; ``query.ring``: join a fresh ring incarnation.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from mobius_fed.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    sha256_of,
    write_bytes_atomic,
)
from mobius_fed.strategies import BARRIER_SNAPSHOT, CHECKPOINT, STATE_COPY, STEP_END, STEP_START
from mobius_fed.transport.safe_arrays import array_record_to_torch, spec_of
from mobius_fed.worker.executor import RingExecutor, WorkerStep

ARRAYS, METRICS, CONFIG = "arrays", "metrics", "config"
COPY_LIMIT_BYTES = 192 << 20  # a state copy rides in one control message (limit 256 MiB)
CHECKPOINT_FILE = re.compile(r"^round-(\d{6})\.ckpt$")
BARRIER_FILE = re.compile(r"^barrier-(\d{6})\.ckpt$")
log = logging.getLogger("mobius.worker")


def replica_arrays(executor: RingExecutor) -> ArrayRecord:
    """The E/R arrays this worker sends: its shared state, never its private home layer."""
    shared = executor.replica.shared_state_dict()
    return ArrayRecord({k: v.detach().clone() for k, v in shared.items()})


_FLOATS = ("float16", "float32", "float64")


def load_replica(executor: RingExecutor, arrays: ArrayRecord) -> None:
    """Load the averaged E/R arrays: exactly the replica's shared names and shapes (its
    private home layer is neither sent nor overwritten), any float dtype (a server
    optimizer such as FedAdam computes in float64; cast as the reference does)."""
    spec = spec_of(executor.replica.shared_state_dict())
    for name, array in arrays.items():
        if name in spec and spec[name][1] in _FLOATS and str(array.dtype) in _FLOATS:
            spec[name] = (spec[name][0], str(array.dtype))
    state = array_record_to_torch(arrays, expected=spec)
    with torch.no_grad():
        for name, p in executor.replica.shared_state_dict().items():
            p.copy_(state[name])


def checkpoint_path(directory: Path, rnd: int) -> Path:
    return directory / f"round-{rnd:06d}.ckpt"


def barrier_path(directory: Path, rnd: int) -> Path:
    return directory / f"barrier-{rnd:06d}.ckpt"


class Snapshots:
    """This worker's state at recent barriers.

    In memory: the two newest barriers and the last checkpointed round. Two, because a
    worker can finish a round whose last frames never reached its neighbours (it froze, or
    its link dropped): its newest barrier is then one its peers never reached. A frozen or
    cut-off worker and every survivor of an incident roll back from memory. On disk: every
    checkpoint file, plus the two newest barriers (``barrier-<round>.ckpt``, which carries
    its payload's sha256), written in the background without an fsync, so that a process
    that crashed comes back at one of the last two barriers too.
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
        """Write the barrier state of ``rnd`` in the background (one write at a time; no
        fsync: it must survive the process, the file carries its payload's sha256)."""
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

    def disk_rounds(self) -> set[int]:
        return self._matching(CHECKPOINT_FILE) | self._matching(BARRIER_FILE)

    def rounds(self) -> set[int]:
        return set(self.memory) | self.disk_rounds() | {0}

    def prune_disk(self, keep: int) -> None:
        """Keep the ``keep`` newest checkpoint files (0: all)."""
        if keep:
            for rnd in sorted(self._matching(CHECKPOINT_FILE), reverse=True)[keep:]:
                checkpoint_path(self.directory, rnd).unlink(missing_ok=True)


def make_client_app(
    executor: RingExecutor,
    snapshots: Snapshots,
    rejoin_ring: Callable[[str, list[str]], None],
    on_step: Callable[[WorkerStep], None] | None = None,
    on_state: Callable[[str], None] | None = None,
) -> ClientApp:
    """The ClientApp of ``executor``; ``rejoin_ring(ring_id, peers)`` replaces its ring links."""
    app = ClientApp()
    cfg = executor.cfg
    tokens_per_step = cfg.batch_size * cfg.model().seq_len

    def state(s: str) -> None:
        if on_state:
            on_state(s)

    def bytes_sent_since(links, links_before, sent_before: int) -> int:
        if links is None:
            return 0
        return max(0, links.bytes_sent - (sent_before if links is links_before else 0))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        conf = msg.content[CONFIG]
        start, end = int(conf[STEP_START]), int(conf[STEP_END])
        rnd = int(conf["round"])
        if executor.step != start:
            raise RuntimeError(
                f"worker-{executor.rank} is at step {executor.step}, round asks for {start}..{end}"
            )
        load_replica(executor, msg.content[ARRAYS])
        state("training")
        losses, seconds, wait_s, compute_s = [], 0.0, 0.0, 0.0
        links_before = executor.links  # a new ring incarnation brings new links (counted from 0)
        sent_before = links_before.bytes_sent if links_before is not None else 0
        for _ in range(start, end):
            r = executor.train_step()
            losses.append(r.loss)
            seconds += r.seconds
            wait_s += r.wait_s
            compute_s += r.compute_s
            if on_step:
                on_step(r)
        t0 = time.perf_counter()  # the barrier snapshot's cost on the critical path
        snap = copy.deepcopy(executor.state_dict())
        checkpointed = bool(conf[CHECKPOINT])
        if not checkpointed and bool(conf.get(BARRIER_SNAPSHOT, False)):
            snapshots.write_barrier(rnd, snap)
        snapshot_s = time.perf_counter() - t0
        reply = RecordDict(
            {
                ARRAYS: replica_arrays(executor),
                METRICS: MetricRecord(
                    {
                        "num-examples": tokens_per_step * (end - start),
                        "loss": losses[-1],
                        "losses": losses,
                        "train-seconds": seconds,
                        "snapshot-seconds": snapshot_s,
                        "wait-seconds": wait_s,
                        "compute-seconds": compute_s,
                        "bytes-sent": bytes_sent_since(executor.links, links_before, sent_before),
                    }
                ),
            }
        )
        if checkpointed:
            snapshots.wait_written()
            path = save_checkpoint(checkpoint_path(snapshots.directory, rnd), snap)
            ck = ConfigRecord({"path": str(path.resolve()), "sha256": sha256_of(path)})
            if bool(conf.get(STATE_COPY, False)):
                size = path.stat().st_size
                if executor.replica.private_parameters():
                    log.warning(
                        "worker-%d: no copy of round %d for the coordinator: the checkpoint "
                        "holds the private home layer, which never leaves this site",
                        executor.rank,
                        rnd,
                    )
                elif size <= COPY_LIMIT_BYTES:
                    ck["copy"] = path.read_bytes()
                else:
                    log.warning(
                        "worker-%d: no copy of round %d for the coordinator: %d bytes exceed "
                        "the control channel's %d",
                        executor.rank,
                        rnd,
                        size,
                        COPY_LIMIT_BYTES,
                    )
            reply["checkpoint"] = ck
            snapshots.prune_disk(int(conf.get("keep-checkpoints", 0)))
        snapshots.keep(rnd, snap, checkpointed)
        state("ready")
        return Message(reply, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        load_replica(executor, msg.content[ARRAYS])
        state("evaluating")
        t0 = time.perf_counter()
        loss = executor.evaluate()
        state("ready")
        metrics = MetricRecord(
            {"num-examples": 1, "eval-loss": loss, "eval-seconds": time.perf_counter() - t0}
        )
        return Message(RecordDict({METRICS: metrics}), reply_to=msg)

    @app.query("state")
    def query_state(msg: Message, context: Context) -> Message:
        conf = ConfigRecord({"rounds": sorted(snapshots.rounds()), "step": executor.step})
        return Message(RecordDict({CONFIG: conf}), reply_to=msg)

    @app.query("restore")
    def restore(msg: Message, context: Context) -> Message:
        conf = msg.content[CONFIG]
        rnd = int(conf["round"])
        state("restoring")
        try:
            source = restore_round(executor, snapshots, rnd, conf)
            want = int(conf.get("step", executor.step))
            if executor.step != want:
                raise CheckpointError(
                    f"the state loaded from {source} is at step {executor.step}, round {rnd} "
                    f"ends at step {want}"
                )
        except Exception as exc:  # any failure is a refusal, so an earlier round is tried
            executor.abandon_step()
            log.error("worker-%d cannot restore round %d: %s", executor.rank, rnd, exc)
            reply = ConfigRecord({"ok": False, "reason": str(exc)})
            return Message(RecordDict({CONFIG: reply}), reply_to=msg)
        log.info(
            "worker-%d restored round %d (step %d) from %s",
            executor.rank,
            rnd,
            executor.step,
            source,
        )
        reply = ConfigRecord({"ok": True, "reason": "", "source": source})
        return Message(RecordDict({CONFIG: reply}), reply_to=msg)

    @app.query("ring")
    def join_ring(msg: Message, context: Context) -> Message:
        conf = msg.content[CONFIG]
        log.info("worker-%d joining ring %s", executor.rank, conf["ring-id"])
        rejoin_ring(str(conf["ring-id"]), [str(p) for p in conf["peers"]])
        state("ready")
        return Message(RecordDict({CONFIG: ConfigRecord({"ok": True})}), reply_to=msg)

    return app


def restore_round(executor: RingExecutor, snapshots: Snapshots, rnd: int, conf) -> str:
    """Load this worker's state at round ``rnd``; return where it came from.

    Order: memory; then, for a round with a manifest (its sha256 given), only the verified
    checkpoint file or the coordinator's copy; for a round without one, the barrier file
    (which checks its own payload hash). Snapshots of later rounds are forgotten: they
    belong to a timeline that is being redone."""
    executor.abandon_step()
    for later in [r for r in snapshots.memory if r > rnd]:
        del snapshots.memory[later]
    if bool(conf.get("fresh", False)):
        snapshots.set_aside()
    if rnd in snapshots.memory:
        executor.load_state_dict(copy.deepcopy(snapshots.memory[rnd]))
        return "memory"
    if rnd == 0:
        executor.load_state_dict(executor.initial_state())
        return "the seed"
    snapshots.wait_written()
    expected = str(conf.get("sha256", "")) or None
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
            if "copy" not in conf:
                raise
            log.error("worker-%d: %s; using the coordinator's copy", executor.rank, exc)
    if "copy" not in conf:
        raise CheckpointError(
            f"no state for round {rnd}: {path} is missing and the coordinator keeps no copy"
        )
    data = bytes(conf["copy"])
    digest = hashlib.sha256(data).hexdigest()
    if digest != conf["copy-sha256"]:
        raise CheckpointError(
            f"the coordinator's copy of round {rnd}: sha256 {digest}, expected "
            f"{conf['copy-sha256']}"
        )
    write_bytes_atomic(path, data)  # becomes this worker's own file again
    executor.load_state_dict(load_checkpoint(path, digest))
    snapshots.keep(rnd, copy.deepcopy(executor.state_dict()), True)
    return "the coordinator's copy"
