"""``mobius-fed up``: a whole federation on this machine, as separate processes on loopback.

Makes certificates, splits the embedded corpus into per-site data, starts
``mobius-coordinator`` and P ``mobius-worker`` processes (each with its own bundle), shows
progress and prints the final losses and checkpoint. It supervises its children (restarts
up to ``max_restarts``, the coordinator with ``--resume auto``; signals forwarded, SIGKILL
after 5 s): docs/deployment.md "Stopping, restarting and healing".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mobius_fed.cli import common
from mobius_fed.cli.common import (
    CliError,
    GracefulStop,
    Terminated,
    add_resume_flag,
    console,
    default_threads,
    prepared_dir,
    site_dirs,
    split_sites,
    threads_from,
)
from mobius_fed.coordinator.endpoints import write_endpoints
from mobius_fed.machines import ENDED_PHASES as ENDED
from mobius_fed.machines import IncidentState
from mobius_fed.tracking import add_tracker_flag
from mobius_fed.transport.tls import NodeTLS

if TYPE_CHECKING:  # torch loads only when up runs, not when `mobius-fed` builds its parser
    from mobius_fed.config import TrainConfig


def _guarded(cmd: list[str]) -> list[str]:
    """``cmd`` started through :mod:`mobius_fed.cli.parent_guard`: it dies with this
    process, even when this process is SIGKILLed, and the fork runs no Python code."""
    return [sys.executable, "-m", "mobius_fed.cli.parent_guard", str(os.getpid()), *cmd]


def free_ports(n: int, lowest: int = 10_000) -> list[int]:
    """``n`` loopback ports free now, drawn below the kernel's ephemeral range.

    A port that ``bind(0)`` handed out and released is an ephemeral port, which the kernel
    may give to any outgoing connection before the daemon meant to listen there binds it
    ("Address already in use"); ports below that range are never handed out that way."""
    try:
        top = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        top = 32_768  # Linux's default start of the range
    span = range(lowest, top) if top - lowest > 100 * n else range(1024, 65_536)  # no room
    ports: list[int] = []
    for port in random.SystemRandom().sample(span, min(len(span), 50 * n)):  # a few tries
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free loopback ports in {50 * n} tries in {span.start}..{span.stop}")


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
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.certs = self.root / "certs"
        self.sites = self.root / "sites"
        self.logs = self.root / "logs"
        ports = free_ports(self.train.P + 3)
        self.coord_port, self.rest_port, self.metrics_port, *self.worker_ports = ports
        self._cmds: dict[str, list[str]] = {}
        self._env: dict[str, str] = {}
        self._settled: set[str] = set()  # exited, and will not be restarted
        self._restart_at: dict[str, float] = {}
        self._last: dict[str, Any] | None = None

    # ---------------------------------------------------------------- setup
    def nodes(self) -> list[str]:
        return ["coordinator", *(f"worker-{i}" for i in range(self.train.P))]

    def bundle(self, node: str) -> NodeTLS:
        """``certs/nodes/<node>/{ca.crt,tls.crt,tls.key}``: the only files ``node`` gets."""
        d = self.certs / "nodes" / node
        return NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key")

    def _certs_complete(self) -> bool:
        every = [self.operator_tls(), *(self.bundle(n) for n in self.nodes())]
        return all(p.is_file() for tls in every for p in (tls.ca, tls.cert, tls.key))

    def prepare(self) -> LocalFederation:
        from mobius_fed.transport.certs import init_certs

        P = self.train.P
        if not self._certs_complete():  # none yet, or made for fewer workers: all new ones
            init_certs(self.certs, P, overwrite=True)
        given = prepared_dir(self.data)
        if given is not None:
            site_dirs(given, P)  # CliError naming a missing site-<i>
            self.sites = given.resolve()
        elif self.data:
            missing = [str(f) for f in self.data if not Path(f).exists()]
            if missing:
                raise CliError(f"--data: not found: {', '.join(missing)}")
            split_sites(self.data, self.sites, P, self.train.encoding)
        elif (
            not all((self.sites / f"site-{i}").is_dir() for i in range(P))
            or (self.sites / f"site-{P}").exists()
        ):
            split_sites(None, self.sites, P, self.train.encoding)
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

    def worker_cmd(self, i: int) -> list[str]:
        tls = self.bundle(f"worker-{i}")
        flags = {
            "--coordinator": f"127.0.0.1:{self.coord_port}",
            "--listen": f"127.0.0.1:{self.worker_ports[i]}",
            "--data-dir": self.sites / f"site-{i}",
            "--out-dir": self.worker_out(i),
            "--ca": tls.ca,
            "--cert": tls.cert,
            "--key": tls.key,
            "--threads": self.threads or default_threads(self.train.P),
        }
        return [sys.executable, "-m", "mobius_fed.cli.worker", *flag_args(flags)]

    def start(self, workers: bool = True) -> LocalFederation:
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self._spawn("coordinator", self.coordinator_cmd())
        for i in range(self.train.P) if workers else ():
            self._spawn(f"worker-{i}", self.worker_cmd(i))
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
        from mobius_fed.coordinator.rest_client import rest_get

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
        self._cmds[name] = cmd
        with open(self.logs / f"{name}.log", "a") as log:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(
                _guarded(cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env or None,
                start_new_session=True,  # a terminal's Ctrl-C reaches only up, which forwards
            )

    # ---------------------------------------------------------- supervision
    def _say(self, message: str) -> None:
        (self.on_event or (lambda m: console.print(m, highlight=False)))(message)

    def supervise(self) -> None:
        """Restart children that died before the run ended (see the module docstring).

        A worker that exits 0 has finished and stays stopped. Nothing is restarted once the
        coordinator's status says the run ended. Raises CliError when the coordinator is
        gone for good."""
        now = time.monotonic()
        for name, proc in list(self.procs.items()):
            rc = proc.poll()
            if rc is None or name in self._settled:
                continue
            if name in self._restart_at:
                if now >= self._restart_at[name]:
                    del self._restart_at[name]
                    self._restart(name)
                continue
            phase = self._phase_now()
            if (rc == 0 and name != "coordinator") or phase in ENDED:
                self._settled.add(name)
                continue
            n = self.restarts.get(name, 0)
            if n >= self.max_restarts:
                self._settled.add(name)
                self._say(f"{name} exited with {rc}; not restarting ({n}/{self.max_restarts} used)")
                if name == "coordinator":
                    raise self._coordinator_gone(f"({rc}) after {n} restarts")
                continue
            self.restarts[name] = n + 1
            self._say(f"{name} exited with {rc}; restarting ({n + 1}/{self.max_restarts})")
            if n == 0:
                self._restart(name)
            else:  # back off a crash loop
                self._restart_at[name] = now + min(0.5 * 2**n, 5.0)

    def _phase_now(self) -> str | None:
        """The run's phase from a fresh status (the last one seen if the coordinator is down)."""
        coord = self.procs.get("coordinator")
        doc = self.status(timeout=1.0) if coord is not None and coord.poll() is None else None
        if doc is not None:
            self._last = doc
        return (self._last or {}).get("phase")

    def _restart(self, name: str) -> None:
        # A coordinator comes back from its newest complete manifest, or starts afresh.
        cmd = self.coordinator_cmd(resume="auto") if name == "coordinator" else self._cmds[name]
        self._spawn(name, cmd)

    # --------------------------------------------------------------- status
    def operator_tls(self) -> NodeTLS:
        c = self.certs
        return NodeTLS(c / "ca.crt", c / "operator.crt", c / "operator.key")

    def status(self, timeout: float = 3.0) -> dict[str, Any] | None:
        """The coordinator's status over gRPC with the operator's certificate."""
        import grpc

        from mobius_fed.cli.status import get_status

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
        raise CliError(f"run did not finish within {timeout:.0f}s (last status: {last})")

    def tail(self, name: str, n: int = 15) -> str:
        lines = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def _coordinator_gone(self, how: str) -> CliError:
        log = self.logs / "coordinator.log"
        return CliError(f"the coordinator exited {how}; see {log}:\n{self.tail('coordinator')}")

    def stop(self, grace: float = 10.0, sig: int = signal.SIGTERM) -> dict[str, int]:
        """Send ``sig`` to every process this federation started, wait up to ``grace``
        seconds, then SIGKILL what is left; return every child's exit status."""
        self._restart_at.clear()
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return {name: p.returncode for name, p in self.procs.items()}


