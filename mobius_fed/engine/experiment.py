"""The paper's comparison: ordered-loop vs Möbius (cyclic) at several depths L (Table 1)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine.reference import EvalResult, ReferenceEngine, StepResult
from mobius_fed.engine.trainer import train
from mobius_fed.plotting import pyplot, save_figure
from mobius_fed.schedule import Order
from mobius_fed.stats import ci95, mean, std


@dataclass
class StepHooks:
    """What training calls after each step and each evaluation of one run."""

    on_step: Callable[[StepResult], None]
    on_eval: Callable[[EvalResult], None]


ArmProgress = Callable[[TrainConfig], AbstractContextManager[StepHooks]]
"""Opens a display for one run (its config) and gives the hooks that update it."""


@dataclass
class Arm:
    loops: int
    order: Order
    curve: list[EvalResult]
    seed: int = 0

    @property
    def final(self) -> float:
        return self.curve[-1].loss


def run_experiment(
    base: TrainConfig,
    sites: Sequence[SiteData],
    loops: Sequence[int],
    orders: Sequence[Order],
    out_dir: Path,
    on_arm: Callable[[TrainConfig], None] | None = None,
    *,
    seeds: int = 1,
    progress: ArmProgress | None = None,
) -> list[Arm]:
    """Train one run per (L, order, seed) from the same data; return their eval curves.

    Seeds are ``base.seed, base.seed + 1, …``; both orders of a seed share initialisation
    and batches. ``progress`` opens a display per run (the CLI's bar of loss and step).
    """
    if seeds < 1:
        raise ValueError(f"seeds must be ≥ 1, got {seeds}")
    arms = []
    for L in loops:
        for k in range(seeds):
            for order in orders:
                seed = base.seed + k
                cfg = base.model_copy(update={"loops": L, "order": order, "seed": seed})
                cfg = TrainConfig.model_validate(cfg.model_dump())
                if on_arm:
                    on_arm(cfg)
                run_dir = out_dir / (f"L{L}-{order}" if seeds == 1 else f"L{L}-{order}-s{seed}")
                curve = _train_arm(cfg, sites, run_dir, progress)
                arms.append(Arm(L, order, curve, seed))
    return arms


def _train_arm(
    cfg: TrainConfig, sites: Sequence[SiteData], run_dir: Path, progress: ArmProgress | None
) -> list[EvalResult]:
    engine = ReferenceEngine(cfg, sites)
    if progress is None:
        return train(engine, run_dir, checkpoint_every=0)
    with progress(cfg) as hooks:
        return train(
            engine, run_dir, checkpoint_every=0, on_step=hooks.on_step, on_eval=hooks.on_eval
        )


def arm_name(cfg: TrainConfig) -> str:
    """One run of an experiment: ``L=2 Möbius seed 0``."""
    return f"L={cfg.loops} {_order_name(cfg.order)} seed {cfg.seed}"


def _order_name(order: str) -> str:
    return "Möbius" if order == "cyclic" else "ordered-loop"


def _finals(arms: Sequence[Arm], L: int, order: str) -> dict[int, float]:
    return {a.seed: a.final for a in arms if a.loops == L and a.order == order}


def _fmt(values: dict[int, float]) -> str:
    xs = list(values.values())
    if not xs:
        return "—"
    return f"{xs[0]:.4f}" if len(xs) == 1 else f"{mean(xs):.4f} ± {std(xs):.4f}"


def markdown_table(arms: Sequence[Arm], P: int) -> str:
    """Rows shaped like the paper's Table 1: L, ordered-loop loss, K, Möbius loss, Δ.

    With several seeds a loss is mean ± std and Δ (paired by seed) carries its Student-t
    95 % interval.
    """
    multi = len({a.seed for a in arms}) > 1
    head = "| L | ordered-loop loss | K | Möbius loss | Δ |"
    if multi:
        head = "| L | ordered-loop loss | K | Möbius loss | Δ [95 % CI] | seeds |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for L in sorted({a.loops for a in arms}):
        ordered, cyclic = _finals(arms, L, "ordered"), _finals(arms, L, "cyclic")
        deltas = [cyclic[s] - ordered[s] for s in sorted(ordered.keys() & cyclic)]
        if not deltas:
            delta = "—"
        elif len(deltas) == 1:
            delta = f"{deltas[0]:+.4f}"
        else:
            m, half = ci95(deltas)
            delta = f"{m:+.4f} [{m - half:+.4f}, {m + half:+.4f}]"
        row = f"| {L} | {_fmt(ordered)} | {L * P} | {_fmt(cyclic)} | {delta} |"
        lines.append(row + (f" {len(deltas)} |" if multi else ""))
    return "\n".join(lines) + "\n"


def title_of(cfg: TrainConfig) -> str:
    """The configuration every arm shares, for a figure's title."""
    mc = cfg.model()
    parts = [
        f"{cfg.preset} ({mc.n_layer} layers, d={mc.d_model}), P={cfg.P}",
        f"{cfg.steps} steps × {cfg.batch_size}×{mc.seq_len} tokens/origin",
        f"{cfg.optimizer} (adjust {cfg.muon_adjust_lr}), sync every {cfg.sync_every}",
    ]
    if knobs := cfg.knobs.active():
        parts.append("knobs: " + ", ".join(f"{k}={v}" for k, v in knobs.items()))
    return "; ".join(parts)


def plot_curves(arms: Sequence[Arm], path: Path, cfg: TrainConfig | None = None) -> Path | None:
    """PNG of validation loss (Eq. 8) against step; None when matplotlib is not installed.

    One colour per L, solid = Möbius, dashed = ordered-loop; with several seeds the line is
    the mean and the band ± one standard deviation.
    """
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, L in enumerate(sorted({a.loops for a in arms})):
        for order in ("ordered", "cyclic"):
            runs = [a for a in arms if a.loops == L and a.order == order]
            if not runs:
                continue
            steps = [e.step for e in runs[0].curve]
            per_step = list(zip(*[[e.loss for e in a.curve] for a in runs]))
            m = [mean(v) for v in per_step]
            colour = colours[j % len(colours)]
            style = "-" if order == "cyclic" else "--"
            seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
            ax.plot(steps, m, style, color=colour, label=f"L={L} {_order_name(order)}{seeds}")
            if len(runs) > 1:
                s = [std(v) for v in per_step]
                lo = [a - b for a, b in zip(m, s)]
                hi = [a + b for a, b in zip(m, s)]
                ax.fill_between(steps, lo, hi, color=colour, alpha=0.15, lw=0)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (Eq. 8)")
    if cfg is not None:
        ax.set_title(title_of(cfg), fontsize=7)
    return save_figure(fig, path, ax)
