"""Robust aggregation across rings (docs/rings.md "Robust aggregation across rings"): a ring
sync combines the R rings' F_i with Flower's FedMedian, FedTrimmedAvg or Krum; ``mean`` is
the weighted average as before, bit for bit; what cannot work is refused with the value
and the limit; one lying ring moves the honest rings' Eq. 8 under the mean, and not under
a robust aggregate (in the reference engine, under the run's own strategy)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from pydantic import ValidationError

from mobius_fed.cli import coordinator as coordinator_cli
from mobius_fed.config import LATER_SETTINGS, ConfigError, TrainConfig
from mobius_fed.coordinator.config import load_coordinator_config
from mobius_fed.robust_sync import RingAggregate
from mobius_fed.strategies import RingPlan, RingSync, RoundPlan, flower_strategy, make_strategy
from tests.bench_loader import load_benchmark

P = 5  # sites cut for the module (site_dirs), as benchmarks/ring_poisoning.py cuts them
pytestmark = pytest.mark.usefixtures("one_torch_thread")
logging.getLogger("flwr").setLevel(logging.WARNING)
CERTS = {"MOBIUS_CA": "ca.crt", "MOBIUS_CERT": "tls.crt", "MOBIUS_KEY": "tls.key"}


def records(rows: list[list[float]], weights: list[int] | None = None) -> list[RecordDict]:
    """One ring-sync record per row: its arrays ``w`` (float32) and its weight."""
    weights = weights or [4] * len(rows)
    return [
        RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(np.asarray(row, dtype=np.float32))}),
                "metrics": MetricRecord({"num-examples": n, "loss": 1.0}),
            }
        )
        for row, n in zip(rows, weights, strict=True)
    ]


def combined(kind: str, rows: list[list[float]], **kw: Any) -> np.ndarray:
    recs = records(rows, [1, 1, 100, 1, 1][: len(rows)])  # robust aggregates ignore weights
    out = RingAggregate(kind, len(rows), **kw)(1, recs)
    assert all(list(r["arrays"].keys()) == ["w"] for r in recs)  # left as they came
    return out["w"].numpy()


def test_median_trimmed_mean_and_krum_of_known_arrays() -> None:
    """Ring 2 of 3 lies on two coordinates: the median is the honest middle; the trimmed
    mean of 5 (cut int(0.34·5) = 1 off each end) is the mean of the middle three; Krum of 5
    (f = 1) picks the one ring closest to its 5 − 1 − 2 = 2 nearest, bit for bit."""
    got = combined("median", [[1, 0, 3], [2, 5, 3], [100, -7, 3]])
    assert got.dtype == np.float32 and got.tolist() == [2, 0, 3]
    five = [[1], [2], [6], [7], [100]]
    assert combined("trimmed", five).tolist() == [5]  # (2 + 6 + 7) / 3
    assert combined("trimmed", five, trim=0.2).tolist() == [5]  # Flower's default, R = 5
    assert combined("trimmed", five, trim=0.4).tolist() == [6]  # cut 2 each end: the median
    rows = [[0.1, 0.0], [0.0, 0.0], [0.0, 0.1], [-0.1, 0.0], [50.0, 50.0]]
    assert np.array_equal(combined("krum", rows), np.asarray(rows[1], dtype=np.float32))
    rows3 = [[0.0, 0.0], [0.1, 0.0], [60.0, -60.0]]  # f = 0 at R = 3: one of the close pair
    got = combined("krum", rows3, krum_f=0)
    assert any(np.array_equal(got, np.float32(row)) for row in rows3[:2])


def test_mean_is_the_weighted_average_as_before_bit_for_bit() -> None:
    """``mean`` (the default everywhere) is Flower's weighted average, as a ring sync did
    before robust aggregates existed; the new settings leave the fingerprint alone."""
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(7).tolist() for _ in range(3)]
    want = aggregate_arrayrecords(records(rows, [3, 1, 2]), "num-examples")["w"].numpy()
    got = RingAggregate("mean", 3)(1, records(rows, [3, 1, 2]))["w"].numpy()
    assert np.array_equal(got, want) and not np.array_equal(got, np.mean(rows, 0))
    cfg = TrainConfig(workers=4, rings=2)
    plan = RingPlan.of(cfg)
    assert cfg.ring_aggregate == "mean" and plan is not None and plan.aggregate == "mean"
    ring = make_strategy("fedavg", 4, RoundPlan.of(cfg), rings=plan).strategy
    assert isinstance(ring, RingSync) and ring.combine == RingAggregate("mean", 2)
    for key in ("ring_aggregate", "ring_trim", "ring_krum_f"):
        assert LATER_SETTINGS[(key,)] == TrainConfig.model_fields[key].default


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            dict(workers=2, rings=2, ring_aggregate="median"),
            r"ring_aggregate=median needs rings ≥ 3 \(got rings=2\)",
        ),
        (dict(workers=1, ring_aggregate="trimmed"), r"needs rings ≥ 3 \(got rings=1\)"),
        (
            dict(workers=4, rings=4, ring_aggregate="krum"),
            r"ring_aggregate=krum with ring_krum_f=1 needs rings ≥ 2·f \+ 3 = 5 \(got rings=4\)",
        ),
        (dict(workers=5, rings=5, ring_aggregate="krum", ring_krum_f=2), r"= 7 \(got rings=5\)"),
        (
            dict(workers=3, rings=3, ring_aggregate="trimmed", ring_trim=0.2),
            r"ring_trim=0.2 cuts int\(0.2·3\) = 0 rings off each end, so the trimmed mean is",
        ),
        (
            dict(workers=4, rings=4, ring_aggregate="trimmed", ring_trim=0.5),
            r"ring_trim=0.5 cuts 2 of rings=4 off each end, every ring: the limit is ring_trim <",
        ),
    ],
)
def test_what_cannot_work_is_refused_with_the_value_and_the_limit(
    settings: dict, message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainConfig(**settings)


def test_robust_aggregates_within_their_limits_and_their_settings() -> None:
    """The smallest R each accepts; the plan and the strategy refuse what the config does
    (for a RingPlan built by hand); flag, variable and choices come from the field."""
    for kind, R, kw in (
        ("median", 3, {}),
        ("trimmed", 3, {}),
        ("krum", 5, {}),
        ("krum", 3, {"ring_krum_f": 0}),
    ):
        cfg = TrainConfig(workers=R, rings=R, ring_aggregate=kind, **kw)
        assert kind in cfg.ring_settings()
    with pytest.raises(ConfigError, match="needs rings ≥ 3"):
        RingSync(flower_strategy("fedavg", 2), RingPlan(1, 2, 1, 2, aggregate="median"))
    with pytest.raises(ConfigError, match="ring_aggregate='mode'"):
        RingAggregate("mode", 3)
    coord = load_coordinator_config(
        environ={
            **CERTS,
            "MOBIUS_WORKERS": "3",
            "MOBIUS_RINGS": "3",
            "MOBIUS_RING_AGGREGATE": "median",
        }
    )
    assert coord.train.ring_aggregate == "median"
    actions = {o: a for a in coordinator_cli.build_parser()._actions for o in a.option_strings}
    assert tuple(actions["--ring-aggregate"].choices) == ("mean", "median", "trimmed", "krum")
    assert "--ring-trim" in actions and "--ring-krum-f" in actions


def test_a_ring_codec_and_diloco_step_on_the_median_of_the_pseudo_gradients(
    site_dirs: list[Path],
) -> None:
    """With int8 pseudo-gradients and DiLoCo's outer step, the median of the decoded δ is
    what the step takes: every ring loads the same F_i, another than under the mean."""
    from mobius_fed.data import SiteData
    from mobius_fed.engine.federated import train_with_strategy
    from mobius_fed.engine.rings import make_engine

    groups = []
    for aggregate in ("mean", "median"):
        cfg = TrainConfig(
            workers=3,
            rings=3,
            ring_codec="int8",
            ring_outer="diloco",
            ring_aggregate=aggregate,
            preset="cpu-tiny",
            batch_size=4,
            optimizer="adamw",
            steps=2,
            ring_sync_every=2,
        )
        engine = make_engine(cfg, [SiteData(d, cfg.model().seq_len) for d in site_dirs[:3]])
        strategy = make_strategy("fedavg", 3, RoundPlan.of(cfg), rings=RingPlan.of(cfg))
        train_with_strategy(engine, strategy)
        ring0, *others = [dict(r.groups[0].named_parameters()) for r in engine.rings]
        assert all(torch.equal(ring0[k], o[k]) for o in others for k in ring0)
        groups.append(ring0)
    assert any(not torch.equal(groups[0][k], groups[1][k]) for k in groups[0])


@pytest.mark.parametrize(
    ("rings", "aggregate"), [(3, "mean"), (3, "median"), (5, "trimmed"), (5, "krum")]
)
def test_one_lying_ring_moves_the_mean_and_not_a_robust_aggregate(
    site_dirs: list[Path], rings: int, aggregate: str
) -> None:
    """R rings of one group, H = 2, 12 steps: at every ring sync the last ring sends its
    F_i sign-flipped (−θ) or ×10. The honest rings' held-out Eq. 8 moves by more than 0.1
    under the mean (R = 3), and by under 0.02 under the median (R = 3), the trimmed mean
    and Krum (R = 5, where Krum with f = 1 is allowed and the trimmed mean is not the
    median). ``python benchmarks/ring_poisoning.py`` prints the figures."""
    bench = load_benchmark("ring_poisoning")
    cfg = bench.config(rings, 1, aggregate, seed=0)
    clean = bench.honest_eq8(cfg, site_dirs[:rings], None)
    for attack in ("flip", "x10"):
        delta = bench.honest_eq8(cfg, site_dirs[:rings], attack) - clean
        if aggregate == "mean":
            assert delta > 0.1, (attack, delta)
        else:
            assert abs(delta) < 0.02, (attack, delta)
