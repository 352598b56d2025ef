"""The pure parts of benchmarks/race.py: each arm's bytes per step, the link that matches
its traffic to gpt2-small's on a GPU site, the refusal of a link the shaper cannot make,
and the time a curve takes to reach a loss."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from tests.bench_loader import load_benchmark

race = load_benchmark("race")
ARGS = SimpleNamespace(rate="1gbit", preset="cpu-tiny", batch=8, rtt_ms=0.0)


def arm(prefix: str):
    return next(a for a in race.arms() if a.name.startswith(prefix))


def test_diloco_sends_its_whole_model_once_per_H_and_the_ring_its_hops():
    from compression import step_bytes

    from mobius_fed.model import build_group, build_replica

    for H in (10, 50, 100):
        cfg = arm(f"DiLoCo H={H}").train_config("cpu-tiny", 8)
        mc = cfg.model()
        params = sum(p.numel() for p in build_group(mc, 0, 0).parameters())
        params += sum(p.numel() for p in build_replica(mc, 0).parameters())
        b = race.sent_bytes(cfg)
        assert b["hops"] == 0 and b["er"] + b["groups"] == pytest.approx(4 * params / H)
    cfg = arm("ring codec").train_config("cpu-tiny", 8)
    b = race.sent_bytes(cfg)
    assert b["hops"] == step_bytes(cfg)[0] / 4 and b["groups"] == 0
    er_fp32 = sum(p.numel() for p in build_replica(cfg.model(), 0).parameters()) * 4
    assert er_fp32 / 10 / 8 < b["er"] < er_fp32 / 10 / 6  # int4 with its scales, every 10


@pytest.mark.parametrize("prefix", ["ring tokens", "ring codec", "DiLoCo H=100"])
def test_the_link_makes_the_arms_traffic_the_same_multiple_of_its_compute(prefix):
    a = arm(prefix)
    link = race.scale_link(a, ARGS, compute_cpu_s=0.04)
    here = 8 * link.bytes_cpu / link.rate_bps / link.compute_cpu_s
    gpu = 8 * link.bytes_gpu / 1e9 / link.compute_gpu_s
    assert here == pytest.approx(gpu, rel=1e-9)
    assert link.compute_gpu_s == pytest.approx(8 * 1024 / race.GPU_TOKENS_S)
    # the projection at this scale is the GPU site's step times k
    gpu_cfg = a.train_config("gpt2-small", 8)
    step = race.step_model(gpu_cfg, link.compute_gpu_s, 1e9, 0.0)
    assert link.projected_step_s == pytest.approx(link.k * step)
    # a byte takes 1 Gbit/s ÷ rate longer here: so do the keepalive pings' answers
    assert link.keepalive_scale == pytest.approx(1e9 / link.rate_bps) and link.keepalive_scale > 1


def test_a_link_below_the_shapers_floor_is_refused_with_the_limit():
    with pytest.raises(SystemExit, match="below the shaper's 8 kbit/s"):
        race.scale_link(arm("DiLoCo H=100"), ARGS, compute_cpu_s=100.0)


def test_time_to_a_loss_interpolates_between_evaluations_in_gpu_site_seconds():
    run = {"link": {"k": 2.0}, "curve": {"seconds": [10.0, 20.0, 30.0], "eval": [3.0, 2.0, 1.5]}}
    assert race.time_to(run, 2.5) == pytest.approx(7.5)  # halfway from 5 to 10 GPU seconds
    assert race.time_to(run, 3.5) == pytest.approx(5.0)  # reached at the first evaluation
    assert race.time_to(run, 1.0) is None
    assert not math.isnan(race.time_to(run, 1.5))
    # by the run's own compute (0.1 s a step against the GPU site's 0.05: k = 2 as well)
    run |= {"compute_s": 0.1, "link": {"k": 4.0, "compute_gpu_s": 0.05}}
    assert race.time_to(run, 2.5, own=True) == pytest.approx(7.5)
    assert race.time_to(run, 2.5) == pytest.approx(3.75)
    base = {"link": {"k": 1.0}, "curve": {"seconds": [10.0, 15.0], "eval": [2.8, 2.5]}}
    assert race.race_ratio(run, base, own=False) == pytest.approx(3.75 / 15)
    assert race.ratio_text([math.inf, 1.0], None) == "not reached in 1 of 2 seeds"


def test_the_way_down_is_the_synced_model_in_fp32_once_per_sync():
    """Whatever codec compresses the way up, the synced E/R and F_i come down in fp32,
    once per sync; the step model charges up, then down."""
    fp32 = race.sent_bytes(arm("DiLoCo H=100").train_config("cpu-tiny", 8))
    int4 = race.sent_bytes(arm("DiLoCo H=100, int4").train_config("cpu-tiny", 8))
    assert int4["groups"] < fp32["groups"] / 6 and int4["er"] == fp32["er"]
    for b in (fp32, int4):
        assert (b["er_down"], b["groups_down"]) == (fp32["er"], fp32["groups"])
    cfg = arm("DiLoCo H=100, int4").train_config("gpt2-small", 8)
    b, rate = race.sent_bytes(cfg), 1e9
    down = 8 * (b["er_down"] + b["groups_down"]) / rate
    assert race.step_model(cfg, 0.05, rate, 0.0) == pytest.approx(
        0.05 + 8 * (b["er"] + b["groups"]) / rate + down
    )
    ring = race.sent_bytes(arm("ring codec").train_config("cpu-tiny", 8))
    assert ring["groups_down"] == 0 and ring["er_down"] > 6 * ring["er"]  # int4 up, fp32 down


def test_measured_bytes_are_the_workers_reports_per_step():
    rounds = [
        {"step": 100, "workers": {"0": {"er_bytes": 10.0, "sync_bytes": 90.0, "down_bytes": 400.0,
                                        "commitment_bytes": 600.0},
                                  "1": {"er_bytes": 10.0, "down_bytes": 100.0}}},
        {"step": 200, "workers": {"0": {"er_bytes": 10.0, "sync_bytes": 90.0, "down_bytes": 100.0},
                                  "1": {"er_bytes": 10.0, "sync_bytes": 90.0,
                                        "commitment_bytes": 200.0}}},
    ]  # fmt: skip
    assert race.measured_bytes(rounds) == {
        "up": (200 + 110) / 2 / 200, "down": 300 / 200, "commitment": (600 + 200) / 2 / 200
    }  # fmt: skip


def test_the_last_rounds_excess_is_taken_out_of_both_times_alike():
    """A run whose last 100 steps took 30 s more than the others (its final checkpoint
    copy): end_excess finds the 30 s, and without it a DiLoCo arm's time shrinks by 30 s
    while a ring that reached the target mid-run keeps its own."""
    steps = [100, 200, 300, 400, 500]

    def run(seconds: list[float], evals: list[float]) -> dict:
        return {"link": {"k": 1.0}, "curve": {"steps": steps, "seconds": seconds, "eval": evals}}

    diloco = run([12.0, 22.0, 32.0, 42.0, 82.0], [3.0, 2.8, 2.6, 2.4, 2.2])
    ring = run([20.0, 40.0, 60.0, 80.0, 100.0], [2.6, 2.4, 2.2, 2.0, 1.9])
    assert race.end_excess(diloco) == pytest.approx(30.0)
    assert race.end_excess(ring) == 0.0
    assert race.race_ratio(ring, diloco, False) == pytest.approx(60.0 / 82.0)
    assert race.race_ratio(ring, diloco, False, no_end=True) == pytest.approx(60.0 / 52.0)
