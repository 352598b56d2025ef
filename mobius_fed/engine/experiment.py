"""The paper's comparison: ordered-loop vs Möbius (cyclic) at several depths L (Table 1)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine.reference import EvalResult, ReferenceEngine
from mobius_fed.engine.trainer import train
from mobius_fed.schedule import Order


@dataclass
class Arm:
    loops: int
    order: Order
    curve: list[EvalResult]

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
) -> list[Arm]:
    """Train one run per (L, order) from the same seed and data; return their eval curves."""
    arms = []
    for L in loops:
        for order in orders:
            cfg = base.model_copy(update={"loops": L, "order": order})
            cfg = TrainConfig.model_validate(cfg.model_dump())
            if on_arm:
                on_arm(cfg)
            curve = train(
                ReferenceEngine(cfg, sites), out_dir / f"L{L}-{order}", checkpoint_every=0
            )
            arms.append(Arm(L, order, curve))
    return arms


def markdown_table(arms: Sequence[Arm], P: int) -> str:
    """Rows shaped like the paper's Table 1: L, ordered-loop loss, K, Möbius loss, Δ."""
    by = {(a.loops, a.order): a.final for a in arms}
    lines = [
        "| L | ordered-loop loss | K | Möbius loss | Δ |",
        "|---|---|---|---|---|",
    ]
    for L in sorted({a.loops for a in arms}):
        ordered, cyclic = by.get((L, "ordered")), by.get((L, "cyclic"))
        delta = f"{cyclic - ordered:+.4f}" if ordered is not None and cyclic is not None else "—"
        fmt = lambda v: "—" if v is None else f"{v:.4f}"  # noqa: E731
        lines.append(f"| {L} | {fmt(ordered)} | {L * P} | {fmt(cyclic)} | {delta} |")
    return "\n".join(lines) + "\n"


def plot_curves(arms: Sequence[Arm], path: Path) -> Path | None:
    """PNG of validation loss (Eq. 8) against step; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in arms:
        label = f"L={arm.loops} {'Möbius' if arm.order == 'cyclic' else 'ordered-loop'}"
        style = "-" if arm.order == "cyclic" else "--"
        ax.plot([e.step for e in arm.curve], [e.loss for e in arm.curve], style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (Eq. 8)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
