"""The coordinator↔worker messages: one typed class per record a message carries, used by
both sides. ``to_record``/``of`` are the only places the wire keys are written and read
(the keys, and so the wire format, are those the run always used). A field travels under
its name with ``-`` for ``_`` (``_s`` as ``-seconds``); a field that is None is left out.

=================  ==========================  =======================================
message type       coordinator → worker        worker → coordinator
=================  ==========================  =======================================
``train``          E/R arrays + TrainOrder     E/R arrays + TrainReport (+ Checkpoint)
                   (+ synced group, R > 1)     (+ its group on a ring sync, R > 1)
                                               (+ Signed: its commitment)
                                               (+ audits: Signed state digest, upload)
``evaluate``       E/R arrays + round/step     EvalReport (+ Signed: its commitment)
                   (+ synced group, R > 1)
``query.state``    (empty)                     StateReply
``query.restore``  RestoreOrder                RestoreReply
``query.ring``     RingOrder                   ``ok``
=================  ==========================  =======================================

A train message right after an evaluate leaves out the array records that evaluate carried
(``TrainOrder.from_evaluate`` names them; :class:`EvaluatedRecords` puts them back), so the
synced model comes down once per barrier.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, TypeVar, cast

from flwr.app import ConfigRecord, MetricRecord

# Keys of the ConfigRecord a train/evaluate message carries.
STEP_START, STEP_END = "step-start", "step-end"
ARRAYS, METRICS, CONFIG = "arrays", "metrics", "config"
# R > 1: a worker's block group F_i (train reply of a ring sync), or the synced F_i
# (the next train or evaluate message): docs/rings.md
GROUP = "group"
# R > 1 with a ring codec: the global F_i a worker's pseudo-gradient is taken against, sent
# with the first train message of a strategy (a fresh run, or after a rollback)
GROUP_BASE = "group-base"
# in a train order: the array records (comma-separated keys) this train message leaves out
# because the evaluate message just before it carried the very same ones (the synced model
# travels down once per barrier, not twice): the worker takes them from that evaluate
FROM_EVALUATE = "from-evaluate"
# audit.commitments: the signed digests of the ring frames a site sent and received in the
# round (transport/commitments.py), in a train or evaluate reply
COMMITMENT = "commitment"
# audits (docs/audits.md): in a train reply, the signed digest of the site's group state at
# the round's start; and, when the order's ``audit-asks`` names the site, the upload of the
# round it asks for (the group's state and that round's frames)
AUDIT_STATE, AUDIT_UPLOAD = "audit-state", "audit-upload"
_W = TypeVar("_W", bound="_Wire")
_CASTS = {"int": int, "bool": bool, "str": str, "bytes": bytes, "float": float}


def _key(name: str) -> str:
    """A field's wire key: ``step_start`` → ``step-start``, ``train_s`` → ``train-seconds``."""
    return (name[:-2] + "_seconds" if name.endswith("_s") else name).replace("_", "-")


def _cast(kind: str, value: Any) -> Any:
    kind = kind.removesuffix(" | None")
    if kind.startswith("list["):
        return [_CASTS[kind[5:-1]](v) for v in value]
    return _CASTS[kind](value)


class _Wire:
    """``to_record`` and ``of`` for a dataclass whose fields are its wire keys."""

    RECORD: ClassVar[type] = ConfigRecord

    def items(self) -> dict[str, Any]:
        """``{wire key: value}`` of every field that is not None."""
        values = {_key(f.name): getattr(self, f.name) for f in fields(cast(Any, self))}
        return {k: v for k, v in values.items() if v is not None}

    def to_record(self) -> Any:
        return self.RECORD(self.items())

    @classmethod
    def of(cls: type[_W], conf: Any) -> _W:
        """Read a record: a field without a default must be there (KeyError naming it)."""
        kwargs = {}
        for f in fields(cast(Any, cls)):
            key = _key(f.name)
            if key in conf:
                kwargs[f.name] = _cast(str(f.type), conf[key])
            elif f.default is MISSING:
                raise KeyError(key)
        return cls(**kwargs)


@dataclass(frozen=True)
class TrainOrder(_Wire):
    """Train steps [step_start, step_end) of round ``round``, then report (and checkpoint)."""

    round: int
    step_start: int
    step_end: int
    checkpoint: bool
    state_copy: bool = False
    keep_checkpoints: int = 0  # checkpoint files the worker keeps (0: all)
    barrier_snapshot: bool = False
    ring_sync: bool | None = None  # R > 1: send this worker's group back (a ring sync)
    audit_asks: str | None = None  # audits: "rank:round,…", the past rounds to upload
    from_evaluate: str | None = None  # FROM_EVALUATE: keys the last evaluate brought

    def fill(self, config: ConfigRecord) -> ConfigRecord:
        config.update(self.items())
        return config


