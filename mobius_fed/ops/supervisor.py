"""The one process supervisor: named children, each in a session of its own with its output
appended to ``<logs>/<name>.log``, restarted as the owner's policy says (after the delay it
chooses), stopped with a signal and SIGKILL after a grace. ``mobius-fed up``
(:class:`~mobius_fed.ops.federation.LocalFederation`) and the namespace testbed
(:class:`~mobius_fed.testbed.supervisor.Supervisor`) both run their processes with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mobius_fed.warmstart import ChildProcess


@dataclass(eq=False)
class Child:
    """One supervised process and what became of it."""

    name: str
    argv: list[str]
    popen: ChildProcess | None = None
    started_at: float = 0.0
    returncode: int | None = None  # of the last run that ended (None while running)
    restarts: int = 0
    final: bool = False  # exited and will not be restarted
    restart_at: float | None = None  # a restart waiting out its back-off

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


Spawn = Callable[[Child, BinaryIO], ChildProcess]
"""Start ``child.argv`` (in a session of its own) writing to the open log file."""
Policy = Callable[[Child], float | None]
"""For a child that just exited: seconds until it restarts, or None: it stays down."""


class ProcessTable:
    """The children of one supervisor. :meth:`check` applies the policy; the owner calls it
    from its own loop or thread."""

    def __init__(self, logs: Path, spawn: Spawn, policy: Policy) -> None:
        self.logs, self._spawn, self._policy = logs, spawn, policy
        self.children: dict[str, Child] = {}
        self.lock = threading.RLock()

    def start(self, name: str, argv: list[str] | None = None) -> Child:
        """Start ``name`` with ``argv`` (default: its last command)."""
        with self.lock:
            c = self.children.get(name) or Child(name, argv or [])
            c.argv = c.argv if argv is None else argv
            with open(self.logs / f"{name}.log", "ab") as log:  # the child keeps its own copy
                c.popen = self._spawn(c, log)
            self.children[name] = c  # once it started
            c.started_at = time.monotonic()
            c.returncode, c.final, c.restart_at = None, False, None
            return c

    def check(self) -> None:
        """Record exits; restart each child the policy restarts once its delay has passed."""
        with self.lock:
            now = time.monotonic()
            for c in list(self.children.values()):
                if c.popen is None or c.final or c.popen.poll() is None:
                    continue
                if c.restart_at is None:  # an exit not seen before
                    c.returncode, c.final = c.popen.returncode, True  # unless the policy says
                    delay = self._policy(c)
                    if delay is None:
                        continue
                    c.final, c.restarts, c.restart_at = False, c.restarts + 1, now + delay
                if now >= c.restart_at:
                    self.start(c.name)

    def send(self, sig: int, group: bool = False) -> list[ChildProcess]:
        """Send ``sig`` to every running child (``group``: to its process group); cancel
        pending restarts. Returns every child's process."""
        with self.lock:
            popens = [c.popen for c in self.children.values() if c.popen is not None]
            for c in self.children.values():
                c.restart_at = None
        for p in popens:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if group:
                        os.killpg(p.pid, sig)
                    else:
                        p.send_signal(sig)
        return popens

    def await_exits(self, names: list[str], timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds for the named children to exit on their own;
        the names of those still running."""
        deadline = time.monotonic() + timeout
        while True:
            left = [n for n in names if n in self.children and self.children[n].running]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)

    def stop(self, grace: float, sig: int = signal.SIGTERM) -> dict[str, int]:
        """Send ``sig`` to every child, wait up to ``grace`` seconds, then SIGKILL what is
        left; return every child's exit status."""
        self.send(sig)
        deadline = time.monotonic() + grace
        for c in self.children.values():
            p = c.popen
            assert p is not None  # every child was started
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return {n: c.popen.wait() for n, c in self.children.items() if c.popen is not None}
