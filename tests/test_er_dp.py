"""DP-FedAvg of the shared E/R: Flower's clipping, keyed noise, the reference oracle and a
real coordinated run that equals it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, RecordDict

from mobius_fed.config import ConfigError, TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.defences.er_dp import COORDINATOR_KEY, ErPrivacy
from mobius_fed.defences.report import status_block
from mobius_fed.defences.stages import write_site_keys
from mobius_fed.engine import ReferenceEngine
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.transport.flower_wire import COORDINATOR_NODE_ID, set_task_identity
from tests.test_coordinator import max_diff, reference, ring_history, run

P = 2


def _record(*arrays: np.ndarray) -> ArrayRecord:
    return ArrayRecord({f"a{i}": Array(a.astype(np.float32)) for i, a in enumerate(arrays)})


def _reply(record: ArrayRecord) -> Message:
    set_task_identity(COORDINATOR_NODE_ID)
    return Message(RecordDict({"arrays": record}), dst_node_id=1, message_type="train")


def _norm(record: ArrayRecord, base: ArrayRecord) -> float:
    pairs = zip(record.to_numpy_ndarrays(), base.to_numpy_ndarrays(), strict=True)
    return float(np.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in pairs)))


def test_each_update_is_clipped_to_C_over_all_arrays() -> None:
    start = _record(np.ones((3, 4)), np.zeros(5))
    big = _reply(_record(np.ones((3, 4)) + 2.0, np.full(5, 2.0)))  # ‖Δ‖ = 2·√17
    small = _reply(_record(np.ones((3, 4)) + 0.01, np.zeros(5)))  # ‖Δ‖ = 0.01·√12
    dp = ErPrivacy(noise=1.0, clip=0.5, P=2, seed=0, key=b"k" * 32)
    dp.clip_replies([big, small], start)
    assert _norm(big.content["arrays"], start) == pytest.approx(0.5, rel=1e-5)
    assert _norm(small.content["arrays"], start) == pytest.approx(0.01 * 12**0.5, rel=1e-5)
    got = big.content["arrays"].to_numpy_ndarrays()  # the direction is kept
    assert np.allclose(got[0] - 1.0, got[1][0]) and got[0].dtype == np.float32


def test_noise_is_keyed_per_round_and_has_std_zC_over_P() -> None:
    zeros = _record(np.zeros((400, 500)))
    dp = ErPrivacy(noise=2.0, clip=0.3, P=4, seed=7, key=b"a" * 32)
    first = dp.add_noise(zeros, 3).to_numpy_ndarrays()[0]
    assert first.std() == pytest.approx(2.0 * 0.3 / 4, rel=0.01) and abs(first.mean()) < 1e-3
    again = dp.add_noise(zeros, 3).to_numpy_ndarrays()[0]
    assert np.array_equal(first, again)  # a redone round draws the same noise
    other_round = dp.add_noise(zeros, 4).to_numpy_ndarrays()[0]
    other_key = ErPrivacy(2.0, 0.3, 4, 7, b"b" * 32).add_noise(zeros, 3).to_numpy_ndarrays()[0]
    assert not np.array_equal(first, other_round) and not np.array_equal(first, other_key)


def test_the_coordinator_key_is_required_when_a_key_directory_is_set(tmp_path: Path) -> None:
    cfg = TrainConfig(preset="cpu-tiny", workers=P, privacy={"er_noise": 1.0})
    assert ErPrivacy.of(cfg).key == b"public-seed:%d" % cfg.seed
    keyed = cfg.model_copy(
        update={"privacy": cfg.privacy.model_copy(update={"noise_key_dir": str(tmp_path)})}
    )
    with pytest.raises(FileNotFoundError, match=COORDINATOR_KEY):
        ErPrivacy.of(keyed)
    write_site_keys(tmp_path, P)
    assert ErPrivacy.of(keyed).key == (tmp_path / COORDINATOR_KEY).read_bytes()
    assert ErPrivacy.of(TrainConfig(preset="cpu-tiny", workers=P)) is None


def test_the_single_process_engine_refuses_to_average_without_the_strategy(
    tmp_path: Path,
) -> None:
    from mobius_fed.data import embedded_corpus, prepare_sites

    cfg = TrainConfig(preset="cpu-tiny", workers=P, batch_size=2, privacy={"er_noise": 1.0})
    dirs = prepare_sites(None, tmp_path / "sites", P, text=embedded_corpus()[:60_000])
    engine = ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len) for d in dirs])
    with pytest.raises(ConfigError, match="er_noise"):
        engine.train_step()
    from mobius_fed.engine.federated import train_with_strategy
    from mobius_fed.strategies import RoundPlan, make_strategy

    plain = make_strategy("fedavg", P, RoundPlan.of(cfg))  # built without its E/R noise
    with pytest.raises(ValueError, match=r"er_privacy=ErPrivacy\.of\(cfg\)"):
        train_with_strategy(engine, plain)


def test_status_reports_the_er_epsilon() -> None:
    cfg = TrainConfig(preset="cpu-tiny", workers=P, sync_every=2, privacy={"er_noise": 4.0})
    block = status_block(cfg, 7)
    assert block is not None and block["er"]["rounds"] == 4
    assert 0 < block["er"]["epsilon"] < status_block(cfg, 20)["er"]["epsilon"]
    assert [d["name"] for d in block["defences"]] == ["er_dp"]


@pytest.mark.slow
def test_a_coordinated_run_with_er_dp_equals_the_reference(tmp_path: Path) -> None:
    """Coordinator + 2 worker processes over mTLS: clipping and the coordinator-keyed noise
    are applied by the same Flower code and generator as in the reference oracle."""
    keys = tmp_path / "keys"
    write_site_keys(keys, P)
    privacy = {"er_noise": 0.5, "er_clip": 0.05, "noise_key_dir": str(keys)}
    train = TrainConfig(
        workers=P, preset="cpu-tiny", batch_size=2, optimizer="adamw", eval_every=2,
        steps=4, sync_every=1, privacy=privacy,
    )  # fmt: skip
    fed = LocalFederation(tmp_path / "up", train, threads=1)
    final = run(fed)
    try:
        got, got_evals = ring_history(fed)
    finally:
        fed.stop()
    assert final["privacy"]["er"]["rounds"] == 4 and final["privacy"]["er"]["epsilon"] > 0
    torch.set_num_threads(1)
    ref, ref_evals = reference(fed)
    assert max_diff(got, ref) <= 1e-5
    assert max(abs(a - b) for (_, a), (_, b) in zip(got_evals, ref_evals, strict=True)) <= 1e-5
    plain = fed.train.model_copy(update={"privacy": fed.train.privacy.model_copy(
        update={"er_noise": 0.0})})  # fmt: skip
    fed.train = plain
    without, _ = reference(fed)
    assert max_diff(got, without) > 1e-3  # the defence changed the run


def test_mobius_fed_status_shows_both_epsilons() -> None:
    from rich.console import Console

    from mobius_fed.cli.status import render_status

    cfg = TrainConfig(preset="cpu-tiny", workers=P, privacy={"er_noise": 4.0, "label_noise": 2.0})
    block = status_block(cfg, 10)
    console = Console(record=True, width=200)
    render_status({"phase": "training", "step": 10, "privacy": block}, console)
    text = console.export_text()
    assert "label_noise, er_dp" in text and "public seed" in text
    assert f"{block['epsilon']:.3g}" in text
    assert f"{block['er']['epsilon']:.3g} (10 barriers)" in text
