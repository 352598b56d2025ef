"""The coordinator's configuration: TOML ``[coordinator]`` + ``[train]``, MOBIUS_* env, flags."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mobius_fed.config import ENV_PREFIX, ConfigError, TrainConfig
from mobius_fed.settings import layered_config, settings_of
from mobius_fed.strategies import sync_strategy
from mobius_fed.transport.tls import NodeTLS


class CoordinatorConfig(BaseModel):
    """A run's coordinator: where it listens, who it trusts, how it aggregates."""

    model_config = ConfigDict(extra="forbid")

    listen: str = Field(
        "0.0.0.0:7300", description="gRPC bind address: control, status, grpc.health.v1 (mTLS)"
    )
    rest_listen: str = Field("0.0.0.0:7380", description="REST status bind address (host:port)")
    rest_mode: Literal["tls", "local", "off"] = Field(
        "tls", description="tls: mutual TLS; local: read-only plain HTTP on 127.0.0.1; off"
    )
    metrics_listen: str | None = Field(
        None,
        description="opt-in plain-HTTP listener (host:port) for /metrics and /healthz, for "
        "Prometheus scrapers and Kubernetes probes without a client certificate; unset: none",
    )
    run_id: str = Field("mobius", description="run name, carried in every ring frame")
    ca: Path | None = Field(None, description="CA certificate (the node bundle's ca.crt)")
    cert: Path | None = Field(None, description="this coordinator's certificate (tls.crt)")
    key: Path | None = Field(None, description="this coordinator's key (tls.key)")
    out_dir: Path = Field(
        Path("runs/coordinator"), description="checkpoint manifests, metrics and history"
    )
    strategy: str = Field(
        "fedavg", description="Flower strategy: fedavg, fedavgm, fedadam, fedyogi, ..."
    )
    strategy_options: dict[str, float] = Field(
        default_factory=dict,
        description="strategy keyword arguments, e.g. server_momentum=0.9",
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="optimizer steps between checkpoints, a multiple of train.sync_every "
        "(0: at the end only)",
    )
    standby_checkpoint_every: int = Field(
        5,
        ge=0,
        description="while a standby site waits: optimizer steps between checkpoints (each "
        "with every worker's copy to the coordinator) at most, rounded up to a multiple of "
        "train.sync_every, so a handover redoes at most that many steps; the newest two "
        "are kept when checkpoint_every is 0 (0: checkpoint_every alone)",
    )
    heartbeat_interval: float = Field(1.0, gt=0, description="seconds between worker heartbeats")
    heartbeat_timeout: float = Field(
        10.0, gt=0, description="seconds without a heartbeat before a worker counts as lost"
    )
    registration_timeout: float = Field(
        600.0, gt=0, description="seconds to wait for all P workers to register"
    )
    round_timeout: float = Field(3600.0, gt=0, description="seconds one round may take")
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
    evict_suspects: bool = Field(
        False,
        description="hand a suspect site's rank (bounds.suspect_after of its E/R updates "
        "clipped) to a waiting standby, as mobius-fed replace --force does; without a "
        "standby it stays and is reported",
    )
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
        0.0, description="seconds to keep serving status after the run ends (-1: until stopped)"
    )
    train: TrainConfig = Field(default_factory=TrainConfig)

    @model_validator(mode="after")
    def _check(self) -> CoordinatorConfig:
        missing = [n for n in ("ca", "cert", "key") if getattr(self, n) is None]
        if missing:
            flags = ", ".join(f"--{n} (MOBIUS_{n.upper()})" for n in missing)
            raise ValueError(
                f"{flags} required: the coordinator knows workers by their certificate "
                "identity (it has no plaintext mode)"
            )
        if self.train.sync_every < 1:
            raise ValueError("train.sync_every must be ≥ 1: each Flower round is one barrier")
        sync_strategy(self.strategy, self.strategy_options, self.train)  # --sync-outer agrees
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must exceed heartbeat_interval")
        self.checkpoint_round_interval()
        return self

    def checkpoint_round_interval(self, train: TrainConfig | None = None) -> int:
        """``checkpoint_every`` (steps) as Flower rounds: steps / sync_every (0: end only)."""
        train = self.train if train is None else train
        every, sync = self.checkpoint_every, max(1, train.sync_every)
        if every % sync:
            raise ValueError(
                f"checkpoint_every={every} steps is not a multiple of train.sync_every={sync}: "
                "checkpoints are taken at barriers (every sync_every steps)"
            )
        return every // sync

    def standby_round_interval(self, train: TrainConfig | None = None) -> int:
        """``standby_checkpoint_every`` (steps) as Flower rounds, rounded up (0: off)."""
        train = self.train if train is None else train
        return -(-self.standby_checkpoint_every // max(1, train.sync_every))

    def tls(self) -> NodeTLS:
        if self.ca is None or self.cert is None or self.key is None:  # the validator's case
            raise ValueError("the coordinator needs ca, cert and key")
        return NodeTLS(self.ca, self.cert, self.key)


SETTINGS = settings_of(CoordinatorConfig, flatten=("train",))
# MOBIUS_<NAME> → setting key (coordinator's own and, flattened, the [train] ones).
ENV_KEYS = {s.env.removeprefix(ENV_PREFIX): s.key for s in SETTINGS if s.path[0] != "train"}
TRAIN_ENV_KEYS = {s.env.removeprefix(ENV_PREFIX): s.key for s in SETTINGS if s.path[0] == "train"}


def load_coordinator_config(
    path: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    train_flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> CoordinatorConfig:
    """File, then ``MOBIUS_*`` environment, then flags (later wins). ``flags`` and
    ``train_flags`` map setting dests (``listen``, ``steps``, ``privacy__label_noise``) to
    values; None means not given."""
    return layered_config(
        CoordinatorConfig,
        section="coordinator",
        path=path,
        environ=dict(os.environ if environ is None else environ),
        flags={**(train_flags or {}), **(flags or {})},
        what="coordinator configuration",
    )


__all__ = ["ENV_KEYS", "TRAIN_ENV_KEYS", "ConfigError", "CoordinatorConfig"]
