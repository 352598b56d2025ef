"""The E/R round's sync settings in one process (``TrainConfig.sync``): the site's codec and
error-feedback math, the τ = 1 merge rule, ``mobius-fed local``'s barrier against the
strategy-driven reference, resume, and the refusals (the ring against the reference:
tests/test_er_sync_ring.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from mobius_fed.config import LATER_SETTINGS, MAX_SYNC_DELAY, TrainConfig
from mobius_fed.coordinator.config import CoordinatorConfig
from mobius_fed.data import SiteData
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.er_sync import ErSite, decode_er
from mobius_fed.strategies import RoundPlan, make_strategy, sync_strategy
from mobius_fed.transport.compress import Codec

pytestmark = pytest.mark.usefixtures("one_torch_thread")
logging.getLogger("flwr").setLevel(logging.WARNING)
BASE = dict(workers=2, preset="cpu-tiny", batch_size=4, optimizer="adamw", eval_every=2)


def site(**sync) -> ErSite:
    return ErSite(TrainConfig(sync=sync).sync)


def test_error_feedback_loses_nothing_but_the_last_residual() -> None:
    """A pseudo-gradient is a running sum: with error feedback the decoded payloads of R
    rounds add up to the true pseudo-gradients' sum minus the last residual; without it the
    rounding errors pile up."""
    gen = torch.Generator().manual_seed(0)
    G = {"w": torch.randn(4, 64, generator=gen)}
    sums = {}
    for ef in (True, False):
        s, theta = site(codec="int4", error_feedback=ef), {"w": G["w"].clone()}
        decoded, true = torch.zeros(4, 64), torch.zeros(4, 64)
        for _ in range(8):
            s.start_round(theta, G)
            step = 0.01 * torch.randn(4, 64, generator=gen)
            theta["w"] -= step
            payload = s.end_round(theta)
            record = decode_er(payload, _record(G), "int4")
            decoded += G["w"] - torch.from_numpy(record["w"].numpy())
            true += step
        sums[ef] = (decoded, true, s.residual)
    decoded, true, residual = sums[True]
    assert residual is not None
    assert torch.allclose(decoded, true - residual["w"], atol=1e-6)
    drift_ef = (decoded - true).abs().max()
    decoded_off, true_off, residual_off = sums[False]
    assert residual_off is None
    assert drift_ef < (decoded_off - true_off).abs().max()


def _record(state: dict[str, torch.Tensor]):
    from flwr.app import ArrayRecord

    return ArrayRecord({k: v.clone() for k, v in state.items()})


def test_the_payload_is_the_codecs_exact_size() -> None:
    s = site(codec="int8")
    theta = {"w": torch.zeros(3, 64), "b": torch.zeros(5)}
    s.start_round(theta, {k: v + 1 for k, v in theta.items()})
    out = s.end_round(theta)
    c = Codec("int8")
    assert {k: a.numpy().nbytes for k, a in out.items()} == {
        "w": c.payload_bytes((3, 64)),
        "b": c.payload_bytes((5,)),
    }
    assert all(str(a.numpy().dtype) == "uint8" for a in out.values())


def test_a_late_round_merges_what_the_global_changed_of_what_was_sent() -> None:
    """τ = 1: round 1 starts from G(0); round 2 trains on from the site's own E/R (G(1) is
    not loaded) and its barrier applies θ ← θ + (G(1) − θ_sent(1)) before sending."""
    s = site(delay=1)
    theta = {"w": torch.zeros(2)}
    s.start_round(theta, {"w": torch.tensor([1.0, 1.0])})  # G(0) loaded: the first round
    assert theta["w"].tolist() == [1.0, 1.0]
    theta["w"] += torch.tensor([0.5, 0.0])  # round 1's progress
    sent = s.end_round(theta)["w"].numpy().tolist()
    assert sent == [1.5, 1.0]
    s.start_round(theta, {"w": torch.tensor([2.0, 3.0])})  # G(1) arrives: not loaded
    assert theta["w"].tolist() == [1.5, 1.0]
    theta["w"] += torch.tensor([0.0, 0.25])  # round 2's progress
    out = s.end_round(theta)["w"].numpy().tolist()
    assert out == [2.0, 3.25] == theta["w"].tolist()  # G(1) + round 2's progress
    with s.evaluating(theta, {"w": torch.tensor([9.0, 9.0])}):
        assert theta["w"].tolist() == [9.0, 9.0]
    assert theta["w"].tolist() == [2.0, 3.25]  # its own E/R back to train on
    state = s.state_dict()
    again = site(delay=1)
    again.load_state_dict(state)
    assert torch.equal(again.sent["w"], torch.tensor([2.0, 3.25]))  # type: ignore[index]


@pytest.fixture(scope="module")
def sites(site_dirs) -> list:
    return list(site_dirs)


def _engine(cfg: TrainConfig, dirs) -> ReferenceEngine:
    return ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len) for d in dirs])


SETTINGS = [
    pytest.param({"codec": "int4"}, id="int4-ef"),
    pytest.param({"delay": 1}, id="delay1"),
    pytest.param({"outer": "diloco", "codec": "int8", "delay": 1}, id="diloco-int8-delay1"),
    pytest.param({"codec": "int4", "down_codec": "int4"}, id="int4-down"),
]


@pytest.mark.parametrize("sync", SETTINGS)
def test_local_equals_the_strategy_driven_reference(sites, sync: dict) -> None:
    """``mobius-fed local``'s barrier (no coordinator) computes what the coordinator's
    strategy computes over the reference's grid, bit for bit, train and eval; and the
    setting changes the run."""
    cfg = TrainConfig(**BASE, steps=5, sync_every=2, sync=sync)
    local = _engine(cfg, sites)
    losses = [local.train_step().origin_losses for _ in range(cfg.steps)]
    final = local.evaluate().origin_losses
    name, options = sync_strategy("fedavg", {}, cfg)
    strategy = make_strategy(
        name,
        cfg.P,
        RoundPlan.of(cfg),
        options,
        er_codec=cfg.sync.codec,
        er_down_codec=cfg.sync.down_codec,
    )
    grid = train_with_strategy(_engine(cfg, sites), strategy)
    assert [r.origin_losses for r in grid.steps] == losses
    assert grid.evals[-1].origin_losses == final
    plain = _engine(TrainConfig(**BASE, steps=5, sync_every=2), sites)
    assert [plain.train_step().origin_losses for _ in range(cfg.steps)] != losses


@pytest.mark.parametrize("sync", SETTINGS)
def test_evaluating_between_barriers_changes_nothing_local_trains(sites, sync: dict) -> None:
    """``mobius-fed local`` evaluates at any step: an evaluation between barriers (every
    step here, E/R every 3) leaves the training exactly as without it."""
    losses = {}
    for every in (1, 0):
        cfg = TrainConfig(**{**BASE, "eval_every": every}, steps=5, sync_every=3, sync=sync)
        engine = _engine(cfg, sites)
        losses[every] = []
        for _ in range(cfg.steps):
            losses[every].append(engine.train_step().origin_losses)
            if every:
                engine.evaluate()
    assert losses[1] == losses[0]


def test_the_reference_refuses_a_strategy_that_would_not_decode_or_step(sites) -> None:
    cfg = TrainConfig(**BASE, steps=2, sync_every=1, sync={"outer": "diloco", "codec": "int8"})
    plain = make_strategy("diloco", cfg.P, RoundPlan.of(cfg))
    with pytest.raises(ValueError, match="sync codec is 'int8', the strategy decodes 'none'"):
        train_with_strategy(_engine(cfg, sites), plain)
    fedavg = make_strategy("fedavg", cfg.P, RoundPlan.of(cfg), er_codec="int8")
    with pytest.raises(ValueError, match="sync outer step is diloco, the strategy is FedAvg"):
        train_with_strategy(_engine(cfg, sites), fedavg)


def test_local_resumes_residuals_and_late_rounds_exactly(sites, tmp_path: Path) -> None:
    cfg = TrainConfig(
        **BASE, steps=6, sync_every=2, sync={"outer": "diloco", "codec": "int4", "delay": 1}
    )
    straight = _engine(cfg, sites)
    want = [straight.train_step().loss for _ in range(cfg.steps)]
    first = _engine(cfg, sites)
    got = [first.train_step().loss for _ in range(3)]  # mid-round: a residual, θ_sent, G
    first.save(tmp_path / "ck.pt")
    second = _engine(cfg, sites)
    second.load(tmp_path / "ck.pt")
    got += [second.train_step().loss for _ in range(3)]
    assert got == want
    assert second.evaluate().loss == straight.evaluate().loss


@pytest.mark.parametrize(
    ("sync", "extra", "words"),
    [
        ({"delay": 2}, {}, ["τ=2", f"limit {MAX_SYNC_DELAY}"]),
        ({"codec": "lowrank"}, {}, ["'lowrank'", "int8"]),
        ({"codec": "int8"}, {"sync_every": 0}, ["sync.codec=int8", "sync_every=0"]),
        ({"delay": 1}, {"sync_every": 0}, ["sync.delay=1", "sync_every=0"]),
        ({"outer": "diloco"}, {"sync_every": 0}, ["sync.outer=diloco", "sync_every=0"]),
        (
            {"codec": "int4"},
            {"privacy": {"er_secagg": True}},
            ["sync.codec=int4", "er_secagg", "exact arithmetic"],
        ),
        ({"delay": 1}, {"workers": 4, "rings": 2}, ["sync.delay=1", "rings > 1"]),
    ],
)
def test_bad_sync_settings_are_refused_naming_value_and_limit(
    sync: dict, extra: dict, words: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        TrainConfig(**{"sync": sync, **extra})
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize(
    ("outer", "strategy", "words"),
    [
        ("diloco", "fedadam", ["--sync-outer diloco", "--strategy fedadam"]),
        ("fedavg", "diloco", ["--sync-outer fedavg", "--strategy diloco"]),
    ],
)
def test_an_outer_step_the_strategy_contradicts_is_refused(
    outer: str, strategy: str, words: list[str], tmp_path: Path
) -> None:
    train = TrainConfig(sync={"outer": outer})
    with pytest.raises(ValueError) as info:
        sync_strategy(strategy, {}, train)
    assert all(w in str(info.value) for w in words), str(info.value)
    tls = {n: tmp_path / n for n in ("ca", "cert", "key")}
    with pytest.raises(ValueError, match=f"--strategy {strategy}"):
        CoordinatorConfig(train=train, strategy=strategy, **tls)


def test_sync_outer_diloco_is_the_diloco_strategy_with_the_outer_settings() -> None:
    train = TrainConfig(sync={"outer": "diloco"}, outer_lr=0.5, outer_momentum=0.8)
    assert sync_strategy("fedavg", {}, train) == (
        "diloco",
        {"server_learning_rate": 0.5, "server_momentum": 0.8},
    )
    assert sync_strategy("fedavgm", {"server_momentum": 0.5}, TrainConfig()) == (
        "fedavgm",
        {"server_momentum": 0.5},
    )


def test_default_sync_settings_keep_old_fingerprints() -> None:
    """A manifest written before ``sync`` existed still resumes: the default settings drop
    out of the fingerprint, a changed one counts."""
    plain = TrainConfig()
    sync = plain.model_dump(mode="json")["sync"]
    assert LATER_SETTINGS[("sync", "down_codec")] == sync.pop("down_codec")
    assert LATER_SETTINGS[("sync",)] == sync
    assert TrainConfig(sync={"codec": "int8"}).fingerprint() != plain.fingerprint()
    assert TrainConfig(sync={"outer": "fedavg"}).fingerprint() != plain.fingerprint()


def test_the_quality_tables_report_reads_back_every_complete_arm(tmp_path):
    """`benchmarks/er_sync.py --report` builds the table from kept results alone: an arm
    name reads back as its arm, and an arm missing a seed is left out."""
    import json

    from tests.bench_loader import load_benchmark

    bench = load_benchmark("er_sync")
    for arm in (bench.Arm(1), bench.Arm(100, "diloco", "int4", 1), bench.Arm(10, "fedavg", "int8")):
        assert bench.arm_of(arm.name) == arm
    runs = tmp_path / "runs"
    runs.mkdir()
    kept = {"preset": "cpu-tiny", "workers": 2, "steps": 6, "extra": []}
    arms = [
        ("H1-fedavg-fp32-tau0", (0, 1), 2.0),
        ("H2-fedavg-int4-tau1", (0, 1), 2.1),
        ("H2-diloco-fp32-tau0", (0,), 2.5),
    ]
    for name, seeds, eq8 in arms:
        for s in seeds:
            row = {"arm": name, "seed": s, "eq8": eq8 + s / 100, **kept}
            (runs / f"{name}-s{s}.json").write_text(json.dumps(row))
    argv = ["--report", "--preset", "cpu-tiny", "--workers", "2", "--steps", "6", "--seeds", "2"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    text = (tmp_path / "table.md").read_text()
    assert "H2-fedavg-int4-tau1" in text and "+0.1000" in text, text
    assert "H2-diloco" not in text, text  # one seed of two: not in the table