STOP_GRACE = 5.0  # seconds children get after a forwarded signal, before SIGKILL


def claim_out(out: Path, resume: bool | str | None, force: bool) -> None:
    """Refuse an ``--out`` that a live ``up`` runs in, or that holds an earlier run unless
    ``--resume`` (continue it) or ``--force`` (delete its outputs first): operations §3."""
    from mobius_fed.coordinator.endpoints import EndpointsError, read_endpoints
    from mobius_fed.coordinator.run_dir import clear_run, earlier_run

    with contextlib.suppress(EndpointsError):
        ep = read_endpoints(out)
        if ep.state != "exited" and ep.alive() and ep.pid != os.getpid():
            raise CliError(
                f"--out {out}: a `mobius-fed up` (pid {ep.pid}) is running there; stop it "
                f"first, or choose another --out (mobius-fed status --run {out})"
            )
    earlier = earlier_run(out)
    if earlier is None or resume:
        return
    if not force:
        raise CliError(
            f"--out {out} holds {earlier}. Continue it with `mobius-fed up --out {out} "
            f"--resume`, replace it with --force (deletes its checkpoints, metrics and logs), "
            "or choose another --out"
        )
    gone = clear_run(out)
    console.print(f"--force: deleted the earlier run's {', '.join(p.name for p in gone)}")


