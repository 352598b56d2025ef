"""Named Linux network namespaces through ``ip netns``: whether they work here, listing,
killing what runs in them, removing a dead testbed's leftovers; and :class:`TestbedError`."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mobius_fed.testbed.compose import ComposeProject, Service
from mobius_fed.warmstart import ChildProcess

log = logging.getLogger("mobius_fed.testbed")

NETNS_ETC = Path("/etc/netns")


class TestbedError(RuntimeError):
    """The testbed could not be built, or a service failed; the message names it."""

    __test__ = False  # not a pytest test class


def lookup_service(project: ComposeProject, name: str) -> Service:
    """The project's service ``name``; TestbedError naming it when there is none."""
    try:
        return project.services[name]
    except KeyError:
        raise TestbedError(f"unknown service {name!r}") from None


def netns_available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "the namespace testbed needs root (ip netns, mount)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("mount", "mount")):
        if shutil.which(tool) is None:
            return (
                f"{tool} is not installed (apt-get install {package}, or "
                "scripts/install_system_tools.sh)"
            )
    name = f"mtbprobe{os.getpid()}"
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if r.returncode != 0:
            return f"`ip netns add` does not work here: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; TestbedError with its stderr when it fails and ``check``."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise TestbedError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    r = ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def fresh_prefix() -> str:
    """A ``mtb<hex>`` prefix no existing namespace starts with."""
    existing = list_netns()
    while True:
        p = "mtb" + secrets.token_hex(3)
        if not any(ns.startswith(p + "-") for ns in existing):
            return p


def _netns_pids(ns: str) -> list[int]:
    r = ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def kill_netns_processes(namespaces: Sequence[str], grace: float = 5.0) -> None:
    """SIGTERM every process in ``namespaces``, then SIGKILL what is left after ``grace``."""
    deadline = time.monotonic() + grace
    sig = signal.SIGTERM
    while True:
        pids = [p for ns in namespaces for p in _netns_pids(ns)]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if sig == signal.SIGKILL and time.monotonic() > deadline + 5:
            log.warning("processes %s survive SIGKILL", pids)
            return
        time.sleep(0.2)
        if time.monotonic() > deadline:
            sig = signal.SIGKILL


def kill_process_groups(popens: Sequence[ChildProcess]) -> None:
    """SIGKILL each process's group and reap it (waiting up to 5 s each)."""
    for p in popens:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


def cleanup_stale(prefix: str) -> list[str]:
    """Remove every namespace ``<prefix>-*`` (killing its processes) and ``/etc/netns``
    entries left by a testbed that died; returns the namespaces removed."""
    if not prefix:
        raise ValueError("cleanup_stale needs a non-empty prefix")
    stale = [ns for ns in list_netns() if ns.startswith(prefix + "-")]
    kill_netns_processes(stale, grace=2.0)
    for ns in stale:
        ip("netns", "del", ns, check=False)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.glob(prefix + "-*"):
            shutil.rmtree(d, ignore_errors=True)
    return stale
