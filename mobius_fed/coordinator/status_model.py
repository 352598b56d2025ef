"""The status model: one definition of what a run reports, for every way it is read.

:class:`WorkerModel` and :class:`IncidentModel` are the records :class:`RunState` keeps
(mutated under its lock); :class:`StatusModel` and :class:`HistoryModel` are the documents
``RunState.status_doc``/``history_doc`` build. REST (``/v1/status``, its OpenAPI schema),
gRPC ``GetStatus``, ``mobius-fed status``, the dashboard and ``/metrics`` all render them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from mobius_fed.machines import EdgeState, IncidentState, Phase, RingState, WorkerState


class WorkerModel(BaseModel):
    """One worker as the coordinator sees it."""

    rank: int = Field(description="ring position (0-based)")
    ring: int = Field(0, description="its ring (R rings of P: rank // P; docs/rings.md)")
    identity: str = Field(
        description="certificate identity: mobius://worker/<rank>, or the standby's it was "
        "handed to"
    )
    address: str = Field("", description="host:port of its ring link ('' until registered)")
    state: WorkerState = Field(
        WorkerState.EXPECTED,
        description="finished: the run ended done; stopped: it failed or was stopped",
    )
    step: int = Field(0, description="last step the worker reported")
    last_heartbeat: float | None = Field(None, description="unix time of the last heartbeat")
    heartbeat_age_s: float | None = Field(
        None, description="seconds since the last heartbeat (coordinator clock)"
    )
    registered_at: float | None = Field(None, description="unix time of its latest registration")
    last_loss: float | None = Field(
        None, description="last training loss of its own origin (null if none / non-finite)"
    )
    tokens_per_s: float = Field(0.0, description="worker throughput, tokens per second")
    incidents: int = Field(0, description="incidents in which this worker was the one lost")
    edges: dict[str, Any] = Field(
        default_factory=dict, description="its ring links as it reports them ('in', 'out')"
    )
    train_s: float | None = Field(None, description="its latest round's training seconds")
    wait_s: float | None = Field(
        None, description="seconds of its latest round spent waiting for frames (if reported)"
    )
    compute_s: float | None = Field(None, description="compute seconds (if reported)")
    wait_share: float | None = Field(None, description="wait_s / train_s of its latest round")
    bytes_per_s: float | None = Field(
        None, description="bytes it sent per training second (if reported)"
    )
    layers: int | None = Field(None, description="blocks of its group F_i (the split)")
    step_compute_s: float | None = Field(
        None, description="compute seconds per training step, its latest round (its pace)"
    )
    block_s: float | None = Field(
        None,
        description="compute seconds per block application, forward and backward, on a "
        "home batch (its home work shared in), its latest round",
    )
    train_s_total: float = Field(0.0, description="training seconds over the run")
    wait_s_total: float = Field(0.0, description="wait seconds over the run")
    bytes_sent_total: float = Field(0.0, description="bytes sent over the run (if reported)")
    sync_bytes_total: float = Field(
        0.0, description="R > 1: bytes of its ring syncs (F_i or its encoded δ) over the run"
    )
    er_bytes_total: float = Field(
        0.0,
        description="bytes of the E/R it sent at barriers over the run (fp32 arrays, a sync "
        "codec's payloads, or a masked update)",
    )


class EdgeModel(BaseModel):
    """One ring edge i → i+1, as its sender reports it."""

    edge: str = Field(description="'worker-<i> → worker-<i+1>'")
    state: EdgeState = Field(description="closed: the run ended")
    reconnects: int = Field(description="times the link reconnected within its grace")
    down_s: float = Field(description="seconds it has been down (0 while up)")
    bytes_per_s: float | None = Field(
        None, description="bytes/s its sender reported for its latest round"
    )
    wait_share: float | None = Field(
        None, description="share of its receiver's latest round spent waiting for frames"
    )
    path: str | None = Field(
        None,
        description="how it connects: direct, reversed (the successor dials out) or "
        "relayed (through mobius-relay); docs/reachability.md",
    )
    tunnel_bytes_per_s: float | None = Field(
        None, description="bytes/s through its tunnel (reversed or relayed edges only)"
    )


class RingHealthModel(BaseModel):
    """One ring of R (its P workers and their edges) and its health (docs/rings.md)."""

    ring: int = Field(description="r: workers r·P .. r·P+P-1")
    workers: list[int] = Field(description="its workers' global ranks")
    state: RingState = Field(
        description="stalled: a worker lost or rejoining, or an edge down; restoring: a "
        "worker loading the rollback; waiting: a worker not registered yet; reconnecting: "
        "an edge within its grace; healthy; ended: the run ended"
    )
    healthy: bool = Field(description="state is healthy")
    step: int = Field(description="the least step its workers reported")
    edges_up: int = Field(description="its edges up")
    edges: int = Field(description="its edges (P)")
    reason: str | None = Field(None, description="what holds it, e.g. 'worker-3 lost'")


class PaceModel(BaseModel):
    """The ring moves at its slowest member's pace: who that is and what it costs."""

    slowest: str = Field(description="'worker-<i>': the most compute seconds per step")
    share: float = Field(
        description="the next slowest worker's compute per step over the slowest's: the "
        "share of the others' pace the ring keeps (1: no cost)"
    )
    step_compute_s: float = Field(description="the slowest worker's compute seconds per step")
    others_s: float = Field(description="the next slowest worker's compute seconds per step")
    summary: str = Field(description="e.g. 'worker-2 holds the ring to 0.41 of the others' pace'")