def cmd_up(args, train: TrainConfig) -> int:
    claim_out(Path(args.out), args.resume, getattr(args, "force", False))
    # The handler raises Terminated in this (main) thread; every child then gets the same
    # signal. The hard deadline is only a safety net beyond the children's grace.
    stop = GracefulStop("mobius-fed up", deadline=STOP_GRACE + 5).install()
    fed = LocalFederation(
        Path(args.out),
        train,
        strategy=args.strategy,
        strategy_options=dict(args.strategy_options),
        checkpoint_every=args.checkpoint_every,
        resume=args.resume or False,
        threads=threads_from(args, train.P),
        data=args.data,
        rejoin_timeout=args.rejoin_timeout,
        max_incidents=args.max_incidents,
        keep_checkpoints=args.keep_checkpoints,
        max_restarts=args.max_restarts,
    )
    final: dict[str, Any] | None = None
    linger = linger_default(args.linger)
    try:
        with _tracked(fed, args.tracker):
            final = _up(fed, args, train)
        _report(final)
        if linger:
            _linger(fed, linger)
        else:
            _served_note(fed)
    except (KeyboardInterrupt, Terminated) as exc:
        stop.ignore()  # a second signal changes nothing: every child is being stopped
        signum = exc.signum if isinstance(exc, Terminated) else int(signal.SIGINT)
        if final is not None:  # the run had ended: this only ends the status service
            fed.stop(grace=STOP_GRACE, sig=signum)
            console.print(f"{signal.Signals(signum).name}: coordinator stopped")
            return 0 if final["phase"] == "done" else 1
        console.print(
            f"[yellow]{signal.Signals(signum).name}: forwarded to every process; "
            f"SIGKILL for any still running after {STOP_GRACE:.0f}s[/]"
        )
        codes = fed.stop(grace=STOP_GRACE, sig=signum)
        if codes:
            console.print("exit status: " + ", ".join(f"{n} {c}" for n, c in codes.items()))
        from mobius_fed.coordinator.manifests import latest_manifest

        manifest = latest_manifest(fed.coordinator_out)
        print(f"last complete checkpoint: {manifest or 'none'}")
        return 128 + signum
    finally:
        stop.ignore()
        fed.stop(grace=STOP_GRACE)  # nothing left running, whatever happened
        if (fed.root / "endpoints.json").is_file():
            with contextlib.suppress(OSError):  # `status`: the run has ended, nothing serves it
                fed.write_endpoints("exited")
        stop.settle()
    if fed.restarts:
        print("restarts: " + ", ".join(f"{n} {c}" for n, c in sorted(fed.restarts.items())))
    if final["phase"] != "done":
        raise CliError(f"run {final['phase']}: {final['error']}")
    return 0


def _tracked(fed: LocalFederation, tracker: str | None):
    """The run's tracker, in ``up`` itself: one tracker across coordinator restarts."""
    from mobius_fed.coordinator.recorder import METRICS_FILE
    from mobius_fed.tracking import tracked

    config = fed.train.model_dump(mode="json")
    return tracked(tracker, fed.coordinator_out / METRICS_FILE, run_name="up", config=config)


