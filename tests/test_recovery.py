"""Incidents and recovery with real processes: a killed, frozen or replaced worker and a
killed coordinator heal by themselves, and the run ends with the uninterrupted losses."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mobius_fed.checkpoint import load_checkpoint
from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.manifests import complete_manifests
from mobius_fed.ops.federation import LocalFederation
from tests.test_coordinator import BASE, max_diff, reference, ring_history

pytestmark = pytest.mark.slow


def federation(tmp_path: Path, steps: int = 14, **kw) -> LocalFederation:
    train = TrainConfig(**BASE, steps=steps, sync_every=1)
    opts = dict(checkpoint_every=2, heartbeat_timeout=3.0, max_restarts=3, threads=1)
    return LocalFederation(tmp_path, train, **{**opts, **kw})


def wait_for_step(fed: LocalFederation, step: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while (doc := fed.status()) is None or doc["step"] < step:
        assert time.monotonic() < deadline, fed.tail("coordinator")
        if fed.max_restarts:
            fed.supervise()
        time.sleep(0.1)
    return doc


def finish(fed: LocalFederation, timeout: float = 240) -> dict:
    try:
        final = fed.wait(timeout=timeout)
        got, _ = ring_history(fed)
    finally:
        fed.stop()
    assert final["phase"] == "done", (final.get("error"), fed.tail("coordinator", 40))
    ref, _ = reference(fed, fed.strategy, fed.strategy_options)
    assert max_diff(got, ref) <= 1e-5, "recovery must not change the losses"
    return final


def restorable_rounds(fed: LocalFederation) -> dict[int, set[int]]:
    """What each worker reported it can restore at the (last) incident, from the log."""
    text = (fed.logs / "coordinator.log").read_text()
    line = text[text.rindex("rounds each worker can restore: ") :].split("\n", 1)[0]
    return {
        int(part.split(":")[0].split("-")[1]): set(json.loads(part.split(":", 1)[1]))
        for part in line.split(": ", 1)[1].split("; ")
    }


def assert_redo_bound(fed: LocalFederation, inc: dict, lost: int) -> None:
    """A crash redoes the round in flight, and one more only where the lost worker's
    snapshot of the round before could not be restored (docs/recovery.md, "What is kept,
    and what is redone"): that barrier file is written in the background after the reply,
    so a SIGKILL while it is written loses it. With a barrier every step, 1 step, else 2,
    and the rollback never skips a round that every worker and the coordinator could
    restore: the coordinator has every round before the one in flight (the two newest in
    memory), never the round in flight, even where every worker finished it."""
    have = restorable_rounds(fed)
    common = {r for r in set.intersection(*have.values()) if r < inc["round"]}
    assert inc["rollback_round"] == max(common), (inc, have)
    assert inc["steps_redone"] <= 2, (inc, have)
    if inc["steps_redone"] == 2:  # only the lost worker may lack the round before
        before = inc["round"] - 1
        assert before not in have[lost], (inc, have)
        assert all(before in r for rank, r in have.items() if rank != lost), (inc, have)


def test_killed_worker_is_restarted_and_the_run_heals(tmp_path: Path):
    fed = federation(tmp_path, keep_checkpoints=2).prepare().start()
    wait_for_step(fed, 5)
    os.kill(fed.procs["worker-2"].pid, signal.SIGKILL)
    final = finish(fed)
    (inc,) = final["incidents"]
    assert inc["rank"] == 2 and inc["state"] == "recovered", inc
    assert "worker-1 → worker-2" in inc["edge"] and "worker-2 → worker-3" in inc["edge"]
    # its session closed: seen before the heartbeat timeout (3 s) could have expired
    assert inc["detection_s"] is not None and inc["detection_s"] < 3.0, inc
    assert_redo_bound(fed, inc, lost=2)
    assert fed.restarts.get("worker-2") == 1
    # the redone rounds' frames (a new ring incarnation) are committed and agree
    assert final["commitments"]["incidents"] == [], final["commitments"]
    # --keep-checkpoints 2: two manifests; workers keep one file more
    rounds = sorted(p.name for p in (fed.coordinator_out / "checkpoints").iterdir())
    assert rounds == ["round-000012", "round-000014"], rounds
    for i in range(4):
        files = list((fed.worker_out(i) / "checkpoints").glob("round-*.ckpt"))
        assert 2 <= len(files) <= 3, files


def test_a_rollback_keeps_a_stateful_server_optimizer_exact(tmp_path: Path):
    """FedAdam's moments and its bias correction (which counts rounds) survive a rollback."""
    options = {"eta": 1e-3, "tau": 1e-3}
    fed = federation(tmp_path, strategy="fedadam", strategy_options=options)
    fed.prepare().start()
    wait_for_step(fed, 5)
    os.kill(fed.procs["worker-1"].pid, signal.SIGKILL)
    final = finish(fed)  # equal to the reference engine under the same FedAdam
    assert [i["state"] for i in final["incidents"]] == ["recovered"]


def test_frozen_worker_past_the_heartbeat_timeout_heals(tmp_path: Path):
    fed = federation(tmp_path).prepare().start()
    wait_for_step(fed, 5)
    pid = fed.procs["worker-1"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while (doc := fed.status())["workers"][1]["state"] != "lost":
            assert time.monotonic() < deadline, doc
            time.sleep(0.2)
        assert doc["phase"] == "recovering" and doc["incidents"][0]["state"] == "open"
        assert any(e["state"] == "down" for e in doc["ring"] if "worker-1" in e["edge"])
        rest = fed.rest("/v1/status")  # the same story over REST and in the metrics
        assert rest["incidents"][0]["rank"] == 1 and rest["workers"][1]["state"] == "lost"
        assert [e["edge"] for e in rest["ring"]][1] == "worker-1 → worker-2"
        assert 'mobius_incidents_total{run_id="local-up"} 1' in fed.rest("/metrics")
        shown = subprocess.run(  # and for a person: mobius-fed status
            [
                sys.executable,
                "-m",
                "mobius_fed.cli.main",
                "status",
                "--coordinator",
                f"127.0.0.1:{fed.coord_port}",
                "--certs",
                str(fed.certs),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert shown.returncode == 0, shown.stderr
        for text in ("recovering", "ring edges", "incidents", "no heartbeat", "lost"):
            assert text in shown.stdout, shown.stdout
        time.sleep(2.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    final = finish(fed)
    (inc,) = final["incidents"]
    assert inc["rank"] == 1 and "no heartbeat" in inc["what"] and inc["state"] == "recovered"
    assert not fed.restarts, "the frozen process itself rejoins; nothing is restarted"


def test_host_replaced_without_its_disk_rejoins_from_the_coordinator_copy(tmp_path: Path):
    fed = federation(tmp_path).prepare().start()
    wait_for_step(fed, 6)
    os.kill(fed.procs["worker-3"].pid, signal.SIGKILL)
    shutil.rmtree(fed.worker_out(3))  # the replacement host has the site's data only
    final = finish(fed)
    (inc,) = final["incidents"]
    assert inc["state"] == "recovered" and inc["rollback_round"] % 2 == 0
    assert "the coordinator's copy" in (fed.logs / "worker-3.log").read_text()


def test_killed_coordinator_comes_back_with_resume_auto(tmp_path: Path):
    fed = federation(tmp_path).prepare().start()
    wait_for_step(fed, 7)
    os.kill(fed.procs["coordinator"].pid, signal.SIGKILL)
    finish(fed)
    assert fed.restarts.get("coordinator") == 1
    assert "resuming from" in (fed.logs / "coordinator.log").read_text()


def test_incident_budget_ends_the_run_naming_rank_and_edge(tmp_path: Path):
    fed = federation(tmp_path, max_incidents=0).prepare().start()
    wait_for_step(fed, 5)
    os.kill(fed.procs["worker-2"].pid, signal.SIGKILL)
    try:
        final = fed.wait(timeout=60)
    finally:
        fed.stop()
    assert final["phase"] == "failed"
    assert "--max-incidents 0" in final["error"] and "worker-2" in final["error"]
    assert "worker-1 → worker-2" in final["error"], final["error"]
    manifest = complete_manifests(fed.coordinator_out)[0]
    assert json.loads(manifest.read_text())["step"] >= 4


def test_bad_and_missing_worker_checkpoints_are_named_and_the_previous_round_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("MOBIUS_STATE_COPY", "off")  # no copy to fall back on
    monkeypatch.setenv("MOBIUS_BARRIER_SNAPSHOTS", "false")
    fed = federation(tmp_path, steps=12, max_restarts=0).prepare().start()
    wait_for_step(fed, 9)
    fed.stop(sig=signal.SIGKILL)
    newest, previous = complete_manifests(fed.coordinator_out)[:2]
    doc, prev = json.loads(newest.read_text()), json.loads(previous.read_text())
    bad = Path(doc["workers"]["1"]["path"])
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the middle of the tensors
    bad.write_bytes(bytes(data))
    gone = Path(prev["workers"]["2"]["path"])
    gone.unlink()

    resumed = federation(tmp_path, steps=12, max_restarts=0, resume="auto")
    resumed.prepare().start()
    finish(resumed)
    coord = (resumed.logs / "coordinator.log").read_text()
    # the flipped bit: named by file, expected and actual hash; then the previous round
    refusal = next(line for line in coord.splitlines() if "cannot restore round" in line)
    assert f"worker-1 cannot restore round {doc['round']}" in refusal, refusal
    assert str(bad) in refusal and doc["workers"]["1"]["sha256"] in refusal, refusal
    # the missing file: named, and the round before it is used
    assert f"round {prev['round']}: worker-2's checkpoint {gone} is missing" in coord
    assert f"restoring round {prev['round'] - 2} " in coord


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_full_disk_is_named_and_the_previous_checkpoint_stays(tmp_path: Path):
    fed = federation(tmp_path, steps=40, max_restarts=0)
    if not _mount_tmpfs(fed.coordinator_out, "16m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        fed.prepare().start()
        deadline = time.monotonic() + 120
        while not complete_manifests(fed.coordinator_out):
            assert time.monotonic() < deadline, fed.tail("coordinator")
            time.sleep(0.1)
        ballast = fed.coordinator_out / "ballast"
        # fill the disk; unbuffered, so closing the file has nothing left to flush
        with contextlib.suppress(OSError), open(ballast, "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        try:
            final = fed.wait(timeout=120)
        finally:
            fed.stop()
        assert final["phase"] == "failed", final
        assert "No space left on device" in final["error"], final["error"]
        assert str(fed.coordinator_out) in final["error"], "the error names the path"
        (fed.coordinator_out / "ballast").unlink()
        left = [p for p in fed.coordinator_out.rglob("*") if ".tmp" in p.name]
        assert not left, f"temporary files left behind: {left}"
        manifest = complete_manifests(fed.coordinator_out)[0]  # verified against its sha256
        doc = json.loads(manifest.read_text())
        load_checkpoint(manifest.parent / doc["er"], doc["er_sha256"])
    finally:
        subprocess.run(["umount", "-l", str(fed.coordinator_out)], capture_output=True)


class _ProxiedFederation(LocalFederation):
    """Worker-1 advertises a proxy's port: the edge worker-0 → worker-1 passes through it."""

    proxy_port = 0

    def worker_cmd(self, i: int) -> list[str]:
        cmd = super().worker_cmd(i)
        return [*cmd, "--advertise", f"127.0.0.1:{self.proxy_port}"] if i == 1 else cmd


@pytest.mark.parametrize(
    "cut_at_bytes",
    [pytest.param(150_000, marks=pytest.mark.long), 485_000],  # the end's FINs: the bug
    ids=["mid-run", "at-the-end"],
)
def test_every_process_exits_by_itself_with_0_after_a_healed_edge(
    tmp_path: Path, cut_at_bytes: int
):
    """The edge worker-0 → worker-1 is reset and refused for 3 s, in the middle of the run
    or while the workers exchange their FINs after the last step; the edge heals, the run
    ends, and stopping the federation finds every worker already gone (or lets it finish
    its FINs) with status 0 — never a SIGTERM'd 143 — within seconds of the run's end."""
    from tests.ring_harness import CutProxy

    train = TrainConfig(**{**BASE, "workers": 3, "steps": 8, "sync_every": 2, "eval_every": 0})
    fed = _ProxiedFederation(tmp_path, train, threads=1).prepare()
    proxy = CutProxy(fed.worker_ports[1])
    fed.proxy_port = proxy.port
    proxy.on_bytes(cut_at_bytes, lambda: proxy.cut(refuse_s=3.0))
    try:
        fed.start()
        final = fed.wait(timeout=240)
        ended = time.monotonic()
        codes = fed.stop()
        took = time.monotonic() - ended
    finally:
        fed.stop()
        proxy.close()
    assert final["phase"] == "done", final.get("error")
    assert proxy.cuts >= 1, f"the proxy never cut the edge ({proxy.bytes_up} bytes passed)"
    assert codes == {n: 0 for n in codes} and len(codes) == 4, (codes, fed.tail("worker-0"))
    assert took < 20.0, f"the processes took {took:.1f}s to exit after the run ended"


def test_a_watchdog_names_the_error_reply_that_left_the_others_waiting() -> None:
    """A worker that cannot join the ring (its listen port taken) answers with an error at
    once, and its predecessor then waits for it until the watchdog: the run's error names
    both, the silent rank and what the other reported."""
    from flwr.app import ConfigRecord, Error, Message, RecordDict

    from mobius_fed.coordinator.grid import ControlGrid, GridTimeout
    from mobius_fed.transport.flower_wire import (
        COORDINATOR_NODE_ID,
        ERROR_INTERNAL,
        message_from_bytes,
        message_to_bytes,
        set_task_identity,
        worker_node_id,
    )

    set_task_identity(COORDINATOR_NODE_ID)
    grid = ControlGrid(3)
    boxes = [grid.open_session(rank) for rank in range(3)]
    orders = [
        Message(RecordDict({"config": ConfigRecord({})}), worker_node_id(r), "query.ring")
        for r in range(3)
    ]
    done: dict[str, object] = {}

    def answer() -> None:
        time.sleep(0.2)
        for rank in (0, 2):  # worker-0 joins; worker-2 cannot listen; worker-1 stays silent
            sent = message_from_bytes(boxes[rank].get(timeout=5).flower_message)
            if rank == 0:
                reply = Message(RecordDict({"config": ConfigRecord({})}), reply_to=sent)
            else:
                why = "worker-2: cannot listen on 127.0.0.1:26561: Address already in use"
                reply = Message(Error(code=ERROR_INTERNAL, reason=why), reply_to=sent)
            grid.deliver(rank, message_to_bytes(reply))
        done["ok"] = True

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(GridTimeout) as caught:
        grid.send_and_receive(orders, timeout=1.5)
    assert done.get("ok")
    assert caught.value.ranks == [1]
    assert str(caught.value).startswith("worker-1 did not answer within 1.5s")
    assert "; worker-2 reported: worker-2: cannot listen on 127.0.0.1:26561" in str(caught.value)
