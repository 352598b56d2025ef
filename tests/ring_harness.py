"""Start real ``mobius-worker`` processes on loopback and collect what they report."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.engine import ReferenceEngine
from mobius_fed.ops.ports import free_ports
from mobius_fed.transport.certs import init_certs
from mobius_fed.warmstart import ChildProcess, spawn

WORKER = [sys.executable, "-m", "mobius_fed.cli.worker"]


@dataclass
class Ring:
    root: Path
    P: int
    train: dict
    ports: list[int] = field(default_factory=list)
    procs: list[ChildProcess] = field(default_factory=list)
    dial: dict[int, int] = field(default_factory=dict)  # worker i dials this successor port

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    def bundle(self, i: int) -> Path:
        """Worker i's own certificate directory: its key and nobody else's."""
        return self.certs / "nodes" / f"worker-{i}"

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
        ports = list(self.ports)
        if i in self.dial:  # e.g. through a proxy on the edge i → i+1
            ports[(i + 1) % self.P] = self.dial[i]
        peers = ",".join(f"127.0.0.1:{p}" for p in ports)
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
            str(self.bundle(i) / "ca.crt"),
            "--cert",
            str(self.bundle(i) / "tls.crt"),
            "--key",
            str(self.bundle(i) / "tls.key"),
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
            log = self.root / f"worker-{i}.log"
            log.write_bytes(b"")
            self.procs.append(spawn(self.worker_cmd(i, (extra or {}).get(i, [])), log, env))
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


class CutProxy:
    """A TCP proxy on loopback between a ring worker and its successor that can cut the
    connection (RST both ways) and refuse new ones for a while, or silently stop
    forwarding on it (:meth:`freeze`; with ``answers_only`` only server → client), or hold
    its bytes for a while (:meth:`stall`), like a flaky or slow WAN link.

    ``bytes_up``: bytes forwarded client → server so far; ``swallowed``: client bytes a
    black hole took (:meth:`wait_swallowed` waits for more); ``on_bytes(n, action)`` runs
    ``action`` (once) when that count first reaches ``n``. With ``swallow=m`` the open
    connections turn into a black hole at that moment, and ``action`` runs once ``m`` more
    client bytes were swallowed (or after ``within`` seconds): whatever the scheduling, the
    client then has sent data that never arrived.
    """

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = free_ports(1)[0]
        self.bytes_up = 0
        self.swallowed = 0
        self.cuts = 0
        self._lock = threading.Lock()
        self._swallowing = threading.Condition(self._lock)
        self._socks: list[socket.socket] = []
        self._trigger: tuple[int, Callable[[], None], int, float] | None = None
        self._swallow: tuple[int, Callable[[], None]] | None = None  # (bytes left, action)
        self._closed = False
        self._gen = 0  # connections accepted after freeze() have a higher generation
        self._frozen = -1
        self._frozen_down = -1  # only server → client: the answers of these connections
        self._listener: socket.socket | None = None
        self._held_until = 0.0  # stall(): bytes wait in the proxy until then, none lost
        self._listen()

    def _listen(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(16)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # listener closed
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, server]
                gen = self._gen
            for a, b, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up, gen), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool, gen: int) -> None:
        try:
            while data := src.recv(1 << 16):
                if gen <= self._frozen or (not up and gen <= self._frozen_down):
                    if up:
                        self._swallowed(len(data))
                    continue  # a black hole: bytes go in, nothing comes out, nothing closes
                if (hold := self._held_until - time.monotonic()) > 0:
                    time.sleep(hold)  # a queue that holds this much of the link's time
                dst.sendall(data)
                if up:
                    self._count(len(data))
        except OSError:
            pass
        finally:  # a black hole does not pass on a close either
            for s in (src,) if gen <= self._frozen and not self._closed else (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _count(self, n: int) -> None:
        action = None
        with self._lock:
            self.bytes_up += n
            if self._trigger is not None and self.bytes_up >= self._trigger[0]:
                _, action, swallow, within = self._trigger
                self._trigger = None
                if swallow:  # black-hole the open connections first; act once data is lost
                    self._frozen, self._gen = self._gen, self._gen + 1
                    self._swallow, action = (swallow, action), self._fire_swallow_after(within)
        if action is not None:
            threading.Thread(target=action, daemon=True).start()

    def _fire_swallow_after(self, within: float) -> Callable[[], None]:
        def later() -> None:
            time.sleep(within)
            self._swallowed(0, force=True)

        return later

    def _swallowed(self, n: int, force: bool = False) -> None:
        action = None
        with self._lock:
            self.swallowed += n
            self._swallowing.notify_all()
            if self._swallow is not None:
                left = self._swallow[0] - n
                if left <= 0 or force:
                    action, self._swallow = self._swallow[1], None
                else:
                    self._swallow = (left, self._swallow[1])
        if action is not None:
            threading.Thread(target=action, daemon=True).start()

    def wait_swallowed(self, more_than: int, timeout: float) -> bool:
        """Wait until a black hole took more than ``more_than`` client bytes in all."""
        with self._swallowing:
            return self._swallowing.wait_for(lambda: self.swallowed > more_than, timeout)

    def on_bytes(
        self, n: int, action: Callable[[], None], swallow: int = 0, within: float = 2.0
    ) -> None:
        with self._lock:
            self._trigger = (self.bytes_up + n, action, swallow, within)

    def cut(self, refuse_s: float = 0.0) -> None:
        """Reset every connection; refuse new ones for ``refuse_s`` seconds."""
        with self._lock:
            socks, self._socks = self._socks, []
            listener, self._listener = self._listener, None
            self.cuts += 1
        if refuse_s and listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            listener.close()
        for s in socks:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv()
            s.close()
        if refuse_s:
            time.sleep(refuse_s)
            if not self._closed:
                self._listen()
        else:
            self._listener = listener

    def freeze(self, answers_only: bool = False) -> None:
        """Swallow everything on the open connections without closing them (a black hole:
        only keepalive can tell); new connections pass. ``answers_only``: the client's bytes
        still arrive, the server's never come back."""
        with self._lock:
            if answers_only:
                self._frozen_down = self._gen
            else:
                self._frozen = self._gen
            self._gen += 1

    def stall(self, seconds: float) -> None:
        """Hold every byte, both ways, for ``seconds`` and then pass it on, none lost: a link
        whose queues hold that much data ahead of a keepalive ping's answer."""
        self._held_until = time.monotonic() + seconds

    def close(self) -> None:
        self._closed = True
        self.cut()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
