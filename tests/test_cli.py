"""End-to-end tests of the ``mobius-fed`` command line (run as subprocesses)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"
TINY = ["--preset", "cpu-tiny", "--batch-size", "2"]


def mobius_fed(
    *args: str, cwd: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        # One intra-op thread: the cpu-tiny model gains nothing from more, and spinning
        # OpenMP threads slow to a crawl when the 2 cores are shared with other tests.
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def _flat(text: str) -> str:
    """The console wraps long lines; compare messages with whitespace collapsed."""
    return " ".join(text.split())


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["local", *TINY, "--workers", "5"], "not divisible by P=5"),
        (["local", *TINY, "--layers-per-group", "4,4,2,1,1"], "more groups than sites"),
        (["local", *TINY, "--loops", "0"], "loops"),
        (["local", *TINY, "--preset", "gpt5"], "invalid choice: 'gpt5'"),
        (["local", *TINY, "--order", "zigzag"], "invalid choice: 'zigzag'"),
        (["local", *TINY, "--encoding", "latin1"], "unknown encoding 'latin1'"),
        (["local", *TINY, "--micro-batches", "3"], "not divisible by micro_batches=3"),
        (["local", *TINY, "--data", "no/such/dir"], "data path not found: no/such/dir"),
        (["local", *TINY, "--config", "missing.toml"], "config file not found"),
        (["experiment", *TINY, "--loops", "1", "0"], "L must be ≥ 1, got 0"),
        (["experiment", *TINY, "--orders", "cyclic", "zigzag"], "unknown order 'zigzag'"),
        (["experiment", *TINY, "--workers", "5"], "not divisible by P=5"),
        (["prepare", "--out", "sites", "--encoding", "latin1"], "latin1"),
        (["up", *TINY, "--standbys", "-1"], "expected a whole number ≥ 0, got '-1'"),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, list) else None,
)
def test_bad_configuration_exits_with_a_clear_message(tmp_path, cli, args, expected) -> None:
    proc = cli(*args)  # an unexpected exception (a traceback) fails the test itself
    assert proc.returncode != 0, proc.stdout
    err = _flat(proc.stderr)
    assert expected in err, err
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything is written


def test_data_directory_without_sites_is_refused(tmp_path, cli) -> None:
    (tmp_path / "empty").mkdir()
    proc = cli("local", *TINY, "--data", "empty", "--out", "OUT")
    assert proc.returncode == 2
    err = _flat(proc.stderr)
    assert "empty" in err and "site-0" in err, err
    assert "Traceback" not in proc.stderr


def test_resume_without_checkpoint_is_refused(tmp_path, cli) -> None:
    proc = cli("local", *TINY, "--steps", "3", "--out", "OUT", "--resume")
    assert proc.returncode == 2
    err = _flat(proc.stderr)
    assert "--resume" in err and "no checkpoint" in err, err
    assert not (tmp_path / "OUT" / "checkpoint.pt").exists()


def test_local_run_writes_checkpoint_and_metrics(tmp_path, cli) -> None:
    proc = cli("local", *TINY, "--steps", "3", "--out", "OUT")
    assert proc.returncode == 0, proc.stderr
    assert "1 thread(s)" in _flat(proc.stderr)  # MOBIUS_THREADS=1 from tests/conftest.py
    out = tmp_path / "OUT"
    assert (out / "checkpoint.pt").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [0, 1, 2]
    assert [r["step"] for r in rows if "eval_loss" in r] == [3]
    assert "final validation loss (Eq. 8)" in proc.stdout

    # Resuming a finished run with a longer budget continues from step 3.
    proc = cli("local", *TINY, "--steps", "4", "--out", "OUT", "--resume")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [0, 1, 2, 3]


def test_resume_with_a_different_config_is_refused(tmp_path, cli) -> None:
    proc = cli("local", *TINY, "--steps", "1", "--out", "OUT")
    assert proc.returncode == 0, proc.stderr
    proc = cli(
        "local",
        *TINY,
        "--steps",
        "2",
        "--order",
        "ordered",
        "--out",
        "OUT",
        "--resume",
    )
    assert proc.returncode != 0
    assert "different configuration" in _flat(proc.stderr), proc.stderr


def test_experiment_prints_the_table(tmp_path) -> None:
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not found")
    proc = mobius_fed(
        "experiment", *TINY, "--steps", "3", "--eval-every", "0",
        "--loops", "1", "2", "--orders", "ordered", "cyclic",
        "--data", str(SHAKESPEARE), "--out", "OUT",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    header = "| L | ordered-loop loss | K | Möbius loss | Δ |"
    lines = proc.stdout.splitlines()
    assert header in lines
    start = lines.index(header)
    rows = [ln for ln in lines[start + 2 :] if ln.startswith("| ")]
    assert len(rows) == 2, proc.stdout
    for L, row in zip((1, 2), rows):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == str(L)
        assert cells[2] == str(4 * L)  # K = L·P with the default P = 4
        ordered, cyclic, delta = float(cells[1]), float(cells[3]), float(cells[4])
        assert delta == pytest.approx(cyclic - ordered, abs=2e-4)
    table = (tmp_path / "OUT" / "table.md").read_text()
    assert header in table
    assert all(row in table for row in rows)


def test_prepare_jsonl_writes_site_dirs(tmp_path, cli) -> None:
    docs = [{"text": f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * 5}
            for i in range(12)]  # fmt: skip
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    proc = cli("prepare", "docs.jsonl", "--out", "sites", "--sites", "3")
    assert proc.returncode == 0, proc.stderr
    for i in range(3):
        site = tmp_path / "sites" / f"site-{i}"
        assert (site / "train_000000.bin").is_file()
        assert (site / "val_000000.bin").is_file()
        meta = json.loads((site / "meta.json").read_text())
        assert meta["site"] == i and meta["sites"] == 3 and meta["encoding"] == "bytes"
    assert not (tmp_path / "sites" / "site-3").exists()
    # Without --overwrite a second run refuses to clobber the sites.
    proc = cli("prepare", "docs.jsonl", "--out", "sites", "--sites", "3")
    assert proc.returncode == 2
    assert "--overwrite" in _flat(proc.stderr)


def test_certs_renew_and_rotate(tmp_path, cli) -> None:
    """renew: a new key for one node, same identity; rotate: a new CA for everyone."""
    assert cli("certs", "init", "--workers", "2", "--out", "c").returncode == 0
    bundle = tmp_path / "c" / "nodes" / "worker-1"
    old_key, old_ca = (bundle / "tls.key").read_bytes(), (bundle / "ca.crt").read_bytes()
    done = cli("certs", "renew", "--node", "worker-1", "--out", "c")
    assert done.returncode == 0 and "mobius://worker/1" in done.stdout, done.stderr
    assert (bundle / "tls.key").read_bytes() != old_key
    assert (bundle / "ca.crt").read_bytes() == old_ca, "renewing one node keeps the CA"
    bad = cli("certs", "renew", "--node", "worker-7", "--out", "c")
    assert bad.returncode == 2 and "worker-7" in bad.stderr
    assert cli("certs", "rotate", "--out", "c").returncode == 0
    assert (bundle / "ca.crt").read_bytes() != old_ca


@pytest.mark.parametrize("daemon", ["worker", "coordinator"])
def test_daemons_refuse_an_unknown_mobius_variable(tmp_path, daemon) -> None:
    """A typo in a deployment's environment stops the daemon with the name, not silently."""
    proc = subprocess.run(
        [sys.executable, "-m", f"mobius_fed.cli.{daemon}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MOBIUS_LR_ADAMW": "0.1"},
    )
    assert proc.returncode == 2, proc.stderr
    err = _flat(proc.stderr)
    assert "unknown environment variable MOBIUS_LR_ADAMW (did you mean MOBIUS_LR_ADAM?)" in err
    assert "Traceback" not in proc.stderr


