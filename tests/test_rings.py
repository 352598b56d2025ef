"""R rings of P groups in the reference engine (docs/rings.md): one ring is today's run,
rings on identical data stay identical to one ring, a ring sync leaves every ring with the
same groups, DiLoCo's outer step is torch's Nesterov SGD on the pseudo-gradient."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from pydantic import ValidationError

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.engine.rings import RingsEngine, make_engine
from mobius_fed.strategies import (
    RingPlan,
    RingSync,
    RoundPlan,
    make_strategy,
    nesterov_step,
    restore_server_state,
    server_state,
)
from mobius_fed.worker.config import WorkerConfig

P = 4  # sites cut for the module (site_dirs)
BASE = dict(preset="cpu-tiny", batch_size=4, optimizer="adamw", steps=4, eval_every=2)
pytestmark = pytest.mark.usefixtures("one_torch_thread")
logging.getLogger("flwr").setLevel(logging.WARNING)


def run(cfg: TrainConfig, dirs: list[Path], order: list[int], outer: str = "fedavg"):
    """Per-step origin losses, per-eval origin losses and the engine, under Flower."""
    engine = make_engine(cfg, [SiteData(dirs[i], cfg.model().seq_len) for i in order])
    strategy = make_strategy(outer, cfg.workers, RoundPlan.of(cfg), rings=RingPlan.of(cfg))
    grid = train_with_strategy(engine, strategy)
    return [r.origin_losses for r in grid.steps], [e.origin_losses for e in grid.evals], engine


def test_one_ring_is_todays_engine_and_strategy(site_dirs: list[Path]) -> None:
    cfg = TrainConfig(workers=2, **BASE)
    assert cfg.P == 2 and RingPlan.of(cfg) is None
    assert type(make_engine(cfg, [SiteData(d, 64) for d in site_dirs[:2]])) is ReferenceEngine
    assert type(make_strategy("fedavg", 2, RoundPlan.of(cfg)).strategy).__name__ == "ErAveraging"


def test_rings_on_identical_data_equal_one_ring_bit_for_bit(site_dirs: list[Path]) -> None:
    """P = 1, R = 2 (DiLoCo's shape, H = 1, plain averaging) with both sites on the same
    data: the rings stay identical, each average of two equal tensors is that tensor, so
    the run equals the one-site run exactly. A ring seeded, fed or synced differently, or
    an average over the wrong replies, breaks it."""
    one = run(TrainConfig(workers=1, **BASE), site_dirs, [0])
    two = run(TrainConfig(workers=2, rings=2, **BASE), site_dirs, [0, 0])
    assert [[v, v] for (v,) in one[0]] == two[0]
    assert [[v, v] for (v,) in one[1]] == two[1]


def test_two_rings_of_two_on_identical_data_track_one_ring(site_dirs: list[Path]) -> None:
    """(R, P) = (2, 2) with ring 1 on ring 0's data, H = 1: each F_i must come back to the
    ring and slot it left (a group sent to the wrong worker, or to all, moves the losses by
    ~1e-3 within two steps). The E/R average runs over four sites instead of two, so
    equality holds up to that rounding (here it is exact)."""
    one = run(TrainConfig(workers=2, **BASE), site_dirs, [0, 1])
    two = run(TrainConfig(workers=4, rings=2, **BASE), site_dirs, [0, 1, 0, 1])
    for a, b in ((one[0], two[0]), (one[1], two[1])):
        assert all(x[:2] == x[2:] for x in b)  # the rings stay identical
        assert max(abs(u - v) for x, y in zip(a, b) for u, v in zip(x, y[:2])) <= 1e-6


def test_a_ring_sync_leaves_every_ring_with_the_same_groups(site_dirs: list[Path]) -> None:
    """(R, P) = (2, 2) on four sites, H = 2: between syncs the rings drift apart (different
    data), after the last sync each F_i is the same in both rings, bit for bit."""
    cfg = TrainConfig(workers=4, rings=2, ring_sync_every=2, **BASE)
    losses, evals, engine = run(cfg, site_dirs, [0, 1, 2, 3])
    assert isinstance(engine, RingsEngine) and len(losses[0]) == len(evals[-1]) == 4
    assert losses[1][:2] != losses[1][2:]
    for i in range(cfg.P):
        a, b = (dict(ring.groups[i].named_parameters()) for ring in engine.rings)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_diloco_outer_step_by_hand_and_as_torch_sgd() -> None:
    theta = ArrayRecord({"w": Array(np.array([1.0], np.float32))})
    avg = ArrayRecord({"w": Array(np.array([0.5], np.float32))})
    new, buf = nesterov_step(theta, avg, None, 0.7, 0.9)
    # Δ = 0.5, b = 0.5, θ = 1 − 0.7·(0.5 + 0.9·0.5) = 0.335
    assert new["w"].numpy()[0] == pytest.approx(0.335) and buf[0][0] == pytest.approx(0.5)
    rng = np.random.default_rng(0)
    w = torch.nn.Parameter(torch.tensor(rng.standard_normal(5), dtype=torch.float32))
    sgd = torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True)
    current, momentum = ArrayRecord({"w": Array(w.detach().numpy().copy())}), None
    for _ in range(3):
        target = rng.standard_normal(5).astype(np.float32)
        w.grad = w.detach() - torch.from_numpy(target)  # the pseudo-gradient
        sgd.step()
        current, momentum = nesterov_step(
            current, ArrayRecord({"w": Array(target)}), momentum, 0.7, 0.9
        )
        np.testing.assert_allclose(current["w"].numpy(), w.detach().numpy(), rtol=1e-6)


def test_diloco_rings_start_from_the_seed_and_keep_their_state(site_dirs: list[Path]) -> None:
    """A DiLoCo ring sync steps from F_i's initial weights; its momentum and the synced
    groups travel in the server state (checkpoints, rollbacks)."""
    cfg = TrainConfig(workers=2, rings=2, ring_outer="diloco", outer_lr=0.7, **{**BASE, "steps": 2})
    _, _, engine = run(cfg, site_dirs, [0, 1], outer="diloco")
    a, b = (dict(ring.groups[0].named_parameters()) for ring in engine.rings)
    assert all(torch.equal(a[k], b[k]) for k in a)  # both rings load the outer step's result
    plan = RingPlan.of(cfg)
    strategy = make_strategy("fedavg", 2, RoundPlan.of(cfg), rings=plan)
    assert isinstance(strategy.strategy, RingSync)
    strategy.strategy.momentum = {0: [np.ones(2)]}
    other = make_strategy("fedavg", 2, RoundPlan.of(cfg), rings=plan)
    restore_server_state(other, server_state(strategy))
    assert np.array_equal(other.strategy.momentum[0][0], np.ones(2))


def test_bad_ring_settings_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="rings=3 does not divide workers=4"):
        TrainConfig(workers=4, rings=3)
    with pytest.raises(ValidationError, match="must be a multiple of sync_every=2"):
        TrainConfig(workers=4, rings=2, sync_every=2, ring_sync_every=3)
    with pytest.raises(ValidationError, match=r"cannot be combined with privacy\.home_layer"):
        TrainConfig(workers=4, rings=2, privacy={"home_layer": "mlp"})
    with pytest.raises(ValidationError, match="needs a coordinator"):
        WorkerConfig(
            data_dir=tmp_path, rank=0, peers=["a:1", "b:2"], train=TrainConfig(workers=4, rings=2)
        )
    # a certificate whose rank is past the run's R·P workers: refused at registration,
    # naming the ring that rank would be in (the message the coordinator aborts with)
    from mobius_fed.coordinator.enrolment import not_enrolled

    assert not_enrolled("mobius://worker/5", "", 4, rings=2) == (
        "identity mobius://worker/5 is not an enrolled worker of this run (P=4: workers 0–3, "
        "2 rings of 2; its certificate's rank 5 would be ring 2, which this run does not have)"
    )
    assert not_enrolled("mobius://worker/6", "", 4) == (
        "identity mobius://worker/6 is not an enrolled worker of this run (P=4)"
    )
    cfg = TrainConfig(workers=4, rings=2, **BASE)
    with pytest.raises(Exception, match="ring syncs are Flower rounds"):
        RingsEngine(cfg, [SiteData(tmp, 64) for tmp in _four(tmp_path)]).train_step()


def test_sites_with_another_h_do_not_share_a_run() -> None:
    """Two sites of the same 2 rings of 2, one with H = 2 and one with H = 4: their configs
    hash apart, so the coordinator refuses the second at registration (config mismatch),
    and the refusal's settings name both H (the real-process refusal, rings and H both
    differing, is in test_coordinator's test_strangers_cannot_register_or_read_status)."""
    a = TrainConfig(workers=4, rings=2, ring_sync_every=2, **BASE)
    b = TrainConfig(workers=4, rings=2, ring_sync_every=4, **BASE)
    assert a.fingerprint() != b.fingerprint()
    assert "ring_sync_every=2" in a.ring_settings() and "ring_sync_every=4" in b.ring_settings()
    same = TrainConfig(workers=4, rings=2, ring_sync_every=2, **BASE)
    assert same.fingerprint() == a.fingerprint()


def _four(root: Path) -> list[Path]:
    from mobius_fed.data import embedded_corpus, prepare_sites

    return prepare_sites(None, root / "sites", 4, text=embedded_corpus()[:60_000])


def test_a_rings_links_admit_only_that_rings_neighbours(tmp_path: Path) -> None:
    """Ring 1 of (R, P) = (2, 2) is workers 2 and 3: they link up under their own
    (global) identities, and worker-3 refuses a stream from ring 0's worker-0, which holds
    the same group slot one ring over: a certificate names the ring through the rank."""
    import grpc

    from mobius_fed.transport.certs import init_certs
    from mobius_fed.transport.tls import open_channel
    from mobius_fed.worker.frames import FrameRules
    from mobius_fed.worker.link import RingLinks

    certs = init_certs(tmp_path / "certs", workers=4)
    cfg = TrainConfig(preset="cpu-tiny", workers=4, rings=2)
    links = [
        RingLinks(
            FrameRules(cfg, i, "rings", lambda: 0),
            listen="127.0.0.1:0",
            successor="",
            tls=certs.bundle(f"worker-{2 + i}"),
            peer_timeout=20,
            ring_base=2,
        )
        for i in range(2)
    ]
    ports = [link.start_server() for link in links]
    try:
        for i, link in enumerate(links):
            link.successor_addr = f"127.0.0.1:{ports[1 - i]}"
        for link in links:
            link.connect()
        assert [link.edge_states()["out"]["state"] for link in links] == ["up", "up"]
        ch = open_channel(f"127.0.0.1:{ports[1]}", certs.bundle("worker-0"), target_name="worker-3")
        with ch, pytest.raises(grpc.RpcError) as err:
            call = ch.stream_stream("/mobius_fed.ring.v1.RingLink/Stream")
            for _ in call(iter([]), timeout=20, metadata=(("mobius-run", "rings"),)):
                pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details() == (
            "worker-3 accepts ring frames only from its predecessor mobius://worker/2, not "
            "mobius://worker/0 (its certificate is ring 0's; this is ring 1's worker-3)"
        )
    finally:
        for link in links:
            link.close()


def test_a_rings_worker_never_connects_to_another_rings_worker(tmp_path: Path) -> None:
    """The other direction: worker-2 (ring 1, slot 0) given ring 0's worker-1 at its
    successor's address never opens the edge: its dial checks the server's certificate for
    worker-3's name, which worker-1's certificate does not carry, and it gives up naming
    its successor worker-3."""
    from mobius_fed.transport.certs import init_certs
    from mobius_fed.worker.frames import FrameRules
    from mobius_fed.worker.link import RingLinks
    from mobius_fed.worker.link_session import PeerError

    certs = init_certs(tmp_path / "certs", workers=4)
    cfg = TrainConfig(preset="cpu-tiny", workers=4, rings=2)

    def link(g: int, timeout: float) -> RingLinks:
        return RingLinks(
            FrameRules(cfg, g % 2, "rings", lambda: 0),
            listen="127.0.0.1:0",
            successor="",
            tls=certs.bundle(f"worker-{g}"),
            peer_timeout=timeout,
            ring_base=g - g % 2,
        )

    ring0, ring1 = link(1, 20), link(2, 2)
    try:
        port = ring0.start_server()
        ring1.start_server()
        ring1.successor_addr = f"127.0.0.1:{port}"
        with pytest.raises(PeerError, match=r"successor worker-3 .*unreachable after 2s"):
            ring1.connect()
        assert ring0.edge_states()["in"]["state"] != "up"
    finally:
        ring0.close()
        ring1.close()


def test_a_ring_codec_sends_the_pseudo_gradient_as_the_codec_rounds_it() -> None:
    """With ``ring_codec`` a worker sends δ = base − θ as the codec's payload (int8: about
    3.9× fewer bytes than fp32), and the coordinator reads exactly the codec's roundtrip."""
    from mobius_fed.model import build_group
    from mobius_fed.strategies import decode_delta, encode_delta, group_arrays
    from mobius_fed.transport.compress import Codec

    mc = TrainConfig(preset="cpu-tiny", workers=4, rings=2).model()
    base, group = build_group(mc, 0, 0), build_group(mc, 0, 1)
    base_state = {k: v.detach() for k, v in base.named_parameters()}
    for codec in ("int8", "int4"):
        sent = encode_delta(group, base_state, codec)
        got = decode_delta(sent, group_arrays(base), codec)
        for name, p in group.named_parameters():
            delta = base_state[name] - p.detach()
            want = Codec(codec).roundtrip(delta)
            assert torch.equal(torch.from_numpy(got[name].numpy()), want)
            assert sent[name].numpy().nbytes == Codec(codec).payload_bytes(tuple(p.shape))
    fp32 = sum(p.numel() * 4 for p in group.parameters())
    int8 = sum(a.numpy().nbytes for a in encode_delta(group, base_state, "int8").values())
    assert 3.5 < fp32 / int8 < 4
