"""The rounds the coordinator can restore: in-memory snapshots of the newest rounds and the
complete checkpoint manifests on disk. It writes a round's checkpoint (worker copies and
E/R first, then the manifest: the commit point) and prunes old ones."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Message

from mobius_fed.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    sha256_of,
    write_bytes_atomic,
)
from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.cadence import CheckpointCadence
from mobius_fed.coordinator.config import CoordinatorConfig
from mobius_fed.coordinator.grid import RunFailed
from mobius_fed.coordinator.recorder import HISTORY_FILE, METRICS_FILE, RunRecorder
from mobius_fed.coordinator.state import RunState
from mobius_fed.coordinator.status_model import HandoverModel
from mobius_fed.messages import Checkpoint
from mobius_fed.model import build_replica
from mobius_fed.run_reader import (
    ER_FILE,
    MANIFEST,
    checkpoint_dir,
    complete_manifests,
    round_dir,
    round_of,
    stored_path,
)
from mobius_fed.strategies import RoundPlan, from_plain, to_plain
from mobius_fed.transport.flower_wire import rank_of_node
from mobius_fed.transport.tls import worker_identity

log = logging.getLogger("mobius.coordinator")
# Every handover of the run, rewritten at each one: a resumed coordinator keeps the ranks
# its standbys hold and refuses the identities they replaced (docs/recovery.md).
HANDOVERS_FILE = "handovers.json"


def split_difference(saved: dict[str, Any] | None, train: TrainConfig) -> str:
    """``: it was written with layers_per_group 3,3,3,3, …`` when the splits differ."""
    try:
        old = TrainConfig.model_validate(saved)
    except ValueError:
        return ""
    return f": {train.difference(old)}" if old.split != train.split else ""


@dataclass
class RoundState:
    """The coordinator's side of the ring state after round ``round``: averaged E/R, the
    strategy's server state and the history so far. Round 0 is the start."""

    round: int
    arrays: ArrayRecord
    server_state: dict[str, Any]
    history: dict[str, Any] | None = None  # only when it came from disk
    manifest: dict[str, Any] | None = None  # the manifest that holds this round, if any


