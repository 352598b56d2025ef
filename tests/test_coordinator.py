"""The coordinator on Flower: real coordinator + worker processes over mTLS on loopback."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from mobius_fed.checkpoint import load_checkpoint, sha256_of
from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.manifests import latest_manifest
from mobius_fed.data import SiteData
from mobius_fed.defences.er_dp import ErPrivacy
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.strategies import RoundPlan, make_strategy
from mobius_fed.transport.certs import init_certs
from mobius_fed.transport.tls import NodeTLS, open_channel
from tests.cert_util import sign_leaf

pytestmark = pytest.mark.slow
logging.getLogger("flwr").setLevel(logging.WARNING)
BASE = dict(workers=4, preset="cpu-tiny", batch_size=4, optimizer="adamw", eval_every=4)


def reference(fed: LocalFederation, strategy: str = "fedavg", options=None, steps=None):
    """(step, origin) → loss and the eval history of the reference engine under Flower."""
    cfg = fed.train
    sites = [SiteData(fed.sites / f"site-{i}", cfg.model().seq_len) for i in range(cfg.P)]
    engine = ReferenceEngine(cfg, sites)
    plan, er = RoundPlan.of(cfg), ErPrivacy.of(cfg)
    grid = train_with_strategy(
        engine, make_strategy(strategy, cfg.P, plan, options or {}, er_privacy=er)
    )
    losses = {(r.step, s): v for r in grid.steps for s, v in enumerate(r.origin_losses)}
    return losses, [(e.step, e.loss) for e in grid.evals]


def ring_history(fed: LocalFederation) -> tuple[dict, list]:
    hist = fed.rest("/v1/history")
    losses = {
        (row["step"], s): v for row in hist["steps"] for s, v in enumerate(row["origin_losses"])
    }
    return losses, [(e["step"], e["loss"]) for e in hist["evals"]]


def run(fed: LocalFederation) -> dict:
    fed.prepare().start()
    try:
        final = fed.wait(timeout=300)
        assert final["phase"] == "done", (final, fed.tail("coordinator"))
        return final
    except BaseException:
        fed.stop()
        raise


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), "every (step, origin) loss must be reported"
    return max(abs(a[k] - b[k]) for k in a)


def test_up_end_to_end(tmp_path: Path):
    out = tmp_path / "up"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mobius_fed.cli.main",
            "up",
            "--workers",
            "4",
            "--preset",
            "cpu-tiny",
            "--steps",
            "6",
            "--batch-size",
            "4",
            "--out",
            str(out),
            "--linger",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final validation loss (Eq. 8)" in proc.stdout and "per origin: s0=" in proc.stdout
    endpoints = json.loads((out / "endpoints.json").read_text())  # findable while it ran
    assert endpoints["grpc"].startswith("127.0.0.1:") and endpoints["rest"].startswith("https://")
    assert Path(endpoints["certs"]["cert"]).is_file()
    rows = [json.loads(line) for line in (out / "coordinator" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and rows[-1]["eval_loss"] > 0
    manifest = latest_manifest(out / "coordinator")
    assert manifest is not None and json.loads(manifest.read_text())["step"] == 6
    time.sleep(0.5)
    for name in ("coordinator", "worker-0", "worker-3"):  # every child process is gone
        assert "Traceback" not in (out / "logs" / f"{name}.log").read_text()


@pytest.mark.parametrize(
    ("sync_every", "order", "optimizer"),
    [(1, "cyclic", "adamw"), (3, "ordered", "adamw"), (3, "cyclic", "muon")],
)
def test_barriers_equal_reference(tmp_path: Path, sync_every: int, order: str, optimizer: str):
    """Per-step per-origin losses and Eq. 8 equal the reference engine under the same Flower
    FedAvg. Replies are aggregated in node order on both sides, so even Muon's bf16
    Newton–Schulz sees bitwise-equal gradients; the bound is the fp32 contract, 1e-5."""
    train = TrainConfig(
        **{**BASE, "optimizer": optimizer}, steps=7, sync_every=sync_every, order=order
    )
    fed = LocalFederation(tmp_path, train)
    run(fed)
    try:
        got, got_evals = ring_history(fed)
    finally:
        fed.stop()
    ref, ref_evals = reference(fed)
    assert max_diff(got, ref) <= 1e-5
    assert [s for s, _ in got_evals] == [s for s, _ in ref_evals]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got_evals, ref_evals)) <= 1e-5


def test_fedavgm_changes_the_run_as_fedavgm_should(tmp_path: Path):
    train = TrainConfig(**BASE, steps=6, sync_every=1)
    options = {"server_momentum": 0.9, "server_learning_rate": 1.0}
    fed = LocalFederation(tmp_path, train, strategy="fedavgm", strategy_options=options)
    run(fed)
    try:
        got, _ = ring_history(fed)
    finally:
        fed.stop()
    ref_m, _ = reference(fed, "fedavgm", options)
    ref_avg, _ = reference(fed, "fedavg")
    assert max_diff(got, ref_m) <= 1e-5
    assert max_diff(got, ref_avg) > 1e-3, "server momentum must change the trajectory"


def test_status_live_and_final_over_rest_and_grpc(tmp_path: Path):
    train = TrainConfig(**BASE, steps=40, sync_every=1)
    fed = LocalFederation(tmp_path, train).prepare().start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            doc = fed.status()
            if doc and doc["phase"] == "training" and 0 < doc["step"] < train.steps:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"never saw a live training status: {fed.tail('coordinator')}")
        assert doc["run_id"] == "local-up" and len(doc["workers"]) == 4
        states = [w["state"] for w in doc["workers"]]
        # "restoring": a heartbeat sent while round 0 was being set up, up to 1 s ago
        assert all(s in ("ready", "training", "evaluating", "restoring") for s in states), states
        assert all(w["address"].startswith("127.0.0.1:") for w in doc["workers"])
        live = fed.rest("/v1/status")
        assert live["phase"] == "training" and live["step"] >= doc["step"]
        assert "mobius_step" in fed.rest("/metrics")
        assert fed.rest("/healthz")["status"] == "ok"
        final = fed.wait(timeout=300)
        assert final["phase"] == "done" and final["step"] == train.steps
        rest_final = fed.rest("/v1/status")
        assert rest_final["phase"] == "done" and rest_final["eval_loss"] == final["eval_loss"]
        hist = fed.rest("/v1/history")
        assert [row["step"] for row in hist["steps"]] == list(range(train.steps))
        assert all(w["last_heartbeat"] for w in rest_final["workers"])
    finally:
        fed.stop()


def test_worker_that_never_comes_back_fails_after_rejoin_timeout_and_resume_reproduces_it(
    tmp_path: Path,
):
    """Without anything to restart it, a killed worker ends the run once --rejoin-timeout
    passes, naming the rank and its ring edges; the manifests stay intact and --resume
    continues with the reference's losses."""
    train = TrainConfig(**BASE, steps=16, sync_every=1)
    fed = LocalFederation(
        tmp_path, train, checkpoint_every=2, heartbeat_timeout=3.0, rejoin_timeout=4.0
    )
    fed.prepare().start()
    try:
        deadline = time.monotonic() + 120
        while (doc := fed.status()) is None or doc["step"] < 6:
            assert time.monotonic() < deadline, fed.tail("coordinator")
            assert doc is None or doc["phase"] == "training" or doc["step"] == 0, doc
            time.sleep(0.1)
        os.kill(fed.procs["worker-2"].pid, signal.SIGKILL)
        killed = time.monotonic()
        while (doc := fed.status())["workers"][2]["state"] != "lost":
            assert time.monotonic() - killed < 10, doc
            time.sleep(0.05)
        # seen at once, by its session closing: not by the 3 s heartbeat timeout
        assert "its session closed" in doc["incidents"][0]["what"], doc["incidents"]
        assert doc["phase"] == "recovering" and doc["incidents"][0]["rank"] == 2
        final = fed.wait(timeout=60)
    finally:
        fed.stop()
    assert final["phase"] == "failed"
    err = final["error"]
    assert "worker-2 did not rejoin within 4s" in err, err
    assert "worker-1 → worker-2" in err and "worker-2 → worker-3" in err, err
    assert final["incidents"][0]["state"] == "failed"
    manifest = latest_manifest(fed.coordinator_out)
    assert manifest is not None, "a complete checkpoint must survive"
    doc = json.loads(manifest.read_text())
    assert 2 <= doc["step"] < train.steps and doc["round"] % 2 == 0
    for w in doc["workers"].values():  # the manifest names intact worker checkpoints
        assert sha256_of(Path(w["path"])) == w["sha256"]
    load_checkpoint(manifest.parent / doc["er"], doc["er_sha256"])

    resumed = LocalFederation(tmp_path, train, checkpoint_every=2, resume=True)
    run(resumed)
    try:
        got, _ = ring_history(resumed)
    finally:
        resumed.stop()
    ref, _ = reference(resumed)
    later = {k: v for k, v in ref.items() if k[0] >= doc["step"]}
    assert max_diff({k: got[k] for k in later}, later) <= 1e-5


