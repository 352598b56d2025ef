"""The private home layer: never averaged, never sent, saved with the site's own state, and
ring == reference exact with it on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord

from mobius_fed.checkpoint import load_checkpoint
from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.defences.site_layers import build_site_replica
from mobius_fed.defences.stages import write_site_keys
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.model import build_replica, is_private
from mobius_fed.privacy.audit import ensure_home_layers
from mobius_fed.strategies import RoundPlan, make_strategy
from tests.test_privacy_ring import PrivateRing

P = 3
BASE = dict(preset="cpu-tiny", workers=P, batch_size=4, eval_every=0, optimizer="adamw")


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> list[SiteData]:
    root = tmp_path_factory.mktemp("home")
    prepare_sites(None, root / "sites", P, text=embedded_corpus())
    seq = TrainConfig(**BASE).model().seq_len
    return [SiteData(root / "sites" / f"site-{i}", seq) for i in range(P)]


def engine(sites, layer: str = "mlp", **kw) -> ReferenceEngine:
    cfg = TrainConfig(**{**BASE, **kw}, privacy={"home_layer": layer})
    eng = ReferenceEngine(cfg, sites)
    ensure_home_layers(eng)
    return eng


def _home(eng: ReferenceEngine, s: int) -> list[torch.Tensor]:
    return [p.detach().clone() for p in eng.replicas[s].private_parameters()]


@pytest.mark.parametrize("layer", ["mlp", "block"])
def test_home_layer_is_private_and_leaves_the_shared_replica_as_it_was(layer: str):
    cfg = TrainConfig(**BASE).model()
    plain, private = build_replica(cfg, 0), build_replica(cfg, 0, layer)
    names = set(private.state_dict())
    shared = set(private.shared_state_dict())
    assert shared == set(plain.state_dict()), "E/R keep their names"
    assert names - shared and all(is_private(k) for k in names - shared)
    assert all(
        torch.equal(plain.state_dict()[k], v) for k, v in private.shared_state_dict().items()
    )
    ids = {id(p) for p in private.shared_parameters()}
    assert ids.isdisjoint(id(p) for p in private.private_parameters())
    h = torch.randn(2, cfg.seq_len, cfg.d_model)
    assert not torch.equal(private.logits(h), plain.logits(h)), "not the identity at step 0"
    with pytest.raises(ValueError, match="home_layer 'mpl' is not one of off, mlp, block"):
        build_replica(cfg, 0, "mpl")


def test_both_engines_build_keyed_site_replicas():
    """The reference engine builds each origin's keyed layer by itself (the ring workers
    call the same ``build_site_replica``), not only through ``ensure_home_layers``."""
    cfg = TrainConfig(preset="cpu-tiny", workers=2, privacy={"home_layer": "mlp"})
    engine = ReferenceEngine(cfg, [None, None])  # type: ignore[list-item]  # sites unused here
    want, got = build_site_replica(cfg, 1), engine.replicas[1]
    assert got.home is not None
    assert all(
        torch.equal(a, b) for a, b in zip(got.private_parameters(), want.private_parameters())
    )


def test_each_site_draws_its_layer_from_its_own_key(tmp_path: Path):
    write_site_keys(tmp_path / "keys", P)
    cfg = TrainConfig(
        **BASE, privacy={"home_layer": "mlp", "noise_key_dir": str(tmp_path / "keys")}
    )
    ref = [_home_of(build_site_replica(cfg, s)) for s in range(P)]
    ring = [_home_of(build_site_replica(cfg, s, "ring")) for s in range(P)]
    public = _home_of(build_site_replica(TrainConfig(**BASE, privacy={"home_layer": "mlp"}), 0))
    for s in range(P):
        assert all(torch.equal(a, b) for a, b in zip(ref[s], ring[s])), "engines agree"
    assert not any(torch.equal(a, b) for a, b in zip(ref[0], ref[1])), "sites differ"
    assert not any(torch.equal(a, b) for a, b in zip(ref[0], public)), "the key matters"
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            build_site_replica(cfg, 0).shared_state_dict().values(),
            build_replica(cfg.model(), cfg.seed).state_dict().values(),
        )
    ), "E/R do not depend on the key"
    (tmp_path / "keys" / "site-2.key").unlink()
    with pytest.raises(FileNotFoundError, match=r"site-2\.key not found"):
        build_site_replica(cfg, 2)


def test_a_frozen_home_layer_stays_as_drawn(sites):
    eng = engine(sites, steps=2, sync_every=1)
    cfg = eng.cfg.model_copy(
        update={"privacy": eng.cfg.privacy.model_copy(update={"home_layer_trained": False})}
    )
    frozen = ReferenceEngine(cfg, sites)
    ensure_home_layers(frozen)
    before = [_home(frozen, s) for s in range(P)]
    for _ in range(2):
        frozen.train_step()
    assert all(torch.equal(a, b) for s in range(P) for a, b in zip(before[s], _home(frozen, s)))
    assert not torch.equal(frozen.replicas[0].wte.weight, build_replica(cfg.model(), 0).wte.weight)


def test_averaging_shares_E_R_and_keeps_each_home_layer_its_own(sites):
    eng = engine(sites, steps=3, sync_every=1)
    before = _home(eng, 0)
    for _ in range(3):
        eng.train_step()
    first = dict(eng.replicas[0].shared_state_dict())
    for s in range(1, P):
        assert all(torch.equal(first[k], v) for k, v in eng.replicas[s].shared_state_dict().items())
    homes = [_home(eng, s) for s in range(P)]
    assert not all(torch.equal(a, b) for a, b in zip(before, homes[0])), "the layer trains"
    for s in range(1, P):
        assert not any(torch.equal(a, b) for a, b in zip(homes[0], homes[s]))
    plain = ReferenceEngine(TrainConfig(**BASE, steps=3, sync_every=1), sites)
    plain_losses = [plain.train_step().loss for _ in range(3)]
    again = engine(sites, steps=3, sync_every=1)
    assert [again.train_step().loss for _ in range(3)] != plain_losses


class Recorder:
    """Strategy hooks that keep every reply's arrays."""

    def __init__(self) -> None:
        self.sent: list[ArrayRecord] = []

    def after_train(self, rnd, replies, arrays) -> None:
        self.sent += [msg.content["arrays"] for msg in replies]

    def after_evaluate(self, rnd, replies) -> None:
        pass


