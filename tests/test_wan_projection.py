"""The ring-step projection of benchmarks/wan.py (the event simulation in
benchmarks/ring_step_sim.py): its limits, one case computed by hand, and the bytes and
compute it is fed. Pure Python, no testbed."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from mobius_fed.config import TrainConfig
from tests.bench_loader import load_benchmark

sim, wan, compression = (
    load_benchmark("ring_step_sim"),
    load_benchmark("wan"),
    load_benchmark("compression"),
)


def _costs(M: int, c_f: float, c_b: float, t_f: float, t_b: float, **kw) -> object:
    """Per-slot compute and transfer seconds, split into M micro-batches (rate 8 bit/s:
    one byte takes one second)."""
    return sim.StepCosts(
        fwd_s=c_f / M,
        bwd_s=c_b / M,
        head_s=kw.get("head", 0.0) / M,
        home_s=kw.get("home", 0.0),
        fwd_bytes=t_f / M,
        bwd_bytes=t_b / M,
        rate_bps=8.0,
        delay_s=kw.get("delay", 0.0),
    )


@pytest.mark.parametrize(("P", "L"), [(4, 1), (3, 2), (2, 1)])
def test_one_micro_batch_is_the_serial_bound(P: int, L: int):
    """M = 1: every slot is compute, then transfer, then one delay (a chain)."""
    K = P * L
    c = _costs(1, 0.3, 0.7, 0.5, 0.2, head=0.11, home=0.05, delay=0.013)
    got = sim.simulate_step("cyclic", P, L, 1, c)["step_s"]
    compute = K * (0.3 + 0.7) + 0.11 + 0.05
    bound = wan.project(compute, K * (0.5 + 0.2), 8.0, 2 * 0.013, K)
    assert got == pytest.approx(compute / bound["serial_busy"])
    assert got == pytest.approx(compute + K * (0.5 + 0.2) + K * 2 * 0.013)


def test_many_micro_batches_approach_the_overlapped_bound():
    """Zero delay, M → ∞: a transfer-bound step tends to max(compute, transfer); a
    compute-bound one to compute plus one backward slot's transfer: the head sends the
    gradients of micro-batches 0..M-1 in that order and the backward starts at M-1."""
    K = 4
    for slot, limit in [((1, 2, 3, 6), K * 9), ((3, 6, 1, 2), K * 9 + 2)]:
        steps = [
            sim.simulate_step("cyclic", 4, 1, M, _costs(M, *slot))["step_s"]
            for M in (1, 2, 4, 16, 64, 256)
        ]
        assert steps[0] == pytest.approx(K * sum(slot))  # the serial bound
        assert all(a >= b for a, b in itertools.pairwise(steps)), steps
        assert steps[-1] == pytest.approx(limit, rel=0.002)
        assert steps[-1] > limit


def test_a_case_computed_by_hand():
    """P = 2, L = 1, M = 2; per micro-batch fwd 1 s, bwd 2 s, head 0.5 s; a forward hop
    3 s, a backward hop 1 s on the link, 0.25 s delay. Worker 0 (worker 1 is its mirror):
    F(t0,m0) 0–1, link 1–4; F(t0,m1) 1–2, link 4–7; F(t1,m0) waits for 4.25, 4.25–5.25,
    link 7–10; F(t1,m1) 7.25–8.25, link 10–13; head m0 10.25–10.75, link 13–14; head m1
    13.25–13.75, link 14–15; B(t1,m1) waits for 15.25, 15.25–17.25, link 17.25–18.25;
    B(t1,m0) 17.25–19.25, link 19.25–20.25; B(t0,m1) (arrived 18.5) 19.25–21.25;
    B(t0,m0) (arrived 20.5) 21.25–23.25."""
    c = sim.StepCosts(1.0, 2.0, 0.5, 0.0, 3.0, 1.0, 8.0, 0.25)
    r = sim.simulate_step("cyclic", 2, 1, 2, c)
    assert r["finish_s"] == [23.25, 23.25]
    assert r["link_s"] == 2 * 2 * (3.0 + 1.0)  # K·M hops each way


def test_the_token_bucket_lets_a_burst_pass_and_refills_at_the_rate():
    """P = 2, M = 1, 1 s per application each way, 2-byte hops at 1 byte/s, a 2-byte
    bucket, no delay. Worker 0: F(t0) 0–1 sends at once (bucket full, then empty); F(t1)
    1–2, bucket refilled 1 byte, link 2–3; head at 3, empty bucket, link 3–5; B(t1) 5–6,
    1 byte refilled, link 6–7; B(t0) 7–8. Without the bucket: the serial 4 + 8 = 12 s."""
    c = sim.StepCosts(1.0, 1.0, 0.0, 0.0, 2.0, 2.0, 8.0, 0.0, burst_bytes=2.0)
    assert sim.simulate_step("cyclic", 2, 1, 1, c)["step_s"] == 8.0
    plain = sim.StepCosts(1.0, 1.0, 0.0, 0.0, 2.0, 2.0, 8.0, 0.0)
    assert sim.simulate_step("cyclic", 2, 1, 1, plain)["step_s"] == 12.0
    assert wan.testbed_burst(2_000_000) == 128 << 10  # 4 ms of 2 Mbit/s is less
    assert wan.testbed_burst(1_000_000_000) == 500_000


@pytest.mark.parametrize("wire", [None, {"fwd": "int8", "bwd": "int4"}])
@pytest.mark.parametrize("M", [1, 2])
def test_hop_bytes_per_direction_add_up_to_step_bytes(wire, M: int):
    kw = {"wire": wire} if wire else {}
    cfg = TrainConfig(preset="cpu-small", workers=4, micro_batches=M, **kw)
    fwd, bwd = wan.hop_bytes(cfg)
    assert cfg.P * cfg.K * M * (fwd + bwd) == compression.step_bytes(cfg)[0]
    if wire:
        assert fwd > bwd  # int8 hidden states, int4 gradients
    else:
        assert fwd == bwd == 4 * (8 // M) * 128 * 96


def test_projection_at_one_micro_batch_is_the_serial_bound():
    cfg = TrainConfig(preset="cpu-small", workers=4)
    nbytes = wan.worker_bytes("cpu-small", 4, 1, cfg.batch_size, "fp32")
    shares = wan.flop_shares(cfg)
    assert sum(shares.values()) == pytest.approx(1.0)
    got = wan.project_micro(cfg, 0.5, shares, 1e7, 0.005)
    serial = wan.project(0.5, nbytes, 1e7, 0.01, cfg.K)
    assert got["busy"] == pytest.approx(serial["serial_busy"])
    two = wan.project_micro(cfg.model_copy(update={"micro_batches": 2}), 0.5, shares, 1e7, 0.005)
    assert serial["busy"] > two["busy"] > got["busy"]  # between the bounds


def test_check_table_reports_measured_over_the_model():
    args = argparse.Namespace(preset="cpu-small", micro=1, steps=10, skip=2)
    cfg = TrainConfig(preset="cpu-small", workers=4)
    shares = dict(zip(wan.SHARES, (0.25, 0.5, 0.125, 0.125)))
    row = {"wire": "none", "shape": "10mbit/5ms", "compute_s": 0.5, "busy": 0.2}
    burst = wan.testbed_burst(10_000_000)
    model = wan.project_micro(cfg, 0.5, shares, 1e7, 0.005, burst)["tokens_s"]
    nbytes = wan.worker_bytes("cpu-small", 4, 1, cfg.batch_size, "fp32")
    serial = cfg.tokens_per_step / (0.5 + 8 * nbytes / 1e7 + cfg.K * 0.01)
    assert serial < model < 1.2 * serial  # the burst passes some bytes at once
    row["tokens_s"] = 0.9 * model
    loopback = {**row, "shape": "loopback", "tokens_s": cfg.tokens_per_step / (1.25 * 0.5)}
    table = wan.check_table([loopback, row], args, shares)
    lines = table.splitlines()
    assert lines[-2].startswith("| none | loopback | 0.500 | 3.15 | 0.000 |")
    assert lines[-2].endswith("**0.80** [0.80, 0.80] | 1.25: 1.00 |")  # κ: its own step
    slower = wan.project_micro(cfg, 1.25 * 0.5, shares, 1e7, 0.005, burst)["tokens_s"]
    assert "**0.90**" in lines[-1]
    assert lines[-1].endswith(f"| 1.25: {0.9 * model / slower:.2f} |")
    assert "fwd 0.25, bwd 0.50, head 0.12, home 0.12" in table
    assert "| —" not in table
    assert wan.check_table([row], args, shares).endswith("| — |\n")  # no loopback: no κ


def test_bad_inputs_are_refused():
    c = sim.StepCosts(1.0, 2.0, 0.5, 0.0, 3.0, 1.0, 8.0, 0.25)
    with pytest.raises(ValueError, match="cyclic order only"):
        sim.simulate_step("ordered", 4, 1, 1, c)
    with pytest.raises(ValueError, match="micro-batches M must be ≥ 1"):
        sim.simulate_step("cyclic", 4, 1, 0, c)
    with pytest.raises(ValueError, match="fwd_s must be ≥ 0"):
        sim.StepCosts(-1.0, 2.0, 0.5, 0.0, 3.0, 1.0, 8.0, 0.25)
    with pytest.raises(ValueError, match="rate_bps must be > 0"):
        sim.StepCosts(1.0, 2.0, 0.5, 0.0, 3.0, 1.0, 0.0, 0.25)
    cfg = TrainConfig(preset="cpu-small", workers=4)
    with pytest.raises(ValueError, match="four values ≥ 0"):
        wan._shares(argparse.Namespace(shares=[1.0, -1.0, 0.0, 0.0]), cfg, measure=False)


def test_project_and_check_from_rows_on_the_command_line(tmp_path, capsys):
    argv = ["project", "--compute", "0.05", "--rates", "1gbit", "--schemes", "bf16"]
    assert wan.main([*argv, "--micro", "2", "--shares", "1", "2", "0", "0"]) == 0
    out = capsys.readouterr().out
    assert "M = 2 micro-batches" in out and "fwd 0.33, bwd 0.67, head 0.00" in out
    rows = tmp_path / "run.out"
    row = {"wire": "both=int8", "shape": "100mbit/5ms", "tokens_s": 5000.0, "compute_s": 0.5}
    rows.write_text("a table line\n" + json.dumps(row) + "\n")
    check = ["check", "--rows", str(rows), "--shares", "1", "2", "0", "0"]
    assert wan.main(check) == 0
    assert "| both=int8 | 100mbit/5ms | 0.500 | 0.81 |" in capsys.readouterr().out
    rows.write_text("nothing here\n")
    with pytest.raises(ValueError, match="no JSON rows"):
        wan.main(check)
    with pytest.raises(ValueError, match="models cyclic only"):
        wan.main([*check, "--order", "ordered"])
