"""Tests for the single-process reference engine (the oracle for the distributed ring)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from mobius_fed import schedule
from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.metrics import read_metrics
from mobius_fed.engine.trainer import CHECKPOINT, METRICS, train

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"
P = 4


def _config(**kw) -> TrainConfig:
    base = dict(
        preset="cpu-tiny",
        workers=P,
        loops=1,
        order="cyclic",
        steps=10,
        batch_size=2,
        warmup_steps=2,
        eval_batches=1,
        seed=0,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """cpu-tiny gains nothing from intra-op threads, and they thrash on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sites(dirs: list[Path], cfg: TrainConfig) -> list[SiteData]:
    return [SiteData(d, cfg.model().seq_len, cfg.encoding) for d in dirs]


@pytest.fixture(scope="session")
def site_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("corpus")
    return prepare_sites(None, root / "sites", P, text=embedded_corpus())


@pytest.fixture(scope="session")
def shakespeare_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not found")
    root = tmp_path_factory.mktemp("shakespeare")
    return prepare_sites([SHAKESPEARE], root / "sites", P)


def _engine(site_dirs: list[Path], **kw) -> ReferenceEngine:
    cfg = _config(**kw)
    return ReferenceEngine(cfg, _sites(site_dirs, cfg))


def _run(engine: ReferenceEngine, n: int) -> list[float]:
    return [engine.train_step().loss for _ in range(n)]


# --- determinism ----------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["cyclic", "ordered"])
def test_same_seed_gives_bit_identical_losses(site_dirs, order) -> None:
    a = _run(_engine(site_dirs, order=order, optimizer="muon"), 10)
    b = _run(_engine(site_dirs, order=order, optimizer="muon"), 10)
    assert a == b
    assert all(math.isfinite(x) for x in a)


def test_different_seed_gives_different_losses(site_dirs) -> None:
    a = _run(_engine(site_dirs, seed=0), 3)
    b = _run(_engine(site_dirs, seed=1), 3)
    assert a != b


# --- checkpoints ----------------------------------------------------------------------------


def test_resume_from_checkpoint_continues_exactly(site_dirs, tmp_path) -> None:
    N, k = 8, 4
    full = _engine(site_dirs, steps=N)
    losses = []
    for _ in range(N):
        losses.append(full.train_step().loss)
        if full.step == k:
            full.save(tmp_path / "step4.pt")

    resumed = _engine(site_dirs, steps=N)
    resumed.load(tmp_path / "step4.pt")
    assert resumed.step == k
    assert _run(resumed, N - k) == losses[k:]
    for g_full, g_res in zip(full.groups, resumed.groups):
        for a, b in zip(g_full.parameters(), g_res.parameters()):
            assert torch.equal(a, b)


def test_trainer_resume_continues_the_metrics_log(site_dirs, tmp_path) -> None:
    N, k = 8, 4
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    full = _engine(site_dirs, steps=N, eval_every=0)
    steps_seen = []

    def snapshot(result) -> None:
        steps_seen.append(result.step)

    train(full, full_dir, checkpoint_every=k, on_step=snapshot)
    assert steps_seen == list(range(N))
    full_rows = [r for r in read_metrics(full_dir / METRICS) if "loss" in r]
    assert [r["step"] for r in full_rows] == list(range(N))

    # Make the step-k checkpoint by training a k-step prefix (same config except `steps`
    # would change the LR schedule, so stop a full-length engine by hand instead).
    prefix = _engine(site_dirs, steps=N, eval_every=0)
    _run(prefix, k)
    prefix.save(part_dir / CHECKPOINT)

    resumed = _engine(site_dirs, steps=N, eval_every=0)
    evals = train(resumed, part_dir, checkpoint_every=k, resume=True)
    assert resumed.step == N
    part_rows = [r for r in read_metrics(part_dir / METRICS) if "loss" in r]
    assert [r["step"] for r in part_rows] == list(range(k, N))
    assert [r["loss"] for r in part_rows] == [r["loss"] for r in full_rows[k:]]
    full_eval = [r for r in read_metrics(full_dir / METRICS) if "eval_loss" in r]
    assert evals[-1].loss == full_eval[-1]["eval_loss"]