def test_flower_arrays_carry_E_R_only_and_train_like_the_plain_reference(sites):
    eng = engine(sites, steps=4, sync_every=2)
    strategy = make_strategy("fedavg", P, RoundPlan.of(eng.cfg))
    strategy.hooks = Recorder()
    grid = train_with_strategy(eng, strategy)
    assert len(strategy.hooks.sent) == 2 * P
    private = {k for k in eng.replicas[0].state_dict() if is_private(k)}
    assert private
    for arrays in strategy.hooks.sent:
        assert set(arrays) == set(eng.replicas[0].shared_state_dict())
    # Flower's FedAvg rounds differently from the engine's plain mean (the 1e-5 contract
    # of tests/test_coordinator.py); the home layers train alike on both sides.
    ref = engine(sites, steps=4, sync_every=2)
    ref_losses = [ref.train_step().origin_losses for _ in range(4)]
    got = [r.origin_losses for r in grid.steps]
    assert max(abs(a - b) for x, y in zip(got, ref_losses) for a, b in zip(x, y)) <= 1e-5
    for s in range(P):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(_home(eng, s), _home(ref, s)))


def test_worker_sends_E_R_only_and_refuses_a_pushed_home_layer(sites):
    from mobius_fed.worker.executor import RingExecutor
    from mobius_fed.worker.flower_client import load_replica, replica_arrays

    cfg = TrainConfig(**BASE, privacy={"home_layer": "mlp"})
    ex = RingExecutor(cfg, 1, sites[1], "run")
    assert ex.replica.home is not None and ex.replica.home_layer == "mlp"
    arrays = replica_arrays(ex)
    assert set(arrays) == set(ex.replica.shared_state_dict())
    assert not any(is_private(k) for k in arrays)
    other = build_replica(cfg.model(), cfg.seed + 1, "mlp")
    home = _home_of(ex.replica)
    load_replica(ex, ArrayRecord(dict(other.shared_state_dict())))
    assert torch.equal(ex.replica.wte.weight, other.wte.weight)
    assert all(torch.equal(a, b) for a, b in zip(home, _home_of(ex.replica)))
    with pytest.raises(Exception, match="home"):
        load_replica(ex, ArrayRecord(dict(other.state_dict())))


def _home_of(replica) -> list[torch.Tensor]:
    return [p.detach().clone() for p in replica.private_parameters()]


