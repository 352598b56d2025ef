"""The pure parts of benchmarks/peers.py: parameter counts against the built model, the
memory limits, the wall-clock projection by hand, and the arms it picks for 4 and 8 sites."""

from __future__ import annotations

import sys

import pytest

from tests.bench_loader import BENCH, load_benchmark

peers = load_benchmark("peers")


def test_parameter_counts_match_the_built_model():
    from mobius_fed.config import TrainConfig
    from mobius_fed.model import build_group, build_replica

    cfg = TrainConfig(preset="cpu-tiny", workers=4)
    mc = cfg.model()
    blocks = sum(p.numel() for i in range(4) for p in build_group(mc, i, 0).parameters())
    er = sum(p.numel() for p in build_replica(mc, 0).parameters())
    assert peers.model_params(12, 32, mc.vocab_size) == blocks + er
    site = sum(p.numel() for p in build_group(mc, 0, 0).parameters()) + er
    assert peers.site_params(12, 32, mc.vocab_size, 4) == site
    assert peers.arm_params(cfg, "federated") == site
    assert peers.SHAPES[0].params == 123_586_560  # gpt2-small, the paper's 124M
    assert 0.95e9 < peers.SHAPES[1].params < 1.05e9


def test_memory_limits():
    assert peers.state_bytes(1_000) == 16_000
    assert peers.max_whole_model(24 * 2**30) == pytest.approx(24 * 2**30 / 16)
    whole = peers.max_whole_model(80 * 2**30)
    ring4, ring8 = (peers.ring_limit(80 * 2**30, P, 128) for P in (4, 8))
    # a ring site holds 1/P of the blocks but all of the E/R: a bigger model, less than P×
    assert whole < ring4 < 4 * whole and ring4 < ring8 < 8 * whole
    # with P = 1 the ring site is the whole model
    assert peers.ring_limit(80 * 2**30, 1, 128) == pytest.approx(whole, rel=1e-6)


def test_projection_by_hand():
    shape = peers.Shape("t", n_layer=2, d=64, vocab=100, seq=16)
    N = shape.params
    kw = dict(sites=4, batch=2, flops=1e9, rate_bps=8e6)  # 1 MB/s
    compute = 6 * N * 2 * 16 / 1e9
    steps = 1e9 / (4 * 2 * 16)
    d = peers.project_arm(shape, "diloco", H=10, **kw)
    assert d["compute_s"] == pytest.approx(compute)
    assert d["step_s"] == pytest.approx(compute + 2 * 4 * N / 1e6 / 10)  # up, then down
    assert d["hours_per_1B"] == pytest.approx(steps * d["step_s"] / 3600)
    r = peers.project_arm(shape, "ring", rtt_s=0.01, **kw)
    hops = 2 * 4 * 2 * 16 * 64 * 4  # 2·P hidden states of batch × seq × d, fp32
    assert r["bytes_per_site_step"] == hops + 100 * 64 * 4
    assert r["step_s"] == pytest.approx(
        max(compute, hops / 1e6) + 4 * 0.01 + 2 * 100 * 64 * 4 / 1e6 + 0.01
    )
    codec = peers.project_arm(shape, "ring", ratio=peers.CODEC_RATIO["codec"], er_every=100, **kw)
    assert codec["bytes_per_site_step"] == pytest.approx(hops * 100 / 512 + 100 * 64 * 4 / 100)
    with pytest.raises(ValueError, match="ring or diloco"):
        peers.project_arm(shape, "fedavg", **kw)


def test_codec_ratio_is_the_wire_payload():
    sys.path.insert(0, str(BENCH))
    from compression import step_bytes

    from mobius_fed.config import TrainConfig
    from mobius_fed.transport.wire_config import WireConfig

    cfg = TrainConfig(preset="cpu-tiny", workers=4, wire=WireConfig.parse_flag(peers.CODEC))
    sent, fp32 = step_bytes(cfg)
    assert sent / fp32 == pytest.approx(peers.CODEC_RATIO["codec"])


def test_tokens_and_int4_ratios_are_the_payloads_at_gpt2_small():
    race = load_benchmark("race")
    arm = next(a for a in race.arms() if a.name.startswith("ring tokens (d/4)"))
    sent = race.sent_bytes(arm.train_config("gpt2-small", 8))
    shape = peers.SHAPES[0]
    assert sent["hops"] == pytest.approx(
        peers.ring_step_bytes(shape, 4, 8, peers.CODEC_RATIO["tokens d/4"])
    )
    assert sent["er"] * 10 == pytest.approx(shape.vocab * shape.d * 4 * peers.INT4_RATIO)


def test_arms_for_four_and_eight_sites():
    four = {a.name: a for a in peers.arms(4)}
    assert peers.ring_groups(4, 12) == 4 and peers.ring_groups(8, 12) == 4
    assert "rings of rings (R=2, P=2, H=1)" in four
    assert {a.kind for a in four.values()} == {"federated", "alone", "pooled"}
    assert [n for n in four if n.startswith("DiLoCo")] == [
        f"DiLoCo H={H} (P=1, R=4)" for H in (1, 10, 50, 100)
    ]
    eight = {a.name: a for a in peers.arms(8)}
    assert "cyclic ring (2 rings of P=4, H=1)" in eight
    private = next(a for a in eight.values() if a.keys)
    assert private.train["layers_per_group"] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert "rings of rings (R=4, P=2, H=1)" in eight


def test_crossover_interpolates_in_log_size():
    assert peers.crossover([(1e8, 5.0, 1.0), (1e9, 3.0, 2.0)]) is None
    assert peers.crossover([(1e8, 1.0, 2.0)]) == 1e8  # the ring is ahead from the start
    # a − b goes 2 → −2 between 1e8 and 1e10: equal halfway in log size
    assert peers.crossover([(1e8, 4.0, 2.0), (1e10, 1.0, 3.0)]) == pytest.approx(1e9)


def test_wall_clock_favours_diloco_h100_for_gpt2_small_and_the_ring_for_the_largest():
    kw = dict(sites=4, batch=8, flops=128e12, rate_bps=1e9)
    ring = dict(ratio=peers.CODEC_RATIO["codec"], er_every=100)
    small, big = peers.SHAPES[0], peers.family(8192, 128)
    for shape, ring_faster in ((small, False), (big, True)):
        r = peers.project_arm(shape, "ring", **ring, **kw)["hours_per_1B"]
        d = peers.project_arm(shape, "diloco", H=100, **kw)["hours_per_1B"]
        assert (r < d) is ring_faster


def test_ring_bytes_are_wan_projects_worker_bytes():
    wan = load_benchmark("wan")
    for scheme, ratio in (("fp32", 1.0), (f"wire={peers.CODEC}", peers.CODEC_RATIO["codec"])):
        want = wan.worker_bytes("gpt2-small", 4, 1, 8, scheme)
        assert peers.ring_step_bytes(peers.SHAPES[0], 4, 8, ratio) == pytest.approx(want)