class TimelineModel(BaseModel):
    """Where a step's time went in the latest training round: the slowest worker's parts
    per step, and the barrier's (architecture §9)."""

    round: int = Field(description="the training round these figures are from")
    step_s: float = Field(description="the round's wall time per step (coordinator clock)")
    compute_s: float = Field(description="the slowest worker's compute seconds per step")
    wait_s: float | None = Field(
        None, description="its seconds per step waiting for ring frames (None: not reported)"
    )
    other_s: float = Field(
        description="its other training seconds per step: sends, codec, optimizer, bookkeeping"
    )
    barrier_s: float = Field(
        description="per step, the round's time outside training: Flower messages, E/R and "
        "ring-sync transfers both ways, aggregation"
    )
    summary: str = Field(description="e.g. 'step 0.121 s: compute 0.035, wait 0.061, …'")


class IncidentModel(BaseModel):
    """A worker or ring edge lost, from detection to recovery."""

    id: int
    kind: str = Field(description="worker lost | ring edge down | worker error")
    what: str
    rank: int | None
    edge: str | None = Field(description="the ring edges involved")
    round: int = Field(description="the round in flight when it was detected (0: none)")
    site: str | None = Field(
        None,
        description="the site lost, by name: worker-2, or the standby that held the rank; "
        "a handover's incident names the replaced site, never its standby (null: an edge)",
    )
    detected_at: float = Field(description="unix time")
    detection_s: float | None = Field(description="detection − the culprit's last sign of life")
    state: IncidentState = IncidentState.OPEN
    rollback_round: int | None = Field(None, description="the round every worker rolled back to")
    steps_redone: int | None = None
    recovered_at: float | None = None
    recovery_s: float | None = Field(None, description="detection → training resumed")
    rejoin_s: float | None = Field(
        None, description="the lost worker's re-registration → training resumed"
    )


class HandoverModel(BaseModel):
    """A rank handed to a standby site (docs/recovery.md "Handover to a standby")."""

    rank: int
    replaced: str = Field(description="the identity that held the rank, refused from then on")
    standby: str = Field(description="the standby identity that holds it now")
    why: str = Field(description="lost past --rejoin-timeout, revoked, or mobius-fed replace")
    at: float = Field(description="unix time of the handover")
    round: int | None = Field(
        None, description="the round the standby took the group from (its checkpoint copy)"
    )
    evaluated_round: bool = Field(
        False,
        description="the standby evaluated that round again (its evaluation was interrupted)",
    )


