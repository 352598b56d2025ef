"""A short chaos run (benchmarks/chaos.py): a killed worker, a frozen one, a cut ring edge
and a killed coordinator, one after another; the run heals by itself and ends with the
reference engine's losses."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(  # benchmarks/ is scripts, not a package
    "chaos_benchmark", Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"
)
bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules[_spec.name] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)  # type: ignore[union-attr]
KINDS, chaos, parse_args, train_config = (
    bench.KINDS,
    bench.chaos,
    bench.parse_args,
    bench.train_config,
)

pytestmark = pytest.mark.slow


@pytest.mark.slow(reason="a ring through a killed worker and coordinator, a freeze and an edge cut")
def test_a_short_chaos_run_heals_every_fault_and_equals_the_reference(tmp_path: Path):
    args = parse_args(
        ["--steps", "24", "--every", "2", "3", "--after-step", "2", "--freeze", "4.5", "5",
         "--cut", "1", "2", "--sequence", ",".join(KINDS), "--max-faults", "4", "--seed", "3"]
    )  # fmt: skip
    report = chaos(tmp_path, train_config(args), args, baseline=False)
    assert report["phase"] == "done", report
    assert report["faults"] == dict.fromkeys(KINDS, 1), report
    assert report["incidents"] >= 1 and report["unhealed at the end"] == 0, report
    assert report["restarts"].get("coordinator") == 1, report
    assert report["missing losses"] == 0 and report["max |Δloss| vs reference"] <= 1e-5, report


def test_an_unknown_fault_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--sequence", "kill worker,meteor"])
    assert "unknown fault(s) ['meteor']" in capsys.readouterr().err
