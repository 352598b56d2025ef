"""The ring's trust model, tried by a real attacker process holding a real worker key.

A P=3 cyclic ring of real ``mobius-worker`` daemons on loopback. The attacker holds
worker 0's key (a compromised site, or a stale second process of worker 0) and aims at
worker 1, whose predecessor worker 0 is. It attacks first while the genuine worker 0 is
not connected yet (so it can open the edge's session itself), then while the genuine
edge is live. One test per rule checks what the attacker got back and what the victim logged;
the last one checks that the genuine ring then finished with exactly the losses of an
undisturbed run (the reference engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.transport.certs import init_certs
from mobius_fed.transport.tls import NodeTLS, open_channel
from mobius_fed.worker.frames import FORWARD, TRAIN, FrameKey, FrameRules
from mobius_fed.worker.link import RingLinks
from tests.ring_harness import Ring

pytestmark = pytest.mark.slow

TRAIN_CFG = dict(
    preset="cpu-tiny", steps=3, batch_size=4, sync_every=0, eval_every=0, order="cyclic"
)
ATTACKER = [sys.executable, "-m", "tests.attacker"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _bundle(d: Path) -> NodeTLS:
    return NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key")


def _probe(port: int, tls: NodeTLS) -> grpc.StatusCode:
    """ALREADY_EXISTS while the edge has a live stream, else INVALID_ARGUMENT: a new
    session must start at ack 0, so this probe never opens (or replaces) one."""
    with open_channel(f"127.0.0.1:{port}", tls, target_name="worker-1") as ch:
        call = ch.stream_stream(
            "/mobius_fed.ring.v1.RingLink/Stream",
            request_serializer=None,
            response_deserializer=None,
        )
        try:
            for _ in call(
                iter(()), timeout=10, metadata=(("mobius-run", "test-run"), ("mobius-ack", "1"))
            ):
                pass
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def _wait_listening(port: int, tls: NodeTLS, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open_channel(f"127.0.0.1:{port}", tls, target_name="worker-1") as ch:
            try:
                ch.unary_unary("/mobius_fed.ring.v1.RingLink/Ping")(b"", timeout=2)
                return
            except grpc.RpcError:
                time.sleep(0.3)
    raise AssertionError("worker-1 never started listening")


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory) -> dict:
    t0 = time.monotonic()
    ring = Ring(tmp_path_factory.mktemp("trust"), 3, TRAIN_CFG).prepare()
    port, stolen, other = ring.ports[1], ring.bundle(0), ring.bundle(2)
    # Worker 1 serves first: its predecessor is not there yet, and until worker 2 starts
    # (within worker 1's 60 s peer timeout) the ring cannot move, so the attacks "during"
    # run against a live edge worker-0 → worker-1 whatever the machine's speed.
    ring.start(only=(1,))
    attacker = None
    try:
        _wait_listening(port, _bundle(other))
        attacker = subprocess.Popen(
            [
                *ATTACKER,
                "--port",
                str(port),
                "--bundle",
                str(stolen),
                "--stranger",
                str(other),
                "--run",
                "test-run",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(ring.root / "attacker.log", "w"),  # noqa: SIM115
            text=True,
            env=ENV,
        )
        assert attacker.stdin is not None and attacker.stdout is not None
        before = json.loads(attacker.stdout.readline() or "{}").get("before")
        assert before, (ring.root / "attacker.log").read_text()[-3000:]
        ring.start(only=(0,))  # the genuine worker 0 joins
        deadline = time.monotonic() + 60
        while _probe(port, _bundle(stolen)) != grpc.StatusCode.ALREADY_EXISTS:
            assert time.monotonic() < deadline, "worker 0's link never came up"
            time.sleep(0.2)
        attacker.stdin.write("during\n")
        attacker.stdin.flush()
        during = json.loads(attacker.stdout.readline() or "{}").get("during")
        assert during, (ring.root / "attacker.log").read_text()[-3000:]
        ring.start(only=(2,))
        ring.wait(timeout=240)
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
        ring.stop()
    ref, ref_eval = ring.reference()
    return {
        "before": before,
        "during": during,
        "ring": ring,
        "reference": (ref, ref_eval),
        "log1": ring.log(1, tail=None),
        "seconds": time.monotonic() - t0,
    }


CULPRIT = "from mobius://worker/0 on edge worker-0 → worker-1: "


def test_frames_from_the_wrong_producer_are_refused_not_relayed(attacked: dict) -> None:
    for got in attacked["before"]["wrong_producer"]:
        assert got["code"] == "INVALID_ARGUMENT", got
        assert CULPRIT in got["details"] and "cannot arrive from worker-0" in got["details"]
    assert "route is worker-2 → worker-0" in attacked["before"]["wrong_producer"][0]["details"]
    assert "route is worker-1 → worker-2" in attacked["before"]["wrong_producer"][1]["details"]
    stranger = attacked["before"]["not_predecessor"]
    assert stranger["code"] == "PERMISSION_DENIED" and "mobius://worker/2" in stranger["details"]
    assert attacked["log1"].count("cannot arrive from worker-0") == 2
    assert "rejected" not in attacked["ring"].log(2, tail=None), "nothing was passed on"


def test_a_second_stream_on_a_live_edge_is_refused_at_once(attacked: dict) -> None:
    second = attacked["during"]["second_stream"]
    assert second["code"] == "ALREADY_EXISTS", second
    assert "already has a live ring stream from mobius://worker/0" in second["details"]
    assert second["seconds"] < 2.0
    bogus = attacked["during"]["bogus_resume"]
    assert bogus["code"] == "FAILED_PRECONDITION" and "no such ring session" in bogus["details"]


def test_a_dead_sessions_leftovers_never_block_the_genuine_frames(attacked: dict) -> None:
    left = attacked["before"]["leftovers"]
    assert left["acked"] and left["token"], "the victim took the attacker's frames"
    # The attacker vanished without a goodbye, so its session waited for a resume; the
    # genuine worker 0's new session replaced it, and its whole frame and half frame went.
    log1 = attacked["log1"]
    assert (
        "ended (replaced by a new session from mobius://worker/0): dropped 1 unconsumed "
        "frame(s), 1 partial tensor(s)"
    ) in log1
    assert "duplicate" not in log1.split("replaced by a new session")[-1]


def test_a_repeated_key_is_refused(attacked: dict) -> None:
    dup = attacked["before"]["duplicate"]
    assert dup["code"] == "INVALID_ARGUMENT"
    assert "duplicate TRAIN FORWARD step 1 origin 2 slot 2 micro 0" in dup["details"]


def test_messages_larger_than_a_piece_are_refused(attacked: dict) -> None:
    assert attacked["before"]["oversized"]["code"] == "RESOURCE_EXHAUSTED"
    assert attacked["before"]["oversized_ping"]["code"] == "RESOURCE_EXHAUSTED"


def test_fin_frames_are_validated(attacked: dict) -> None:
    fat = attacked["before"]["fin_with_tensor"]
    assert (
        fat["code"] == "INVALID_ARGUMENT" and "FIN from origin 0 carries a tensor" in fat["details"]
    )
    odd = attacked["before"]["fin_with_fields"]
    assert odd["code"] == "INVALID_ARGUMENT" and "carries step 3, chunks 1" in odd["details"]


def test_idle_streams_do_not_starve_the_health_service(attacked: dict) -> None:
    idle = attacked["before"]["idle_streams"]
    assert idle["codes"] == ["ALREADY_EXISTS"] * 9
    assert idle["slowest_refusal_s"] < 2.0
    assert max(idle["health_ms"]) < 1000
    flood = attacked["during"]["flood"]
    assert flood["codes"] == ["ALREADY_EXISTS"] * 12, flood
    assert max(flood["health_ms"]) < 1000


def test_after_the_attacks_the_ring_has_the_undisturbed_losses(attacked: dict) -> None:
    ring, (ref, ref_eval) = attacked["ring"], attacked["reference"]
    got = ring.losses()
    assert set(got) == set(ref)
    assert all(got[k] == ref[k] for k in ref), {k: (got[k], ref[k]) for k in ref}
    assert ring.eval_losses() == dict(enumerate(ref_eval))


def test_a_consumed_key_replayed_is_refused(tmp_path: Path) -> None:
    """The victim is a RingLinks in this process (so the test can consume a frame); the
    attacker is a real process holding the predecessor's key."""
    certs = init_certs(tmp_path / "certs", workers=2)
    cfg = TrainConfig(workers=2, **{k: v for k, v in TRAIN_CFG.items() if k != "steps"})
    victim = RingLinks(
        FrameRules(cfg, 1, "test-run", lambda: 0),
        listen="127.0.0.1:0",
        successor="127.0.0.1:1",
        tls=certs.bundle("worker-1"),
        peer_timeout=20,
    )
    port, stolen = victim.start_server(), certs.root / "nodes" / "worker-0"
    attacker = subprocess.Popen(
        [
            *ATTACKER,
            "--replay",
            "--port",
            str(port),
            "--run",
            "test-run",
            "--bundle",
            str(stolen),
            "--stranger",
            "-",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert attacker.stdin is not None and attacker.stdout is not None
        assert json.loads(attacker.stdout.readline())["acked"]
        key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
        assert torch.equal(
            victim.inbox.get(key, 10, "the first copy"), torch.full((4, 32, 32), 3.0)
        )
        attacker.stdin.write("consumed\n")
        attacker.stdin.flush()
        replay = json.loads(attacker.stdout.readline())["replay"]
        assert replay["code"] == "INVALID_ARGUMENT", replay
        assert "replay of TRAIN FORWARD step 0 origin 0 slot 1 micro 0" in replay["details"]
        assert CULPRIT in replay["details"]
        assert victim.rejected == [replay["details"]]
    finally:
        attacker.kill()
        victim.close()
