"""The worker daemon's configuration: TOML file, MOBIUS_* environment, then flags."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mobius_fed.config import ENV_PREFIX, ConfigError, TrainConfig
from mobius_fed.relay.edges import TunnelKeys
from mobius_fed.relay.keys import read_relay_key
from mobius_fed.relay.plan import is_host_port
from mobius_fed.settings import layered_config, read_toml, settings_of
from mobius_fed.transport.link_tuning import LinkConfig, LinkTuningError, refuse_renamed_variables
from mobius_fed.transport.tls import NodeTLS


def dialable(bind: str, wildcard: str = "127.0.0.1", port: int | None = None) -> str:
    """Bind address ``bind`` (host:port) as a peer dials it: a wildcard host (0.0.0.0, [::],
    none) becomes ``wildcard``; ``port``, when given, is the one actually bound."""
    host, bound = bind.rsplit(":", 1)
    host = wildcard if host in ("0.0.0.0", "[::]", "") else host
    return f"{host}:{bound if port is None else port}"


class WorkerConfig(BaseModel):
    """One ring worker: its rank, where the ring is, its data and its identity."""

    model_config = ConfigDict(extra="forbid")

    rank: int | None = Field(
        None, ge=0, description="static ring only: this worker's rank (else: from its cert)"
    )
    peers: list[str] = Field(
        default_factory=list, description="static ring: host:port of every worker in ring order"
    )
    coordinator: str | None = Field(None, description="host:port of mobius-coordinator")
    standby: bool = Field(
        False,
        description="coordinated: wait in the coordinator's standby pool until it hands this "
        "site a lost worker's rank (a standby-<n> certificate; docs/recovery.md)",
    )
    listen: str | None = Field(
        None, description="ring bind address (unset: 0.0.0.0 and the port in peers, or 7000)"
    )
    advertise: str | None = Field(
        None, description="the ring address the predecessor dials (unset: the listen address)"
    )
    reachable: Literal["yes", "no"] = Field(
        "yes",
        description="whether the ring predecessor can dial this worker's listen address; "
        "no: this site only dials out (docs/reachability.md)",
    )
    relay: str | None = Field(
        None, description="host:port of a mobius-relay, for ring edges neither end can accept"
    )
    relay_key: Path | None = Field(
        None, description="file holding the relay's shared key (the relay's --key-file)"
    )
    tunnel_listen: str | None = Field(
        None,
        description="bind address of the rendezvous port an outbound-only successor opens "
        "its tunnels to (unset: none)",
    )
    tunnel_advertise: str | None = Field(
        None, description="the rendezvous address the successor dials (unset: tunnel listen)"
    )
    data_dir: Path = Field(description="this worker's site: train_*.bin, val_*.bin, meta.json")
    out_dir: Path = Field(Path("runs/worker"), description="worker checkpoints and metrics")
    run_id: str = Field(
        "mobius", description="static ring only (a coordinated worker takes the coordinator's)"
    )
    ca: Path | None = Field(None, description="CA certificate (the node bundle's ca.crt)")
    cert: Path | None = Field(
        None, description="this worker's certificate (tls.crt); it decides the rank"
    )
    key: Path | None = Field(None, description="this worker's key (tls.key)")
    insecure: bool = Field(
        False,
        description="static ring only: plaintext gRPC, no authentication (local debugging)",
    )
    peer_timeout: float = Field(
        120.0, gt=0, description="seconds to wait for the coordinator and ring peers"
    )
    link_grace: float = Field(
        60.0, ge=0, description="seconds a dropped ring edge may take to reconnect"
    )
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (unset: all cores of this host)"
    )
    capture_frames: Path | None = Field(None, description="audit: append every sent frame here")
    emulate_slowdown: float = Field(
        1.0,
        ge=1.0,
        description="benchmarks: behave as a site this many times slower than one core of "
        "this host (each training application of its group lasts x times the CPU time it "
        "used; the worker sleeps the rest); 1: off",
    )
    link: LinkConfig = Field(default_factory=LinkConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    verify_train: bool = Field(
        False,
        description="coordinated: refuse a run whose config differs from [train] "
        "(set automatically when train settings are given)",
    )

    @model_validator(mode="after")
    def _check(self) -> WorkerConfig:
        if self.coordinator is None:
            if self.train.rings > 1:
                raise ValueError(
                    f"rings={self.train.rings} needs a coordinator (--coordinator): the "
                    "ring syncs are its Flower rounds"
                )
            if self.rank is None or not self.peers:
                raise ValueError("give --coordinator, or a static ring with --rank and --peers")
            if len(self.peers) != self.train.workers:
                raise ValueError(
                    f"peers lists {len(self.peers)} addresses but train.workers is "
                    f"{self.train.workers}"
                )
            if self.rank >= self.train.workers:
                raise ValueError(f"rank {self.rank} out of range for P={self.train.workers}")
        if self.standby and self.coordinator is None:
            raise ValueError("standby needs --coordinator: the coordinator hands it a rank")
        if self.insecure and self.coordinator is not None:
            raise ValueError(
                "insecure is for static rings only: the coordinator knows workers by their "
                "certificate identity"
            )
        for name in ("relay", "tunnel_listen", "tunnel_advertise"):
            value = getattr(self, name)
            if value is not None and (not is_host_port(value) or ";" in value):
                raise ValueError(f"{name} {value!r} is not host:port")
        if self.tunnel_advertise and not self.tunnel_listen:
            raise ValueError("tunnel_advertise needs tunnel_listen (where to bind it)")
        if self.relay and self.relay_key is None:
            raise ValueError("relay needs relay_key (the file holding the relay's key)")
        if not self.insecure and None in (self.ca, self.cert, self.key):
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
        return self.advertise or dialable(self.listen_address)

    @property
    def rendezvous_address(self) -> str:
        """Where an outbound-only successor opens its tunnels ('' when none)."""
        if self.tunnel_advertise or not self.tunnel_listen:
            return self.tunnel_advertise or ""
        return dialable(self.tunnel_listen, self.advertise_address.rsplit(":", 1)[0])

    def tunnel_keys(self, run_key: bytes = b"") -> TunnelKeys:
        """Keys for tunnelled edges: the run's (from the coordinator; a static ring uses the
        relay key) and the relay's."""
        relay = read_relay_key(self.relay_key) if self.relay_key else b""
        return TunnelKeys(run=run_key or relay, relay=relay)

    @property
    def successor(self) -> str:
        if self.rank is None:  # a coordinated worker learns its ring from the coordinator
            raise ValueError("a static ring's successor needs --rank and --peers")
        return self.peers[(self.rank + 1) % len(self.peers)]

    @property
    def coordinator_address(self) -> str:
        if self.coordinator is None:
            raise ValueError("a coordinated worker needs --coordinator")
        return self.coordinator

    def tls(self) -> NodeTLS | None:
        return None if self.insecure else self.node_tls()

    def node_tls(self) -> NodeTLS:
        """This worker's bundle (required unless insecure: the validator says so first)."""
        if self.ca is None or self.cert is None or self.key is None:
            raise ValueError("ca, cert and key are required (or --insecure for local debugging)")
        return NodeTLS(ca=self.ca, cert=self.cert, key=self.key)


