"""Warm starts (mobius_fed/warmstart.py): a child forked from the fork server behaves as
the fresh ``python -m`` it replaces: its own pid and session, its environment, working
directory, arguments and output file, its exit status (a signal's too), and it dies with
the process that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mobius_fed.warmstart import WarmProcess, can_start, enabled, spawn

REPO = Path(__file__).resolve().parents[1]
CHILD = [sys.executable, "-m", "tests.warm_child"]


def _report(log: Path, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = log.read_text().split("\n", 1)[0] if log.exists() else ""
        if line.startswith("{"):
            return json.loads(line)
        time.sleep(0.05)
    raise AssertionError(f"no report in {log}: {log.read_text() if log.exists() else ''}")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"  # a zombie no one reaps (PID 1 of a container may not) is dead


def test_which_commands_start_warm() -> None:
    assert can_start([sys.executable, "-m", "mobius_fed.cli.worker", "--rank", "0"])
    assert not can_start(["/usr/bin/python3.99", "-m", "mobius_fed.cli.worker"])
    assert not can_start([sys.executable, "-m", "http.server"])
    assert not can_start(["ip", "netns", "exec", "site-0", sys.executable, "-m", "mobius_fed"])
    evil = [sys.executable, "-m", "tests.evil_worker"]
    assert can_start(evil, {"MOBIUS_WARM_PACKAGES": "other, tests"}) and not can_start(evil, {})
    assert enabled({"MOBIUS_WARM_START": "1"}) and not enabled({"MOBIUS_WARM_START": "0"})
    assert not enabled({})
    with pytest.raises(ValueError, match="-m MODULE` command"):
        WarmProcess(["ls"], "/dev/null")


def test_the_preload_leaves_the_fork_server_fit_to_fork() -> None:
    """Past torch, the preloaded daemon modules start no thread (no gRPC event engine, no
    pool): a child forked after them holds no lock or thread state it did not start."""
    probe = (
        "import os, sys\n"
        "from mobius_fed.warmstart import PRELOAD\n"
        "tasks = lambda: sorted(open(f'/proc/self/task/{t}/comm').read().strip()"
        " for t in os.listdir('/proc/self/task'))\n"
        "for name in [n for n in PRELOAD if n.split('.')[0] == 'torch']: __import__(name)\n"
        "before = tasks()\n"
        "for name in PRELOAD: __import__(name)\n"
        "print(before == tasks(), before, tasks(), 'grpc' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "True" and out[-1] == "True", out  # gRPC imported, no thread more


def test_a_warm_child_is_the_python_m_it_replaces(tmp_path: Path) -> None:
    env = {**os.environ, "WARM_PROBE": "from the caller"}
    log = tmp_path / "child.log"
    p = WarmProcess([*CHILD, "exit", "7"], log, env, cwd=REPO, start_new_session=True)
    assert p.wait(timeout=60) == 7 and p.poll() == 7 and p.returncode == 7
    r = _report(log)
    assert r["argv"] == ["exit", "7"] and r["cwd"] == str(REPO)
    assert r["pid"] == p.pid != os.getpid() and r["sid"] == p.pid  # a session of its own
    assert r["probe"] == "from the caller"
    assert r["torch_preloaded"]  # the point: torch came with the fork
    assert "to stderr" in log.read_text()

    log = tmp_path / "raise.log"
    p = WarmProcess([*CHILD, "raise"], log, env, cwd=REPO)
    assert p.wait(timeout=60) == 1
    assert "RuntimeError: a failure the log must show" in log.read_text()


def test_a_signal_ends_a_warm_child_as_it_ends_a_popen(tmp_path: Path) -> None:
    log = tmp_path / "sleep.log"
    p = WarmProcess([*CHILD, "sleep"], log, cwd=REPO)
    _report(log)
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    p.kill()
    assert p.wait(timeout=30) == -signal.SIGKILL
    p.kill()  # a second kill of an ended child is harmless


def test_spawn_starts_warm_only_when_on(tmp_path: Path) -> None:
    guard = [sys.executable, "-m", "mobius_fed.cli.parent_guard"]  # exits 1: no command
    for on, kind in (("1", WarmProcess), ("0", subprocess.Popen)):
        log = tmp_path / f"guard-{on}.log"
        p = spawn(guard, log, {**os.environ, "MOBIUS_WARM_START": on})
        assert isinstance(p, kind) and p.wait(timeout=60) == 1
        assert "usage: python -m mobius_fed.cli.parent_guard" in log.read_text()
    for named, kind in (("", subprocess.Popen), ("tests", WarmProcess)):
        env = {**os.environ, "MOBIUS_WARM_START": "1", "MOBIUS_WARM_PACKAGES": named}
        p = spawn([*CHILD, "exit", "3"], tmp_path / f"{named}.log", env, cwd=REPO)
        assert isinstance(p, kind) and p.wait(timeout=60) == 3  # another package: if named
        assert _report(tmp_path / f"{named}.log")["torch_preloaded"] == bool(named)


def test_a_warm_child_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """As ``parent_guard`` does for a cold child of ``up``: SIGKILL the owner, and its fork
    server and the warm child go too."""
    log = tmp_path / "orphan.log"
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from mobius_fed.warmstart import WarmProcess\n"
            f"p = WarmProcess({[*CHILD, 'sleep']!r}, {str(log)!r}, cwd={str(REPO)!r})\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        assert _report(log)["pid"] == child and not _gone(child)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10  # SIGTERM at once: the child watches its owner's pid
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child), "the warm child outlived the process that started it"
    finally:
        owner.kill()
        if not _gone(child := locals().get("child", 0) or 0) and child:
            os.kill(child, signal.SIGKILL)
