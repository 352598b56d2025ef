"""R rings of P groups on real processes (docs/rings.md): a coordinator and R·P
``mobius-worker`` processes over mTLS equal the reference engine under the same Flower
strategy exactly (max |Δ loss| = 0, train and eval), and status shows the rings."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.engine.rings import make_engine
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.run_reader import read_run
from mobius_fed.strategies import RingPlan, RoundPlan, make_strategy
from mobius_fed.transport.compress import Codec

pytestmark = pytest.mark.slow
logging.getLogger("flwr").setLevel(logging.WARNING)
BASE = dict(preset="cpu-tiny", batch_size=4, optimizer="adamw", eval_every=2)


def reference(fed: LocalFederation, strategy: str, engine: list | None = None) -> tuple[dict, dict]:
    """(step, site) → loss and (step, site) → eval loss of the reference under Flower
    (the engine appended to ``engine``, if given)."""
    cfg = fed.train
    sites = [SiteData(fed.sites / f"site-{g}", cfg.model().seq_len) for g in range(cfg.workers)]
    flower = make_strategy(
        strategy,
        cfg.workers,
        RoundPlan.of(cfg),
        rings=RingPlan.of(cfg),
        er_codec=cfg.sync.codec,
        er_down_codec=cfg.sync.down_codec,
    )
    rings = make_engine(cfg, sites)
    grid = train_with_strategy(rings, flower)
    if engine is not None:
        engine.append(rings)
    losses = {(r.step, g): v for r in grid.steps for g, v in enumerate(r.origin_losses)}
    return losses, {(e.step, g): v for e in grid.evals for g, v in enumerate(e.origin_losses)}


def ring(fed: LocalFederation) -> tuple[dict, dict, dict, list]:
    """The ring's (step, site) losses and eval losses, its final status and its rounds."""
    fed.prepare().start()
    try:
        final = fed.wait(timeout=300)
        assert final["phase"] == "done", (final, fed.tail("coordinator"))
        hist = fed.rest("/v1/history")
    finally:
        fed.stop()
    losses = {
        (row["step"], g): v for row in hist["steps"] for g, v in enumerate(row["origin_losses"])
    }
    evals = {(e["step"], g): v for e in hist["evals"] for g, v in enumerate(e["origin_losses"])}
    return losses, evals, final, hist["rounds"]


