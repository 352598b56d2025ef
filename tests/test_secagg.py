"""Secure Aggregation of the shared E/R: masks cancel, quantisation is bounded, a redone
round masks afresh, bad replies are refused, the coordinator holds only masked vectors, and
a real coordinated run equals the reference engine bit for bit."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.grid import RunFailed
from mobius_fed.coordinator.manifests import latest_manifest
from mobius_fed.coordinator.replies import validate_reply
from mobius_fed.data import SiteData
from mobius_fed.defences.er_dp import ErPrivacy
from mobius_fed.defences.secagg import (
    MASKED,
    MASKED_ARRAY,
    Quantiser,
    Round,
    SecAgg,
    SecAggError,
    SiteMasker,
    check_masked,
)
from mobius_fed.defences.stages import write_site_keys
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.strategies import RoundPlan, make_strategy
from mobius_fed.transport.flower_wire import (
    COORDINATOR_NODE_ID,
    set_task_identity,
    worker_node_id,
)
from tests.test_coordinator import max_diff, ring_history, run

P = 4
SHAPES = {"wte": (6, 5), "head": (7,)}


def _cfg(**privacy) -> TrainConfig:
    return TrainConfig(preset="cpu-tiny", workers=P, privacy={"er_secagg": True, **privacy})


def _record(rng: np.random.Generator, scale: float = 0.02) -> ArrayRecord:
    return ArrayRecord(
        {k: Array(rng.standard_normal(s).astype(np.float32) * scale) for k, s in SHAPES.items()}
    )


def _reply(site: int, masked: ArrayRecord, examples: int = 64) -> Message:
    set_task_identity(COORDINATOR_NODE_ID)
    msg = Message(
        RecordDict({MASKED: masked, "metrics": MetricRecord({"num-examples": examples})}),
        dst_node_id=worker_node_id(site),
        message_type="train",
    )
    msg.metadata.__dict__["_src_node_id"] = worker_node_id(site)
    return msg


def _round(maskers: list[SiteMasker], rnd: int = 3, attempt: str = "run/abc.1") -> Round:
    return Round(rnd, attempt, [m.keys.public for m in maskers])


def _sites(cfg: TrainConfig, start: ArrayRecord, order: Round | None = None, seed: int = 1):
    """Each site's arrays (start + a small update) and its masked record."""
    rng = np.random.default_rng(seed)
    maskers = [SiteMasker(cfg, s) for s in range(P)]
    order = order or _round(maskers)
    arrays, masked = [], []
    for s in range(P):
        mine = ArrayRecord(
            {k: Array(a + _record(rng, 1e-3)[k].numpy()) for k, a in zip(
                start.keys(), start.to_numpy_ndarrays(), strict=True)}
        )  # fmt: skip
        arrays.append(mine)
        masked.append(maskers[s].masked(mine, start, order))
    return maskers, arrays, masked


def test_masks_cancel_and_the_sum_is_the_mean_update() -> None:
    cfg = _cfg()
    start = _record(np.random.default_rng(0))
    _, arrays, masked = _sites(cfg, start)
    server = SecAgg.of(cfg)
    mean = server.unmask([_reply(s, m) for s, m in enumerate(masked)], start, list(range(P)))
    step = Quantiser.of(cfg).step
    for name, a in zip(start.keys(), mean.to_numpy_ndarrays(), strict=True):
        want = np.mean([r[name].numpy().astype(np.float64) for r in arrays], axis=0)
        assert np.abs(a.astype(np.float64) - want).max() <= step / 2 + 1e-7  # fp32 rounding
        assert a.dtype == np.float32
    # one masked vector alone is uniform noise, not the site's quantised update
    q = Quantiser.of(cfg)
    own = q.quantise(np.concatenate([(arrays[0][k].numpy() - start[k].numpy()).ravel()
                                     for k in SHAPES]).astype(np.float64))  # fmt: skip
    got = masked[0][MASKED_ARRAY].numpy().astype(np.uint64)
    assert not np.array_equal(got, own) and np.mean(got == own) < 0.05