class RoundStore:
    """Snapshots of the newest rounds, and the manifests on disk, newest first."""

    def __init__(self, cfg: CoordinatorConfig, plan: RoundPlan, state: RunState) -> None:
        self.cfg, self.train, self.plan, self.state = cfg, cfg.train, plan, state
        self.manifests = complete_manifests(cfg.out_dir, plan) if cfg.resume else []
        if cfg.resume is True and not self.manifests:
            raise FileNotFoundError(
                f"--resume: no complete checkpoint manifest under {checkpoint_dir(cfg.out_dir)}"
            )
        for path in self.manifests:
            doc = json.loads(path.read_text())
            if doc["fingerprint"] != cfg.train.fingerprint():
                why = split_difference(doc.get("train"), cfg.train)
                raise ValueError(f"--resume: {path} was written by a different train config{why}")
        self.snapshots: dict[int, RoundState] = {}
        copies = cfg.state_copy == "coordinator" and not cfg.train.privacy.er_secagg
        self.cadence = CheckpointCadence.of(plan, cfg.standby_round_interval(), copies)
        self.keep_checkpoints = self.cadence.keep_checkpoints(cfg.keep_checkpoints)
        self.fresh = False  # a fresh start: workers set an earlier run's files aside
        self.last_manifest_round = 0
        # the oldest round an audit may still fail (Audits.oldest_open): pruning keeps the
        # newest manifest before it, the round a failed audit rolls the run back to
        self.audit_open: Callable[[], int | None] = lambda: None
        self.rolled_back: Callable[[int], None] = lambda rnd: None  # Audits.rolled_back

    # ------------------------------------------------------------ the start
    def start_state(self, recorder: RunRecorder) -> RoundState:
        """Round 0 from the seed, or the newest manifest whose E/R file verifies."""
        for path in self.manifests:
            doc = json.loads(path.read_text())
            try:
                state = self.load_round(path, doc)
            except CheckpointError as exc:
                log.error("cannot resume from %s: %s; trying the previous manifest", path, exc)
                continue
            recorder.replay(state.history or {})
            self.last_manifest_round = state.round
            self.state.set(checkpoint=str(path))
            log.info("resuming from %s (round %d, step %d)", path, doc["round"], doc["step"])
            self.snapshots[state.round] = state
            return state
        if self.cfg.resume is True:
            raise RunFailed(
                f"--resume: no manifest under {checkpoint_dir(self.cfg.out_dir)} could be loaded"
            )
        self.fresh = True
        self._set_aside_earlier_run()
        self.snapshots[0] = state = self.seed_state()
        return state

    def _set_aside_earlier_run(self) -> None:
        """A fresh run: an earlier run's files (here and on the workers) are moved aside,
        never reused, never pruned as this run's own."""
        out = Path(self.cfg.out_dir)
        earlier = (
            checkpoint_dir(out),
            out / METRICS_FILE,
            out / HISTORY_FILE,
            out / HANDOVERS_FILE,
        )
        for old in earlier:
            if old.is_file() or (old.is_dir() and any(old.iterdir())):
                aside = old.with_name(f"{old.name}.{int(time.time())}")
                old.rename(aside)
                log.warning("an earlier run's %s moved to %s", old.name, aside)

    # ---------------------------------------------------------- handovers
    def saved_handovers(self) -> list[HandoverModel]:
        """The handovers an interrupted run recorded (none unless it resumes); a file that
        cannot be read fails the start, naming it: a replaced identity must stay refused."""
        path = Path(self.cfg.out_dir) / HANDOVERS_FILE
        if not self.manifests or not path.is_file():
            return []
        try:
            return [HandoverModel.model_validate(h) for h in json.loads(path.read_text())]
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(
                f"--resume: cannot read the run's handovers from {path}: {exc}; a replaced "
                "site must stay refused, so the coordinator does not start without them"
            ) from exc

    def save_handovers(self, handovers: list[HandoverModel]) -> None:
        """Rewrite the handovers' record (atomically) after each change."""
        doc = [h.model_dump(mode="json") for h in handovers]
        write_bytes_atomic(
            Path(self.cfg.out_dir) / HANDOVERS_FILE, json.dumps(doc, indent=2).encode()
        )

    def seed_state(self) -> RoundState:
        """Round 0: E/R from the seed, a strategy with no server state yet."""
        replica = build_replica(self.train.model(), self.train.seed)
        shared = replica.shared_state_dict()  # E/R only: home layers never leave their site
        arrays = ArrayRecord({k: v.detach().clone() for k, v in shared.items()})
        return RoundState(0, arrays, {})

    def load_round(self, path: Path, doc: dict[str, Any]) -> RoundState:
        saved = load_checkpoint(path.parent / doc["er"], doc.get("er_sha256"))
        return RoundState(
            int(doc["round"]),
            from_plain(saved["arrays"]),
            from_plain(saved["server_state"]),
            history=saved.get("history", {}),
            manifest={**doc, "dir": str(path.parent)},
        )

    # ------------------------------------------------------------- lookups
    def rounds(self) -> list[int]:
        """Every round this coordinator can restore, newest first (0: the seed)."""
        disk = {round_of(m) for m in self.manifests}
        return sorted(set(self.snapshots) | disk | {0}, reverse=True)

    def manifest_doc(self, rnd: int) -> dict[str, Any] | None:
        snap = self.snapshots.get(rnd)
        if snap is not None and snap.manifest is not None:
            return snap.manifest
        m = self.manifest_path(rnd)
        return None if m is None else {**json.loads(m.read_text()), "dir": str(m.parent)}

    def manifest_path(self, rnd: int) -> Path | None:
        return next((m for m in self.manifests if round_of(m) == rnd), None)

    def restored(self, rnd: int) -> RoundState:
        """Round ``rnd``'s state, now the newest: later snapshots (a redo) are forgotten."""
        snap = self.snapshots.get(rnd)
        if snap is None and rnd == 0:
            snap = self.seed_state()
        elif snap is None:  # an older manifest from disk
            manifest = self.manifest_path(rnd)
            if manifest is None:
                raise RunFailed(f"round {rnd}: its manifest disappeared during the restore")
            snap = self.load_round(manifest, json.loads(manifest.read_text()))
        self.snapshots = {r: v for r, v in self.snapshots.items() if r <= rnd}
        self.snapshots[rnd] = snap
        self.fresh = False
        return snap

    def forget_after(self, rnd: int) -> None:
        """A rollback past newer checkpoints (a failed audit): their manifests held what
        the run now redoes without the lie, so they go, on disk too (a later incident or a
        ``--resume`` must never take one)."""
        for m in [m for m in self.manifests if round_of(m) > rnd]:
            (m.parent / MANIFEST).unlink(missing_ok=True)  # the commit point first
            shutil.rmtree(m.parent, ignore_errors=True)
            log.warning("checkpoint %s dropped: the run rolled back to round %d", m.parent, rnd)
        self.manifests = [m for m in self.manifests if round_of(m) <= rnd]
        if self.manifests:
            self.state.set(checkpoint=str(self.manifests[0]))
        self.last_manifest_round = min(self.last_manifest_round, rnd)
        self.rolled_back(rnd)
        if (self.cadence.copy_round or 0) > rnd:  # status: no copy to start from until
            self.cadence.copy_round = None  # the next checkpoint round

    # ------------------------------------------------------------- a round
    def keep(
        self, rnd: int, arrays: ArrayRecord, server_state: dict[str, Any], replies: list[Message]
    ) -> None:
        """Round ``rnd`` ended with ``arrays``: snapshot it, checkpoint it if the plan says."""
        snap = RoundState(rnd, copy.deepcopy(arrays), server_state)
        if self.cadence.ordered(rnd):
            snap.manifest = self.write_checkpoint(rnd, replies, snap)
            self.last_manifest_round = rnd
        self.snapshots[rnd] = snap
        # The two newest rounds (a worker may have finished one its peers did not)
        # and the newest manifest's.
        keep = {*sorted(self.snapshots, reverse=True)[:2], self.last_manifest_round}
        self.snapshots = {r: v for r, v in self.snapshots.items() if r in keep}

    def write_checkpoint(
        self, rnd: int, replies: list[Message], snap: RoundState
    ) -> dict[str, Any]:
        """Worker copies and E/R first, then the manifest: the manifest is the commit point.
        A write error names the path and fails the run; the previous manifest stays."""
        rdir = round_dir(self.cfg.out_dir, rnd)
        workers = {str(rank): entry for rank, entry in self._worker_entries(rnd, replies, rdir)}
        if len(workers) != self.train.workers:
            raise RunFailed(
                f"only {len(workers)} of {self.train.workers} workers confirmed round {rnd}"
            )
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
        self.cadence.written(rnd, workers)
        if self.keep_checkpoints:
            self.prune(self.keep_checkpoints)
        return {**manifest, "dir": str(rdir)}

    def _worker_entries(self, rnd: int, replies: list[Message], rdir: Path):
        """(rank, manifest entry) of each worker's confirmed checkpoint; a copy it sent is
        verified and written next to the manifest."""
        for reply in replies:
            rank = rank_of_node(reply.metadata.src_node_id)
            if "checkpoint" not in reply.content:
                raise RunFailed(f"worker-{rank} did not confirm its round-{rnd} checkpoint")
            ck = Checkpoint.of(reply.content["checkpoint"])
            entry: dict[str, Any] = {
                "identity": self.state.workers[rank].identity or worker_identity(rank),
                "path": ck.path,  # as the worker reported it, on its host
                "file": stored_path(self.cfg.out_dir, ck.path),  # relative to <out> if beside
                "sha256": ck.sha256,
            }
            if ck.copy is not None:
                digest = hashlib.sha256(ck.copy).hexdigest()
                if digest != ck.sha256:
                    raise RunFailed(
                        f"worker-{rank}'s copy of its round-{rnd} checkpoint does not match its "
                        f"sha256 (expected {ck.sha256}, got {digest})"
                    )
                name = f"worker-{rank}.ckpt"
                write_bytes_atomic(rdir / name, ck.copy)
                entry.update(copy=name, copy_sha256=digest, copy_bytes=len(ck.copy))
            yield rank, entry

    def prune(self, keep: int) -> None:
        """Keep the ``keep`` newest complete manifests' round directories and, while an
        audit's verdict may still come, the newest complete one before its round (a failed
        audit rolls back to it): ``keep`` + 1 at most."""
        rounds = sorted(checkpoint_dir(self.cfg.out_dir).glob("round-*"), reverse=True)
        complete = [d for d in rounds if (d / MANIFEST).is_file()]
        if len(complete) <= keep:
            return
        oldest_kept = complete[keep - 1].name
        held = held_for_audit(complete, self.audit_open())
        for d in rounds:
            if d.name < oldest_kept and d != held:
                shutil.rmtree(d, ignore_errors=True)
                log.info("pruned %s (keeping the newest %d manifests)", d, keep)
        self.manifests = [m for m in self.manifests if m.parent.exists()]


def held_for_audit(complete: list[Path], open_round: int | None) -> Path | None:
    """Of ``complete`` (round directories with a manifest, newest first), the newest whose
    round is before ``open_round``: where a failed audit of that round rolls back to
    (None: no audit open, or none before it: the start, round 0, needs no file)."""
    if open_round is None:
        return None
    return next((d for d in complete if round_of(d / MANIFEST) < open_round), None)