@pytest.mark.parametrize(
    ("R", "P", "H", "outer", "steps", "codec", "aggregate"),
    [
        pytest.param(2, 2, 1, "fedavg", 4, "none", "mean", id="R2-P2-H1-fedavg"),
        pytest.param(2, 2, 2, "diloco", 5, "none", "mean", id="R2-P2-H2-diloco"),
        # the race's DiLoCo: whole models (P = 1), int4 pseudo-gradients; a train message
        # after an evaluate carries no model, the site takes the evaluate's
        pytest.param(2, 1, 2, "diloco", 5, "int4", "mean", id="R2-P1-H2-diloco-int4"),
        # and the synced groups come down as int4 payloads of their change (fp32 once)
        pytest.param(
            2,
            1,
            2,
            "diloco",
            5,
            "int4+down",
            "mean",
            id="R2-P1-H2-diloco-int4-down",
            marks=pytest.mark.long,  # its every part runs in the next one
        ),
        # and the E/R too, both ways: DiLoCo's whole model in int4
        pytest.param(2, 1, 2, "diloco", 5, "int4+down+er", "mean", id="R2-P1-H2-diloco-int4-er"),
        pytest.param(
            2, 4, 1, "fedavg", 4, "none", "mean", id="R2-P4-H1-fedavg", marks=pytest.mark.long
        ),
        pytest.param(
            2, 4, 3, "diloco", 7, "none", "mean", id="R2-P4-H3-diloco", marks=pytest.mark.long
        ),
        pytest.param(
            2, 2, 2, "fedavg", 5, "int8", "mean", id="R2-P2-H2-fedavg-int8", marks=pytest.mark.long
        ),
        pytest.param(
            2, 4, 2, "diloco", 4, "int4", "mean", id="R2-P4-H2-diloco-int4", marks=pytest.mark.long
        ),
        pytest.param(3, 2, 2, "fedavg", 4, "none", "median", id="R3-P2-H2-fedavg-median"),
    ],
)
def test_rings_equal_the_reference_exactly(
    tmp_path: Path, R: int, P: int, H: int, outer: str, steps: int, codec: str, aggregate: str
) -> None:
    """Every (step, site) loss and every site's held-out loss equal the reference's, bit
    for bit: per step all R rings train, every H steps (and at the end) each F_i is synced
    across the rings (DiLoCo's outer step for the E/R and the groups in the diloco run,
    whose last sync, at step 5 or 7, falls off the H grid; with a codec, each worker sends its
    pseudo-gradient as int8 or int4 and the coordinator decodes the same bytes the reference
    encodes; ``+down``: the synced groups come down as the codec's payload of their change
    too; ``+er``: so do the E/R, both ways, every H steps, each site keeping its residual;
    with ``median``, three rings' groups go through Flower's FedMedian)."""
    codec, *extras = codec.split("+")
    down = "down" in extras
    er_sync = {"codec": codec, "down_codec": codec} if "er" in extras else {}
    train = TrainConfig(
        sync=er_sync,
        ring_down_codec=codec if down else "fp32",
        workers=R * P,
        rings=R,
        ring_sync_every=H,
        ring_outer=outer,
        ring_codec=codec,
        ring_aggregate=aggregate,
        steps=steps,
        **BASE,
    )
    fed = LocalFederation(tmp_path, train, strategy=outer, threads=1)
    got, got_evals, final, rounds = ring(fed)
    engines: list = []
    ref, ref_evals = reference(fed, outer, engines)
    assert set(got) == set(ref) and set(got_evals) == set(ref_evals)
    assert max(abs(got[k] - ref[k]) for k in ref) == 0
    assert max(abs(got_evals[k] - ref_evals[k]) for k in ref_evals) == 0
    assert final["rings"] == R and [w["ring"] for w in final["workers"]] == [
        g // P for g in range(R * P)
    ]
    assert [(h["ring"], h["workers"], h["state"]) for h in final["ring_health"]] == [
        (r, list(range(r * P, r * P + P)), "ended") for r in range(R)
    ]
    commitments = final["commitments"]  # every ring's hops, by global rank
    assert commitments["incidents"] == [], commitments
    assert commitments["frames_checked"] > 0 or P == 1, commitments  # P = 1: no ring hops
    model = read_run(fed.coordinator_out)  # the synced groups, as export reads them
    for got_group, ref_group in zip(model.groups, engines[0].rings[0].groups, strict=True):
        ref_params = dict(ref_group.named_parameters())
        same = all(torch.equal(p, ref_params[k]) for k, p in got_group.named_parameters())
        # a down codec: the sites hold the last broadcast, the export the coordinator's F_i
        assert same != bool(down)
    # each sync's bytes, counted apart from the ring links: F_i in fp32, or its encoded δ
    synced = [r["round"] for r in rounds if r["round"] % H == 0 or r["round"] == steps]
    codec, down_codec = (None, None) if codec == "none" else (Codec(codec), Codec(codec))
    down_codec = down_codec if down else None
    er_shapes = [tuple(t.shape) for t in engines[0].replicas[0].shared_state_dict().values()]
    er = sum(4 * math.prod(shape) for shape in er_shapes)
    # ``+er``: each site's E/R goes up as the codec's payload, comes down in fp32 once
    er_up = sum(codec.payload_bytes(shape) for shape in er_shapes) if codec and er_sync else er
    for r in rounds:
        for g, w in r["workers"].items():
            params = engines[0].group(int(g)).parameters()
            want = sum(
                p.numel() * 4 if codec is None else codec.payload_bytes(tuple(p.shape))
                for p in params
            )
            assert w.get("sync_bytes") == (want if r["round"] in synced else None), (r, g)
            # the way down, once per barrier (an evaluate's model is not sent again): the
            # E/R, the synced F_i after a sync, the global F_i once with a codec
            group = 4 * sum(p.numel() for p in engines[0].group(int(g)).parameters())
            if down_codec is not None and r["round"] > 1:  # the payload of F_i's change
                params = engines[0].group(int(g)).parameters()
                group = sum(down_codec.payload_bytes(tuple(p.shape)) for p in params)
            with_group = r["round"] - 1 in synced or (r["round"] == 1 and codec is not None)
            er_down = er_up if r["round"] > 1 else er
            assert w.get("er_bytes") == er_up, (r, g)
            assert w.get("down_bytes") == er_down + (group if with_group else 0), (r, g)
    first = [e["edge"] for e in final["ring"]][: P + 1]  # ring 0 closes on itself
    assert P == 1 or (
        first[P - 1] == f"worker-{P - 1} → worker-0" and first[P] == f"worker-{P} → worker-{P + 1}"
    )


