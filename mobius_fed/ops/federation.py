"""A whole federation on this machine: a coordinator and P workers as child processes on
loopback, each with its own certificate bundle and site data, supervised (restarts up to
``max_restarts``, the coordinator with ``--resume auto``; signals forwarded, SIGKILL after
a grace): docs/deployment.md "Stopping, restarting and healing". ``mobius-fed up`` and the
multi-process tests drive it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import grpc

from mobius_fed import warmstart
from mobius_fed.coordinator.endpoints import write_endpoints
from mobius_fed.coordinator.rest_client import get_status, rest_get
from mobius_fed.machines import ENDED_PHASES as ENDED
from mobius_fed.machines import Phase
from mobius_fed.ops import OpsError
from mobius_fed.ops.local import default_threads, prepared_dir, site_dirs, split_sites
from mobius_fed.ops.ports import free_ports
from mobius_fed.ops.supervisor import Child, ProcessTable
from mobius_fed.settings import ENV_PREFIX
from mobius_fed.transport.tls import NodeTLS, node_name_of
from mobius_fed.warmstart import ChildProcess, WarmProcess

if TYPE_CHECKING:  # torch loads only when a federation is made, not at import
    from mobius_fed.config import TrainConfig


def _guarded(cmd: list[str]) -> list[str]:
    """``cmd`` started through :mod:`mobius_fed.cli.parent_guard`: it dies with this
    process, even when this process is SIGKILLed, and the fork runs no Python code."""
    return [sys.executable, "-m", "mobius_fed.cli.parent_guard", str(os.getpid()), *cmd]


def flag_args(flags: dict[str, Any]) -> list[str]:
    """``{"--flag": value}`` as a command line's words (in order; None leaves a flag out)."""
    return [w for flag, value in flags.items() if value is not None for w in (flag, str(value))]


def toml_table(name: str, doc: dict[str, Any]) -> list[str]:
    """``doc`` as TOML lines under ``[name]``; nested dicts become sub-tables, None is left
    out (TOML has no null). Strings and numbers are written as JSON, which TOML reads."""
    lines = [f"[{name}]"]
    subs = []
    for key, value in doc.items():
        if isinstance(value, dict):
            subs.append((key, value))
        elif value is not None:
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in subs:
        lines += toml_table(f"{name}.{key}", value)
    return lines


# A worker's FIN exchange after its last step: up to 30 s for the other workers' FINs and
# 10 s for their acknowledgement (worker/coordinated.py, worker/link.py), and some slack.
FINISH_S = 45.0