def test_strangers_cannot_register_or_read_status(tmp_path: Path):
    train = TrainConfig(**BASE, steps=4, sync_every=1)
    fed = LocalFederation(tmp_path, train).prepare()
    other_ca = init_certs(tmp_path / "other-ca", 4)  # a different CA altogether
    # Our CA, but an identity that is not enrolled: worker-6 of a 4-worker run.
    stranger = sign_leaf(fed.certs, tmp_path / "stranger", "mobius://worker/6", "worker-6")
    fed.start(workers=False)
    target = f"127.0.0.1:{fed.coord_port}"

    def call(tls: NodeTLS, rpc: str, req) -> grpc.RpcError:
        ch = open_channel(target, tls, target_name="coordinator")
        try:
            with pytest.raises(grpc.RpcError) as info:
                getattr(control_pb2_grpc.ControlStub(ch), rpc)(req, timeout=10)
            return info.value
        finally:
            ch.close()

    try:
        deadline = time.monotonic() + 60
        while fed.status() is None:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        foreign = NodeTLS(fed.certs / "ca.crt", other_ca.worker(0).cert, other_ca.worker(0).key)
        reg = control_pb2.RegisterRequest(listen_address="127.0.0.1:1")
        assert call(foreign, "Register", reg).code() == grpc.StatusCode.UNAVAILABLE
        assert call(foreign, "GetStatus", control_pb2.StatusRequest()).code() == (
            grpc.StatusCode.UNAVAILABLE
        )
        err = call(stranger, "Register", reg)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "worker/6" in err.details()
        err = call(stranger, "GetStatus", control_pb2.StatusRequest())
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        operator = fed.operator_tls()
        err = call(operator, "Register", reg)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, "the operator is not a worker"
        # config mismatch, refused on both sides: the worker process exits with the reason
        w0 = NodeTLS(fed.certs / "ca.crt", fed.certs / "worker-0.crt", fed.certs / "worker-0.key")
        err = call(
            w0,
            "Register",
            control_pb2.RegisterRequest(
                listen_address="127.0.0.1:1", config_fingerprint="0123456789abcdef"
            ),
        )
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "mismatch" in err.details()
        proc = subprocess.run(  # a site with another H for its rings: both sides named
            [*fed.worker_cmd(1), "--rings", "2", "--ring-sync-every", "2"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode != 0 and "config mismatch" in proc.stderr, proc.stderr[-2000:]
        assert "rings=1 ring_sync_every=1" in proc.stderr  # the coordinator's
        assert "(this worker: workers=4 rings=2 ring_sync_every=2" in proc.stderr

        # duplicate rank: a second worker-0 while the first waits registered for its peers
        def register_and_wait() -> None:
            ch = open_channel(target, w0, target_name="coordinator")
            try:
                control_pb2_grpc.ControlStub(ch).Register(reg, timeout=5)
            except grpc.RpcError:
                pass  # times out: its peers never come
            finally:
                ch.close()

        threading.Thread(target=register_and_wait, daemon=True).start()
        time.sleep(1.0)
        err = call(w0, "Register", reg)
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "worker-0" in err.details()
    finally:
        fed.stop()