class CommitmentIncidentModel(BaseModel):
    """A lie or a fault the commitments showed (docs/security.md "Commitments")."""

    kind: str = Field(
        description="digest mismatch (a hop's sender and receiver committed different "
        "bytes) | relay altered (a relay committed other bytes out than in) | missing "
        "commitment | forged commitment (not signed by the site's certificate key) | late "
        "commitment (for another round or ring incarnation) | malformed commitment"
    )
    what: str = Field(description="what was found, naming the sites and the first frame")
    round: int = Field(description="the round whose reply carried it")
    phase: str = Field(description="train or eval")
    step: int | None = Field(None, description="the first step it concerns (null: the reply's)")
    edge: str | None = Field(
        None, description="the hop 'worker-<sender> → worker-<receiver>' (digest mismatch)"
    )
    site: str | None = Field(
        None, description="the site it names (every kind but a digest mismatch): worker-2"
    )
    frames: int = Field(1, description="frames it concerns in that reply")
    detected_at: float = Field(description="unix time")


class CommitmentStatusModel(BaseModel):
    """audit.commitments: what the sites' signed frame digests showed so far."""

    replies_checked: int = Field(description="train and evaluate replies whose commitment was read")
    frames_checked: int = Field(
        description="frame hops whose sender's and receiver's digests were compared and equal"
    )
    incidents: list[CommitmentIncidentModel] = Field(
        default_factory=list, description="the latest 100, oldest first"
    )
    by_kind: dict[str, int] = Field(default_factory=dict, description="incidents per kind")
    sites: list[str] = Field(
        default_factory=list,
        description="sites named by an incident (both ends of a mismatched hop)",
    )


class AuditIncidentModel(BaseModel):
    """What an audit by recomputation found (docs/audits.md)."""

    kind: str = Field(
        description="audit failed (the replay of the site's group sent other frames, or "
        "left another state, than it committed) | upload mismatch (the upload is not what "
        "it committed) | audit refused (no upload, or the round not kept) | audit timed "
        "out (the upload came after audit.timeout_s) | audit error (the auditor's own "
        "failure: names no one)"
    )
    what: str = Field(description="what was found, naming the site, the round and the frame")
    site: str | None = Field(None, description="the site it names: worker-2")
    round: int = Field(description="the audited round")
    step: int | None = Field(None, description="the first step that differed")
    detected_at: float = Field(description="unix time")


class AuditStatusModel(BaseModel):
    """audit.rate: the audits by recomputation asked, done and what they found."""

    rate: float = Field(description="the chance that a round of a site is audited")
    asked: int = Field(description="uploads asked of the sites")
    passed: int = Field(description="audits whose replay equalled every committed frame")
    frames_compared: int = Field(description="sent frames recomputed and compared equal")
    pending: int = Field(description="asked or queued, not yet done")
    skipped: int = Field(0, description="drawn but not asked: the auditor lagged behind")
    incidents: list[AuditIncidentModel] = Field(
        default_factory=list, description="the latest 100, oldest first"
    )
    by_kind: dict[str, int] = Field(default_factory=dict, description="incidents per kind")
    suspects: list[str] = Field(
        default_factory=list, description="sites named by a failed, refused or mismatched audit"
    )
    unauditable: str | None = Field(None, description="why this run's sites cannot be audited")


class StandbyStatusModel(BaseModel):
    """Standby sites waiting, and what a handover to one would redo (docs/recovery.md)."""

    waiting: list[str] = Field(description="standbys a handover can take now (standby-<n>)")
    checkpoint_every: int | None = Field(
        description="steps between checkpoints (each with every worker's copy) while a "
        "standby waits: standby_checkpoint_every, or checkpoint_every where that is less "
        "(null: only at the end)"
    )
    redo_steps: int | None = Field(
        description="the most steps a handover redoes once the first copy is taken "
        "(checkpoint_every); null: unbounded, see note"
    )
    copy_step: int | None = Field(
        description="the step of the newest checkpoint with every worker's copy: a "
        "handover now takes the group from there (null: none yet, from the start)"
    )
    note: str | None = Field(None, description="why redo_steps is null")