@dataclass
class LocalFederation:
    """A coordinator and P workers as child processes of this one, all on 127.0.0.1."""

    root: Path
    train: TrainConfig
    strategy: str = "fedavg"
    strategy_options: dict[str, float] = field(default_factory=dict)
    checkpoint_every: int = 0
    heartbeat_timeout: float = 10.0
    resume: bool | str = False  # True, False or "auto"
    threads: int | None = None
    rejoin_timeout: float | None = None
    max_incidents: int | None = None
    keep_checkpoints: int | None = None
    # Restarts per child before giving up (0: no supervision; wait() fails when the
    # coordinator exits, and a dead worker stays dead).
    max_restarts: int = 0
    data: list[Path] | None = None  # --data: a site-<i>/ directory, or text files to split
    rest_mode: str = "tls"  # the coordinator's REST: tls (operator cert) or local (plain)
    metrics: bool = True  # the plain /metrics + /healthz listener, when the coordinator has it
    on_event: Callable[[str], None] | None = None
    # standby sites (docs/recovery.md "Handover to a standby"): standby-<k> with site-<P+k>
    standbys: int = 0

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.certs = self.root / "certs"
        self.sites = self.root / "sites"
        self.logs = self.root / "logs"
        ports = free_ports(self.train.workers + self.standbys + 3)
        self.coord_port, self.rest_port, self.metrics_port, *self.worker_ports = ports
        self._env: dict[str, str] = {}
        self._table = ProcessTable(self.logs, self._popen, self._policy)
        self._last: dict[str, Any] | None = None

    @property
    def procs(self) -> dict[str, ChildProcess]:
        """Every child's current process."""
        return {n: c.popen for n, c in self._table.children.items() if c.popen is not None}

    @property
    def restarts(self) -> dict[str, int]:
        """How often each restarted child was restarted."""
        return {n: c.restarts for n, c in self._table.children.items() if c.restarts}

    @property
    def _settled(self) -> set[str]:
        """Children that exited and will not be restarted."""
        return {n for n, c in self._table.children.items() if c.final}

    @property
    def _cmds(self) -> dict[str, list[str]]:
        return {n: c.argv for n, c in self._table.children.items()}

    # ---------------------------------------------------------------- setup
    def bundle(self, node: str) -> NodeTLS:
        """``certs/nodes/<node>/{ca.crt,tls.crt,tls.key}``: the only files ``node`` gets."""
        d = self.certs / "nodes" / node
        return NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key")

    def prepare(self) -> LocalFederation:
        from mobius_fed.transport.certs import init_certs

        P, S = self.train.workers, self.standbys  # all R·P sites, then the standbys'
        nodes = ["coordinator", *(f"worker-{i}" for i in range(P))]
        nodes += [f"standby-{k}" for k in range(S)]
        every = [self.operator_tls(), *(self.bundle(n) for n in nodes)]
        if not all(p.is_file() for tls in every for p in (tls.ca, tls.cert, tls.key)):
            init_certs(self.certs, P, overwrite=True, standbys=S)  # none yet, or others: new
        given = prepared_dir(self.data)
        if given is not None:
            site_dirs(given, P + S)  # OpsError naming a missing site-<i>
            self.sites = given.resolve()
        elif (  # text files (OpsError naming missing ones), or the corpus unless split for P
            self.data
            or not all((self.sites / f"site-{i}").is_dir() for i in range(P + S))
            or (self.sites / f"site-{P + S}").exists()
        ):
            split_sites(self.data, self.sites, P + S, self.train.encoding)
        self.logs.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def coordinator_out(self) -> Path:
        return self.root / "coordinator"

    def worker_out(self, i: int) -> Path:
        return self.root / f"worker-{i}"

    def write_train_toml(self) -> Path:
        """The run's [train] table, handed to the coordinator with --config."""
        lines = toml_table("train", self.train.model_dump(mode="json"))
        path = self.root / "train.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def coordinator_cmd(self, resume: bool | str | None = None) -> list[str]:
        """The coordinator's command line; ``resume`` overrides the federation's setting."""
        tls = self.bundle("coordinator")
        resume = self.resume if resume is None else resume
        flags = {
            "--listen": f"127.0.0.1:{self.coord_port}",
            "--rest-mode": self.rest_mode,
            "--rest-listen": f"127.0.0.1:{self.rest_port}",
            "--ca": tls.ca,
            "--cert": tls.cert,
            "--key": tls.key,
            "--out-dir": self.coordinator_out,
            "--strategy": self.strategy,
            "--checkpoint-every": self.checkpoint_every,
            "--linger": "-1",
            "--heartbeat-timeout": self.heartbeat_timeout,
            "--heartbeat-interval": min(1.0, self.heartbeat_timeout / 4),
            "--run-id": "local-up",
            "--config": self.write_train_toml(),
            "--tracker": "none",  # up itself tracks (one tracker across coordinator restarts)
            "--metrics-listen": f"127.0.0.1:{self.metrics_port}" if self.metrics_url else None,
            "--rejoin-timeout": self.rejoin_timeout,
            "--max-incidents": self.max_incidents,
            "--keep-checkpoints": self.keep_checkpoints,
        }
        cmd = [sys.executable, "-m", "mobius_fed.cli.coordinator", *flag_args(flags)]
        for k, v in self.strategy_options.items():
            cmd += ["--strategy-option", f"{k}={json.dumps(v)}"]
        if resume == "auto":
            cmd += ["--resume", "auto"]
        elif resume:
            cmd += ["--resume"]
        return cmd

    def standby_out(self, k: int) -> Path:
        return self.root / f"standby-{k}"

    def worker_cmd(self, i: int) -> list[str]:
        """Worker i's command line; ``i`` ≥ P: standby-<i − P> (its own site-<i>)."""
        P = self.train.workers
        node = f"worker-{i}" if i < P else f"standby-{i - P}"
        tls = self.bundle(node)
        flags = {
            "--coordinator": f"127.0.0.1:{self.coord_port}",
            "--listen": f"127.0.0.1:{self.worker_ports[i]}",
            "--data-dir": self.sites / f"site-{i}",
            "--out-dir": self.worker_out(i) if i < P else self.standby_out(i - P),
            "--ca": tls.ca,
            "--cert": tls.cert,
            "--key": tls.key,
            "--threads": self.threads or default_threads(self.train.workers),
        }
        standby = ["--standby"] if i >= P else []
        return [sys.executable, "-m", "mobius_fed.cli.worker", *flag_args(flags), *standby]

    def start(self, workers: bool = True) -> LocalFederation:
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self._spawn("coordinator", self.coordinator_cmd())
        P = self.train.workers
        for i in range(P) if workers else ():
            self._spawn(f"worker-{i}", self.worker_cmd(i))
        for k in range(self.standbys) if workers else ():
            self._spawn(f"standby-{k}", self.worker_cmd(P + k))
        return self

    @property
    def rest_url(self) -> str:
        scheme = "http" if self.rest_mode == "local" else "https"
        return f"{scheme}://127.0.0.1:{self.rest_port}"

    @property
    def metrics_url(self) -> str | None:
        """The plain metrics listener's /metrics (None: off)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics else None

    def rest(self, path: str) -> Any:
        """GET a REST endpoint of the coordinator as the operator (JSON or text)."""
        tls = None if self.rest_mode == "local" else self.operator_tls()
        return rest_get(self.rest_url, path, tls)

    def endpoints(self, state: str = "running") -> dict[str, Any]:
        """What ``endpoints.json`` says about this federation (see coordinator/endpoints);
        ``state`` is ``up``'s own: starting, running or exited (operations §3)."""
        c = self.operator_tls()
        return {
            "run_id": "local-up",
            "state": state,
            "pid": os.getpid(),
            "grpc": f"127.0.0.1:{self.coord_port}",
            "rest": self.rest_url,
            "rest_mode": self.rest_mode,
            "server_name": "coordinator",
            "metrics": self.metrics_url,
            "dashboard": self.rest_url + "/",
            "certs": {
                "dir": str(self.certs.resolve()),
                "ca": str(c.ca.resolve()),
                "cert": str(c.cert.resolve()),
                "key": str(c.key.resolve()),
            },
            "out_dir": str(self.coordinator_out.resolve()),
            "logs": str(self.logs.resolve()),
        }

    def write_endpoints(self, state: str = "running") -> Path:
        return write_endpoints(self.root, self.endpoints(state))

    def _spawn(self, name: str, cmd: list[str]) -> None:
        self._table.start(name, cmd)

    def _env_of(self, child: Child) -> dict[str, str]:
        """A site's environment: the ``MOBIUS_*`` training variables and ``MOBIUS_CONFIG``
        (already in train.toml) left out. A site takes the coordinator's config; given some
        training settings, it would check that config against those alone, and be refused."""
        if child.name == "coordinator":
            return self._env
        from mobius_fed.worker.config import TRAIN_ENV_KEYS  # loads torch: not at import

        drop = {ENV_PREFIX + k for k in TRAIN_ENV_KEYS} | {ENV_PREFIX + "CONFIG"}
        return {k: v for k, v in self._env.items() if k not in drop}

    def _popen(self, child: Child, log: BinaryIO) -> ChildProcess:
        env = self._env_of(child)
        if warmstart.enabled(env) and warmstart.can_start(child.argv, env):
            # forked from the fork server, which exits with this process; the child dies
            # with the fork server as a guarded one dies with this process
            return WarmProcess(child.argv, log.name, env, start_new_session=True)
        return subprocess.Popen(
            _guarded(child.argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env or None,
            start_new_session=True,  # a terminal's Ctrl-C reaches only up, which forwards
        )

    # ---------------------------------------------------------- supervision
    def _say(self, message: str) -> None:
        (self.on_event or (lambda m: print(m, file=sys.stderr, flush=True)))(message)

    def supervise(self) -> None:
        """Restart children that died before the run ended (see the module docstring).

        A worker that exits 0 has finished and stays stopped. Nothing is restarted once the
        coordinator's status says the run ended. Raises OpsError when the coordinator is
        gone for good."""
        self._table.check()

    def _policy(self, child: Child) -> float | None:
        """When ``child``, just exited, comes back (see :meth:`supervise`)."""
        name, rc, n = child.name, child.returncode, child.restarts
        if (rc == 0 and name != "coordinator") or self._phase_now() in ENDED:
            return None
        if (by := self._replaced_by(name)) is not None:  # refused by the coordinator for good
            self._say(f"{name} exited with {rc}; not restarting: {by} holds its rank now")
            return None
        if n >= self.max_restarts:
            self._say(f"{name} exited with {rc}; not restarting ({n}/{self.max_restarts} used)")
            if name == "coordinator":
                raise self._coordinator_gone(f"({rc}) after {n} restarts")
            return None
        self._say(f"{name} exited with {rc}; restarting ({n + 1}/{self.max_restarts})")
        if name == "coordinator":  # back from its newest complete manifest, or afresh
            child.argv = self.coordinator_cmd(resume="auto")
        return 0.0 if n == 0 else min(0.5 * 2**n, 5.0)  # back off a crash loop

    def _replaced_by(self, name: str) -> str | None:
        """The standby that replaced site ``name`` in a handover (its identity is refused
        from then on: docs/recovery.md), as the latest status says; None if not replaced."""
        for h in (self._last or {}).get("handovers") or ():
            with contextlib.suppress(ValueError, TypeError):  # not an identity: not this one
                if node_name_of(h["replaced"]) == name:
                    return node_name_of(h["standby"])
        return None

    def _phase_now(self) -> str | None:
        """The run's phase from a fresh status (the last one seen if the coordinator is down)."""
        coord = self.procs.get("coordinator")
        doc = self.status(timeout=1.0) if coord is not None and coord.poll() is None else None
        if doc is not None:
            self._last = doc
        return (self._last or {}).get("phase")

    # --------------------------------------------------------------- status
    def operator_tls(self) -> NodeTLS:
        c = self.certs
        return NodeTLS(c / "ca.crt", c / "operator.crt", c / "operator.key")

    def status(self, timeout: float = 3.0) -> dict[str, Any] | None:
        """The coordinator's status over gRPC with the operator's certificate."""
        addr = f"127.0.0.1:{self.coord_port}"
        try:
            return json.loads(get_status(addr, self.operator_tls(), timeout))
        except grpc.RpcError:
            return None

    def wait(self, on_status=None, timeout: float = 3600) -> dict[str, Any]:
        """Poll until the run is done or failed, or the coordinator died (and, with
        ``max_restarts``, could not be restarted); return the last status."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            doc = self.status()
            if doc is not None:
                last = self._last = doc
                if on_status:
                    on_status(doc)
                if doc["phase"] in ENDED:
                    return doc
            coord = self.procs["coordinator"]
            if self.max_restarts:
                self.supervise()
                if "coordinator" in self._settled and self._last:  # gone after the end
                    return self._last
            elif coord.poll() is not None:
                raise self._coordinator_gone(f"({coord.returncode})")
            time.sleep(0.5)
        raise OpsError(f"run did not finish within {timeout:.0f}s (last status: {last})")

    def tail(self, name: str, n: int = 15) -> str:
        lines = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def _coordinator_gone(self, how: str) -> OpsError:
        log = self.logs / "coordinator.log"
        return OpsError(f"the coordinator exited {how}; see {log}:\n{self.tail('coordinator')}")

    def stop(self, grace: float = 10.0, sig: int = signal.SIGTERM) -> dict[str, int]:
        """Send ``sig`` to every process this federation started, wait up to ``grace``
        seconds, then SIGKILL what is left; return every child's exit status.

        After a finished run the workers first get up to :data:`FINISH_S` to exit by
        themselves: the coordinator counts the run done at the last step's replies, and
        the workers then still exchange their FINs around the ring, which may wait for an
        edge that is re-dialling (a signal there would end a finished worker with 143)."""
        if (self._last or {}).get("phase") == Phase.DONE:
            workers = [n for n in self._table.children if n != "coordinator"]
            if late := self._table.await_exits(workers, FINISH_S):
                self._say(f"{', '.join(late)} still running {FINISH_S:.0f}s after the run "
                          "ended; stopping")  # fmt: skip
        return self._table.stop(grace, sig)