@pytest.mark.long
def test_a_killed_worker_of_one_ring_heals_to_the_same_losses(tmp_path: Path) -> None:
    """worker-3 (ring 1) is SIGKILLed mid-run, between DiLoCo ring syncs whose
    pseudo-gradients travel as int8: the supervisor restarts it, every worker rolls back to
    the last barrier, the coordinator restores the synced groups and outer state and sends
    each worker the global F_i its pseudo-gradient is taken against, and the run ends with
    the reference's losses, bit for bit; the incident names ring 1's edges."""
    import os
    import signal
    import time

    train = TrainConfig(
        workers=4,
        rings=2,
        ring_sync_every=3,
        ring_outer="diloco",
        ring_codec="int8",
        steps=12,
        **BASE,
    )
    opts = dict(checkpoint_every=2, heartbeat_timeout=3.0, max_restarts=3, threads=1)
    fed = LocalFederation(tmp_path, train, strategy="diloco", **opts)
    fed.prepare().start()
    try:
        deadline = time.monotonic() + 120
        while (doc := fed.status()) is None or doc["step"] < 5:
            assert time.monotonic() < deadline, fed.tail("coordinator")
            fed.supervise()
            time.sleep(0.1)
        os.kill(fed.procs["worker-3"].pid, signal.SIGKILL)
        # not supervised yet, so worker-3 stays down: ring 1 reads stalled, ring 0 does not
        while (doc := fed.status()) is None or doc["ring_health"][1]["state"] != "stalled":
            assert time.monotonic() < deadline, fed.tail("coordinator")
            time.sleep(0.05)
        stalled = doc["ring_health"]
        final = fed.wait(timeout=240)
        hist = fed.rest("/v1/history")
    finally:
        fed.stop()
    assert final["phase"] == "done", (final.get("error"), fed.tail("coordinator", 40))
    assert "worker-3" in stalled[1]["reason"] and stalled[0]["state"] != "stalled", stalled
    assert [h["state"] for h in final["ring_health"]] == ["ended", "ended"]
    (inc,) = final["incidents"]
    assert inc["rank"] == 3 and inc["state"] == "recovered", inc
    assert "worker-2 → worker-3" in inc["edge"] and "worker-3 → worker-2" in inc["edge"]
    assert final["commitments"]["incidents"] == [], final["commitments"]
    got = {(row["step"], g): v for row in hist["steps"] for g, v in enumerate(row["origin_losses"])}
    ref, ref_evals = reference(fed, "diloco")
    assert set(got) == set(ref) and max(abs(got[k] - ref[k]) for k in ref) == 0
    evals = {(e["step"], g): v for e in hist["evals"] for g, v in enumerate(e["origin_losses"])}
    assert max(abs(evals[k] - ref_evals[k]) for k in ref_evals) == 0