def _report(final: dict[str, Any]) -> None:
    """The run's result, printed when it ends (before any linger)."""
    if final["phase"] != "done":
        console.print(f"[red]run {final['phase']}[/]: {final['error']}")
        return
    per = ", ".join(f"s{s}={v:.4f}" for s, v in enumerate(final["eval_origin_losses"] or []))
    if final.get("eval_loss") is not None:
        print(f"final validation loss (Eq. 8): {final['eval_loss']:.4f}  per origin: {per}")
    print(f"checkpoint: {final['checkpoint']}", flush=True)


def _linger(fed: LocalFederation, seconds: float) -> None:
    """Keep the coordinator serving the final status for ``seconds`` (< 0: until a signal)."""
    run = fed.root
    how = "until Ctrl-C / SIGTERM" if seconds < 0 else f"for {seconds:.0f}s (--linger)"
    console.print(
        f"run ended; the coordinator keeps serving its status {how}: "
        f"mobius-fed status --run {run} | mobius-fed dashboard --run {run}"
    )
    deadline = None if seconds < 0 else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        if fed.procs["coordinator"].poll() is not None:
            console.print("the coordinator exited; nothing left to serve")
            return
        time.sleep(0.2)


def linger_default(value: float | None) -> float:
    """``--linger`` when given; otherwise serve until a signal only where a person watches
    (standard output is a terminal), and exit at once in a script or CI job."""
    if value is not None:
        return value
    return -1.0 if sys.stdout.isatty() else 0.0


def _served_note(fed: LocalFederation) -> None:
    """Where the status was served, for a run that exits at once (a script, ``--linger 0``)."""
    ep = fed.endpoints()
    console.print(
        f"run ended; its status was served at {ep['rest']}/ (gRPC {ep['grpc']}); the "
        f"coordinator has stopped. To keep it serving after a run: mobius-fed up --linger "
        f"SECONDS|forever (then mobius-fed status --run {fed.root})",
        highlight=False,
    )


def _print_endpoints(fed: LocalFederation) -> None:
    ep = fed.endpoints()
    lines = [
        f"coordinator gRPC  {ep['grpc']}  (status, grpc.health.v1; mTLS)",
        f"REST + dashboard  {ep['rest']}/  (mutual TLS, operator cert {ep['certs']['cert']})",
    ]
    if ep["metrics"]:
        lines.append(f"metrics           {ep['metrics']}  (plain HTTP, also /healthz /readyz)")
    lines.append(f"endpoints file    {fed.root / 'endpoints.json'}")
    lines.append(
        f"look at it with   mobius-fed status --run {fed.root}  |  "
        f"mobius-fed dashboard --run {fed.root}"
    )
    for line in lines:
        console.print(line, highlight=False)


def _up(fed: LocalFederation, args, train: TrainConfig) -> dict[str, Any]:
    """Prepare, start and watch the federation; the final status."""
    fed.write_endpoints("starting")  # `status` finds the run before certs, data, processes
    fed.prepare()
    console.print(
        f"[bold]mobius-fed up[/]: coordinator + {train.P} workers on 127.0.0.1, "
        f"{train.preset}, L={train.loops} {train.order}, {train.steps} steps, "
        f"{args.strategy} every {train.sync_every} step(s); logs in {fed.logs}"
    )
    fed.start()
    fed.write_endpoints()
    _print_endpoints(fed)
    with common.step_progress("{task.fields[info]}") as bar:
        task = bar.add_task("train", total=train.steps, info="waiting for workers")
        told: dict[int, str] = {}  # incident id → the state already printed

        def show(doc: dict[str, Any]) -> None:
            for inc in doc.get("incidents", []):  # recovery, as it happens
                if told.get(inc["id"]) == inc["state"]:
                    continue
                told[inc["id"]] = inc["state"]
                if inc["state"] == IncidentState.OPEN:
                    bar.console.print(f"[yellow]incident {inc['id']}[/]: {inc['what']}")
                elif inc["state"] == IncidentState.RECOVERED:
                    bar.console.print(
                        f"[green]incident {inc['id']} recovered[/] in {inc['recovery_s']:.1f}s: "
                        f"rolled back to round {inc['rollback_round']}, "
                        f"{inc['steps_redone']} step(s) redone"
                    )
                else:
                    bar.console.print(f"[red]incident {inc['id']} {inc['state']}[/]")
            losses = [w["last_loss"] for w in doc["workers"] if w["last_loss"] is not None]
            info = doc["phase"]
            if losses:
                info += f"  loss {sum(losses) / len(losses):.4f}"
            if doc.get("eval_loss") is not None:
                info += f"  val {doc['eval_loss']:.4f}"
            bar.update(task, completed=doc["step"], info=info)

        fed.on_event = bar.console.print
        return fed.wait(on_status=show)


