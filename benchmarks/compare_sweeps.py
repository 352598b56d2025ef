"""Δ = Möbius − ordered per L for several sweeps side by side (e.g. one variant each).

    python benchmarks/compare_sweeps.py base=runs/sweep-a coupled=runs/sweep-b …

Each argument is NAME=SWEEP_DIR (a ``mobius-fed sweep --out`` directory, or one length's
``OUT/n<steps>`` of a ``--lengths`` sweep). Prints one Markdown table: for every L, each
sweep's Δ with its 95 % interval (paired by seed) and the shift of Δ against the first
sweep. Only (P, L) cells finished in every sweep count.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from mobius_fed.research.report import PAPER_TABLE1, rows
from mobius_fed.research.sweep import load_results


def main(argv: list[str]) -> int:
    if not argv or any("=" not in a for a in argv):
        print(__doc__, file=sys.stderr)
        return 2
    named = [(a.split("=", 1)[0], Path(a.split("=", 1)[1])) for a in argv]
    tables = {}
    for name, d in named:
        results = load_results(d)
        if not results:
            lengths = sorted(p.name for p in d.glob("n*") if (p / "cells").is_dir())
            hint = f" (a --lengths sweep: name one of {', '.join(lengths)})" if lengths else ""
            print(f"error: no finished cells under {d / 'cells'}{hint}", file=sys.stderr)
            return 2
        tables[name] = {(r.P, r.L): r for r in rows(results) if r.deltas}
    keys = sorted(set.intersection(*(set(t) for t in tables.values())))
    names = [n for n, _ in named]
    print("| P | L | " + " | ".join(f"Δ {n} [95 % CI]" for n in names), end="")
    print(" | " + " | ".join(f"{n} − {names[0]}" for n in names[1:]) + " | paper Δ |")
    print("|---" * (2 + 2 * len(names)) + "|")
    for key in keys:
        cells = []
        for n in names:
            m, half = tables[n][key].delta_ci
            width = "" if math.isnan(half) else f" ± {half:.4f}"
            cells.append(f"{m:+.4f}{width} (n={len(tables[n][key].deltas)})")
        base = tables[names[0]][key].delta_ci[0]
        shifts = [f"{tables[n][key].delta_ci[0] - base:+.4f}" for n in names[1:]]
        paper = PAPER_TABLE1.get(key[1]) if key[0] == 4 else None
        print(
            f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " | " + " | ".join(shifts)
            + f" | {'—' if paper is None else f'{paper:+.4f}'} |"
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
