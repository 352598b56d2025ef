"""The three-way front's table: Δ Eq. 8 paired by seed with its 95 % interval, and the
worst margin over every attacked seed."""

from __future__ import annotations

import math

from mobius_fed.privacy.pareto import SettingRun, front, table


def _runs() -> list[SettingRun]:
    base = {0: 2.0, 1: 2.1, 2: 1.9}
    runs = [SettingRun("none", "cpu-small", s, v) for s, v in base.items()]
    deltas = {0: 0.10, 1: 0.20, 2: 0.30}
    runs += [SettingRun("codec", "cpu-small", s, base[s] + d) for s, d in deltas.items()]
    runs.append(SettingRun("codec", "cpu-tiny", 0, 3.0, {"early: map": 0.2}, 0.2))
    runs.append(SettingRun("codec", "cpu-tiny", 1, 3.0, {"trained: map": 0.4}, 0.2))
    runs.append(SettingRun("none", "cpu-tiny", 0, 2.9))
    return runs


def test_delta_is_paired_by_seed_with_a_student_t_interval() -> None:
    row = next(r for r in front(_runs()) if r["setting"] == "codec")
    mean, sd, n, half = row["delta"]["cpu-small"]
    assert n == 3 and math.isclose(mean, 0.2) and math.isclose(sd, 0.1)
    assert math.isclose(half, 4.303 * 0.1 / math.sqrt(3))
    assert math.isnan(row["delta"]["cpu-tiny"][3])  # one paired seed: no interval
    assert math.isclose(row["max_margin"], 0.4) and row["max_attack"] == "trained: map"


def test_table_prints_the_interval_and_a_single_seed_alone() -> None:
    line = next(x for x in table(_runs()).splitlines() if x.startswith("| codec "))
    assert "+0.200 [-0.048, +0.448] (3)" in line
    assert "+0.100 (1)" in line
    assert "+40.0" in line  # the worst margin over both attacked seeds, in points
