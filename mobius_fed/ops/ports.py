"""Loopback ports for the daemons of a federation on one machine, never handed out twice.

``free_ports`` draws ports below the kernel's ephemeral range, so that no outgoing
connection takes one before its daemon binds it. Two processes drawing at once (two test
processes, a test and the ``mobius-fed up`` it started) could still draw the same free port,
or one could probe a port that the other's daemon is about to bind again after a ring
restart. So each port handed out is also leased machine-wide: a POSIX record lock on byte
``port`` of one lock file in the temporary directory, held by the process that drew it
until it exits (the kernel drops the locks of a process that dies, however it dies). A port
another process holds is never drawn.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

LEASES = Path(tempfile.gettempdir()) / "mobius-fed-ports.lock"
_HANDED_OUT: set[int] = set()  # by free_ports in this process: never handed out twice
_lease_fd: int | None = None  # one descriptor for the process: closing any drops the locks


def _lease(port: int) -> bool:
    """Lease ``port`` to this process; False if another process holds it. Without a lock
    file (read-only temporary directory) every port leases: this process's set still holds."""
    global _lease_fd
    if _lease_fd is None:
        try:
            _lease_fd = os.open(LEASES, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            return True
    try:
        fcntl.lockf(_lease_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return False
    return True


def free_ports(n: int, lowest: int = 10_000) -> list[int]:
    """``n`` loopback ports free now, drawn below the kernel's ephemeral range and leased to
    this process (module docstring)."""
    try:
        top = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        top = 32_768  # Linux's default start of the range
    span = range(lowest, top) if top - lowest > 100 * n else range(1024, 65_536)  # no room
    ports: list[int] = []
    for port in random.SystemRandom().sample(span, min(len(span), 50 * n)):  # a few tries
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            if not _lease(port):
                continue
            _HANDED_OUT.add(port)
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free loopback ports in {50 * n} tries in {span.start}..{span.stop}")
