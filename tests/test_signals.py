"""Stop signals and supervision with real processes: the daemons stop within 2 s on SIGTERM
(exit 0 after a finished run, 143 otherwise) and leave the last manifest intact; ``mobius-fed
up`` forwards SIGTERM to every child, leaves no orphans, and restarts a crashed child."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mobius_fed.checkpoint import load_checkpoint, sha256_of
from mobius_fed.cli import coordinator as coordinator_cli
from mobius_fed.cli import main as main_cli
from mobius_fed.cli import worker as worker_cli
from mobius_fed.cli.common import flag_values
from mobius_fed.cli.up import STOP_DEADLINE
from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.manifests import latest_manifest
from mobius_fed.ops.federation import LocalFederation

# Two workers, the smallest model, one torch thread each: the 2 cores are shared.
TINY = dict(workers=2, preset="cpu-tiny", batch_size=2, optimizer="adamw", eval_every=0)
STOP_WITHIN = 2.0
# `up` as users run it: each child a fresh interpreter under up's parent guard, found by its
# command line among up's own children (not forked from a warm-start server)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MOBIUS_WARM_START": "0"}


# --------------------------------------------------------------------------- flags (no processes)
def test_resume_flag_takes_auto_or_a_boolean() -> None:
    parse = coordinator_cli.build_parser().parse_args
    assert parse([]).resume is None
    assert parse(["--resume"]).resume is True
    assert parse(["--resume", "auto"]).resume == "auto"
    assert parse(["--resume", "false"]).resume is False
    assert parse(["--resume", "--steps", "3"]).resume is True
    with pytest.raises(SystemExit):
        parse(["--resume", "sometimes"])
    up = main_cli.build_parser().parse_args
    assert up(["up"]).resume is None and up(["up", "--resume"]).resume is True
    assert up(["up", "--resume", "auto"]).resume == "auto"


def test_recovery_flags_reach_the_config_keys() -> None:
    args = coordinator_cli.build_parser().parse_args(
        [
            "--rejoin-timeout",
            "42.5",
            "--max-incidents",
            "3",
            "--keep-checkpoints",
            "2",
            "--state-copy",
            "off",
        ]
    )
    flags = flag_values(args, coordinator_cli.FLAGS)
    assert flags["rejoin_timeout"] == 42.5 and flags["max_incidents"] == 3
    assert flags["keep_checkpoints"] == 2 and flags["state_copy"] == "off"
    args = worker_cli.build_parser().parse_args(["--link-grace", "90"])
    assert flag_values(args, worker_cli.FLAGS)["link_grace"] == 90.0
    up = main_cli.build_parser().parse_args(
        [
            "up",
            "--rejoin-timeout",
            "30",
            "--max-incidents",
            "4",
            "--keep-checkpoints",
            "3",
            "--checkpoint-every",
            "5",
        ]
    )
    assert (up.rejoin_timeout, up.max_incidents, up.keep_checkpoints) == (30.0, 4, 3)
    assert up.checkpoint_every == 5 and up.max_restarts == 5


def test_up_passes_flags_and_per_node_bundles(tmp_path: Path) -> None:
    fed = LocalFederation(
        tmp_path, TrainConfig(**TINY), rejoin_timeout=30, max_incidents=4, keep_checkpoints=3
    )
    cmd = fed.coordinator_cmd(resume="auto")
    assert cmd[cmd.index("--rejoin-timeout") + 1] == "30"
    assert cmd[cmd.index("--max-incidents") + 1] == "4"
    assert cmd[cmd.index("--keep-checkpoints") + 1] == "3"
    assert cmd[-2:] == ["--resume", "auto"]
    assert "--resume" not in fed.coordinator_cmd()
    for node, argv in (("coordinator", cmd), ("worker-1", fed.worker_cmd(1))):
        d = tmp_path / "certs" / "nodes" / node
        got = [argv[argv.index(f) + 1] for f in ("--ca", "--cert", "--key")]
        assert got == [str(d / "ca.crt"), str(d / "tls.crt"), str(d / "tls.key")]


# --------------------------------------------------------------------------- daemons
def _federation(root: Path, steps: int) -> LocalFederation:
    fed = LocalFederation(root, TrainConfig(**TINY, steps=steps), checkpoint_every=2, threads=1)
    return fed.prepare().start()


def _wait_status(fed: LocalFederation, ok, timeout: float = 90.0, ending: bool = False) -> dict:
    """The first status doc that ``ok`` accepts; a child that exits first fails the test,
    unless ``ending`` and it exited 0 (a worker leaves on its own once the run is done,
    which may come before the status poll sees the coordinator's "done")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = fed.status()
        if doc is not None and ok(doc):
            return doc
        for name, p in fed.procs.items():
            rc = p.poll()
            assert rc is None or (ending and rc == 0), f"{name} exited ({rc}): {fed.tail(name)}"
        time.sleep(0.1)
    raise AssertionError(f"timed out; coordinator log:\n{fed.tail('coordinator')}")


def _term(fed: LocalFederation, name: str) -> tuple[int, float]:
    """SIGTERM one child; its exit status and how long it took to exit."""
    proc = fed.procs[name]
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=10)
    return rc, time.monotonic() - start


