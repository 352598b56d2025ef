"""The coordinator↔worker messages: one typed class per record a message carries, used by
both sides. ``to_record``/``of`` are the only places the wire keys are written and read
(the keys, and so the wire format, are those the run always used).

=================  ==========================  =======================================
message type       coordinator → worker        worker → coordinator
=================  ==========================  =======================================
``train``          E/R arrays + TrainOrder     E/R arrays + TrainReport (+ Checkpoint)
``evaluate``       E/R arrays + round/step     EvalReport
``query.state``    (empty)                     StateReply
``query.restore``  RestoreOrder                RestoreReply
``query.ring``     RingOrder                   ``ok``
=================  ==========================  =======================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, MetricRecord

# Keys of the ConfigRecord a train/evaluate message carries.
STEP_START, STEP_END, CHECKPOINT = "step-start", "step-end", "checkpoint"
STATE_COPY = "state-copy"  # the worker also sends its checkpoint's bytes (a copy kept elsewhere)
BARRIER_SNAPSHOT = "barrier-snapshot"  # the worker writes its barrier state to disk too
ARRAYS, METRICS, CONFIG = "arrays", "metrics", "config"


@dataclass(frozen=True)
class TrainOrder:
    """Train steps [step_start, step_end) of round ``round``, then report (and checkpoint)."""

    round: int
    step_start: int
    step_end: int
    checkpoint: bool
    state_copy: bool = False
    keep_checkpoints: int = 0  # checkpoint files the worker keeps (0: all)
    barrier_snapshot: bool = False

    def fill(self, config: ConfigRecord) -> ConfigRecord:
        config[STEP_START], config[STEP_END] = self.step_start, self.step_end
        config[CHECKPOINT] = self.checkpoint
        config[STATE_COPY] = self.state_copy
        config["keep-checkpoints"] = self.keep_checkpoints
        config[BARRIER_SNAPSHOT] = self.barrier_snapshot
        config["round"] = self.round
        return config

    @classmethod
    def of(cls, conf: Any) -> TrainOrder:
        return cls(
            round=int(conf["round"]),
            step_start=int(conf[STEP_START]),
            step_end=int(conf[STEP_END]),
            checkpoint=bool(conf[CHECKPOINT]),
            state_copy=bool(conf.get(STATE_COPY, False)),
            keep_checkpoints=int(conf.get("keep-checkpoints", 0)),
            barrier_snapshot=bool(conf.get(BARRIER_SNAPSHOT, False)),
        )


OPTIONAL_FIGURES = {  # a train report's wire key → its field, for figures a worker may omit
    "wait-seconds": "wait_s",
    "compute-seconds": "compute_s",
    "bytes-sent": "bytes_sent",
    "frames-sent": "frames_sent",
}


@dataclass(frozen=True)
class TrainReport:
    """A worker's figures for one train round."""

    losses: list[float]
    num_examples: float
    train_s: float
    snapshot_s: float = 0.0
    wait_s: float | None = None
    compute_s: float | None = None
    bytes_sent: float | None = None
    frames_sent: float | None = None

    def to_record(self) -> MetricRecord:
        rec: dict[str, Any] = {
            "num-examples": self.num_examples,
            "loss": self.losses[-1],
            "losses": list(self.losses),
            "train-seconds": self.train_s,
            "snapshot-seconds": self.snapshot_s,
        }
        for key, name in OPTIONAL_FIGURES.items():
            if getattr(self, name) is not None:
                rec[key] = getattr(self, name)
        return MetricRecord(rec)

    @classmethod
    def of(cls, metrics: Any) -> TrainReport:
        return cls(
            losses=[float(v) for v in metrics["losses"]],
            num_examples=float(metrics["num-examples"]),
            train_s=float(metrics["train-seconds"]),
            snapshot_s=float(metrics.get("snapshot-seconds", 0.0)),
            **{n: float(metrics[k]) for k, n in OPTIONAL_FIGURES.items() if k in metrics},
        )

    def figures(self) -> dict[str, float]:
        """``train_s`` and every optional figure reported, by the coordinator's names."""
        out = {"train_s": self.train_s}
        out.update(
            {n: getattr(self, n) for n in OPTIONAL_FIGURES.values() if getattr(self, n) is not None}
        )
        return out


@dataclass(frozen=True)
class Checkpoint:
    """A worker's confirmation of its round checkpoint (with a copy of the file, if asked)."""

    path: str
    sha256: str
    copy: bytes | None = None

    def to_record(self) -> ConfigRecord:
        rec = ConfigRecord({"path": self.path, "sha256": self.sha256})
        if self.copy is not None:
            rec["copy"] = self.copy
        return rec

    @classmethod
    def of(cls, conf: Any) -> Checkpoint:
        copy = bytes(conf["copy"]) if "copy" in conf else None
        return cls(str(conf["path"]), str(conf["sha256"]), copy)


@dataclass(frozen=True)
class StateReply:
    """The rounds a worker can restore, and its step."""

    rounds: list[int]
    step: int

    def to_record(self) -> ConfigRecord:
        return ConfigRecord({"rounds": sorted(self.rounds), "step": self.step})

    @classmethod
    def of(cls, conf: Any) -> StateReply:
        return cls([int(r) for r in conf["rounds"]], int(conf.get("step", 0)))


@dataclass(frozen=True)
class RestoreOrder:
    """Roll back to the end of round ``round`` (step ``step``). ``sha256``: the manifest's
    digest of the worker's file ('' without a manifest); ``copy``: the coordinator's copy
    of it, sent only to a worker that lacks the round; ``fresh``: set an earlier run's
    files aside first."""

    round: int
    step: int
    sha256: str = ""
    fresh: bool = False
    file: str | None = None
    copy: bytes | None = None
    copy_sha256: str | None = None

    def to_record(self) -> ConfigRecord:
        rec = ConfigRecord(
            {"round": self.round, "step": self.step, "sha256": self.sha256, "fresh": self.fresh}
        )
        for key, value in (("file", self.file), ("copy", self.copy)):
            if value is not None:
                rec[key] = value
        if self.copy_sha256 is not None:
            rec["copy-sha256"] = self.copy_sha256
        return rec

    @classmethod
    def of(cls, conf: Any) -> RestoreOrder:
        return cls(
            round=int(conf["round"]),
            step=int(conf["step"]),
            sha256=str(conf.get("sha256", "")),
            fresh=bool(conf.get("fresh", False)),
            file=str(conf["file"]) if "file" in conf else None,
            copy=bytes(conf["copy"]) if "copy" in conf else None,
            copy_sha256=str(conf["copy-sha256"]) if "copy-sha256" in conf else None,
        )


@dataclass(frozen=True)
class RestoreReply:
    ok: bool
    reason: str = ""
    source: str | None = None  # where the state came from (memory, a file, the copy)

    def to_record(self) -> ConfigRecord:
        rec = ConfigRecord({"ok": self.ok, "reason": self.reason})
        if self.source is not None:
            rec["source"] = self.source
        return rec

    @classmethod
    def of(cls, conf: Any) -> RestoreReply:
        return cls(bool(conf["ok"]), str(conf["reason"]), conf.get("source"))


@dataclass(frozen=True)
class RingOrder:
    """Join ring incarnation ``ring_id`` with these ring addresses (index = rank)."""

    ring_id: str
    peers: list[str]

    def to_record(self) -> ConfigRecord:
        return ConfigRecord({"ring-id": self.ring_id, "peers": list(self.peers)})

    @classmethod
    def of(cls, conf: Any) -> RingOrder:
        return cls(str(conf["ring-id"]), [str(p) for p in conf["peers"]])
