"""The E/R round's sync settings on real processes (``--sync-outer``, ``--sync-codec``,
``--sync-delay``; docs/er-sync.md): a coordinator and
P ``mobius-worker`` processes over mTLS equal the reference engine under the same Flower
strategy exactly (max |Δ loss| = 0, train and eval), and each barrier's E/R bytes are the
exact payload."""

from __future__ import annotations

import logging
import math
import os
import signal
from pathlib import Path

import pytest

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.defences.secagg import SecAgg
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.federated import EngineGrid, train_with_strategy
from mobius_fed.er_sync import payload_spec
from mobius_fed.model import build_replica
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.strategies import RoundPlan, UpdateClip, make_strategy, sync_strategy
from mobius_fed.transport.safe_arrays import spec_of
from tests.test_recovery import wait_for_step

pytestmark = pytest.mark.slow
logging.getLogger("flwr").setLevel(logging.WARNING)
BASE = dict(workers=2, preset="cpu-tiny", batch_size=4, optimizer="adamw", eval_every=2)


def reference(fed: LocalFederation) -> EngineGrid:
    """The reference engine under the strategy the coordinator builds for this run."""
    cfg = fed.train
    sites = [SiteData(fed.sites / f"site-{i}", cfg.model().seq_len) for i in range(cfg.P)]
    name, options = sync_strategy(fed.strategy, fed.strategy_options, cfg)
    strategy = make_strategy(
        name,
        cfg.P,
        RoundPlan.of(cfg),
        options,
        update_clip=UpdateClip.of(cfg),
        er_codec=cfg.sync.codec,
        er_down_codec=cfg.sync.down_codec,
        secagg=SecAgg.of(cfg),
    )
    return train_with_strategy(ReferenceEngine(cfg, sites), strategy)


def check_exact(fed: LocalFederation, hist: dict) -> None:
    grid = reference(fed)
    got = {(r["step"], s): v for r in hist["steps"] for s, v in enumerate(r["origin_losses"])}
    ref = {(r.step, s): v for r in grid.steps for s, v in enumerate(r.origin_losses)}
    assert set(got) == set(ref) and max(abs(got[k] - ref[k]) for k in ref) == 0
    got_ev = {(e["step"], s): v for e in hist["evals"] for s, v in enumerate(e["origin_losses"])}
    ref_ev = {(e.step, s): v for e in grid.evals for s, v in enumerate(e.origin_losses)}
    assert set(got_ev) == set(ref_ev) and max(abs(got_ev[k] - ref_ev[k]) for k in ref_ev) == 0


def er_bytes(train: TrainConfig) -> int:
    """What one site's E/R reply takes: fp32 arrays, the codec's payloads, or under SecAgg
    the masked update (one integer of the wire dtype per value)."""
    spec = spec_of(build_replica(train.model(), train.seed).shared_state_dict())
    secagg = SecAgg.of(train)
    if secagg is not None:
        n = sum(math.prod(shape) for shape, _ in spec.values())
        return n * secagg.q.wire_dtype.itemsize
    if train.sync.codec != "none":
        spec = payload_spec(spec, train.sync.codec)
    size = {"float32": 4, "uint8": 1}
    return sum(size[dtype] * math.prod(shape) for shape, dtype in spec.values())


@pytest.mark.parametrize(
    ("sync", "strategy", "steps"),
    [
        pytest.param({"codec": "int4"}, "fedavg", 5, id="int4-ef"),
        # both ways int4: the first train brings the E/R in fp32, later ones a payload
        pytest.param({"codec": "int4", "down_codec": "int4"}, "fedavg", 5, id="int4-down"),
        pytest.param({"delay": 1}, "fedavg", 5, id="delay1"),
        pytest.param(
            {"outer": "diloco", "codec": "int8", "delay": 1}, "fedavg", 5, id="diloco-int8-delay1"
        ),
        pytest.param(
            {"delay": 1},
            "fedavg",
            5,
            id="delay1-secagg",
            marks=pytest.mark.long,
        ),
    ],
)
def test_sync_settings_equal_the_reference_exactly(
    tmp_path: Path, sync: dict, strategy: str, steps: int, request: pytest.FixtureRequest
) -> None:
    """P = 2, E/R every 2 steps (the last round, at step 5, falls off the grid): every
    (step, origin) loss and every held-out loss equal the reference's bit for bit; with a
    codec each site's residual carries over, with τ = 1 each site trains on from its own E/R
    and merges round r's average at the end of round r + 1 (also under Secure Aggregation,
    long marker: the masked update is the merged E/R's); every train reply's E/R bytes are
    the exact payload (fp32 arrays, the codec's, or the masked update)."""
    secagg = request.node.callspec.id.endswith("secagg")  # τ = 1 under Secure Aggregation
    privacy = {"er_secagg": True} if secagg else {}
    train = TrainConfig(**BASE, steps=steps, sync_every=2, sync=sync, privacy=privacy)
    fed = LocalFederation(tmp_path, train, strategy=strategy, threads=1)
    fed.prepare().start()
    try:
        final = fed.wait(timeout=240)
        assert final["phase"] == "done", (final.get("error"), fed.tail("coordinator"))
        hist = fed.rest("/v1/history")
    finally:
        fed.stop()
    check_exact(fed, hist)
    want = er_bytes(train)
    for r in hist["rounds"]:
        assert [w.get("er_bytes") for w in r["workers"].values()] == [want] * 2, r
    assert [w["er_bytes_total"] for w in final["workers"]] == [want * 3] * 2
    if train.sync.down_codec != "fp32":  # the way down: fp32 once, then the payload
        fp32 = er_bytes(TrainConfig(**BASE))
        down = er_bytes(TrainConfig(**BASE, sync={"codec": train.sync.down_codec}))
        got = [[w.get("down_bytes") for w in r["workers"].values()] for r in hist["rounds"]]
        assert got == [[fp32] * 2, [down] * 2, [down] * 2], got
    if sync.get("outer") == "diloco":
        assert final["strategy"] == "diloco"


@pytest.mark.long
def test_a_killed_worker_resumes_its_residual_and_late_round_exactly(tmp_path: Path) -> None:
    """worker-1 is SIGKILLed mid-run under int4 with error feedback and τ = 1: the
    supervisor restarts it, both workers roll back to the last barrier (their residuals and
    sent E/R with it) and the run ends with the reference's losses, bit for bit."""
    train = TrainConfig(**BASE, steps=10, sync_every=2, sync={"codec": "int4", "delay": 1})
    opts = dict(checkpoint_every=2, heartbeat_timeout=3.0, max_restarts=3, threads=1)
    fed = LocalFederation(tmp_path, train, **opts)
    fed.prepare().start()
    try:
        wait_for_step(fed, 5)
        os.kill(fed.procs["worker-1"].pid, signal.SIGKILL)
        final = fed.wait(timeout=240)
        hist = fed.rest("/v1/history")
    finally:
        fed.stop()
    assert final["phase"] == "done", (final.get("error"), fed.tail("coordinator", 40))
    (inc,) = final["incidents"]
    assert inc["rank"] == 1 and inc["state"] == "recovered", inc
    check_exact(fed, hist)
