"""Run a Compose project without a container engine: one Linux network namespace per service
(docs/deployment.md "Network-namespace testbed").

What docs/ leaves out: namespaces ``<prefix>-switch`` (one bridge per compose network) and
``<prefix>-<service>``; ``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over
``/etc/hosts``; network *k* is ``10.213.<k+1>.0/24`` and no namespace has a default
route (every network is as closed as compose ``internal: true``); a service's veths are
``eth0``, ``eth1``, ... in its network order; an empty ``resolv.conf`` next to the
``/etc/netns`` hosts file keeps other lookups from waiting on DNS. Each process runs as ``ip
netns exec NS unshare --mount --propagation private -- sh -c SCRIPT sh ARGV...``: the script
mounts a private tmpfs over each volume target's top-level directory (e.g. ``/srv``; the
host's stays untouched), bind-mounts the volumes (read-only ones remounted ``ro``), then
``exec``\\ s the command, so the service's main pid is the command's own. Named volumes are
``<root>/volumes/<name>``, logs ``<root>/logs``. :meth:`Testbed.down` (also ``__exit__``)
tears everything down; :func:`~.namespaces.cleanup_stale` removes a killed run's leftovers.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from mobius_fed.testbed.compose import ComposeProject, Service, load_compose
from mobius_fed.testbed.filesystem import ServiceFilesystem
from mobius_fed.testbed.namespaces import (
    TestbedError,
    fresh_prefix,
    kill_process_groups,
    log,
    lookup_service,
    netns_available,
)
from mobius_fed.testbed.network import TestbedNetwork
from mobius_fed.testbed.supervisor import Supervisor, service_env

if TYPE_CHECKING:  # wan is imported where used: `python -m mobius_fed.testbed.wan` runs it
    from mobius_fed.testbed.wan import WanShape

P = ParamSpec("P")
R = TypeVar("R")


def _forward(
    part: str, method: Callable[Concatenate[Any, P], R]
) -> Callable[Concatenate[Testbed, P], R]:
    """A Testbed method that calls ``method`` on its component ``self.<part>``."""

    @functools.wraps(method)
    def forwarded(self: Testbed, *args: P.args, **kwargs: P.kwargs) -> R:
        return getattr(getattr(self, part), method.__name__)(*args, **kwargs)

    return forwarded


class Testbed:
    """A compose project running as hosts in network namespaces on this machine.

    ``env_overrides`` maps a service to environment variables that replace or extend its
    compose environment (e.g. ``{"coordinator": {"MOBIUS_STEPS": "8"}}``). ``wan`` maps a
    service to the shape of its access link (rate and one-way delay, see
    :mod:`mobius_fed.testbed.wan`); services not named are unshaped.

    Its parts ``net`` (:class:`~.network.TestbedNetwork`), ``fs``
    (:class:`~.filesystem.ServiceFilesystem`) and ``supervisor`` (:class:`~.supervisor.Supervisor`)
    document the methods forwarded to them.
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        compose_file: str | os.PathLike[str],
        root_dir: str | os.PathLike[str],
        *,
        project: str | None = None,
        env_overrides: Mapping[str, Mapping[str, str]] | None = None,
        prefix: str | None = None,
        environ: Mapping[str, str] | None = None,
        wan: Mapping[str, WanShape] | None = None,
    ) -> None:
        self.compose_file = Path(compose_file)
        self.project: ComposeProject = load_compose(compose_file, environ=environ, project=project)
        self.root = Path(root_dir).resolve()
        for svc, env in (env_overrides or {}).items():
            if svc not in self.project.services:
                raise TestbedError(f"override for unknown service {svc!r}")
            self.project.services[svc].environment.update({k: str(v) for k, v in env.items()})
        self.wan = {svc: shape for svc, shape in (wan or {}).items() if shape.shaped}
        for svc in self.wan:
            lookup_service(self.project, svc)
        self.prefix = prefix or fresh_prefix()
        if len(self.prefix) > 12 or not self.prefix.replace("-", "").isalnum():
            raise TestbedError(f"bad prefix {self.prefix!r} (≤ 12 letters/digits)")
        self.logs_dir = self.root / "logs"
        self.volumes_dir = self.root / "volumes"
        self.net = TestbedNetwork(self.project, self.prefix, self.wan, self._say)
        self.fs = ServiceFilesystem(self.project, self.volumes_dir)
        self.supervisor = Supervisor(
            self.project, self.logs_dir, self._say, self._host_argv, self._is_up
        )
        self._built = False
        self._closed = False
        self._tb_log: IO[str] | None = None

    def _say(self, msg: str) -> None:
        log.info("%s", msg)
        if self._tb_log is not None:
            self._tb_log.write(f"{time.strftime('%H:%M:%S')} {msg}\n")
            self._tb_log.flush()

    def _host_argv(self, svc: Service, argv: Sequence[str]) -> list[str]:
        return self.fs.host_argv(self.net.namespace(svc.name), svc, argv)

    def _is_up(self) -> bool:
        return self._built and not self._closed

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Testbed:
        try:
            self.build()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        """Create volume directories, namespaces, bridges, veths and hosts files."""
        if self._built:
            return
        if self._closed:
            raise TestbedError("this testbed was torn down; make a new one")
        reason = netns_available()
        if not reason and self.wan:
            from mobius_fed.testbed.wan import wan_tools_missing

            reason = wan_tools_missing(self.wan.values())
        if reason:
            raise TestbedError(reason)
        self._built = True
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._tb_log = open(self.logs_dir / "testbed.log", "a")  # noqa: SIM115
        self._say(
            f"testbed {self.prefix}: project {self.project.name} from {self.compose_file}, "
            f"root {self.root}"
        )
        for note in self.project.notes:
            self._say(f"note: {note}")
        self.fs.make_volumes()
        self.net.plan_addresses()
        self.fs.check_mounts()
        self.net.build()
        if any(shape.delay > 0 for shape in self.wan.values()):
            self.net.start_delay_lines(self.logs_dir, service_env)

    def up(self, timeout: float = 300.0, services: Sequence[str] | None = None) -> None:
        """Build, then start services in dependency order (see :meth:`Supervisor.up`)."""
        self.build()
        self.supervisor.up(timeout, services)

    # ------------------------------------------------------------------ forwarded
    @property
    def switch_namespace(self) -> str:
        return self.net.switch_namespace

    namespace = _forward("net", TestbedNetwork.namespace)
    namespaces = _forward("net", TestbedNetwork.namespaces)
    address = _forward("net", TestbedNetwork.address)
    volume_path = _forward("fs", ServiceFilesystem.volume_path)
    log_path = _forward("supervisor", Supervisor.log_path)
    log_tail = _forward("supervisor", Supervisor.log_tail)
    describe_failure = _forward("supervisor", Supervisor.describe_failure)
    exec = _forward("supervisor", Supervisor.exec)
    processes = _forward("supervisor", Supervisor.processes)
    returncode = _forward("supervisor", Supervisor.returncode)
    restarts = _forward("supervisor", Supervisor.restarts)
    failed = _forward("supervisor", Supervisor.failed)
    finished = _forward("supervisor", Supervisor.finished)
    running = _forward("supervisor", Supervisor.running)

    # ------------------------------------------------------------------ teardown
    def down(self) -> None:
        """Stop everything and remove every namespace, veth, bridge and /etc/netns entry.
        Safe to call more than once, and after a partial build."""
        if self._closed:
            return
        self._closed = True
        saved = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # finish the cleanup
                saved[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            popens = self.supervisor.stop()
            self.net.kill_processes()
            kill_process_groups(popens)
            self.net.remove()
            self.fs.remove_host_dirs()
            self._say(f"testbed {self.prefix} removed")
            if self._tb_log is not None:
                self._tb_log.close()
                self._tb_log = None
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
