"""The coordinator's configuration: TOML ``[coordinator]`` + ``[train]``, MOBIUS_* env, flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mobius_fed.config import (  # noqa: F401 - TRAIN_ENV_KEYS: the coordinator's training vars
    TRAIN_ENV_KEYS,
    ConfigError,
    TrainConfig,
    describe_validation_error,
    layered_settings,
)
from mobius_fed.transport.tls import NodeTLS

ENV_KEYS = {
    "LISTEN": "listen",
    "REST_LISTEN": "rest_listen",
    "REST_MODE": "rest_mode",
    "RUN_ID": "run_id",
    "CA": "ca",
    "CERT": "cert",
    "KEY": "key",
    "OUT_DIR": "out_dir",
    "STRATEGY": "strategy",
    "CHECKPOINT_EVERY": "checkpoint_every",
    "HEARTBEAT_INTERVAL": "heartbeat_interval",
    "HEARTBEAT_TIMEOUT": "heartbeat_timeout",
    "REGISTRATION_TIMEOUT": "registration_timeout",
    "RESUME": "resume",
    "REJOIN_TIMEOUT": "rejoin_timeout",
    "MAX_INCIDENTS": "max_incidents",
    "KEEP_CHECKPOINTS": "keep_checkpoints",
    "STATE_COPY": "state_copy",
    "RESTORE_TIMEOUT": "restore_timeout",
    "BARRIER_SNAPSHOTS": "barrier_snapshots",
    "INSECURE": "insecure",
    "LINGER": "linger",
}


class CoordinatorConfig(BaseModel):
    """A run's coordinator: where it listens, who it trusts, how it aggregates."""

    model_config = ConfigDict(extra="forbid")

    listen: str = Field("0.0.0.0:7300", description="gRPC control + status + health (mTLS)")
    rest_listen: str = Field("0.0.0.0:7380", description="REST status (host:port)")
    rest_mode: Literal["tls", "local", "off"] = Field(
        "tls", description="tls: mutual TLS; local: read-only plain HTTP on 127.0.0.1"
    )
    run_id: str = "mobius"
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    insecure: bool = False
    out_dir: Path = Path("runs/coordinator")
    strategy: str = "fedavg"
    strategy_options: dict[str, float] = Field(default_factory=dict)
    checkpoint_every: int = Field(0, ge=0, description="rounds between checkpoints (0: end only)")
    heartbeat_interval: float = Field(1.0, gt=0)
    heartbeat_timeout: float = Field(10.0, gt=0)
    registration_timeout: float = Field(600.0, gt=0)
    round_timeout: float = Field(3600.0, gt=0)
    resume: bool | Literal["auto"] = Field(
        False, description="continue from the newest complete manifest; auto: if there is one"
    )
    rejoin_timeout: float = Field(
        300.0, gt=0, description="seconds an incident waits for the lost worker to come back"
    )
    max_incidents: int = Field(
        10, ge=0, description="incidents the run recovers from before it fails"
    )
    restore_timeout: float = Field(
        120.0, gt=0, description="seconds every worker has to load the rollback state"
    )
    keep_checkpoints: int = Field(0, ge=0, description="complete manifests to keep (0: all)")
    barrier_snapshots: bool = Field(
        True,
        description="workers also write their state at every barrier to disk, in the "
        "background, so a crashed worker redoes at most the round in flight",
    )
    state_copy: Literal["coordinator", "off"] = Field(
        "coordinator",
        description="coordinator: workers also send their checkpoint to the coordinator, so a "
        "host replaced without its disk can rejoin; off: they keep it to themselves",
    )
    linger: float = Field(
        0.0, description="seconds to keep serving status after the run ends (-1: until interrupted)"
    )
    train: TrainConfig = Field(default_factory=TrainConfig)

    @model_validator(mode="after")
    def _check(self) -> CoordinatorConfig:
        if self.insecure:
            raise ValueError(
                "the coordinator has no insecure mode: it knows workers by their certificate "
                "identity (--insecure exists for static rings of mobius-worker only)"
            )
        if None in (self.ca, self.cert, self.key):
            raise ValueError("ca, cert and key are required")
        if self.train.sync_every < 1:
            raise ValueError("train.sync_every must be ≥ 1: each Flower round is one barrier")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must exceed heartbeat_interval")
        return self

    def tls(self) -> NodeTLS | None:
        return None if self.insecure else NodeTLS(self.ca, self.cert, self.key)  # type: ignore[arg-type]


def load_coordinator_config(
    path: Path | None,
    flags: dict[str, Any],
    train_flags: dict[str, Any],
    environ: dict[str, str] | None = None,
) -> CoordinatorConfig:
    """File, then ``MOBIUS_*`` environment, then flags (later wins)."""
    environ = dict(os.environ if environ is None else environ)
    top, train = layered_settings(path, "coordinator", ENV_KEYS, flags, train_flags, environ)
    try:
        return CoordinatorConfig.model_validate({**top, "train": train})
    except ValidationError as exc:
        problem = describe_validation_error(exc)
        raise ConfigError(f"invalid coordinator configuration: {problem}") from exc