def test_local_reads_training_settings_from_the_environment(tmp_path) -> None:
    """MOBIUS_OPTIMIZER / MOBIUS_MICRO_BATCHES used to be ignored outside the daemons."""
    proc = subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.main", "config", "show", "--steps", "3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MOBIUS_OPTIMIZER": "adamw", "MOBIUS_MICRO_BATCHES": "2",
             "MOBIUS_STEPS": "9", "MOBIUS_PRIVACY__LABEL_NOISE": "0.5"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    train = json.loads(proc.stdout)["train"]
    assert (train["optimizer"], train["micro_batches"], train["steps"]) == ("adamw", 2, 3)
    assert train["privacy"]["label_noise"] == 0.5


def test_daemons_print_the_layered_config(tmp_path) -> None:
    """--print-config: TOML, then MOBIUS_*, then flags, resolved, without starting."""
    (tmp_path / "run.toml").write_text(
        '[coordinator]\nstrategy = "fedadam"\n[train]\nsteps = 5\nseed = 2\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.coordinator", "--config", "run.toml",
         "--ca", "a", "--cert", "b", "--key", "c", "--seed", "3", "--print-config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MOBIUS_STEPS": "6", "MOBIUS_SEED": "4"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["strategy"] == "fedadam"  # file
    assert (cfg["train"]["steps"], cfg["train"]["seed"]) == (6, 3)  # env > file, flag > env


def test_free_ports_lie_below_the_ephemeral_range_and_are_bindable():
    """`up` and the ring tests pick their daemons' ports here. A port from bind(0) is an
    ephemeral one that an outgoing connection may take before the daemon binds it."""
    import socket

    from mobius_fed.ops.ports import free_ports

    top = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(10_000 <= p < top for p in ports), (ports, top)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    # a second call before the first call's daemons bind (a relay's ports beside a
    # federation's) never hands a port out twice: 60 calls of 8 would collide by chance
    later = [q for _ in range(60) for q in free_ports(8)]
    assert len(set(later) | set(ports)) == len(later) + len(ports)


def test_free_ports_are_never_drawn_by_two_processes():
    """Two test processes (or a test and the `up` it started) draw at the same time: a port
    one holds is never drawn by the other, even while nothing is bound to it (the gap in
    which a daemon binds its port again after a ring restart)."""
    import subprocess
    import sys

    from mobius_fed.ops.ports import free_ports

    mine = set(free_ports(400))
    other = subprocess.run(
        [sys.executable, "-c", "from mobius_fed.ops.ports import free_ports; "
         "print(*free_ports(2000))"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    theirs = set(map(int, other.stdout.split()))
    assert len(theirs) == 2000 and not mine & theirs


# ------------------------------------------------------------- a run's state, like `ps`
UP_TINY = ["--workers", "2", *TINY, "--eval-every", "0", "--threads", "1"]


def test_status_of_a_starting_run_says_starting(tmp_path) -> None:
    """endpoints.json says "starting" and its `up` is alive, but no coordinator answers
    yet: status waits --timeout, then says so (exit 75), not "no endpoints.json" nor
    "cannot reach"."""
    from mobius_fed.cli.up import LocalFederation
    from mobius_fed.config import TrainConfig

    fed = LocalFederation(tmp_path / "run", TrainConfig(preset="cpu-tiny", workers=2))
    fed.write_endpoints("starting")  # what `up` writes first; its pid is this live process
    proc = mobius_fed("status", "--run", "run", "--timeout", "1", cwd=tmp_path)
    assert proc.returncode == 75, (proc.stdout, proc.stderr)
    out = _flat(proc.stdout)
    assert "starting" in out and f"pid {os.getpid()}" in out and "--timeout 60" in out, out
    proc = mobius_fed("status", "--run", "run", "--timeout", "0.5", "--json", cwd=tmp_path)
    assert proc.returncode == 75 and json.loads(proc.stdout)["state"] == "starting"


def test_up_runs_training_variables_and_flags_together(tmp_path) -> None:
    """A training setting from the environment beside one from a flag: the run's sites
    take the coordinator's whole config (the variables once made each site check the
    coordinator's config against those variables alone, and every registration failed)."""
    env = {"MOBIUS_RING_CODEC": "int8", "MOBIUS_SYNC__CODEC": "int8"}
    proc = mobius_fed(
        "up", *UP_TINY, "--steps", "2", "--sync-every", "2", "--out", "run", cwd=tmp_path,
        env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    train = (tmp_path / "run" / "train.toml").read_text()
    assert 'ring_codec = "int8"' in train and "sync_every = 2" in train, train
    logs = (tmp_path / "run" / "logs" / "worker-0.log").read_text()
    assert "config mismatch" not in logs, logs[-2000:]


def test_up_writes_its_endpoints_before_preparing(tmp_path) -> None:
    """`up` names its run in endpoints.json before certificates and data: a run that fails
    while preparing is found by status, which says it exited (nothing recorded)."""
    proc = mobius_fed("up", *UP_TINY, "--data", "missing.txt", "--out", "run", cwd=tmp_path)
    assert proc.returncode == 2 and "missing.txt" in _flat(proc.stderr), proc.stderr
    assert json.loads((tmp_path / "run" / "endpoints.json").read_text())["state"] == "exited"
    proc = mobius_fed("status", "--run", "run", cwd=tmp_path)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    out = _flat(proc.stdout)
    assert "exited" in out and "last known state: none recorded" in out, out


def processes_naming(path: Path) -> list[int]:
    """Live processes (not zombies) whose command line, working directory or an open file
    (a daemon's log) lies in ``path``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            places = [os.readlink(entry / "cwd")]
            places += [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if str(path) in cmd or any(p.startswith(str(path)) for p in places):
            found.append(int(entry.name))
    return found


@pytest.mark.slow(reason="a real `up` killed, its run read by status, then `up` twice more")
def test_status_follows_up_from_start_to_kill_and_up_refuses_the_dead_runs_out(
    tmp_path, cli
) -> None:
    """A real `up`: status (found as soon as endpoints.json exists) waits for the
    coordinator and answers; after `kill -9` of up it reports the run dead with the last
    step and checkpoint from the run directory; `up` into that --out then refuses unless
    --resume or --force (which deletes the run's outputs, keeping certs and sites). Status
    runs in this process (`cli`); `up` in processes of its own."""
    import signal
    import time

    from mobius_fed.coordinator.manifests import latest_manifest
    from mobius_fed.coordinator.run_dir import earlier_run

    run = tmp_path / "run"
    argv = [sys.executable, "-m", "mobius_fed.cli.main", "up", *UP_TINY, "--steps", "10000",
            "--checkpoint-every", "2", "--out", str(run)]  # fmt: skip
    up = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (run / "endpoints.json").is_file():
            assert up.poll() is None and time.monotonic() < deadline, up.stderr
            time.sleep(0.02)
        proc = cli("status", "--run", "run", "--timeout", "120")
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        assert "mobius-fed run" in proc.stdout and "workers" in proc.stdout
        while (manifest := latest_manifest(run / "coordinator")) is None:
            assert up.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.1)
        up.send_signal(signal.SIGKILL)
        up.wait(timeout=30)
        # its children die with it, but not at the same instant: a coordinator still
        # alive could write one more manifest after the one read below
        while processes_naming(run):
            assert time.monotonic() < deadline, processes_naming(run)
            time.sleep(0.05)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    manifest = latest_manifest(run / "coordinator")
    assert manifest is not None
    saved = json.loads(manifest.read_text())["step"]
    proc = cli("status", "--run", "run")
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    out = _flat(proc.stdout)
    assert "run run: dead" in out and f"pid {up.pid}" in out, out
    assert "last known state: phase" in out and "last complete checkpoint: " in out, out
    assert "continue it with: mobius-fed up --out run --resume" in out, out
    proc = cli("status", "--run", "run", "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 3 and doc["state"] == "dead", doc
    assert doc["last_known"]["step"] >= saved and doc["checkpoint"], doc

    proc = mobius_fed("up", *UP_TINY, "--steps", "2", "--out", "run", cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = _flat(proc.stderr)
    assert "--out run holds a run last seen at phase" in err and "--force" in err, err
    assert "--resume" in err and latest_manifest(run / "coordinator") == manifest
    # --force deletes the earlier run's outputs first (here the new run then stops at once,
    # on its missing --data); certificates and sites stay.
    proc = mobius_fed("up", *UP_TINY, "--force", "--data", "missing.txt", "--out", "run",
                      cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and "missing.txt" in _flat(proc.stderr), proc.stderr
    deleted = _flat(proc.stderr).split("--force: deleted the earlier run's ")[1]
    assert deleted.startswith("coordinator, logs, endpoints.json, train.toml, worker-0"), deleted
    assert earlier_run(run) is None and not (run / "worker-0").exists()
    assert (run / "certs" / "ca.crt").is_file() and (run / "sites" / "site-1").is_dir()


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_generate_and_eval_threads_help_names_their_own_work(command: str) -> None:
    from mobius_fed.cli.main import build_parser

    sub = next(
        a for a in build_parser([command])._actions if isinstance(a, argparse._SubParsersAction)
    )
    text = _flat(sub.choices[command].format_help())
    assert "--threads N torch intra-op threads" in text and "training" not in text, text
    assert ("generation" if command == "generate" else "evaluation") in text, text


def test_exported_models_folder_is_git_ignored() -> None:
    """`mobius-fed export runs/up --out models` (the README's) writes into the checkout."""
    repo = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout (or no git): nothing to ignore")
    for path in ("models/origin-0/model.safetensors", "runs/up/endpoints.json"):
        done = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", path], cwd=repo, timeout=30
        )
        assert done.returncode == 0, f"{path} is not git-ignored"


def test_up_standbys_start_standby_sites_beside_the_workers(tmp_path) -> None:
    """``up --standbys 2``: the federation it runs starts standby-0 and standby-1 with
    ``--standby``, standby certificates and sites of their own (docs/recovery.md)."""
    from mobius_fed.cli import common
    from mobius_fed.cli.main import build_parser
    from mobius_fed.cli.up import _federation

    args = build_parser().parse_args(["up", *TINY, "--standbys", "2", "--out", str(tmp_path)])
    fed = _federation(args, common.train_config_from_args(args), {})
    assert fed.standbys == 2
    P = fed.train.workers
    cmd = fed.worker_cmd(P + 1)
    assert "--standby" in cmd and str(fed.sites / f"site-{P + 1}") in cmd
    assert str(fed.bundle("standby-1").cert) in cmd


def test_sync_settings_the_path_cannot_take_are_refused(tmp_path, cli) -> None:
    """A τ above its limit, and an E/R outer step the strategy contradicts, are refused
    before anything runs, naming the value and the limit (or both values)."""
    proc = cli("local", *TINY, "--sync-delay", "2", "--out", "OUT")
    err = _flat(proc.stderr)
    assert proc.returncode == 2 and "τ=2" in err and "limit 1" in err, err
    proc = cli("up", *TINY, "--sync-outer", "diloco", "--strategy", "fedadam", "--out", "UP")
    err = _flat(proc.stderr)
    assert proc.returncode == 2, err
    assert "--sync-outer diloco conflicts with --strategy fedadam" in err, err
    assert not (tmp_path / "UP").exists() and "Traceback" not in proc.stderr
