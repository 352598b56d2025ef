"""Research tools: analysis known answers, sweep grid/resume/report, experiment tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mobius_fed import stats
from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.experiment import Arm, markdown_table
from mobius_fed.engine.reference import EvalResult
from mobius_fed.engine.trainer import train
from mobius_fed.research import analyze, report
from mobius_fed.research.sweep import grid, prepare_cell, run_cells

P = 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _cfg(**kw) -> TrainConfig:
    base = dict(preset="cpu-tiny", workers=P, loops=2, steps=4, batch_size=2, eval_batches=1)
    return TrainConfig(**{**base, **kw})


def _engine(site_dirs: list[Path], **kw) -> ReferenceEngine:
    cfg = _cfg(**kw)
    return ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len) for d in site_dirs])


# --------------------------------------------------------------------- measures
def test_cka_and_cosine_known_answers() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 16, generator=g)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g))
    assert analyze.linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    # CKA ignores scale, orthogonal transforms and shifts: the same input twice gives 1.
    assert analyze.linear_cka(x, 3.0 * x @ q + 1.0) == pytest.approx(1.0, abs=1e-12)
    assert analyze.linear_cka(x, torch.randn(200, 16, generator=g)) < 0.3
    assert analyze.mean_cosine(x, 2 * x) == pytest.approx(1.0)
    assert analyze.mean_cosine(x, -x) == pytest.approx(-1.0)
    assert math.isnan(analyze.mean_cosine(torch.zeros(3, 4), x[:3, :4]))
    with pytest.raises(ValueError, match="same rows"):
        analyze.linear_cka(x, x[:10])


def test_identity_groups_have_zero_update_and_cka_one(site_dirs: list[Path]) -> None:
    """At init every output projection is zero, so every group is the identity."""
    engine = _engine(site_dirs, order="cyclic")
    model = analyze.Model(engine.cfg, engine.groups, engine.replicas)
    a = analyze.analyze_model(model, engine.sites, batches=1)
    K = engine.cfg.K
    assert all(a.update[i][t] == 0.0 for i in range(P) for t in range(K))
    for i in range(P):
        assert all(
            a.cka[i][t][u] == pytest.approx(1.0, abs=1e-9) for t in range(K) for u in range(K)
        )
        assert len({round(v, 9) for v in a.norm[i]}) == 1  # the stream never changes
    # A group that does something has a non-zero update at every depth it runs.
    with torch.no_grad():
        for p in engine.groups[1].parameters():
            p.add_(0.05)
    b = analyze.analyze_model(model, engine.sites, batches=1)
    assert all(b.update[1][t] > 0 for t in range(K)) and b.update[0][0] == 0.0


def test_analyze_checkpoints_side_by_side(site_dirs: list[Path], tmp_path: Path) -> None:
    runs = []
    for order in ("cyclic", "ordered"):
        engine = _engine(site_dirs, order=order)
        train(engine, tmp_path / order, checkpoint_every=0)
        runs.append((tmp_path / order, engine.evaluate()))
    out = analyze.analyze_paths(
        [r for r, _ in runs], tmp_path / "an", data=[site_dirs[0].parent], batches=1
    )
    doc = json.loads((out.parent / "analysis.json").read_text())
    for (_, ev), a in zip(runs, doc, strict=True):
        # Eq. 8's terms from the analysis equal the engine's own evaluation.
        assert a["origin_loss"] == pytest.approx(ev.origin_losses, abs=1e-5)
    ordered = doc[1]
    K = 2 * P
    for i in range(P):  # ordered: group i runs only at depths t ≡ i (mod P)
        assert [t for t in range(K) if ordered["update"][i][t] is not None] == [i, i + P]
    assert all(v is not None for row in doc[0]["update"] for v in row)  # cyclic: everywhere
    text = out.read_text()
    assert "logit-lens validation loss" in text and "| F_1 |" in text
    assert (out.parent / "depth_roles.png").is_file() and (out.parent / "cka.png").is_file()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        analyze.load_model(tmp_path / "missing")


def test_analyze_refuses_a_subspace_run_by_name(site_dirs: list[Path], tmp_path: Path) -> None:
    engine = _engine(site_dirs, subspace={"rank": 8, "mode": "home"})
    engine.save(tmp_path / "sub" / "checkpoint.pt")
    model = analyze.load_model(tmp_path / "sub")  # loads (export uses it); analysis refuses
    with pytest.raises(ValueError, match=r"has a shared subspace \(subspace.rank = 8\)"):
        analyze.analyze_model(model, engine.sites, batches=1)


# ------------------------------------------------------------------------ sweep
def test_grid_rejects_bad_values() -> None:
    base = _cfg()
    with pytest.raises(ValueError, match=r"P=5 does not divide the 12 layers \(divisors: 1, 2"):
        grid(base, [5], [1], ["cyclic"], [0], Path("x"))
    with pytest.raises(ValueError, match="unknown order 'spiral'"):
        grid(base, [2], [1], ["spiral"], [0], Path("x"))
    with pytest.raises(ValueError, match="L must be ≥ 1"):
        grid(base, [2], [0], ["cyclic"], [0], Path("x"))
    cells = grid(base, [2, 3], [1, 2], ["ordered", "cyclic"], [0, 1], Path("x"))
    assert len(cells) == 16 and cells[0].name == "P2-L1-ordered-s0"


def test_sweep_runs_resumes_and_reports(site_dirs: list[Path], tmp_path: Path) -> None:
    base = _cfg(steps=3, eval_every=0)
    cells = grid(base, [P], [1], ["ordered", "cyclic"], [0, 1], tmp_path)
    sites = site_dirs[0].parent
    todo = [c.directory for c in cells if prepare_cell(c, sites, coupled=False, checkpoint_every=0)]
    assert len(todo) == 4
    assert run_cells(todo, parallel=2) == []
    # Finished cells are skipped; a changed configuration in the same place is refused.
    assert not any(prepare_cell(c, sites, coupled=False, checkpoint_every=0) for c in cells)
    with pytest.raises(ValueError, match="another configuration"):
        prepare_cell(cells[0], sites, coupled=True, checkpoint_every=0)
    # A cell written before a setting existed (the field is missing) is the same cell.
    spec_path = cells[0].directory / "cell.json"
    spec = json.loads(spec_path.read_text())
    del spec["train"]["privacy"]["input_clip"]
    spec_path.write_text(json.dumps(spec))
    assert not prepare_cell(cells[0], sites, coupled=False, checkpoint_every=0)
    results = [json.loads((c.directory / "result.json").read_text()) for c in cells]
    # A cell process reproduces the in-process reference engine exactly.
    cfg = cells[1].cfg
    engine = ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len) for d in site_dirs])
    train(engine, tmp_path / "same", checkpoint_every=0)
    assert results[1]["final"] == engine.evaluate().loss
    path = report.write_report(results, tmp_path, command="mobius-fed sweep …")
    row = report.rows(results)[0]
    d = [results[1]["final"] - results[0]["final"], results[3]["final"] - results[2]["final"]]
    assert row.deltas == d
    m, half = stats.ci95(d)
    assert f"{m:+.4f} [{m - half:+.4f}, {m + half:+.4f}]" in path.read_text()
    assert "+0.1697" in path.read_text()  # the paper's Table 1 beside ours


def test_stats() -> None:
    assert stats.t975(1) == 12.706 and stats.t975(2) == 4.303 and stats.t975(100) == 1.96
    m, half = stats.ci95([1.0, 2.0, 3.0])
    assert m == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(stats.ci95([1.0])[1]) and stats.std([5.0]) == 0.0
    with pytest.raises(ValueError, match="degrees of freedom"):
        stats.t975(0)


def test_experiment_table_with_seeds() -> None:
    def arm(L: int, order: str, seed: int, loss: float) -> Arm:
        return Arm(L, order, [EvalResult(step=10, loss=loss)], seed)  # type: ignore[arg-type]

    arms = [arm(1, "ordered", 0, 3.0), arm(1, "cyclic", 0, 3.2), arm(1, "ordered", 1, 3.1)]
    arms.append(arm(1, "cyclic", 1, 3.4))
    table = markdown_table(arms, P=4)
    m, half = stats.ci95([0.2, 0.3])
    assert "| 1 | 3.0500 ± 0.0707 | 4 | 3.3000 ± 0.1414 |" in table
    assert f"{m:+.4f} [{m - half:+.4f}, {m + half:+.4f}] | 2 |" in table
    assert "| 1 | 3.0000 | 4 | 3.2000 | +0.2000 |" in markdown_table(arms[:2], P=4)


def test_cli_experiment_with_seeds_and_sweep_refusal(
    site_dirs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mobius_fed.cli.main import main

    common = ["--preset", "cpu-tiny", "--workers", "2", "--steps", "2", "--batch-size", "2"]
    common += ["--threads", "1"]
    out = tmp_path / "exp"
    args = ["experiment", *common, "--loops", "1", "--seeds", "2", "--eval-batches", "1"]
    assert main([*args, "--data", str(site_dirs[0].parent), "--out", str(out)]) == 0
    table = (out / "table.md").read_text()
    assert "Δ [95 % CI] | seeds |" in table and " ± " in table and "| 2 |" in table
    assert (out / "validation.png").is_file() and (out / "L1-cyclic-s1" / "checkpoint.pt").is_file()
    with pytest.raises(SystemExit) as exc:
        main(["sweep", "--preset", "cpu-tiny", "--workers", "5", "--out", str(tmp_path / "s")])
    assert exc.value.code == 2
    assert "P=5 does not divide the 12 layers" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("home_layer", ["off", "mlp"])
def test_analyze_a_coordinated_run_from_its_manifest(tmp_path: Path, home_layer: str) -> None:
    """A real coordinated run (coordinator + 2 worker processes over mTLS) is assembled from
    its newest manifest: the workers' groups, the averaged E/R and each site's home layer.
    Its Eq. 8 terms equal the ones the ring itself evaluated at that round."""
    from mobius_fed.ops.federation import LocalFederation

    train = _cfg(steps=4, sync_every=1, eval_every=4, privacy={"home_layer": home_layer})
    fed = LocalFederation(tmp_path / "up", train, checkpoint_every=2, threads=1)
    fed.prepare().start()
    try:
        final = fed.wait(timeout=300)
        assert final["phase"] == "done", (final, fed.tail("coordinator"))
        evals = fed.rest("/v1/history")["evals"]
    finally:
        fed.stop()
    (last,) = [e for e in evals if e["step"] == 4]
    manifest = tmp_path / "up" / "coordinator" / "checkpoints" / "round-000004" / "manifest.json"
    doc = json.loads(manifest.read_text())
    # With a home layer no copy goes to the coordinator: the workers' own files are read.
    assert ("copy" in doc["workers"]["0"]) == (home_layer == "off")
    model = analyze.load_model(tmp_path / "up")  # the up root: its newest manifest
    assert model.cfg.privacy.home_layer == home_layer and "round 4" in model.name
    sites = analyze.sites_for(model.cfg, manifest, None, tmp_path / "an")
    assert sites[0].directory == tmp_path / "up" / "sites" / "site-0"  # found above the manifest
    got = analyze.analyze_model(model, sites, batches=1)
    assert got.origin_loss == pytest.approx(last["origin_losses"], abs=1e-5)
    if home_layer == "off":  # a copy that does not match the manifest is refused
        (manifest.parent / "worker-1.ckpt").write_bytes(b"not a checkpoint")
        with pytest.raises(Exception, match="sha256"):
            analyze.load_model(manifest)