def test_quantisation_error_is_at_most_half_a_step_and_out_of_range_values_clip() -> None:
    for bits, bound in ((32, 1.0), (16, 0.05), (64, 4.0)):
        q = Quantiser(bits, bound, P)
        x = np.random.default_rng(bits).uniform(-bound, bound, 5000)
        total = np.zeros(x.size, np.uint64)
        for _ in range(P):  # P equal values: their mean is x again
            total = total + q.quantise(x)
        err = np.abs(q.mean(total) - x).max()
        assert err <= q.step / 2 * (1 + 1e-9), (bits, err, q.step)
        assert q.wire_dtype == (np.uint32 if bits <= 32 else np.uint64)
    q = Quantiser(32, 0.1, P)
    total = sum((q.quantise(np.array([5.0, -5.0])) for _ in range(P)), np.zeros(2, np.uint64))
    assert np.allclose(q.mean(total), [0.1, -0.1])
    with pytest.raises(SecAggError, match="er_secagg_bits"):
        Quantiser(8, 1.0, P)


def test_a_redone_round_with_a_new_attempt_masks_afresh() -> None:
    cfg = _cfg()
    start = _record(np.random.default_rng(0))
    maskers, arrays, first = _sites(cfg, start)
    with pytest.raises(SecAggError, match=r"site 0: round 3 attempt 'run/abc\.1' was masked once"):
        maskers[0].masked(arrays[0], start, _round(maskers))  # the same masks twice: refused
    twin = SiteMasker(cfg, 0, maskers[0].keys)  # what a repeat would have sent
    again = [twin.masked(arrays[0], start, _round(maskers))]
    redone = [
        m.masked(a, start, _round(maskers, attempt="run/abc.2"))
        for m, a in zip(maskers, arrays, strict=True)
    ]
    other_round = maskers[0].masked(arrays[0], start, _round(maskers, rnd=4))
    vec = [r[MASKED_ARRAY].numpy() for r in first]
    assert np.array_equal(vec[0], again[0][MASKED_ARRAY].numpy())  # same attempt: same masks
    for s in range(P):
        assert np.mean(vec[s] == redone[s][MASKED_ARRAY].numpy()) < 0.01
    assert np.mean(vec[0] == other_round[MASKED_ARRAY].numpy()) < 0.01
    server = SecAgg.of(cfg)
    sums = [
        server.unmask([_reply(s, m) for s, m in enumerate(ms)], start, list(range(P)))
        for ms in (first, redone)
    ]
    for a, b in zip(*(s.to_numpy_ndarrays() for s in sums), strict=True):
        assert np.array_equal(a, b)  # the aggregate does not depend on the masks


def test_malformed_replies_are_refused_naming_the_site() -> None:
    cfg = _cfg()
    q = Quantiser.of(cfg)
    n = sum(int(np.prod(s)) for s in SHAPES.values())
    good = ArrayRecord({MASKED_ARRAY: Array(np.zeros(n, np.uint32))})
    check_masked(2, RecordDict({MASKED: good}), n, q)

    def masked(**arrays: np.ndarray) -> RecordDict:
        return RecordDict({MASKED: ArrayRecord({k: Array(v) for k, v in arrays.items()})})

    cases = [
        masked(masked=np.zeros(n)),  # wrong dtype
        masked(masked=np.zeros(3, np.uint32)),  # wrong shape
        masked(masked=np.zeros(n, np.uint32), x=np.zeros(1)),  # an extra array
        RecordDict({"metrics": MetricRecord({"num-examples": 1})}),  # no masked record
        RecordDict({MASKED: good, "arrays": _record(np.random.default_rng(0))}),  # in the clear
    ]
    for content in cases:
        with pytest.raises(SecAggError, match="site 2"):
            check_masked(2, content, n, q)
        reply = _reply(2, good)
        reply.content = content
        spec = {k: (s, "float32") for k, s in SHAPES.items()}
        with pytest.raises(RunFailed, match="worker-2"):
            validate_reply(2, reply, spec, SecAgg.of(cfg))
    with pytest.raises(SecAggError, match="lacks"):
        Round.of(ConfigRecord({"round": 1}), P)
    start = _record(np.random.default_rng(0))
    _, _, masked = _sites(cfg, start)
    with pytest.raises(SecAggError, match="every site"):  # a missing site never unmasks
        SecAgg.of(cfg).unmask([_reply(s, masked[s]) for s in range(3)], start, [0, 1, 2])


def _sites_data(tmp_path: Path, cfg: TrainConfig) -> list[SiteData]:
    from mobius_fed.data import embedded_corpus, prepare_sites

    dirs = prepare_sites(None, tmp_path / "sites", cfg.P, text=embedded_corpus()[:60_000])
    return [SiteData(d, cfg.model().seq_len) for d in dirs]