class StatusModel(BaseModel):
    """``GET /v1/status``: where the run stands (same document as gRPC ``GetStatus``)."""

    run_id: str
    phase: Phase
    round: int = Field(description="Flower rounds (step barriers) started")
    num_rounds: int
    step: int = Field(description="training steps completed")
    steps: int = Field(description="training steps of the whole run")
    strategy: str
    error: str | None = None
    checkpoint: str | None = Field(None, description="latest checkpoint manifest")
    started_at: float = Field(description="unix time")
    finished_at: float | None = None
    eval_loss: float | None = Field(None, description="latest validation loss (Eq. 8)")
    eval_origin_losses: list[float | None] | None = None
    server_time: float | None = Field(None, description="coordinator clock at this reply")
    rings: int = Field(1, description="R: rings of P workers each (docs/rings.md)")
    ring: list[EdgeModel] = Field(default_factory=list, description="every ring edge")
    ring_health: list[RingHealthModel] = Field(
        default_factory=list, description="each ring's health (one entry per ring, R ≥ 1)"
    )
    incidents: list[IncidentModel] = Field(default_factory=list)
    handovers: list[HandoverModel] = Field(
        default_factory=list, description="ranks handed to standby sites"
    )
    standby: StandbyStatusModel | None = Field(
        None, description="standbys waiting and the steps a handover to one redoes"
    )
    train_loss: float | None = Field(
        None, description="training loss of the latest step every origin reported (mean)"
    )
    pace: PaceModel | None = Field(
        None, description="the slowest site and its cost (once every worker reported a round)"
    )
    timeline: TimelineModel | None = Field(
        None, description="where a step's time went, the latest training round"
    )
    config: dict[str, Any] | None = Field(None, description="the run's configuration")
    privacy: dict[str, Any] | None = Field(
        None,
        description=(
            "privacy defences and their accounting (when reported); input: ε per position "
            "and per sequence, per site, with what it covers and what it does not"
        ),
    )
    bounds: dict[str, Any] | None = Field(
        None,
        description="E/R updates clipped at barriers and ring frames refused by a neighbour, "
        "per site, the last of each, and the suspects (docs/security.md, 'Bounds on what a "
        "site sends'); null until one is",
    )
    commitments: CommitmentStatusModel | None = Field(
        None,
        description="audit.commitments: frame hops compared and the incidents found "
        "(docs/security.md 'Commitments'); null when off",
    )
    audits: AuditStatusModel | None = Field(
        None,
        description="audit.rate: audits by recomputation and what they found "
        "(docs/audits.md); null when off",
    )
    workers: list[WorkerModel]


class StepLossModel(BaseModel):
    step: int
    loss: float | None = Field(description="mean over origins; null until every origin reported")
    origin_losses: list[float | None] = Field(description="loss per origin (index = origin)")


class EvalModel(BaseModel):
    round: int
    step: int
    loss: float | None = Field(description="mean validation loss over origins (Eq. 8)")
    origin_losses: list[float | None]


class RoundModel(BaseModel):
    round: int
    seconds: float
    overhead_s: float = Field(description="round wall time not spent in the workers")
    train_s: float = Field(0.0, description="the slowest worker's training time")
    snapshot_s: float = Field(0.0, description="the slowest worker's barrier snapshot copy")
    steps: int = Field(0, description="training steps in the round")
    workers: dict[str, dict[str, float | None]] = Field(
        default_factory=dict,
        description="rank → its figures: train_s, and where reported wait_s, compute_s, "
        "bytes_sent, frames_sent, sync_bytes (R > 1, a ring-sync round), er_bytes, "
        "down_bytes (the arrays that came down for the round, its evaluate's included), "
        "commitment_bytes (its signed commitment of the round's frames)",
    )


class HistoryModel(BaseModel):
    """``GET /v1/history``: training loss per step and origin, evaluations, round times."""

    run_id: str
    steps: list[StepLossModel]
    evals: list[EvalModel]
    rounds: list[RoundModel]
    incidents: list[IncidentModel] = Field(default_factory=list)
    handovers: list[HandoverModel] = Field(default_factory=list)


class HealthModel(BaseModel):
    status: str = Field(description="always 'ok' while the server answers")
    phase: Phase


class ReadyModel(BaseModel):
    ready: bool = Field(description="false once the run failed or was stopped")
    phase: Phase


class ErrorModel(BaseModel):
    detail: str