def test_engine_checkpoint_keeps_the_home_layer_and_resumes_exactly(sites, tmp_path: Path):
    a = engine(sites, steps=4, sync_every=1)
    for _ in range(2):
        a.train_step()
    path = a.save(tmp_path / "ref.ckpt")
    state = load_checkpoint(path)
    assert any(is_private(k) for k in state["replicas"][0])
    b = engine(sites, steps=4, sync_every=1)
    b.load(path)
    assert [a.train_step().loss for _ in range(2)] == [b.train_step().loss for _ in range(2)]
    for s in range(P):
        assert all(torch.equal(x, y) for x, y in zip(_home(a, s), _home(b, s)))


@pytest.mark.slow
@pytest.mark.parametrize("order", ["cyclic", "ordered"])
def test_ring_with_home_layer_equals_reference_bit_for_bit(tmp_path: Path, order: str):
    train = dict(
        preset="cpu-tiny",
        steps=3,
        batch_size=4,
        micro_batches=2,
        sync_every=0,  # a ring without a coordinator keeps E/R local
        eval_every=0,
        optimizer="adamw",
        order=order,
    )
    ring = PrivateRing(tmp_path, 3, train)
    ring.privacy = {"home_layer": "mlp"}
    ring.prepare().start().wait()
    ref, ref_eval = ring.reference()
    got = ring.losses()
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) == 0.0, "ring must equal the reference exactly"
    assert all(ring.eval_losses()[s] == v for s, v in enumerate(ref_eval))
    for i in range(3):  # each worker's own checkpoint holds its home layer
        saved = load_checkpoint(ring.out(i) / f"worker-{i}.pt")
        assert any(is_private(k) for k in saved["replica"])


@pytest.mark.slow
def test_coordinated_run_keeps_home_layers_on_their_sites(tmp_path: Path):
    """Real coordinator + workers: the losses equal the reference under the same FedAvg,
    and neither the E/R checkpoint nor any state copy at the coordinator holds a home
    layer (the workers' own checkpoints do)."""
    import json

    from mobius_fed.coordinator.manifests import latest_manifest
    from mobius_fed.ops.federation import LocalFederation
    from tests.test_coordinator import reference, ring_history, run

    train = TrainConfig(
        **{**BASE, "workers": 3}, steps=4, sync_every=2, privacy={"home_layer": "mlp"}
    )
    fed = LocalFederation(tmp_path, train, checkpoint_every=2)
    run(fed)
    try:
        got, _ = ring_history(fed)
    finally:
        fed.stop()
    ref, _ = reference(fed)
    assert max(abs(got[k] - ref[k]) for k in ref) <= 1e-5 and set(got) == set(ref)
    manifest = latest_manifest(fed.coordinator_out)
    assert manifest is not None
    doc = json.loads(manifest.read_text())
    er = load_checkpoint(manifest.parent / doc["er"], doc["er_sha256"])
    names = set(er["arrays"]["__array_record__"])
    assert names and not any(is_private(k) for k in names)
    for w in doc["workers"].values():
        assert "copy" not in w, "a checkpoint holding a home layer is never copied out"
        assert any(is_private(k) for k in load_checkpoint(Path(w["path"]))["replica"])


def _audit(sites, privacy: dict):
    from mobius_fed.privacy.audit import Audit

    cfg = TrainConfig(**{**BASE, "optimizer": "muon"}, steps=3, privacy=privacy)
    return Audit(cfg, sites, inverter_steps=1).run().target


def test_keyed_home_layer_stops_the_last_hop_attacks_but_not_target_grouping(sites, tmp_path):
    write_site_keys(tmp_path / "keys", P)
    keys = str(tmp_path / "keys")
    for layer in ("mlp", "block"):
        t = _audit(sites, {"home_layer": layer, "noise_key_dir": keys})
        assert t.home_layer == layer and t.tokens == 3 * 4 * 32
        # without the layer the R-on-h attack reads back every target (test_privacy.py)
        assert t.best_accuracy <= 0.15, t
        assert None not in (t.linear_accuracy, t.matching_accuracy, t.cluster_accuracy)
        # ... yet gradients still group the tokens by target far above shuffled targets
        assert t.cluster_purity > t.cluster_purity_chance + 0.1, t
        if layer == "mlp":  # its own layer, drawn from its own key, is no stand-in
            assert t.surrogate == "its own home layer" and t.surrogate_accuracy <= 0.15


def test_home_layer_keyed_by_the_public_seed_is_rebuilt_by_the_attacker(sites):
    t = _audit(sites, {"home_layer": "mlp"})
    assert t.surrogate == "the victim's initial layer (public seed)"
    assert t.surrogate_accuracy >= 0.99 and t.matching_accuracy >= 0.9, t
