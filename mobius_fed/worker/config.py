"""The worker daemon's configuration: TOML file, MOBIUS_* environment, then flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mobius_fed.config import (  # noqa: F401 - TRAIN_ENV_KEYS: the worker's training vars
    TRAIN_ENV_KEYS,
    ConfigError,
    TrainConfig,
    describe_validation_error,
    layered_settings,
)
from mobius_fed.transport.tls import NodeTLS

# Environment variables the worker reads (name without the prefix → config key).
ENV_KEYS = {
    "RANK": "rank",
    "PEERS": "peers",
    "LISTEN": "listen",
    "DATA_DIR": "data_dir",
    "OUT_DIR": "out_dir",
    "RUN_ID": "run_id",
    "CA": "ca",
    "CERT": "cert",
    "KEY": "key",
    "INSECURE": "insecure",
    "PEER_TIMEOUT": "peer_timeout",
    "THREADS": "threads",
    "COORDINATOR": "coordinator",
    "ADVERTISE": "advertise",
    "CAPTURE_FRAMES": "capture_frames",
    "LINK_GRACE": "link_grace",
}


class WorkerConfig(BaseModel):
    """One ring worker: its rank, where the ring is, its data and its identity."""

    model_config = ConfigDict(extra="forbid")

    rank: int | None = Field(None, ge=0, description="static ring only; else from the cert")
    peers: list[str] = Field(
        default_factory=list, description="static ring: host:port of every worker in ring order"
    )
    coordinator: str | None = Field(None, description="host:port of mobius-coordinator")
    listen: str | None = Field(None, description="ring bind address")
    advertise: str | None = Field(None, description="ring address peers dial (coordinated)")
    data_dir: Path
    out_dir: Path = Path("runs/worker")
    run_id: str = "mobius"
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    insecure: bool = False
    peer_timeout: float = Field(120.0, gt=0)
    link_grace: float = Field(
        60.0, ge=0, description="seconds a dropped ring edge may take to reconnect"
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    capture_frames: Path | None = Field(None, description="audit: append every sent frame here")
    train: TrainConfig = Field(default_factory=TrainConfig)
    verify_train: bool = Field(
        False,
        description="coordinated: refuse a run whose config differs from [train] "
        "(set automatically when train settings are given)",
    )

    @model_validator(mode="after")
    def _check(self) -> WorkerConfig:
        if self.coordinator is None:
            if self.rank is None or not self.peers:
                raise ValueError("give --coordinator, or a static ring with --rank and --peers")
            if len(self.peers) != self.train.workers:
                raise ValueError(
                    f"peers lists {len(self.peers)} addresses but train.workers is "
                    f"{self.train.workers}"
                )
            if self.rank >= self.train.workers:
                raise ValueError(f"rank {self.rank} out of range for P={self.train.workers}")
        tls = (self.ca, self.cert, self.key)
        if not self.insecure and None in tls:
            raise ValueError("ca, cert and key are required (or --insecure for local debugging)")
        return self

    @property
    def listen_address(self) -> str:
        if self.listen:
            return self.listen
        if self.rank is not None and self.peers:
            return f"0.0.0.0:{self.peers[self.rank].rsplit(':', 1)[1]}"
        return "0.0.0.0:7000"

    @property
    def advertise_address(self) -> str:
        if self.advertise:
            return self.advertise
        host, port = self.listen_address.rsplit(":", 1)
        return f"{'127.0.0.1' if host in ('0.0.0.0', '[::]', '') else host}:{port}"

    @property
    def successor(self) -> str:
        return self.peers[(self.rank + 1) % len(self.peers)]  # type: ignore[operator]

    def tls(self) -> NodeTLS | None:
        if self.insecure:
            return None
        return NodeTLS(ca=self.ca, cert=self.cert, key=self.key)  # type: ignore[arg-type]


def load_worker_config(
    path: Path | None,
    flags: dict[str, Any],
    train_flags: dict[str, Any],
    environ: dict[str, str] | None = None,
) -> WorkerConfig:
    """File, then ``MOBIUS_*`` environment, then flags (later wins)."""
    environ = dict(os.environ if environ is None else environ)
    top, train = layered_settings(path, "worker", ENV_KEYS, flags, train_flags, environ)
    if isinstance(top.get("peers"), str):  # MOBIUS_PEERS=host:port,host:port
        top["peers"] = [p.strip() for p in top["peers"].split(",") if p.strip()]
    top.setdefault("verify_train", bool(train))
    try:
        return WorkerConfig.model_validate({**top, "train": train})
    except ValidationError as exc:
        raise ConfigError(
            f"invalid worker configuration: {describe_validation_error(exc)}"
        ) from exc