class Spy(SecAgg):
    """SecAgg that keeps a copy of every reply content the coordinator unmasks."""

    seen: list[list[dict]]

    def unmask(self, replies, start, sites):
        self.seen.append([{k: dict(v) for k, v in r.content.array_records.items()}
                          for r in replies])  # fmt: skip
        return super().unmask(replies, start, sites)


@pytest.mark.parametrize("strategy", ["fedavg", "fedadam"])
def test_the_strategy_receives_only_masked_updates_and_the_run_stays_close(
    tmp_path: Path, strategy: str
) -> None:
    """A server optimizer acts on the unmasked aggregate: the run stays within the
    quantisation error of the same strategy without SecAgg."""
    cfg = TrainConfig(preset="cpu-tiny", workers=P, batch_size=2, steps=3, sync_every=1,
                      optimizer="adamw", privacy={"er_secagg": True})  # fmt: skip
    sites = _sites_data(tmp_path, cfg)
    spy = Spy(Quantiser.of(cfg))
    spy.seen = []
    grid = train_with_strategy(
        ReferenceEngine(cfg, sites), make_strategy(strategy, P, RoundPlan.of(cfg), secagg=spy)
    )
    assert len(spy.seen) == 3
    for contents in spy.seen:
        for c in contents:
            assert set(c) == {MASKED}, "no E/R array reaches the strategy in the clear"
    plain_cfg = cfg.model_copy(update={"privacy": cfg.privacy.model_copy(
        update={"er_secagg": False})})  # fmt: skip
    plain = train_with_strategy(
        ReferenceEngine(plain_cfg, sites), make_strategy(strategy, P, RoundPlan.of(cfg))
    )
    got = [v for r in grid.steps for v in r.origin_losses]
    want = [v for r in plain.steps for v in r.origin_losses]
    if strategy == "fedavg":  # FedAdam's m/√v is nearly sign(Δ): the rounding cancels
        assert got != want, "quantisation changes the run, within its bound"
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    with pytest.raises(ValueError, match=r"secagg=SecAgg\.of\(cfg\)"):
        plain_strategy = make_strategy("fedavg", P, RoundPlan.of(cfg))
        train_with_strategy(ReferenceEngine(cfg, sites), plain_strategy)


def test_the_coordinator_attack_on_the_sum_is_scored_against_victim_and_union(
    tmp_path: Path,
) -> None:
    """The leakage audit with SecAgg: the attack reads the quantised mean update only; the
    union of the bags is what it can find, the victim's own bag is diluted in it."""
    from mobius_fed.privacy.leakage import LeakageAudit

    cfg = TrainConfig(preset="cpu-tiny", workers=P, steps=2, batch_size=4, eval_every=0,
                      warmup_steps=1, privacy={"er_secagg": True})  # fmt: skip
    report = LeakageAudit(cfg, _sites_data(tmp_path, cfg), inverter_steps=1, known=()).run()
    name = "E (tied: inputs and targets), sum (SecAgg) vs "
    rows = {(r.round, r.rows.removeprefix(name), r.score): r for r in report.updates}
    targets = {name + t for t in ("victim's bag", "site 1's bag", "union of bags")}
    assert {r.rows for r in report.updates} == targets
    victim, union = rows[(1, "victim's bag", "sign")], rows[(1, "union of bags", "sign")]
    assert union.bag > victim.bag and union.base_rate > victim.base_rate
    assert victim.topk_precision < 0.9, "the sum does not single out the victim's tokens"


def reference(fed: LocalFederation) -> tuple[dict, list]:
    """The reference engine under the same Flower strategy, with SecAgg (and DP) on."""
    torch.set_num_threads(1)
    cfg = fed.train
    sites = [SiteData(fed.sites / f"site-{i}", cfg.model().seq_len) for i in range(cfg.P)]
    strategy = make_strategy(fed.strategy, cfg.P, RoundPlan.of(cfg), fed.strategy_options,
                             er_privacy=ErPrivacy.of(cfg), secagg=SecAgg.of(cfg))  # fmt: skip
    grid = train_with_strategy(ReferenceEngine(cfg, sites), strategy)
    losses = {(r.step, s): v for r in grid.steps for s, v in enumerate(r.origin_losses)}
    return losses, [(e.step, e.loss) for e in grid.evals]