def _training(doc: dict) -> bool:
    return doc["phase"] == "training" and doc["step"] >= 5 and doc["checkpoint"] is not None


@pytest.fixture(scope="module")
def terminated_mid_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One federation for the two mid-run checks below (one start, not two): it trains past
    a checkpoint, then worker-1 gets SIGTERM, then the coordinator (the run not done)."""
    fed = _federation(tmp_path_factory.mktemp("mid-run"), steps=10_000)
    try:
        _wait_status(fed, _training)
        worker = _term(fed, "worker-1")
        coordinator = _term(fed, "coordinator")
    finally:
        fed.stop(grace=5)
    return {"fed": fed, "worker-1": worker, "coordinator": coordinator}


@pytest.mark.slow
@pytest.mark.xdist_group("signals-mid-run")
def test_sigterm_coordinator_mid_run_exits_143_and_keeps_the_manifest(
    terminated_mid_run: dict,
) -> None:
    fed = terminated_mid_run["fed"]
    rc, seconds = terminated_mid_run["coordinator"]
    assert rc == 143, fed.tail("coordinator")
    assert seconds < STOP_WITHIN, f"coordinator took {seconds:.2f}s to stop"
    assert "SIGTERM received" in fed.tail("coordinator", 40)
    manifest = latest_manifest(fed.coordinator_out)
    assert manifest is not None, "the last complete manifest must survive"
    doc = json.loads(manifest.read_text())
    load_checkpoint(manifest.parent / doc["er"])
    for w in doc["workers"].values():
        assert sha256_of(Path(w["path"])) == w["sha256"]


@pytest.mark.slow
@pytest.mark.xdist_group("signals-mid-run")
def test_sigterm_worker_mid_run_exits_143(terminated_mid_run: dict) -> None:
    fed = terminated_mid_run["fed"]
    rc, seconds = terminated_mid_run["worker-1"]
    assert rc == 143, fed.tail("worker-1")
    assert seconds < STOP_WITHIN, f"worker-1 took {seconds:.2f}s to stop"
    # The run is not done (it failed, or waits for worker-1 to come back): 143 too.
    rc, seconds = terminated_mid_run["coordinator"]
    assert rc == 143 and seconds < STOP_WITHIN, (rc, seconds, fed.tail("coordinator"))


@pytest.mark.slow
def test_sigterm_after_a_finished_run_exits_0(tmp_path: Path) -> None:
    fed = _federation(tmp_path, steps=2)  # lingers with --linger -1 once done
    try:
        _wait_status(fed, lambda d: d["phase"] == "done", ending=True)
        for name in ("worker-0", "worker-1"):  # a finished worker exits 0 on its own
            assert fed.procs[name].wait(timeout=30) == 0, fed.tail(name)
        rc, seconds = _term(fed, "coordinator")
    finally:
        fed.stop(grace=5)
    assert rc == 0 and seconds < STOP_WITHIN, (rc, seconds, fed.tail("coordinator"))


# --------------------------------------------------------------------------- mobius-fed up
def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


class _Up:
    """``mobius-fed up`` as a subprocess; tracks every child it ever had."""

    def __init__(self, out: Path, *extra: str) -> None:
        self.out = out
        self.err = out.parent / f"{out.name}.stderr"
        argv = [sys.executable, "-m", "mobius_fed.cli.main", "up", "--workers", "2",
                "--preset", "cpu-tiny", "--batch-size", "2", "--eval-every", "0",
                "--checkpoint-every", "2", "--out", str(out), *extra]  # fmt: skip
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=ENV)
        self.seen: set[int] = set()

    def children(self) -> set[int]:
        kids = _children(self.proc.pid)
        self.seen |= kids
        return kids

    def child(self, node: str) -> int | None:
        for pid in self.children():
            if f"/nodes/{node}/tls.crt" in _cmdline(pid):
                return pid
        return None

    def log(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_for(self, ok, what: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            self.children()
            assert self.proc.poll() is None, f"up exited ({self.proc.returncode}):\n{self.log()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.log()}"
            time.sleep(0.1)

    def training(self) -> bool:
        log = self.out / "logs" / "coordinator.log"
        return log.is_file() and "all 2 workers joined" in log.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.seen:  # never leave anything behind, even when the test failed
            if _alive(pid) and "mobius_fed.cli" in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_up_forwards_sigterm_and_leaves_no_orphans(tmp_path: Path) -> None:
    up = _Up(tmp_path / "up", "--steps", "10000")
    try:
        up.wait_for(up.training, "training")
        kids = up.children()
        assert len(kids) == 3, [_cmdline(p) for p in kids]
        start = time.monotonic()
        up.proc.send_signal(signal.SIGTERM)
        out, _ = up.proc.communicate(timeout=20)
        seconds = time.monotonic() - start
    finally:
        up.close()
    assert up.proc.returncode == 143, up.log()
    # The children stopped by themselves within the grace (each exited 143, below, not
    # SIGKILLed), and up by its own deadline (STOP_DEADLINE: the grace and 5 s for its own
    # unwinding, a safety net it then exits by); a second for the exit to reach this test.
    # Not grace + 2 s: on a loaded machine up's unwinding alone took 2.4 s.
    assert seconds < STOP_DEADLINE + 1, seconds
    alive = [(p, _cmdline(p)) for p in up.seen if _alive(p)]
    assert not alive, f"children outlived up: {alive}"
    status = re.search(r"exit status: (.*)", up.log())
    assert status, up.log()
    codes = dict(item.rsplit(" ", 1) for item in status.group(1).split(", "))
    assert codes == {"coordinator": "143", "worker-0": "143", "worker-1": "143"}, codes
    assert "last complete checkpoint:" in out.decode()


def test_supervise_restarts_a_crashed_child_up_to_the_cap(tmp_path: Path) -> None:
    """LocalFederation.supervise with stand-in children (no coordinator is running, so the
    run counts as not ended): crashes are restarted with the same command, at most
    max_restarts times each; a clean exit is final."""
    said: list[str] = []
    fed = LocalFederation(tmp_path, TrainConfig(**TINY), max_restarts=2, on_event=said.append)
    fed.logs.mkdir(parents=True)
    crash = [sys.executable, "-c", "import os; os._exit(3)"]
    fed._spawn("worker-1", crash)
    fed._spawn("worker-0", [sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while fed.restarts.get("worker-1", 0) < 2 or fed.procs["worker-1"].poll() is None:
        assert time.monotonic() < deadline, said
        fed.supervise()
        time.sleep(0.05)
    while "worker-1" not in fed._settled:
        assert time.monotonic() < deadline, said
        fed.supervise()
        time.sleep(0.05)
    assert said == [
        "worker-1 exited with 3; restarting (1/2)",
        "worker-1 exited with 3; restarting (2/2)",
        "worker-1 exited with 3; not restarting (2/2 used)",
    ], said
    assert fed._cmds["worker-1"] == crash and "worker-0" in fed._settled
    assert fed.restarts == {"worker-1": 2}
    # A crashed coordinator comes back with --resume auto.
    fed._spawn("coordinator", crash)
    fed.procs["coordinator"].wait()
    fed.supervise()
    assert fed._cmds["coordinator"][-2:] == ["--resume", "auto"]
    fed.stop(grace=2)


@pytest.mark.slow
def test_up_restarts_a_killed_worker_and_shows_the_recovery(tmp_path: Path) -> None:
    up = _Up(tmp_path / "up", "--steps", "10000", "--max-restarts", "2")
    try:
        up.wait_for(up.training, "training")
        victim = up.child("worker-1")
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        line = "worker-1 exited with -9; restarting (1/2)"
        up.wait_for(lambda: line in " ".join(up.log().split()), "the restart line", 30)
        up.wait_for(lambda: up.child("worker-1") not in (None, victim), "a new worker-1")
        said = lambda: " ".join(up.log().split())  # noqa: E731
        up.wait_for(lambda: "incident 1: worker-1" in said(), "the incident line", 30)
        up.wait_for(lambda: "incident 1 recovered in" in said(), "the recovery line", 60)
        up.proc.send_signal(signal.SIGTERM)
        up.proc.communicate(timeout=20)
    finally:
        up.close()
    assert up.proc.returncode == 143, up.log()
    assert not [p for p in up.seen if _alive(p)], "children outlived up"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie is gone for our purpose
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_guarded_daemon_dies_with_its_parent_even_by_sigkill(tmp_path: Path) -> None:
    """`up` starts daemons through mobius_fed.cli.parent_guard (no preexec_fn in the fork):
    the daemon keeps the guard's pid, and SIGKILL of the parent takes it down."""
    parent_code = (
        "import subprocess, sys, time\n"
        "from mobius_fed.ops.federation import _guarded\n"
        "child = subprocess.Popen(_guarded([sys.executable, '-c', "
        "'import time; time.sleep(120)']), start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 20
    while "time.sleep(120)" not in Path(f"/proc/{child}/cmdline").read_text():
        assert time.monotonic() < deadline, "the guard never exec'd its command"
        time.sleep(0.05)  # the guard has exec'd: same pid, the daemon's command line
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the daemon outlived its SIGKILLed parent"
        time.sleep(0.05)
    late = subprocess.run([sys.executable, "-m", "mobius_fed.cli.parent_guard", "1",
                           sys.executable, "-c", "print('ran')"], capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert late.returncode == 143 and "ran" not in late.stdout, "a parent already gone"
