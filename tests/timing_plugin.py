"""Per-test wall and CPU time, for finding where the suite's time goes (docs/testing.md).

Enabled by ``TEST_TIMES=FILE`` (tests/conftest.py registers it): every test
process appends one JSON line per test to ``FILE`` with its node id, the xdist worker, its
wall time (setup + call + teardown) and the CPU time of the test process's whole process
tree over the same span. The tree's CPU is, for the test process and every descendant
alive at either end, user + system time plus the time of the children each has reaped
(``/proc/PID/stat`` fields 14-17), so a daemon that a test started and waited for counts,
and so does a forked child of the warm-start fork server. A descendant that outlives its
parent and is reparented outside the tree is not counted: the figure is a lower bound.
Each line also has ``own`` (the CPU of the test process alone: what the test computes
in-process), ``start`` (epoch seconds) and ``pid`` (the test process), so that a process
accounting log (``accton``) can be matched to the test that started each process.
``python scripts/test_times.py FILE`` reads the lines and prints the slowest tests with
their CPU share.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds incl. reaped children) of ``pid``; None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return ppid, (utime + stime + cutime + cstime) / TICKS


def tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and all its live descendants (each with its reaped ones)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


class TestTimes:
    """Appends one JSON line per test to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        start, wall0, cpu0 = time.time(), time.monotonic(), tree_cpu(os.getpid())
        own0 = time.process_time()
        yield
        wall = time.monotonic() - wall0
        cpu = max(0.0, tree_cpu(os.getpid()) - cpu0)
        own = time.process_time() - own0
        slow = item.get_closest_marker("slow")
        reason = slow.kwargs.get("reason") if slow is not None else None
        line = {"test": item.nodeid, "worker": self.worker, "wall": wall, "cpu": cpu}
        line |= {"own": round(own, 3), "start": round(start, 2), "pid": os.getpid()}
        line |= {"reason": reason} if reason else {}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
