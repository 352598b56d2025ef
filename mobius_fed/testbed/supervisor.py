"""The testbed's process supervisor: starts services in dependency order, applies restart
policies, waits for healthchecks, runs commands on a service's host, and stops it all."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from mobius_fed.ops.supervisor import Child, ProcessTable
from mobius_fed.testbed.compose import ComposeProject, Service
from mobius_fed.testbed.filesystem import EXEC_LINE
from mobius_fed.testbed.namespaces import TestbedError, lookup_service
from mobius_fed.warmstart import ChildProcess


def _in_wrapper(pid: int) -> bool:
    """Whether ``pid`` is still ip/unshare/the mount script rather than the command."""
    try:
        exe = os.path.basename(os.path.realpath(f"/proc/{pid}/exe"))
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if exe in ("ip", "unshare"):
        return True
    return len(cmd) > 2 and cmd[1] == b"-c" and cmd[2].endswith(EXEC_LINE.encode())


def service_env(svc: Service, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A service's environment: a minimal base (with the testbed's own PYTHONPATH, if
    set), its compose environment, then ``extra``."""
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    base = {
        "PATH": f"{bindir}:{path}" if bindir not in path.split(":") else path,
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    if os.environ.get("PYTHONPATH"):  # the services run the mobius_fed the testbed runs
        base["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return {**base, **svc.environment, **(extra or {})}


class Supervisor:
    """The processes of a testbed's services (one :class:`ProcessTable` child each).
    ``host_argv(svc, argv)`` wraps a command to run on the service's host; ``is_up()`` says
    whether commands may run now."""

    def __init__(
        self,
        project: ComposeProject,
        logs_dir: Path,
        say: Callable[[str], None],
        host_argv: Callable[[Service, Sequence[str]], list[str]],
        is_up: Callable[[], bool],
    ) -> None:
        self.project, self.logs_dir, self._say = project, logs_dir, say
        self._host_argv, self._is_up = host_argv, is_up
        self._table = ProcessTable(logs_dir, self._spawn, self._policy)
        self._lock = self._table.lock
        self._healthy: set[str] = set()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    def _state(self, service: str) -> Child:
        name = lookup_service(self.project, service).name
        return self._table.children.get(name) or Child(name, [])

    def log_path(self, service: str) -> Path:
        return self.logs_dir / f"{lookup_service(self.project, service).name}.log"

    def log_tail(self, service: str, lines: int = 20) -> str:
        try:
            text = self.log_path(service).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------ running
    def up(self, timeout: float = 300.0, services: Sequence[str] | None = None) -> None:
        """Start services in dependency order, honouring ``depends_on`` conditions.

        Raises TestbedError naming the service when a dependency fails (exits non-zero,
        never becomes healthy) or ``timeout`` passes, and when any started service has
        failed for good by the time everything is started.
        """
        deadline = time.monotonic() + timeout
        order = self.project.start_order()
        if services is not None:
            wanted = self._with_deps(services)
            order = [s for s in order if s in wanted]
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, name="testbed", daemon=True)
            self._monitor.start()
        for name in order:
            svc = self.project.services[name]
            if name in self._table.children:
                continue
            for dep, cond in svc.depends_on.items():
                self._await(dep, cond, name, deadline)
            self._table.start(name, svc.argv)
        failed = {n: rc for n, rc in self.failed().items() if n in order}
        if failed:
            raise TestbedError(self.describe_failure(failed))

    def describe_failure(self, failed: Mapping[str, int]) -> str:
        """One message naming every failed service, with the first one's log tail."""
        first = next(iter(failed))
        names = ", ".join(
            f"{n} (exit {rc}"
            + (f", after {self.restarts(n)} restarts)" if self.restarts(n) else ")")
            for n, rc in failed.items()
        )
        return (
            f"service {names} failed; last lines of {first}'s log ({self.log_path(first)}):\n"
            + self.log_tail(first)
        )

    def _with_deps(self, services: Sequence[str]) -> set[str]:
        out: set[str] = set()
        todo = list(services)
        while todo:
            s = lookup_service(self.project, todo.pop()).name
            if s not in out:
                out.add(s)
                todo.extend(self.project.services[s].depends_on)
        return out

    def _spawn(self, child: Child, log: BinaryIO) -> subprocess.Popen:
        if self._stopping.is_set():
            raise TestbedError("testbed is shutting down")
        log.write(f"--- testbed: starting {shlex.join(child.argv)}\n".encode())
        log.flush()
        self._healthy.discard(child.name)
        svc = self.project.services[child.name]
        p = self._popen(svc, child.argv, stdout=log, stderr=subprocess.STDOUT)
        self._say(f"started {svc.name} (pid {p.pid}): {shlex.join(child.argv)}")
        return p

    def _popen(
        self, svc: Service, argv: Sequence[str], env: Mapping[str, str] | None = None, **io: Any
    ) -> subprocess.Popen:
        """``argv`` on ``svc``'s host, in a process group of its own."""
        return subprocess.Popen(
            self._host_argv(svc, list(argv)),
            env=service_env(svc, env),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd="/",
            **io,
        )

    def _policy(self, child: Child) -> float | None:
        """Restart now as the service's ``restart`` says, or leave it down."""
        svc, rc = self.project.services[child.name], child.returncode
        restart = not self._stopping.is_set() and (
            svc.restart in ("always", "unless-stopped")
            or (
                svc.restart == "on-failure"
                and rc != 0
                and (svc.max_restarts is None or child.restarts < svc.max_restarts)
            )
        )
        self._say(
            f"{child.name} exited with {rc}"
            + (f"; restart #{child.restarts + 1}" if restart else "")
        )
        return 0.0 if restart else None

    def _watch(self) -> None:
        """Record exits and apply restart policies until the testbed stops."""
        while not self._stopping.wait(0.25):
            with contextlib.suppress(TestbedError):  # shutting down while restarting
                self._table.check()

    def _await(self, dep: str, cond: str, who: str, deadline: float) -> None:
        st = self._table.children.get(dep)
        what = f"service {dep!r} (a dependency of {who!r})"
        if st is None:
            raise TestbedError(f"{what} was not started")
        if cond == "service_started":
            return
        if cond == "service_completed_successfully":
            while not st.final:
                if time.monotonic() > deadline:
                    raise TestbedError(f"timed out waiting for {what} to complete")
                time.sleep(0.2)
            if st.returncode != 0:
                raise TestbedError(
                    f"{what} exited with status {st.returncode}; last lines of its log "
                    f"({self.log_path(dep)}):\n{self.log_tail(dep)}"
                )
            return
        self._await_healthy(dep, what, deadline)

    def _await_healthy(self, name: str, what: str, deadline: float) -> None:
        st = self._table.children[name]
        hc = self.project.services[name].healthcheck
        if hc is None:
            raise TestbedError(f"{what} has no healthcheck to wait for")
        failures, last = 0, ""
        next_probe = st.started_at + (hc.start_interval if hc.start_period else hc.interval)
        while name not in self._healthy:
            if st.final:
                raise TestbedError(
                    f"{what} exited with status {st.returncode} before it became healthy; "
                    f"last lines of its log:\n{self.log_tail(name)}"
                )
            now = time.monotonic()
            if now > deadline:
                raise TestbedError(f"timed out waiting for {what} to become healthy: {last}")
            if now < next_probe:
                time.sleep(min(0.2, next_probe - now))
                continue
            in_start = now - st.started_at < hc.start_period
            ok, last = self.probe(name)
            if ok:
                self._healthy.add(name)
                self._say(f"{name} is healthy")
                return
            if not in_start:
                failures += 1
                if failures >= hc.retries:
                    raise TestbedError(
                        f"{what} is unhealthy after {failures} failed checks: {last}\n"
                        f"last lines of its log:\n{self.log_tail(name)}"
                    )
            gap = hc.start_interval if in_start else hc.interval
            next_probe = time.monotonic() + gap

    def probe(self, service: str) -> tuple[bool, str]:
        """Run the service's healthcheck once: (passed, last output line)."""
        hc = lookup_service(self.project, service).healthcheck
        if hc is None:
            raise TestbedError(f"service {service} has no healthcheck")
        try:
            r = self.exec(service, hc.argv, timeout=hc.timeout)
        except subprocess.TimeoutExpired:
            return False, f"healthcheck timed out after {hc.timeout:g}s"
        out = (r.stdout + r.stderr).strip().splitlines()
        return r.returncode == 0, (out[-1] if out else f"exit {r.returncode}")

    def exec(
        self,
        service: str,
        argv: Sequence[str],
        *,
        timeout: float | None = 60.0,
        env: Mapping[str, str] | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on the service's host: its namespace, hosts file, volumes and
        environment (plus ``env``). Raises subprocess.TimeoutExpired after killing it."""
        svc = lookup_service(self.project, service)
        if not self._is_up():
            raise TestbedError("the testbed is not up")
        p = self._popen(svc, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
        r = subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        if check and r.returncode != 0:
            raise TestbedError(
                f"{service}: {shlex.join(argv)} exited with {r.returncode}: {err.strip()}"
            )
        return r

    # ------------------------------------------------------------------ inspection
    def processes(self, wait: float = 5.0) -> dict[str, int]:
        """``{service: pid}`` of every running service's main process: the command itself,
        once the namespace/mount wrapper has exec'd into it (waits up to ``wait`` s)."""
        with self._lock:
            running = {
                n: c.popen.pid for n, c in self._table.children.items() if c.popen and c.running
            }
        out: dict[str, int] = {}
        deadline = time.monotonic() + wait
        for name, pid in running.items():
            while _in_wrapper(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if os.path.exists(f"/proc/{pid}"):
                out[name] = pid
        return out

    def returncode(self, service: str) -> int | None:
        """The exit status of the service's last run (None while running / never run)."""
        return self._state(service).returncode

    def restarts(self, service: str) -> int:
        return self._state(service).restarts

    def failed(self) -> dict[str, int]:
        """``{service: exit status}`` of services that exited non-zero and will not restart."""
        with self._lock:
            return {
                n: c.returncode
                for n, c in self._table.children.items()
                if c.final and c.returncode not in (0, None)
            }

    def finished(self, service: str) -> bool:
        """Whether the service has exited and its restart policy will not restart it."""
        return self._state(service).final

    def running(self, service: str) -> bool:
        return self._state(service).running

    # ------------------------------------------------------------------ teardown
    def stop(self) -> list[ChildProcess]:
        """Stop restarting, SIGTERM every service's process group; returns their processes."""
        self._stopping.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5)
        return self._table.send(signal.SIGTERM, group=True)
