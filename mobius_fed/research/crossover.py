"""Δ = Möbius − ordered against training length: tokens per parameter, a fit, a figure.

A multi-length sweep (``mobius-fed sweep --lengths …``) keeps one ordinary sweep per length
under ``OUT/n<steps>/``. This module joins them: for every (P, L) and length, Δ paired by seed
with its 95 % interval, placed at the run's tokens per parameter

    D/N = steps · P · batch · seq_len / N,

with N the model's parameters (P block groups plus one E/R replica), and a least-squares
line Δ = a + b·log10(D/N) per (P, L) through the per-seed Δs, the slope b with its
Student-t 95 % interval. The paper's Table 1 sits at 2.5B tokens / 124M parameters.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mobius_fed.plotting import pyplot, save_figure
from mobius_fed.research.report import PAPER_TABLE1, Row, ci_text, describe, rows
from mobius_fed.stats import mean, t975

PAPER_TOKENS = 2.5e9
PAPER_PARAMS = 124e6
PAPER_TOKENS_PER_PARAM = PAPER_TOKENS / PAPER_PARAMS


def length_dir(out: Path, steps: int) -> Path:
    """Where a multi-length sweep keeps the sweep of one training length."""
    return Path(out) / f"n{steps}"


def check_lengths(lengths: Sequence[int]) -> list[int]:
    """The lengths, sorted; a length < 1 or a repeated one raises ValueError naming it."""
    for n in lengths:
        if n < 1:
            raise ValueError(f"sweep: --lengths must be ≥ 1 step each, got {n}")
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"sweep: --lengths repeats a value: {' '.join(map(str, lengths))}")
    return sorted(lengths)


def tokens_per_param(train: dict[str, Any]) -> float:
    """Training tokens over all origins per model parameter for a cell's TrainConfig."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.model import count_parameters

    cfg = TrainConfig.model_validate(train)
    return cfg.steps * cfg.tokens_per_step / count_parameters(cfg.model())


@dataclass
class Point:
    """One (P, L) at one training length: the sweep's row and its tokens per parameter."""

    steps: int
    tokens_per_param: float
    row: Row


Table = dict[tuple[int, int], list[Point]]


@dataclass
class Fit:
    """Δ = a + b·log10(D/N) by least squares; ``half`` is b's 95 % half-width (df = n − 2)."""

    intercept: float
    slope: float
    half: float
    n: int

    def at(self, tokens_per_param: float) -> float:
        return self.intercept + self.slope * math.log10(tokens_per_param)


def fit_log(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    """Least-squares line of ``ys`` on log10(``xs``) with a Student-t interval on the slope.

    Needs two distinct x values; with two points the half-width is nan.
    """
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"fit: need ≥ 2 paired points, got {len(xs)} x and {len(ys)} y")
    if min(xs) <= 0:
        raise ValueError(f"fit: tokens per parameter must be > 0, got {min(xs)}")
    u = [math.log10(x) for x in xs]
    mu, my = mean(u), mean(ys)
    sxx = sum((x - mu) ** 2 for x in u)
    if sxx == 0:
        raise ValueError("fit: all points have the same tokens per parameter")
    slope = sum((x - mu) * (y - my) for x, y in zip(u, ys, strict=True)) / sxx
    intercept = my - slope * mu
    n = len(u)
    if n < 3:
        return Fit(intercept, slope, math.nan, n)
    rss = sum((y - intercept - slope * x) ** 2 for x, y in zip(u, ys, strict=True))
    return Fit(intercept, slope, t975(n - 2) * math.sqrt(rss / (n - 2) / sxx), n)


def points(by_length: Mapping[int, Sequence[dict[str, Any]]]) -> Table:
    """Per (P, L): one Point per training length (shortest first), from each length's cells."""
    out: Table = {}
    for steps in sorted(by_length):
        results = by_length[steps]
        if not results:
            continue
        for r in results:
            if r["train"]["steps"] != steps:
                raise ValueError(
                    f"crossover: cell {r.get('name', '?')} trained {r['train']['steps']} steps "
                    f"but sits with the {steps}-step cells"
                )
        d_n = tokens_per_param(results[0]["train"])
        for row in rows(results):
            if row.deltas:
                out.setdefault((row.P, row.L), []).append(Point(steps, d_n, row))
    return dict(sorted(out.items()))


def fit_points(pts: Sequence[Point]) -> Fit | None:
    """The fit through every per-seed Δ of a (P, L); None with fewer than two lengths."""
    if len({p.steps for p in pts}) < 2:
        return None
    xs = [p.tokens_per_param for p in pts for _ in p.row.deltas]
    return fit_log(xs, [d for p in pts for d in p.row.deltas])


# ------------------------------------------------------------------------------- report
def _loss(values: dict[int, float]) -> str:
    return f"{mean(list(values.values())):.4f}" if values else "—"