def test_checkpoint_from_a_different_config_is_refused(site_dirs, tmp_path) -> None:
    engine = _engine(site_dirs)
    engine.train_step()
    ckpt = engine.save(tmp_path / "c.pt")
    for other in (dict(order="ordered"), dict(loops=2), dict(seed=1), dict(lr_muon=0.01)):
        with pytest.raises(ValueError, match="different configuration"):
            _engine(site_dirs, **other).load(ckpt)
    # Only the step budget may change (extending a run).
    longer = _engine(site_dirs, steps=20)
    longer.load(ckpt)
    assert longer.step == 1


def test_checkpoint_of_another_split_is_refused_naming_both(site_dirs, tmp_path) -> None:
    uneven = _engine(site_dirs, layers_per_group="4,4,2,2")
    ckpt = uneven.save(tmp_path / "c.pt")
    with pytest.raises(ValueError) as err:
        _engine(site_dirs).load(ckpt)
    assert str(err.value) == (
        "checkpoint cannot continue this run: it was written with layers_per_group 4,4,2,2, "
        "this run has layers_per_group 3,3,3,3"
    )
    _engine(site_dirs, layers_per_group=[4, 4, 2, 2]).load(ckpt)  # the same split resumes


def test_missing_checkpoint_raises(site_dirs, tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        _engine(site_dirs).load(tmp_path / "nope.pt")


# --- evaluation (paper Eq. 8) ---------------------------------------------------------------


@pytest.mark.parametrize("order", ["cyclic", "ordered"])
def test_eval_is_mean_of_per_origin_path_losses(site_dirs, order) -> None:
    engine = _engine(site_dirs, order=order, loops=2, eval_batches=2)
    _run(engine, 3)
    result = engine.evaluate()
    cfg = engine.cfg
    per_origin = []
    with torch.no_grad():
        for s in range(cfg.P):
            losses = []
            for b in range(cfg.eval_batches):
                x, y = engine.sites[s].batch(
                    "val", seed=cfg.seed, step=b, batch_size=cfg.batch_size
                )
                h = engine.replicas[s].embed(x)
                for i in schedule.path(cfg.order, s, cfg.P, cfg.loops):
                    h = engine.groups[i](h)
                losses.append(engine.replicas[s].loss(h, y).item())
            per_origin.append(sum(losses) / len(losses))
    assert result.step == 3
    assert result.origin_losses == pytest.approx(per_origin, rel=1e-6)
    assert result.loss == pytest.approx(sum(per_origin) / cfg.P, rel=1e-6)
    # The origins really take different paths (cyclic) or see different data (both).
    assert len(set(result.origin_losses)) > 1


# --- orders and replica averaging -----------------------------------------------------------


def test_cyclic_and_ordered_differ(site_dirs) -> None:
    cyc = _run(_engine(site_dirs, order="cyclic"), 4)
    ordd = _run(_engine(site_dirs, order="ordered"), 4)
    # Block groups are the identity at initialisation, so the first loss cannot tell the
    # orders apart; after some updates the different paths give different losses.
    assert cyc[0] == pytest.approx(ordd[0], rel=1e-6)
    assert cyc[1:] != ordd[1:]
    assert all(abs(a - b) > 1e-6 for a, b in zip(cyc[2:], ordd[2:]))


def _replicas_equal(engine: ReferenceEngine) -> bool:
    first = list(engine.replicas[0].parameters())
    return all(
        all(torch.equal(a, b) for a, b in zip(first, r.parameters())) for r in engine.replicas[1:]
    )


def test_sync_every_one_keeps_replicas_equal(site_dirs) -> None:
    engine = _engine(site_dirs, sync_every=1)
    assert _replicas_equal(engine)
    for _ in range(3):
        engine.train_step()
        assert _replicas_equal(engine)


def test_sync_every_zero_lets_replicas_diverge(site_dirs) -> None:
    engine = _engine(site_dirs, sync_every=0)
    assert _replicas_equal(engine)
    engine.train_step()
    assert not _replicas_equal(engine)
    engine.train_step()
    assert not _replicas_equal(engine)


def test_sync_every_two_averages_at_even_steps(site_dirs) -> None:
    engine = _engine(site_dirs, sync_every=2)
    engine.train_step()
    assert not _replicas_equal(engine)
    engine.train_step()
    assert _replicas_equal(engine)


# --- micro-batches --------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_micro_batches_do_not_change_the_math(site_dirs, optimizer) -> None:
    one = _run(_engine(site_dirs, batch_size=4, micro_batches=1, optimizer=optimizer), 4)
    two = _run(_engine(site_dirs, batch_size=4, micro_batches=2, optimizer=optimizer), 4)
    # Not bitwise: with two micro-batches the step loss is the mean of two half-batch means
    # and the parameter gradients are sums of two half-batch accumulations rescaled by 1/M,
    # a different floating-point summation order; the matmuls also run on differently
    # shaped inputs (different blocking). Mathematically equal, so rounding-level close.
    assert two[0] == pytest.approx(one[0], abs=1e-5)
    if optimizer == "adamw":
        assert two == pytest.approx(one, abs=1e-5)
    else:
        # Muon orthogonalises the update with a bf16 Newton–Schulz iteration, which turns
        # rounding-level gradient differences into ~1e-5 parameter differences per step.
        assert two == pytest.approx(one, abs=1e-3)


# --- learning -------------------------------------------------------------------------------


def test_loss_decreases_on_tinyshakespeare(shakespeare_dirs) -> None:
    engine = _engine(shakespeare_dirs, steps=30, batch_size=4, eval_batches=2)
    before = engine.evaluate().loss
    assert before == pytest.approx(math.log(257), abs=0.3)  # uniform-ish at init
    losses = _run(engine, 30)
    after = engine.evaluate().loss
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert after < before - 0.5


def test_engine_needs_one_site_per_worker(site_dirs) -> None:
    cfg = _config()
    with pytest.raises(ValueError, match="one site per worker"):
        ReferenceEngine(cfg, _sites(site_dirs[:3], cfg))


def test_trainer_writes_metrics_and_checkpoint(site_dirs, tmp_path) -> None:
    engine = _engine(site_dirs, steps=4, eval_every=2)
    evals = train(engine, tmp_path, checkpoint_every=0)
    assert [e.step for e in evals] == [2, 4]
    assert (tmp_path / CHECKPOINT).is_file()
    rows = read_metrics(tmp_path / METRICS)
    assert [r["step"] for r in rows if "loss" in r] == [0, 1, 2, 3]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("order", ["cyclic", "ordered"])
def test_gradients_equal_autograd_of_the_paper_objective(site_dirs, order) -> None:
    """An independent oracle for the loss scaling: compose the model naively, take
    J = mean_s CE(R_s(F_path(s)(E_s(x_s))), z_s) and let autograd differentiate it.
    Block-group gradients must equal dJ/dθ_i; replica s holds d loss_s/dθ_s = P · dJ/dθ_s."""
    import copy

    P, L, M = 2, 2, 2
    engine = _engine(
        site_dirs[:P],
        workers=P,
        loops=L,
        micro_batches=M,
        order=order,
        optimizer="adamw",
        batch_size=4,
    )
    groups = copy.deepcopy(engine.groups)
    replicas = copy.deepcopy(engine.replicas)
    engine.compute_gradients()

    losses = []
    for s in range(P):
        x, y = engine.sites[s].batch("train", seed=engine.cfg.seed, step=0, batch_size=4)
        h = replicas[s].embed(x)
        for i in schedule.path(order, s, P, L):
            h = groups[i](h)
        losses.append(replicas[s].loss(h, y))
    torch.stack(losses).mean().backward()

    for naive, ours in zip(groups, engine.groups):
        for (name, a), b in zip(naive.named_parameters(), ours.parameters()):
            assert b.grad is not None, name
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)
    for naive, ours in zip(replicas, engine.replicas):
        for (name, a), b in zip(naive.named_parameters(), ours.parameters()):
            torch.testing.assert_close(b.grad, P * a.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_metrics_reader_drops_a_torn_last_record_and_names_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]  # killed mid-write: resumable
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        read_metrics(path)
