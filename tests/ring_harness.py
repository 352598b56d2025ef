"""Start real ``mobius-worker`` processes on loopback and collect what they report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mobius_fed.cli.up import free_ports
from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.engine import ReferenceEngine
from mobius_fed.transport.certs import init_certs

WORKER = [sys.executable, "-m", "mobius_fed.cli.worker"]


@dataclass
class Ring:
    root: Path
    P: int
    train: dict
    ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    def site(self, i: int) -> Path:
        return self.root / "sites" / f"site-{i}"

    def out(self, i: int) -> Path:
        return self.root / "out" / f"worker-{i}"

    def config(self) -> TrainConfig:
        return TrainConfig(workers=self.P, **self.train)

    def prepare(self) -> Ring:
        init_certs(self.certs, self.P)
        prepare_sites(None, self.root / "sites", self.P, text=embedded_corpus())
        self.ports = free_ports(self.P)
        return self

    def worker_cmd(self, i: int, extra: list[str] = ()) -> list[str]:  # type: ignore[assignment]
        peers = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        cmd = [
            *WORKER,
            "--rank",
            str(i),
            "--peers",
            peers,
            "--listen",
            f"127.0.0.1:{self.ports[i]}",
            "--data-dir",
            str(self.site(i)),
            "--out-dir",
            str(self.out(i)),
            "--ca",
            str(self.certs / "ca.crt"),
            "--cert",
            str(self.certs / f"worker-{i}.crt"),
            "--key",
            str(self.certs / f"worker-{i}.key"),
            "--threads",
            "1",
            "--peer-timeout",
            "60",
            "--run-id",
            "test-run",
            "--log-level",
            "WARNING",
        ]
        cmd += ["--workers", str(self.P)]
        for key, value in self.train.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        return cmd + list(extra)

    def start(
        self, extra: dict[int, list[str]] | None = None, only: tuple[int, ...] | None = None
    ) -> Ring:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for i in range(self.P) if only is None else only:
            log = open(self.root / f"worker-{i}.log", "w")  # noqa: SIM115
            self.procs.append(
                subprocess.Popen(
                    self.worker_cmd(i, (extra or {}).get(i, [])),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
        return self

    def wait(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                i = int(p.args[p.args.index("--rank") + 1])
                assert rc == 0, f"worker-{i} exited {rc}:\n{self.log(i)}"
        finally:
            self.stop()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def log(self, i: int, tail: int | None = 4000) -> str:
        text = (self.root / f"worker-{i}.log").read_text()
        return text[-tail:] if tail else text

    def losses(self) -> dict[tuple[int, int], float]:
        """(step, origin) → loss reported by that origin's home worker."""
        rows = {}
        for i in range(self.P):
            for line in (self.out(i) / "metrics.jsonl").read_text().splitlines():
                r = json.loads(line)
                if "loss" in r:
                    rows[r["step"], r["origin"]] = r["loss"]
        return rows

    def eval_losses(self) -> dict[int, float]:
        rows = {}
        for i in range(self.P):
            for line in (self.out(i) / "metrics.jsonl").read_text().splitlines():
                r = json.loads(line)
                if "eval_loss" in r:
                    rows[r["origin"]] = r["eval_loss"]
        return rows

    def reference(self) -> tuple[dict[tuple[int, int], float], list[float]]:
        cfg = self.config()
        sites = [SiteData(self.site(i), cfg.model().seq_len) for i in range(self.P)]
        engine = ReferenceEngine(cfg, sites)
        losses = {}
        for _ in range(cfg.steps):
            r = engine.train_step()
            losses.update({(r.step, s): v for s, v in enumerate(r.origin_losses)})
        return losses, engine.evaluate().origin_losses