def points_table(table: Table) -> str:
    """Δ per (P, L) and length, with the paper's Table 1 rows at their tokens per parameter."""
    lines = [
        "| P | L | steps | tokens/param | ordered loss (mean) | Möbius loss (mean) "
        "| Δ = Möbius − ordered [95 % CI] | seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (P, L), pts in table.items():
        for p in pts:
            lines.append(
                f"| {P} | {L} | {p.steps} | {p.tokens_per_param:.2f} | {_loss(p.row.ordered)} "
                f"| {_loss(p.row.cyclic)} | {ci_text(*p.row.delta_ci)} | {len(p.row.deltas)} |"
            )
    for L, d in PAPER_TABLE1.items():
        lines.append(
            f"| 4 | {L} | paper (2.5B tokens, 124M) | {PAPER_TOKENS_PER_PARAM:.1f} | — | — "
            f"| {d:+.4f} (one seed) | 1 |"
        )
    return "\n".join(lines) + "\n"


def trend(fit: Fit, last: Point) -> str:
    """Plain words for a slope and the longest length's Δ."""
    if math.isnan(fit.half):
        slope = "slope without an interval (two points)"
    elif fit.slope + fit.half < 0:
        slope = "Δ falls with tokens (slope < 0 at 95 %)"
    elif fit.slope - fit.half > 0:
        slope = "Δ rises with tokens (slope > 0 at 95 %)"
    else:
        slope = "no trend resolved (slope interval spans 0)"
    m, half = last.row.delta_ci
    if math.isnan(half):
        where = f"Δ = {m:+.4f} at the longest length (no interval)"
    elif m + half < 0:
        where = "Δ < 0 at the longest length (95 %)"
    elif m - half > 0:
        where = "Δ > 0 at the longest length (95 %)"
    else:
        where = "Δ at the longest length is not distinguished from 0"
    return f"{slope}; {where}"


def fits_table(table: Table) -> str:
    """Per (P, L): the slope per decade of tokens/param with its 95 % interval, and a verdict."""
    lines = [
        "| P | L | slope of Δ per decade of tokens/param [95 % CI] | points | fit extrapolated "
        f"to {PAPER_TOKENS_PER_PARAM:.0f} tokens/param | reading |",
        "|---|---|---|---|---|---|",
    ]
    for (P, L), pts in table.items():
        fit = fit_points(pts)
        if fit is None:
            lines.append(f"| {P} | {L} | — (one length) | {len(pts)} | — | — |")
            continue
        lines.append(
            f"| {P} | {L} | {ci_text(fit.slope, fit.half)} | {fit.n} "
            f"| {fit.at(PAPER_TOKENS_PER_PARAM):+.4f} | {trend(fit, pts[-1])} |"
        )
    return "\n".join(lines) + "\n"


def plot_crossover(table: Table, path: Path, title: str) -> Path | None:
    """Δ against tokens/param (log x), one line per (P, L) with 95 % bars and its fit dashed;
    the paper's Table 1 points at 2.5B / 124M."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    several_p = len({P for P, _ in table}) > 1
    for (P, L), pts in table.items():
        xs = [p.tokens_per_param for p in pts]
        ms = [p.row.delta_ci[0] for p in pts]
        errs = [0.0 if math.isnan(p.row.delta_ci[1]) else p.row.delta_ci[1] for p in pts]
        label = f"ours, P={P}, L={L}" if several_p else f"ours, L={L}"
        line = ax.errorbar(xs, ms, yerr=errs, marker="o", capsize=3, label=label)
        fit = fit_points(pts)
        if fit is not None:  # dotted: the fit, carried on to the paper's tokens per parameter
            ends = [min(xs), max(max(xs), PAPER_TOKENS_PER_PARAM)]
            ax.plot(ends, [fit.at(x) for x in ends], ls=":", color=line[0].get_color(), lw=1)
    ds = list(PAPER_TABLE1.values())
    ax.plot(
        [PAPER_TOKENS_PER_PARAM] * len(ds),
        ds,
        "k^",
        alpha=0.7,
        ls="none",
        label="paper Table 1 (124M, P=4, one seed)",
    )
    for L, d in PAPER_TABLE1.items():
        dy = {6: 4, 10: -8, 15: -16}.get(L, 0)  # the three L ≥ 6 points nearly coincide
        ax.annotate(
            f"L={L}",
            (PAPER_TOKENS_PER_PARAM, d),
            xytext=(6, dy),
            textcoords="offset points",
            fontsize=7,
        )
    ax.set_xscale("log")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("training tokens per parameter (all origins)")
    ax.set_ylabel("Δ = Möbius − ordered (validation loss)")
    ax.set_title(textwrap.fill(title, 120), fontsize=7)
    return save_figure(fig, path, ax)


def write_crossover(
    by_length: Mapping[int, Sequence[dict[str, Any]]], out: Path, *, command: str = ""
) -> Path:
    """``out/crossover.md`` (points, fits, the paper's rows) and ``out/crossover.png``."""
    out = Path(out)
    table = points(by_length)
    if not table:
        raise ValueError(f"crossover: no (P, L) with both orders finished under {out}")
    some = next(r for rs in by_length.values() for r in rs)
    header = describe(some["train"], coupled=some.get("coupled_batches", False)).replace(
        f"{some['train']['steps']} steps", "/".join(map(str, sorted(by_length))) + " steps", 1
    )
    png = plot_crossover(table, out / "crossover.png", header)
    lines = [
        "# Sweep over training length: Δ = Möbius − ordered against tokens per parameter",
        "",
        f"Runs: {header}. Δ is paired by seed, with Student's t 95 % intervals; tokens per "
        "parameter count every origin's training tokens over the model's parameters (P groups "
        "plus one E/R replica). The fit is Δ = a + b·log10(tokens/param) through the per-seed Δs.",
        "",
    ]
    if command:
        lines += ["Command:", "", "```bash", command, "```", ""]
    lines += [points_table(table), "", fits_table(table)]
    if png:
        lines += ["", f"![Δ against tokens per parameter]({png.name})"]
    path = out / "crossover.md"
    path.write_text("\n".join(lines) + "\n")
    return path