SETTINGS = settings_of(WorkerConfig, flatten=("train",))
# MOBIUS_<NAME> → setting key (the worker's own and, flattened, the [train] ones).
ENV_KEYS = {s.env.removeprefix(ENV_PREFIX): s.key for s in SETTINGS if s.path[0] != "train"}
TRAIN_ENV_KEYS = {s.env.removeprefix(ENV_PREFIX): s.key for s in SETTINGS if s.path[0] == "train"}


def load_worker_config(
    path: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    train_flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> WorkerConfig:
    """File, then ``MOBIUS_*`` environment, then flags (later wins). Training settings
    given anywhere make a coordinated worker check the coordinator's config against them."""
    environ = dict(os.environ if environ is None else environ)
    try:
        refuse_renamed_variables(environ)
    except LinkTuningError as exc:
        raise ConfigError(f"invalid worker configuration: {exc}") from None
    flags = {**(train_flags or {}), **(flags or {})}
    train_given = any(v is not None for k, v in flags.items() if k in TRAIN_DESTS) or any(
        ENV_PREFIX + n in environ for n in TRAIN_ENV_KEYS
    )
    if path is not None and not train_given:
        train_given = bool(read_toml(path).get("train"))
    return layered_config(
        WorkerConfig,
        section="worker",
        path=path,
        environ=environ,
        flags=flags,
        extra={"verify_train": True} if train_given else None,
        what="worker configuration",
    )


TRAIN_DESTS = {s.dest for s in SETTINGS if s.path[0] == "train"}
__all__ = ["ENV_KEYS", "TRAIN_ENV_KEYS", "ConfigError", "WorkerConfig"]
