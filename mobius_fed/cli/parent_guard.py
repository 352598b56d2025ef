"""Run a command that dies with its parent: ``python -m mobius_fed.cli.parent_guard PID CMD…``.

Sets ``PR_SET_PDEATHSIG`` (SIGTERM when PID dies, even by SIGKILL; survives ``exec``), then
execs CMD, which keeps the guard's pid. It lets ``up`` fork with no Python code in the child
(no ``preexec_fn``, whose ``pthread_atfork`` run could hang in gRPC's handler); see
docs/deployment.md "Stopping, restarting and healing".
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PARENT_GONE = 143  # as if the SIGTERM had come: the parent died before prctl took effect


def die_with(parent: int) -> None:
    """SIGTERM this process when ``parent`` dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(PARENT_GONE)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m mobius_fed.cli.parent_guard PARENT_PID COMMAND [ARG ...]")
    die_with(int(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
