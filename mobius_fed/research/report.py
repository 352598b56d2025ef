"""Sweep results as a table (mean ± std over seeds, Δ with a 95 % interval) and a figure."""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mobius_fed.plotting import pyplot, save_figure
from mobius_fed.stats import ci95, mean, std

# The paper's Table 1 (124M, 2.5B FineWeb tokens, P = 4, one seed): Δ = Möbius − ordered.
PAPER_TABLE1: dict[int, float] = {1: 0.1697, 2: 0.0557, 6: -0.0084, 10: -0.0059, 15: -0.0083}


@dataclass
class Row:
    """One (P, L) of a sweep: final losses per seed for each order, paired Δ per seed."""

    P: int
    L: int
    ordered: dict[int, float]
    cyclic: dict[int, float]

    @property
    def deltas(self) -> list[float]:
        return [self.cyclic[s] - self.ordered[s] for s in sorted(self.ordered.keys() & self.cyclic)]

    @property
    def delta_ci(self) -> tuple[float, float]:
        d = self.deltas
        return ci95(d) if d else (math.nan, math.nan)


def rows(results: Sequence[dict[str, Any]]) -> list[Row]:
    """Group finished cells by (P, L); each order keeps its final Eq. 8 loss per seed."""
    table: dict[tuple[int, int], Row] = {}
    for r in results:
        t = r["train"]
        key = (t["workers"], t["loops"])
        row = table.setdefault(key, Row(*key, ordered={}, cyclic={}))
        getattr(row, t["order"])[t["seed"]] = r["final"]
    return [table[k] for k in sorted(table)]


def _mean_std(values: dict[int, float]) -> str:
    xs = list(values.values())
    if not xs:
        return "—"
    return f"{mean(xs):.4f} ± {std(xs):.4f}" if len(xs) > 1 else f"{xs[0]:.4f}"


def ci_text(m: float, half: float) -> str:
    """``m`` and its 95 % interval [m − half, m + half] (none when ``half`` is nan)."""
    return f"{m:+.4f}" if math.isnan(half) else f"{m:+.4f} [{m - half:+.4f}, {m + half:+.4f}]"


def markdown_table(table: Sequence[Row]) -> str:
    """P, L, K, ordered and Möbius loss (mean ± std), Δ with its 95 % interval, paper's Δ."""
    lines = [
        "| P | L | K | ordered-loop loss | Möbius loss | Δ = Möbius − ordered [95 % CI] "
        "| seeds | paper Δ (P=4, 124M) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        paper = PAPER_TABLE1.get(r.L) if r.P == 4 else None
        delta = ci_text(*r.delta_ci) if r.deltas else "—"
        lines.append(
            f"| {r.P} | {r.L} | {r.P * r.L} | {_mean_std(r.ordered)} | {_mean_std(r.cyclic)} "
            f"| {delta} | {len(r.deltas)} | {'—' if paper is None else f'{paper:+.4f}'} |"
        )
    return "\n".join(lines) + "\n"


def paper_table() -> str:
    lines = ["| L | paper Δ (124M, 2.5B tokens, P=4, one seed) |", "|---|---|"]
    lines += [f"| {L} | {d:+.4f} |" for L, d in PAPER_TABLE1.items()]
    return "\n".join(lines) + "\n"


def describe(train: dict[str, Any], *, coupled: bool = False) -> str:
    """One line naming what the runs share (preset, steps, batch, optimizer, knobs…)."""
    from mobius_fed.config import TrainConfig

    seq = TrainConfig.model_validate(train).model().seq_len
    layers = f" with {train['n_layer']} layers" if train.get("n_layer") else ""
    parts = [
        f"preset {train['preset']}{layers}",
        f"{train['steps']} steps",
        f"batch {train['batch_size']}×{seq} tokens per origin",
        f"{train['optimizer']} (Muon lr {train['lr_muon']}, adjust {train['muon_adjust_lr']}; "
        f"AdamW lr {train['lr_adam']})",
        f"sync every {train['sync_every']}",
        f"encoding {train['encoding']}",
    ]
    knobs = {k: v for k, v in (train.get("knobs") or {}).items() if v not in (None, False, 0)}
    if knobs:
        parts.append("knobs " + ", ".join(f"{k}={v}" for k, v in sorted(knobs.items())))
    if coupled:
        parts.append("coupled batches (all sites share offsets)")
    return "; ".join(parts)


def plot_delta(table: Sequence[Row], path: Path, title: str) -> Path | None:
    """Δ against L, one line per P with 95 % error bars, the paper's P = 4 points beside."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_p: dict[int, list[Row]] = defaultdict(list)
    for r in table:
        if r.deltas:
            by_p[r.P].append(r)
    for P, rs in sorted(by_p.items()):
        Ls = [r.L for r in rs]
        ms = [r.delta_ci[0] for r in rs]
        errs = [0.0 if math.isnan(r.delta_ci[1]) else r.delta_ci[1] for r in rs]
        ax.errorbar(Ls, ms, yerr=errs, marker="o", capsize=3, label=f"ours, P={P}")
    ax.plot(
        list(PAPER_TABLE1),
        list(PAPER_TABLE1.values()),
        "k^--",
        alpha=0.6,
        label="paper Table 1 (124M, P=4)",
    )
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("L (passes)")
    ax.set_ylabel("Δ = Möbius − ordered (validation loss)")
    ax.set_title(textwrap.fill(title, 120), fontsize=7)
    return save_figure(fig, path, ax)


def write_report(results: Sequence[dict[str, Any]], out: Path, *, command: str = "") -> Path:
    """``out/table.md``, ``out/delta.png`` and ``out/report.md``; returns the report's path."""
    out = Path(out)
    table = rows(results)
    header = describe(results[0]["train"], coupled=results[0].get("coupled_batches", False))
    (out / "table.md").write_text(markdown_table(table))
    png = plot_delta(table, out / "delta.png", header)
    lines = [
        "# Sweep: ordered-loop vs Möbius",
        "",
        f"Runs: {header}. Loss: final validation loss (paper Eq. 8). Δ is paired by seed "
        "(same initialisation and batches for both orders); the interval is Student's t 95 %.",
        "",
    ]
    if command:
        lines += ["Command:", "", "```bash", command, "```", ""]
    lines += [markdown_table(table), "", "The paper's Table 1:", "", paper_table()]
    if png:
        lines += ["", f"![Δ against L]({png.name})"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
