"""The coordinator against a worker key in the wrong hands: a real coordinator process, and
a client holding a real worker bundle that sends what a compromised worker could."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import grpc
import pytest

from mobius_fed.config import TrainConfig
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.transport.tls import open_channel

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def registered_as(tmp_path: Path, train: TrainConfig, rank: int):
    """A real coordinator (no workers) and a client registered with worker ``rank``'s key."""
    fed = LocalFederation(tmp_path, train).prepare().start(workers=False)
    ch = None
    try:
        deadline = time.monotonic() + 60
        while fed.status() is None:
            assert time.monotonic() < deadline, fed.tail("coordinator")
            time.sleep(0.2)
        ch = open_channel(
            f"127.0.0.1:{fed.coord_port}", fed.bundle(f"worker-{rank}"), target_name="coordinator"
        )
        stub = control_pb2_grpc.ControlStub(ch)
        stub.Register(control_pb2.RegisterRequest(listen_address="127.0.0.1:9"), timeout=10)
        yield fed, stub
    finally:
        if ch is not None:
            ch.close()
        fed.stop()


def test_heartbeats_with_impossible_values_never_reach_status(tmp_path: Path):
    train = TrainConfig(workers=4, preset="cpu-tiny", steps=20, batch_size=4)
    with registered_as(tmp_path, train, 1) as (fed, stub):
        bad = {
            "NaN loss": dict(step=3, last_loss=math.nan),
            "huge loss": dict(step=3, last_loss=1e300),
            "negative speed": dict(tokens_per_s=-1e308),
            "infinite speed": dict(tokens_per_s=math.inf),
            "unknown state": dict(state="pwned"),
            "a coordinator-only state": dict(state="recovered"),
            "step past the run": dict(step=10_000),
            "links that are not JSON": dict(links_json="{"),
            "links with a bad count": dict(links_json=json.dumps({"out": {"reconnects": -5}})),
        }
        for what, fields in bad.items():
            with pytest.raises(grpc.RpcError) as info:
                stub.Heartbeat(control_pb2.HeartbeatRequest(**fields), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert "heartbeat refused" in info.value.details(), what
        w = fed.status()["workers"][1]
        assert w["last_loss"] is None and w["tokens_per_s"] == 0.0 and w["step"] == 0, w
        assert w["state"] == "registered"
        ok = control_pb2.HeartbeatRequest(state="ready", step=2, last_loss=3.5, tokens_per_s=10)
        assert not stub.Heartbeat(ok, timeout=10).stop
        w = fed.status()["workers"][1]
        assert (w["state"], w["step"], w["last_loss"], w["tokens_per_s"]) == ("ready", 2, 3.5, 10)


def test_a_worker_that_never_answers_is_named_by_the_watchdog(tmp_path: Path, monkeypatch):
    """A worker that holds its session and heartbeats but never answers (stuck loading):
    the run fails within the restore timeout, naming it, instead of hanging."""
    monkeypatch.setenv("MOBIUS_RESTORE_TIMEOUT", "3")
    train = TrainConfig(workers=1, preset="cpu-tiny", steps=4, batch_size=4)
    with registered_as(tmp_path, train, 0) as (fed, stub):
        hello = iter([control_pb2.Envelope(note="hello")])

        def silent():  # say hello, then never answer anything
            yield from hello
            time.sleep(60)

        session = stub.Session(silent())
        deadline = time.monotonic() + 30
        while (doc := fed.status())["phase"] != "failed":
            assert time.monotonic() < deadline, doc
            stub.Heartbeat(control_pb2.HeartbeatRequest(state="ready"), timeout=10)
            time.sleep(0.5)
        assert "worker-0 did not report the rounds it can restore within 3s" in doc["error"]
        assert "watchdog" in doc["error"]
        session.cancel()