OPTIONAL_FIGURES = {  # a train report's wire key → its field, for figures a worker may omit
    "wait-seconds": "wait_s",
    "compute-seconds": "compute_s",
    "bytes-sent": "bytes_sent",
    "frames-sent": "frames_sent",
    "sync-bytes": "sync_bytes",
    "er-bytes": "er_bytes",
    "down-bytes": "down_bytes",
    "commitment-bytes": "commitment_bytes",
}


@dataclass(frozen=True)
class TrainReport(_Wire):
    """A worker's figures for one train round (and ``loss``, the last of ``losses``)."""

    RECORD = MetricRecord
    losses: list[float]
    num_examples: float
    train_s: float
    snapshot_s: float = 0.0
    wait_s: float | None = None
    compute_s: float | None = None
    bytes_sent: float | None = None
    frames_sent: float | None = None
    sync_bytes: float | None = None  # R > 1: what a ring sync's F_i (or δ) took, on its round
    er_bytes: float | None = None  # the E/R it sent at the barrier (fp32, a codec's, masked)
    # the arrays that came down since its last train reply: this train message's and those
    # of the evaluate before it (each record once, as it crossed the wire)
    down_bytes: float | None = None
    commitment_bytes: float | None = None  # its signed commitment: body and signature

    def items(self) -> dict[str, Any]:
        return {**super().items(), "loss": self.losses[-1]}

    def figures(self) -> dict[str, float]:
        """``train_s`` and every optional figure reported, by the coordinator's names."""
        optional = {n: getattr(self, n) for n in OPTIONAL_FIGURES.values()}
        return {"train_s": self.train_s, **{n: v for n, v in optional.items() if v is not None}}


@dataclass(frozen=True)
class Checkpoint(_Wire):
    """A worker's confirmation of its round checkpoint (with a copy of the file, if asked)."""

    path: str
    sha256: str
    copy: bytes | None = None


@dataclass(frozen=True)
class Signed(_Wire):
    """A site's commitment (its canonical body) and the signature of its TLS key over it."""

    body: bytes
    signature: bytes


@dataclass(frozen=True)
class StateReply(_Wire):
    """The rounds a worker can restore, and its step."""

    rounds: list[int]
    step: int = 0

    def items(self) -> dict[str, Any]:
        return {"rounds": sorted(self.rounds), "step": self.step}


@dataclass(frozen=True)
class RestoreOrder(_Wire):
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


@dataclass(frozen=True)
class RestoreReply(_Wire):
    ok: bool
    reason: str
    source: str | None = None  # where the state came from (memory, a file, the copy)


@dataclass(frozen=True)
class RingOrder(_Wire):
    """Join ring incarnation ``ring_id`` with these ring addresses (index = rank) and, after
    a handover, the identity that holds each rank (None: worker-<rank> everywhere)."""

    ring_id: str
    peers: list[str]
    identities: list[str] | None = None


class EvaluatedRecords:
    """A site's copy of the array records its last evaluate message brought, for the train
    message after it that leaves them out (``TrainOrder.from_evaluate``): the worker and the
    reference engine's in-process node both take them back by :meth:`restore`."""

    def __init__(self) -> None:
        self.round: int | None = None
        self.records: dict[str, Any] = {}

    def keep(self, msg: Any) -> None:
        """Keep the array records of evaluate message ``msg`` (its config names the round)."""
        rnd = msg.content.get(CONFIG, ConfigRecord()).get("round")
        self.round = rnd if isinstance(rnd, int) else None
        self.records = dict(msg.content.array_records.items())

    def forget(self) -> None:
        """A restore or a new run: what an earlier evaluate brought belongs to another timeline."""
        self.round, self.records = None, {}

    def restore(self, msg: Any) -> Any:
        """``msg`` (a train message) with the records its order says it left out put back;
        a RuntimeError when this site holds no evaluate of the round before it."""
        conf = msg.content[CONFIG]
        keys = [k for k in str(conf.get(_key("from_evaluate"), "")).split(",") if k]
        if not keys:
            return msg
        rnd = int(conf["round"])
        missing = [k for k in keys if k not in self.records]
        if self.round != rnd - 1 or missing:
            raise RuntimeError(
                f"round {rnd}'s train message leaves out {', '.join(keys)} for the evaluate of "
                f"round {rnd - 1}, but this site kept round {self.round}'s "
                f"({', '.join(sorted(self.records)) or 'nothing'})"
            )
        for key in keys:
            msg.content[key] = self.records[key]
        return msg