# --------------------------------------------------------------------------- the command
def linger_value(text: str) -> float:
    """``--linger`` values: seconds (0: exit at once), or ``forever`` / -1."""
    if text.strip().lower() in ("forever", "inf", "-1"):
        return -1.0
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'forever', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds ≥ 0 or 'forever', got {text!r}")
    return value


class _LazyTrainFlagsParser(argparse.ArgumentParser):
    """``up``'s parser: the training flags are generated from TrainConfig (which loads
    torch) on first use — parsing or help — not when ``mobius-fed`` builds its parser, so
    ``mobius-fed health`` stays torch-free."""

    populated = True

    def _populate(self) -> None:
        if not self.populated:
            self.populated = True
            common.add_train_flags(self)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._populate()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._populate()
        return super().format_help()


def up_main(args: argparse.Namespace) -> int:
    """``mobius-fed up``: build the train config from TOML/env/flags and run."""
    from mobius_fed.cli.coordinator import parse_options

    train = common.train_config_from_args(args)
    args.strategy_options = parse_options(args.strategy_option)
    return cmd_up(args, train)


def register(sub) -> None:
    """Add ``up`` to the ``mobius-fed`` subcommands."""
    parser_class, sub._parser_class = sub._parser_class, _LazyTrainFlagsParser
    try:
        p = sub.add_parser(
            "up",
            help="coordinator + P workers as processes on this machine",
            description="A whole federation on 127.0.0.1: certificates, per-site data, the "
            "coordinator and P workers, supervised. Writes OUT/endpoints.json (addresses, "
            "operator certs) for `mobius-fed status|health|dashboard --run OUT`; after the "
            "run the coordinator keeps serving status until Ctrl-C when the output is a "
            "terminal, and exits at once in a script (see --linger).",
        )
    finally:
        sub._parser_class = parser_class
    p.populated = False  # the training flags come on first use
    p.add_argument(
        "--out", default="runs/up", help="certs, sites, logs, checkpoints (default runs/up)"
    )
    p.add_argument(
        "--strategy", default="fedavg", help="fedavg, fedavgm, fedadam, fedyogi, … (default fedavg)"
    )
    p.add_argument(
        "--strategy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a strategy option (repeatable), e.g. server_learning_rate=0.5",
    )
    common.add_checkpoint_flag(p, 0)
    common.add_data_flag(p)
    common.add_threads_flag(p, "cores / P per worker")
    _add_recovery_flags(p)
    add_resume_flag(
        p,
        "continue from the newest complete manifest; --resume auto: only if there is one",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="start afresh in an --out that holds an earlier run, deleting its checkpoints, "
        "metrics and logs (certs and sites are kept); without it (or --resume) up refuses",
    )
    add_tracker_flag(p)
    p.set_defaults(func=up_main)


def _add_recovery_flags(p) -> None:
    """Retention, incident budget, restarts and the linger after the run."""
    p.add_argument(
        "--keep-checkpoints", type=int, help="complete manifests to keep (coordinator's default)"
    )
    p.add_argument(
        "--rejoin-timeout",
        type=float,
        help="seconds an incident waits for a lost worker to come back (coordinator's default)",
    )
    p.add_argument(
        "--max-incidents",
        type=int,
        help="incidents the run recovers from before it fails (coordinator's default)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="times up restarts each crashed process (0: never); a worker comes back with the "
        "same command, the coordinator with --resume auto (default 5)",
    )
    p.add_argument(
        "--linger",
        type=linger_value,
        default=None,
        metavar="SECONDS",
        help="after the run, keep the coordinator serving status, dashboard and metrics for "
        "SECONDS (0: exit at once; forever: until Ctrl-C / SIGTERM). Default: forever when "
        "standard output is a terminal, 0 in a script",
    )
