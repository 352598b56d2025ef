"""``mobius-fed up``: a whole federation on this machine, as separate processes on loopback.

Makes certificates, splits the embedded corpus into per-site data, starts
``mobius-coordinator`` and P ``mobius-worker`` processes, shows progress from the
coordinator's status, prints the final losses and where the checkpoint is. Ctrl-C stops
every process it started; the last complete checkpoint stays intact.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from mobius_fed.cli.common import CliError, console
from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.server import latest_manifest
from mobius_fed.data import embedded_corpus, prepare_sites
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.transport.certs import init_certs
from mobius_fed.transport.tls import NodeTLS, open_channel


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class LocalFederation:
    """A coordinator and P workers as child processes of this one, all on 127.0.0.1."""

    root: Path
    train: TrainConfig
    strategy: str = "fedavg"
    strategy_options: dict[str, float] = field(default_factory=dict)
    checkpoint_every: int = 0
    heartbeat_timeout: float = 10.0
    resume: bool = False
    threads: int | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.certs = self.root / "certs"
        self.sites = self.root / "sites"
        self.logs = self.root / "logs"
        ports = free_ports(self.train.P + 2)
        self.coord_port, self.rest_port, self.worker_ports = ports[0], ports[1], ports[2:]

    # ---------------------------------------------------------------- setup
    def prepare(self) -> LocalFederation:
        P = self.train.P
        if not (self.certs / "ca.crt").is_file():
            init_certs(self.certs, P)
        if (
            not all((self.sites / f"site-{i}").is_dir() for i in range(P))
            or (self.sites / f"site-{P}").exists()
        ):
            prepare_sites(
                None, self.sites, P, self.train.encoding, text=embedded_corpus(), overwrite=True
            )
        self.logs.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def coordinator_out(self) -> Path:
        return self.root / "coordinator"

    def worker_out(self, i: int) -> Path:
        return self.root / f"worker-{i}"

    def write_train_toml(self) -> Path:
        """The run's [train] table, handed to the coordinator with --config."""
        lines = ["[train]"]
        for key, value in self.train.model_dump(mode="json").items():
            if value is not None:
                lines.append(f"{key} = {json.dumps(value)}")
        path = self.root / "train.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def coordinator_cmd(self) -> list[str]:
        c = self.certs
        cmd = [
            sys.executable,
            "-m",
            "mobius_fed.cli.coordinator",
            "--listen",
            f"127.0.0.1:{self.coord_port}",
            "--rest-mode",
            "local",
            "--rest-listen",
            f"127.0.0.1:{self.rest_port}",
            "--ca",
            str(c / "ca.crt"),
            "--cert",
            str(c / "coordinator.crt"),
            "--key",
            str(c / "coordinator.key"),
            "--out-dir",
            str(self.coordinator_out),
            "--strategy",
            self.strategy,
            "--checkpoint-every",
            str(self.checkpoint_every),
            "--linger",
            "-1",
            "--heartbeat-timeout",
            str(self.heartbeat_timeout),
            "--heartbeat-interval",
            str(min(1.0, self.heartbeat_timeout / 4)),
            "--run-id",
            "local-up",
            "--config",
            str(self.write_train_toml()),
        ]
        for k, v in self.strategy_options.items():
            cmd += ["--strategy-option", f"{k}={json.dumps(v)}"]
        return cmd + (["--resume"] if self.resume else [])

    def worker_cmd(self, i: int) -> list[str]:
        c = self.certs
        threads = self.threads or max(1, (os.cpu_count() or 1) // self.train.P)
        return [
            sys.executable,
            "-m",
            "mobius_fed.cli.worker",
            "--coordinator",
            f"127.0.0.1:{self.coord_port}",
            "--listen",
            f"127.0.0.1:{self.worker_ports[i]}",
            "--data-dir",
            str(self.sites / f"site-{i}"),
            "--out-dir",
            str(self.worker_out(i)),
            "--ca",
            str(c / "ca.crt"),
            "--cert",
            str(c / f"worker-{i}.crt"),
            "--key",
            str(c / f"worker-{i}.key"),
            "--threads",
            str(threads),
        ]

    def start(self, workers: bool = True) -> LocalFederation:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self._spawn("coordinator", self.coordinator_cmd(), env)
        for i in range(self.train.P) if workers else ():
            self._spawn(f"worker-{i}", self.worker_cmd(i), env)
        return self

    def rest(self, path: str) -> Any:
        """GET a local-mode REST endpoint of the coordinator (JSON or text)."""
        import httpx

        r = httpx.get(f"http://127.0.0.1:{self.rest_port}{path}", timeout=5)
        r.raise_for_status()
        return r.json() if r.headers["content-type"].startswith("application/json") else r.text

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.logs / f"{name}.log", "a")  # noqa: SIM115 - owned by the child
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    # --------------------------------------------------------------- status
    def operator_tls(self) -> NodeTLS:
        c = self.certs
        return NodeTLS(c / "ca.crt", c / "operator.crt", c / "operator.key")

    def status(self, timeout: float = 3.0) -> dict[str, Any] | None:
        """The coordinator's status over gRPC with the operator's certificate."""
        channel = open_channel(
            f"127.0.0.1:{self.coord_port}", self.operator_tls(), target_name="coordinator"
        )
        try:
            stub = control_pb2_grpc.ControlStub(channel)
            reply = stub.GetStatus(control_pb2.StatusRequest(), timeout=timeout)
            return json.loads(reply.json)
        except grpc.RpcError:
            return None
        finally:
            channel.close()

    def wait(self, on_status=None, timeout: float = 3600) -> dict[str, Any]:
        """Poll until the run is done or failed, or a process died; return the last status."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            doc = self.status()
            if doc is not None:
                last = doc
                if on_status:
                    on_status(doc)
                if doc["phase"] in ("done", "failed", "stopped"):
                    return doc
            coord = self.procs["coordinator"]
            if coord.poll() is not None:
                raise CliError(
                    f"the coordinator exited ({coord.returncode}); see "
                    f"{self.logs / 'coordinator.log'}:\n{self.tail('coordinator')}"
                )
            time.sleep(0.5)
        raise CliError(f"run did not finish within {timeout:.0f}s (last status: {last})")

    def tail(self, name: str, n: int = 15) -> str:
        lines = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self, grace: float = 10.0) -> None:
        """Stop every process this federation started (SIGTERM, then SIGKILL)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def cmd_up(args, train: TrainConfig) -> int:
    fed = LocalFederation(
        Path(args.out),
        train,
        strategy=args.strategy,
        strategy_options=dict(args.strategy_options),
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    ).prepare()
    console.print(
        f"[bold]mobius-fed up[/]: coordinator + {train.P} workers on 127.0.0.1, "
        f"{train.preset}, L={train.loops} {train.order}, {train.steps} steps, "
        f"{args.strategy} every {train.sync_every} step(s); logs in {fed.logs}"
    )
    fed.start()
    try:
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        ) as bar:
            task = bar.add_task("train", total=train.steps, info="waiting for workers")

            def show(doc: dict[str, Any]) -> None:
                losses = [w["last_loss"] for w in doc["workers"] if w["last_loss"] is not None]
                info = doc["phase"]
                if losses:
                    info += f"  loss {sum(losses) / len(losses):.4f}"
                if doc.get("eval_loss") is not None:
                    info += f"  val {doc['eval_loss']:.4f}"
                bar.update(task, completed=doc["step"], info=info)

            final = fed.wait(on_status=show)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process[/]")
        fed.stop(grace=5)
        manifest = latest_manifest(fed.coordinator_out)
        print(f"last complete checkpoint: {manifest or 'none'}")
        return 130
    fed.stop()
    if final["phase"] != "done":
        raise CliError(f"run {final['phase']}: {final['error']}")
    per = ", ".join(f"s{s}={v:.4f}" for s, v in enumerate(final["eval_origin_losses"] or []))
    print(f"final validation loss (Eq. 8): {final['eval_loss']:.4f}  per origin: {per}")
    print(f"checkpoint: {final['checkpoint']}")
    return 0