def _federation(tmp_path: Path, workers: int = 3, steps: int = 4, **privacy) -> LocalFederation:
    train = TrainConfig(
        workers=workers, preset="cpu-tiny", batch_size=2, optimizer="adamw", eval_every=2,
        steps=steps, sync_every=1, privacy={"er_secagg": True, **privacy},
    )  # fmt: skip
    return LocalFederation(tmp_path / "up", train, threads=1)


def _exact(fed: LocalFederation, final: dict) -> None:
    got, got_evals = ring_history(fed)
    ref, ref_evals = reference(fed)
    assert max_diff(got, ref) == 0.0, "SecAgg: ring == reference, bit for bit"
    assert [v for _, v in got_evals] == [v for _, v in ref_evals]


@pytest.mark.slow
def test_a_coordinated_run_with_secagg_equals_the_reference(tmp_path: Path) -> None:
    """Coordinator + 3 worker processes over mTLS: keys relayed, masked replies summed; a
    server optimizer (FedAdam) acts on the unmasked sum in both engines alike. FedAvg runs
    in the test of every defence together, below."""
    fed = _federation(tmp_path)
    fed.strategy = "fedadam"
    final = run(fed)
    try:
        _exact(fed, final)
    finally:
        fed.stop()
    log = (fed.logs / "coordinator.log").read_text()
    assert "Traceback" not in log
    manifest = json.loads(latest_manifest(fed.coordinator_out).read_text())
    assert manifest["workers"] and not any("copy" in w for w in manifest["workers"].values()), (
        "a worker's checkpoint holds its own E/R: no copy goes to the coordinator"
    )


@pytest.mark.slow
def test_a_killed_worker_heals_with_secagg_on(tmp_path: Path) -> None:
    """The incident path redoes the round on a new ring incarnation (fresh masks, the
    restarted worker's new key); the run still equals the reference."""
    from tests.test_recovery import wait_for_step

    fed = _federation(tmp_path, workers=P, steps=10)
    fed.checkpoint_every, fed.heartbeat_timeout, fed.max_restarts = 2, 3.0, 3
    fed.prepare().start()
    try:
        wait_for_step(fed, 4)
        os.kill(fed.procs["worker-2"].pid, signal.SIGKILL)
        final = fed.wait(timeout=240)
        assert final["phase"] == "done", (final.get("error"), fed.tail("coordinator", 40))
        (inc,) = final["incidents"]
        assert inc["rank"] == 2 and inc["state"] == "recovered", inc
        _exact(fed, final)
    finally:
        fed.stop()
    log = (fed.logs / "coordinator.log").read_text()
    rings = {line.split("opening ring ")[1].strip() for line in log.splitlines()
             if "opening ring " in line}  # fmt: skip
    assert len(rings) == 2, "the redone round runs on a new attempt"


def test_the_single_process_engine_refuses_secagg_without_the_strategy(tmp_path: Path) -> None:
    from mobius_fed.config import ConfigError
    from mobius_fed.defences.report import status_block

    cfg = _cfg()
    engine = ReferenceEngine(cfg, _sites_data(tmp_path, cfg))
    with pytest.raises(ConfigError, match=r"privacy\.er_secagg .* applied by the Flower"):
        engine.train_step()
    (entry,) = status_block(cfg, 3)["defences"]
    assert entry["name"] == "er_secagg" and entry["bits"] == cfg.privacy.er_secagg_bits


@pytest.mark.slow
def test_home_layer_input_defence_and_secagg_together_equal_the_reference(tmp_path: Path) -> None:
    """Every defence for a site's data at once, in one coordinated run (FedAvg): the private
    home layer (targets), the private input layer behind clipped first-send noise (inputs),
    Secure Aggregation with DP-FedAvg (the E/R: the sites clip before masking, the
    coordinator adds its keyed noise to the sum), all keyed by the sites' own secrets;
    still bit for bit."""
    keys = tmp_path / "keys"
    write_site_keys(keys, 3)
    fed = _federation(
        tmp_path, home_layer="mlp", home_input="block", input_noise=1.0, input_clip=4.0,
        er_noise=0.5, er_clip=0.05, noise_key_dir=str(keys),
    )  # fmt: skip
    final = run(fed)
    try:
        _exact(fed, final)
    finally:
        fed.stop()
    names = [d["name"] for d in final["privacy"]["defences"]]
    assert names == ["input_noise", "home_layer", "home_input", "er_dp", "er_secagg"]
    assert final["privacy"]["input"]["epsilon_position"] is not None
    assert final["privacy"]["er"]["rounds"] == 4
