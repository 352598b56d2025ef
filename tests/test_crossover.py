"""Δ against training length: tokens per parameter, the log fit, the report, ``--lengths``."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mobius_fed import stats
from mobius_fed.config import TrainConfig
from mobius_fed.data import embedded_corpus, prepare_sites
from mobius_fed.model import count_parameters
from mobius_fed.research import crossover
from mobius_fed.research.sweep import Cell, by_cost, run_cells


def _train(**kw) -> dict:
    base = dict(preset="cpu-tiny", workers=4, n_layer=4, loops=1, steps=32, batch_size=8)
    return TrainConfig(**{**base, **kw}).model_dump(mode="json")


def _result(final: float, **kw) -> dict:
    return {"name": "x", "train": _train(**kw), "final": final}


def test_tokens_per_param_counts_every_origin() -> None:
    train = _train(steps=512)
    n = count_parameters(TrainConfig.model_validate(train).model())
    assert n == 59_648  # cpu-tiny with 4 layers: 4 × 12,352 + one tied 320 × 32 embedding
    assert crossover.tokens_per_param(train) == 512 * 4 * 8 * 32 / n
    assert abs(crossover.PAPER_TOKENS_PER_PARAM - 20.16) < 0.01


def test_fit_log_known_answers() -> None:
    xs = [1.0, 10.0, 100.0]
    exact = crossover.fit_log(xs, [0.1, 0.05, 0.0])
    assert exact.slope == pytest.approx(-0.05) and exact.intercept == pytest.approx(0.1)
    assert exact.half == pytest.approx(0.0, abs=1e-12) and exact.at(1000.0) == pytest.approx(-0.05)
    # Residuals ±e at the ends, ∓2e in the middle: slope unchanged, se = sqrt(6e²/1/2).
    e = 0.01
    noisy = crossover.fit_log(xs, [0.1 + e, 0.05 - 2 * e, 0.0 + e])
    assert noisy.slope == pytest.approx(-0.05)
    assert noisy.half == pytest.approx(stats.t975(1) * math.sqrt(6 * e * e / 1 / 2))
    assert math.isnan(crossover.fit_log([1.0, 10.0], [0.0, 1.0]).half)
    with pytest.raises(ValueError, match="same tokens per parameter"):
        crossover.fit_log([2.0, 2.0, 2.0], [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="must be > 0"):
        crossover.fit_log([0.0, 1.0], [0.0, 1.0])
    with pytest.raises(ValueError, match="need ≥ 2 paired points"):
        crossover.fit_log([1.0], [0.0])


def test_lengths_are_checked_and_costly_cells_go_first() -> None:
    assert crossover.check_lengths([600, 150, 2400]) == [150, 600, 2400]
    with pytest.raises(ValueError, match="repeats a value: 150 150"):
        crossover.check_lengths([150, 150])
    with pytest.raises(ValueError, match="≥ 1 step each, got 0"):
        crossover.check_lengths([0, 10])
    cells = [
        Cell(TrainConfig.model_validate(_train(steps=n, loops=L)), Path(f"n{n}-L{L}"))
        for n, L in [(32, 8), (128, 1), (128, 4), (32, 1)]
    ]
    assert [c.name for c in by_cost(cells)] == ["n128-L4", "n32-L8", "n128-L1", "n32-L1"]


def test_points_fits_and_report(tmp_path: Path) -> None:
    by_length = {}
    for n, (d0, d1) in {32: (0.20, 0.10), 128: (0.10, 0.06), 512: (0.02, -0.02)}.items():
        by_length[n] = [
            _result(3.0, steps=n, order="ordered", seed=0),
            _result(3.0 + d0, steps=n, order="cyclic", seed=0),
            _result(2.9, steps=n, order="ordered", seed=1),
            _result(2.9 + d1, steps=n, order="cyclic", seed=1),
        ]
    table = crossover.points(by_length)
    pts = table[(4, 1)]
    assert [p.steps for p in pts] == [32, 128, 512]
    assert pts[2].row.deltas == pytest.approx([0.02, -0.02])
    fit = crossover.fit_points(pts)
    xs = [p.tokens_per_param for p in pts for _ in range(2)]
    ys = [0.20, 0.10, 0.10, 0.06, 0.02, -0.02]
    assert fit == crossover.fit_log(xs, [d for p in pts for d in p.row.deltas])
    assert fit.slope == pytest.approx(crossover.fit_log(xs, ys).slope) and fit.n == 6
    path = crossover.write_crossover(by_length, tmp_path, command="mobius-fed sweep --lengths …")
    text = path.read_text()
    assert "preset cpu-tiny with 4 layers; 32/128/512 steps;" in text
    m, half = pts[0].row.delta_ci
    assert f"| 4 | 1 | 32 | {pts[0].tokens_per_param:.2f} |" in text
    assert f"{m:+.4f} [{m - half:+.4f}, {m + half:+.4f}] | 2 |" in text
    assert f"{fit.slope:+.4f} [{fit.slope - fit.half:+.4f}, {fit.slope + fit.half:+.4f}]" in text
    assert "| 4 | 6 | paper (2.5B tokens, 124M) | 20.2 |" in text and "-0.0084" in text
    assert (tmp_path / "crossover.png").is_file()
    by_length[32][0] = _result(3.0, steps=33, order="ordered", seed=0)
    with pytest.raises(ValueError, match="trained 33 steps but sits with the 32-step cells"):
        crossover.points(by_length)


def test_trend_reading() -> None:
    pts = crossover.points(
        {
            n: [_result(3.0, steps=n, order="ordered", seed=s) for s in (0, 1, 2)]
            + [
                _result(3.0 + d + e, steps=n, order="cyclic", seed=s)
                for s, e in enumerate((0, 1e-3, -1e-3))
            ]
            for n, d in {32: 0.3, 128: 0.1, 512: -0.1}.items()
        }
    )[(4, 1)]
    reading = crossover.trend(crossover.fit_points(pts), pts[-1])
    assert reading == "Δ falls with tokens (slope < 0 at 95 %); Δ < 0 at the longest length (95 %)"


def test_cli_sweep_over_lengths_resumes_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mobius_fed.cli.main import main

    sites = prepare_sites(None, tmp_path / "sites", 2, text=embedded_corpus()[:60_000])
    out = tmp_path / "sweep"
    args = ["sweep", "--preset", "cpu-tiny", "--workers", "2", "--loops", "1", "--seeds", "1"]
    args += ["--batch-size", "2", "--eval-batches", "1", "--eval-every", "0", "--threads", "4"]
    args += ["--lengths", "4", "2", "--data", str(sites[0].parent), "--out", str(out)]
    assert main(args) == 0
    for n in (2, 4):
        result = json.loads(
            (out / f"n{n}" / "cells" / "P2-L1-cyclic-s0" / "result.json").read_text()
        )
        assert result["train"]["steps"] == n and (out / f"n{n}" / "report.md").is_file()
    text = (out / "crossover.md").read_text()
    assert "| 2 | 1 | 2 |" in text and "| 2 | 1 | 4 |" in text
    capsys.readouterr()
    assert main(args) == 0  # every cell finished: nothing runs again
    assert "sweep: 4 cells (4 finished already)" in " ".join(capsys.readouterr().err.split())


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs /proc")
def test_sigterm_stops_a_sweep_and_its_cells(tmp_path: Path) -> None:
    sites = prepare_sites(None, tmp_path / "sites", 2, text=embedded_corpus()[:60_000])
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "mobius_fed.cli.research", "sweep", "--preset", "cpu-tiny"]
    cmd += ["--workers", "2", "--loops", "1", "--orders", "cyclic", "--seed-list", "0"]
    cmd += ["--steps", "100000", "--batch-size", "2", "--eval-every", "0", "--threads", "1"]
    cmd += ["--data", str(sites[0].parent), "--out", str(out)]
    cold = {**os.environ, "MOBIUS_WARM_START": "0"}  # the cell is the sweep's own child
    sweep = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=cold)
    metrics = out / "cells" / "P2-L1-cyclic-s0" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.5)
    cells = _children(sweep.pid)
    assert metrics.is_file() and len(cells) == 1, "the cell never started"
    sweep.send_signal(signal.SIGTERM)
    assert sweep.wait(timeout=120) == 128 + signal.SIGTERM
    assert not Path(f"/proc/{cells[0]}").exists()  # the cell ended with the sweep


def test_a_cell_finished_meanwhile_is_not_run_again(tmp_path: Path) -> None:
    cell = tmp_path / "P4-L1-cyclic-s0"
    cell.mkdir()
    (cell / "result.json").write_text(json.dumps({"final": 2.0}))
    seen: list[Path] = []
    assert run_cells([cell], parallel=1, on_done=lambda d, r, s: seen.append(d)) == []
    assert seen == [] and not (cell / "cell.log").exists()
