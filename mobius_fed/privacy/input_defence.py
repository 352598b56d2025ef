"""The input defence measured: first-hop token recovery and the Eq. 8 price, per variant.

Each variant of ``privacy.home_input`` (and "none") is trained on the reference engine by
:class:`mobius_fed.privacy.leakage.LeakageAudit` with the first remote hop of the victim's
stream observed, for every seed; the input attacks run on what that hop carries at step 0
and on the held-out text after training. Every site's layer is keyed by its own secret
(``noise_key_dir``), which no attacker holds. The price is Eq. 8 validation loss minus
that of "none" on the same seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.privacy.leakage import LeakageAudit
from mobius_fed.privacy.pareto import read_runs, select_named, write_runs

VARIANTS: dict[str, dict] = {
    "none": {},
    "rotation": {"home_input": "rotation"},
    "rotation frozen": {"home_input": "rotation", "home_input_trained": False},
    "mlp": {"home_input": "mlp"},
    "mlp frozen": {"home_input": "mlp", "home_input_trained": False},
    "block": {"home_input": "block"},
    "block frozen": {"home_input": "block", "home_input_trained": False},
    "noise σ=1": {"input_noise": 1.0},
    "block + noise σ=1": {"home_input": "block", "input_noise": 1.0},
    "block + noise σ=2": {"home_input": "block", "input_noise": 2.0},
    # clipped to C = 4 per position (the Gaussian mechanism the accountant covers)
    "clipped noise σ=0.25": {"input_noise": 0.25, "input_clip": 4.0},
    "block + clipped σ=1": {"home_input": "block", "input_noise": 1.0, "input_clip": 4.0},
    "block + clipped σ=4": {"home_input": "block", "input_noise": 4.0, "input_clip": 4.0},
    "clipped noise σ=4": {"input_noise": 4.0, "input_clip": 4.0},
    "block + clipped σ=16": {"home_input": "block", "input_noise": 16.0, "input_clip": 4.0},
}
KNOWN = (0.01, 0.05, 0.25)  # 25 %: enough pairs to fit a d×d map on cpu-tiny


@dataclass
class DefenceRun:
    """One (variant, seed): Eq. 8 and first-hop recovery {"stage: attack": [exact, top5]}."""

    variant: str
    seed: int
    eval_loss: float
    slot: int
    attacker: int
    recovery: dict[str, list[float]] = field(default_factory=dict)


def select_variants(names: str | None) -> dict[str, dict]:
    """The variants named (comma-separated), or all; an unknown name is refused."""
    return select_named(VARIANTS, names, "variant")


def measure(
    cfg: TrainConfig,
    sites: Sequence[SiteData],
    variant: str,
    *,
    inverter_steps: int = 400,
    log: Callable[[str], None] | None = None,
) -> DefenceRun:
    """One audited run of ``variant`` on ``cfg`` (which must name the site keys)."""
    if cfg.privacy.noise_key_dir is None:
        raise ValueError("measure the input layer with site keys (privacy.noise_key_dir)")
    pc = cfg.privacy.model_copy(update=select_variants(variant)[variant])
    run_cfg = cfg.model_copy(update={"privacy": pc})
    audit = LeakageAudit(
        run_cfg, sites, inverter_steps=inverter_steps, known=KNOWN, first_hop_only=True, log=log
    )
    report = audit.run()
    out = DefenceRun(variant, cfg.seed, report.eval_loss, *audit.hops[0])
    for row in report.hops:
        out.recovery[f"{row.stage}: {row.attack}"] = [row.exact, row.top5]
    return out


def price_table(runs: Sequence[DefenceRun]) -> str:
    """Markdown: per variant, Eq. 8 and its price (mean over seeds, paired with "none"), and
    each attack's first-hop exact recovery (mean over seeds; max in brackets)."""
    variants = list(dict.fromkeys(r.variant for r in runs))
    attacks = list(dict.fromkeys(k for r in runs for k in r.recovery))
    base = {r.seed: r.eval_loss for r in runs if r.variant == "none"}
    head = "| variant | seeds | Eq. 8 | Δ Eq. 8 | " + " | ".join(attacks) + " |"
    lines = [head, "|---" * (4 + len(attacks)) + "|"]
    for v in variants:
        sel = [r for r in runs if r.variant == v]
        loss = sum(r.eval_loss for r in sel) / len(sel)
        paired = [r.eval_loss - base[r.seed] for r in sel if r.seed in base]
        delta = f"{sum(paired) / len(paired):+.3f}" if paired else "—"
        cells = []
        for a in attacks:
            xs = [r.recovery[a][0] for r in sel if a in r.recovery]
            cells.append(f"{100 * sum(xs) / len(xs):.1f} ({100 * max(xs):.1f})" if xs else "—")
        seeds = ",".join(str(r.seed) for r in sel)
        lines.append(f"| {v} | {seeds} | {loss:.4f} | {delta} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_outputs(runs: Sequence[DefenceRun], out: Path) -> list[Path]:
    """input_defence.json (every run) and input_defence.md (the table) in ``out``."""
    return write_runs(runs, out, "input_defence", price_table(runs))


def load_runs(paths: Sequence[Path]) -> list[DefenceRun]:
    """The runs of earlier input_defence.json files, in order."""
    return read_runs(DefenceRun, paths)
