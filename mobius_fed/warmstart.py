"""Warm starts: ``python -m mobius_fed…`` children forked from a server that has already
imported torch, instead of each interpreter importing it again.

A fresh worker spends 3–6 s of CPU before its first step, most of it importing ``torch``
and ``torch._dynamo`` (which ``torch.optim`` pulls in on its first use); a child forked from
a process that has imported both spends about 0.6 s. The fork server is the standard
library's (:mod:`multiprocessing`'s ``forkserver`` start method, with these modules
preloaded): a single-threaded process that imported nothing else, so no gRPC or OpenMP state
is forked. Each child then takes its own session, output file, environment, working
directory and ``sys.argv``, and runs the module as ``__main__``: the same program
``python -m`` would run, in a process of its own with a pid, signals and an exit status.

Turned on by ``MOBIUS_WARM_START=1`` (the test suite sets it, docs/testing.md); off, every
child is a fresh interpreter. Only ``[sys.executable, "-m", "mobius_fed…", …]`` commands
start warm (and those of a package named in ``MOBIUS_WARM_PACKAGES``); anything else
(another interpreter, a venv, a namespace's ``ip netns exec``) starts cold.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

ENV = "MOBIUS_WARM_START"
PACKAGES_ENV = "MOBIUS_WARM_PACKAGES"
# What the fork server imports once: torch, and the modules of every daemon it starts (a
# worker, a coordinator, a relay; `up`'s own imports are a subset). None starts a thread or
# touches gRPC's core at import (tests/test_warmstart.py), so the server stays fit to fork.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.optim",
    "mobius_fed.worker.daemon",
    "mobius_fed.coordinator.server",
    "mobius_fed.coordinator.rest",
    "mobius_fed.relay",
]
PR_SET_PDEATHSIG = 1
_MAIN_LOCK = threading.Lock()


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``MOBIUS_WARM_START`` is on in ``env`` (default: this process's)."""
    return (os.environ if env is None else env).get(ENV, "") not in ("", "0")


def python_m(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is ``python -m MODULE …`` with this interpreter."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m"


def packages(env: Mapping[str, str] | None = None) -> set[str]:
    """The top-level packages whose modules start warm: this one, and those named
    (comma-separated) in ``MOBIUS_WARM_PACKAGES`` of ``env`` (the test suite names its own,
    for the lying workers of tests/evil_worker.py)."""
    named = (os.environ if env is None else env).get(PACKAGES_ENV, "")
    return {__name__.split(".")[0], *(n.strip() for n in named.split(",") if n.strip())}


def can_start(argv: Sequence[str], env: Mapping[str, str] | None = None) -> bool:
    """Whether :func:`spawn` starts ``argv`` warm: :func:`python_m` of a module of
    :func:`packages`."""
    return python_m(argv) and argv[2].split(".")[0] in packages(env)


def _context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _die_with(owner: int) -> None:
    """SIGTERM this child when ``owner`` (the process that asked for it) dies, even by
    SIGKILL, as ``up``'s parent guard does for a cold child; and when the fork server dies."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        os._exit(143)
    if os.getppid() != parent:
        os._exit(143)

    def watch() -> None:
        select.select([pidfd], [], [])  # readable once the owner has exited
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="die-with-owner", daemon=True).start()


def _run(
    argv: list[str], env: dict[str, str], cwd: str | None, log: str, session: bool, owner: int
) -> None:
    """The child: become ``python -m argv[2] argv[3:]`` with ``env``, writing to ``log``."""
    # multiprocessing hands each child the owner's end of the pipe whose EOF tells the fork
    # server its owner is gone; a child that kept it would keep the fork server alive
    fs: Any = multiprocessing.forkserver._forkserver  # private: the owner-alive pipe below
    if fs._forkserver_alive_fd is not None:
        os.close(fs._forkserver_alive_fd)
        fs._forkserver_alive_fd = None
    _die_with(owner)
    if session:
        os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # line-buffered text on the new descriptors, as the log of a fresh interpreter
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.path.insert(0, os.getcwd())  # as `python -m` puts its working directory first
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


class ChildProcess(Protocol):
    """What supervisors use of a child: :class:`subprocess.Popen` or :class:`WarmProcess`."""

    pid: int

    @property
    def args(self) -> Any: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def spawn(
    argv: Sequence[str],
    log: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    start_new_session: bool = False,
) -> ChildProcess:
    """Start ``argv`` with its output appended to ``log``: warm where :func:`enabled` (in
    ``env``) and :func:`can_start`, otherwise a fresh interpreter."""
    if enabled(env) and can_start(argv, env):
        return WarmProcess(argv, log, env, cwd, start_new_session)
    with open(log, "ab") as out:  # the child keeps its own copy
        return subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=start_new_session,
        )


class WarmProcess:
    """A warm child, with the part of :class:`subprocess.Popen`'s interface supervisors use."""

    def __init__(
        self,
        argv: Sequence[str],
        log: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        start_new_session: bool = False,
    ) -> None:
        if not python_m(argv):
            raise ValueError(f"not a `{sys.executable} -m MODULE` command: {list(argv)}")
        self.args = list(argv)
        self._proc = _context().Process(
            target=_run,
            args=(
                self.args,
                dict(os.environ if env is None else env),
                None if cwd is None else str(cwd),
                str(Path(log).resolve()),
                start_new_session,
                os.getpid(),
            ),
            daemon=False,
        )
        with _MAIN_LOCK:  # no caller's script is run again as the child's __mp_main__
            main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
            try:
                self._proc.start()
            finally:
                sys.modules["__main__"] = main
        # multiprocessing joins its children when this process exits; a supervised child is
        # stopped by its supervisor instead, so it is not one of them.
        multiprocessing.process._children.discard(self._proc)  # type: ignore[attr-defined]
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
