"""``mobius-fed plan``: the split that minimises the simulated ring step over unequal sites."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mobius_fed.cli.main import main
from mobius_fed.config import TrainConfig
from mobius_fed.ops import plan as planner
from mobius_fed.ops.plan import (
    PlanError,
    plan_split,
    read_sites,
    site_costs,
    site_flops,
    step_seconds,
)
from mobius_fed.ops.step_sim import StepCosts, simulate_step

CFG = dict(preset="cpu-tiny", batch_size=4)


def _sites(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sites.yaml"
    path.write_text(text)
    return path


SLOW_THIRD = """\
sites:
  - {name: a, tflops: 2}
  - {name: b, tflops: 2}
  - {name: c, tflops: 1}
  - {name: d, tflops: 2}
"""


def test_per_worker_costs_equal_one_for_all_when_they_are_equal() -> None:
    c = StepCosts(1.0, 2.0, 0.5, 0.1, 3.0, 1.0, 8.0, 0.25)
    assert simulate_step("cyclic", 3, 2, 2, [c] * 3) == simulate_step("cyclic", 3, 2, 2, c)
    with pytest.raises(ValueError, match="2 workers' costs for P=3"):
        simulate_step("cyclic", 3, 1, 1, [c] * 2)


def test_a_slow_site_gets_fewer_layers_and_the_plan_beats_the_even_split(tmp_path) -> None:
    """Compute-bound (unshaped links, M = 2 so that sending overlaps): the site at half
    speed holds fewer blocks, and the plan is the best of every split, simulated."""
    cfg = TrainConfig(**CFG, micro_batches=2)
    sites = read_sites(_sites(tmp_path, SLOW_THIRD), cfg)
    plan = plan_split(cfg, sites)
    assert plan.even == (3, 3, 3, 3) and plan.even_step_s == step_seconds(cfg, sites, plan.even)
    assert plan.split[2] < 3 and sum(plan.split) == 12
    every = [step_seconds(cfg, sites, s) for s in planner._compositions(12, 4)]
    assert plan.step_s == pytest.approx(min(every), rel=1e-12)
    assert plan.speedup > 1.15 and plan.tokens_s == pytest.approx(cfg.tokens_per_step / plan.step_s)
    # the slow site's forward on one micro-batch: its blocks at its speed
    costs = site_costs(cfg, sites, plan.split)
    per_block = planner.block_flops(cfg) / 1e12
    assert costs[2].fwd_s == pytest.approx(plan.split[2] * per_block)


def test_equal_sites_keep_the_even_split_and_local_search_finds_the_best(
    tmp_path, monkeypatch
) -> None:
    cfg = TrainConfig(**CFG)
    equal = read_sites(_sites(tmp_path, "sites: [{tflops: 1}, {tflops: 1}, {tflops: 1}]\n"), cfg)
    assert plan_split(TrainConfig(**CFG, workers=3), equal).split == (4, 4, 4)
    sites = read_sites(_sites(tmp_path, SLOW_THIRD), cfg)
    exhaustive = plan_split(cfg, sites)
    monkeypatch.setattr(planner, "EXHAUSTIVE", 0)  # many layers, many sites: a local search
    assert plan_split(cfg, sites).step_s == pytest.approx(exhaustive.step_s, rel=1e-12)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("sites: [{block_ms: 2, tflops: 1}]\n", "block_ms (measured) or tflops (declared)"),
        ("sites: [{name: x, tflops: 1, rate: fast}]\n", "site 0 (x): rate 'fast'"),
        ("sites: [{tflops: 1}, {tflops: 1, colour: red}]\n", "site 1 (worker-1): unknown key"),
        ("sites: [{block_ms: 0}]\n", "block_ms must be > 0"),
        ("nodes: []\n", "expected a list under 'sites:'"),
    ],
)
def test_a_bad_sites_file_is_refused_naming_the_site(tmp_path, text: str, words: str) -> None:
    with pytest.raises(PlanError, match=re.escape(words)):
        read_sites(_sites(tmp_path, text), TrainConfig(**CFG))


def test_plan_command_prints_both_splits_and_refuses_more_groups_than_sites(
    tmp_path, capsys
) -> None:
    path = _sites(tmp_path, SLOW_THIRD)
    assert main(["plan", "--sites", str(path), "--preset", "cpu-tiny", "--micro-batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "even split    3,3,3,3" in out and "planned split" in out and "tokens/s" in out
    assert "mobius-fed up --layers-per-group" in out
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--sites", str(path), "--workers", "5"])
    assert exc.value.code != 0
    assert "more groups than sites" in " ".join(capsys.readouterr().err.split())


def test_a_measured_block_time_is_for_the_home_batch(tmp_path) -> None:
    """``block_ms``: one block forward on the whole home batch, so with M micro-batches
    each application of a group of n blocks takes n · block_ms / M."""
    cfg = TrainConfig(**CFG, workers=2, micro_batches=2)
    sites = read_sites(_sites(tmp_path, "sites: [{block_ms: 4}, {block_ms: 8}]\n"), cfg)
    a, b = site_costs(cfg, sites, (8, 4))
    assert a.fwd_s == pytest.approx(8 * 0.004 / 2) and b.fwd_s == pytest.approx(4 * 0.008 / 2)
    assert b.bwd_s == pytest.approx(2 * b.fwd_s)


@pytest.mark.parametrize("micro", [1, 2])
def test_a_speed_from_measured_step_compute_gives_that_compute_back(micro: int) -> None:
    """``site_flops``: a site that measured c compute seconds per step holding n blocks is
    planned at a speed whose simulated step compute, holding n blocks, is c again; holding
    fewer blocks, less."""
    cfg = TrainConfig(**CFG, workers=4, micro_batches=micro)
    site = planner.Site("w", site_flops(cfg, 3, 0.8), planner.UNSHAPED_BPS, 0.0, "")
    K, M = cfg.K, cfg.micro_batches

    def compute(n: int) -> float:
        (c,) = site_costs(cfg, [site], (n,))
        return K * M * (c.fwd_s + c.bwd_s) + M * c.head_s

    assert compute(3) == pytest.approx(0.8)
    assert compute(1) < compute(2) < 0.8
    with pytest.raises(PlanError, match="compute > 0"):
        site_flops(cfg, 3, 0.0)
