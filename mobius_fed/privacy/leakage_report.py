"""Results of the leakage audit (:mod:`mobius_fed.privacy.leakage`) and their tables."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class HopRow:
    """One input attack on the victim's stream at one hop."""

    stage: str  # "step 0" (the first training batch) or "trained" (held-out text at the end)
    slot: int  # forward slot: the hidden state after ``slot`` block groups
    attacker: int  # the worker that receives it
    attack: str
    exact: float
    top5: float
    tokens: int


@dataclass
class UpdateRow:
    """The E/R-update attack on one round of the victim site's update."""

    round: int  # 1-based: the barrier after step ``round - 1``
    rows: str  # "E (tied: inputs and targets)", "E (inputs)" or "R (targets)"
    score: str
    topk_precision: float
    precision: float
    recall: float
    base_rate: float
    bag: int


@dataclass
class LeakageReport:
    preset: str
    order: str
    optimizer: str
    tied: bool
    steps: int
    workers: int
    victim: int
    vocab: int
    eval_loss: float
    warmup_steps: int
    hops: list[HopRow] = field(default_factory=list)
    updates: list[UpdateRow] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def chance(self) -> tuple[float, float]:
        return 1 / self.vocab, min(1.0, 5 / self.vocab)


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def hop_table(report: LeakageReport) -> str:
    """Markdown: one line per (stage, attack), one column per hop, 'exact / top-5'."""
    slots = sorted({r.slot for r in report.hops})
    attackers = {r.slot: r.attacker for r in report.hops}
    head = "| stage | attack | " + " | ".join(f"slot {s} (worker {attackers[s]})" for s in slots)
    lines = [head + " |", "|---|---|" + "---|" * len(slots)]
    keys = dict.fromkeys((r.stage, r.attack) for r in report.hops)
    cell = {(r.stage, r.attack, r.slot): r for r in report.hops}
    for stage, attack in keys:
        parts = []
        for s in slots:
            r = cell.get((stage, attack, s))
            parts.append("—" if r is None else f"{_pct(r.exact)} / {_pct(r.top5)}")
        lines.append(f"| {stage} | {attack} | " + " | ".join(parts) + " |")
    exact, top5 = report.chance
    chance = f"{_pct(exact)} / {_pct(top5)}"
    lines.append("| | chance (1/V, 5/V) | " + " | ".join([chance] * len(slots)) + " |")
    return "\n".join(lines)


def update_table(report: LeakageReport) -> str:
    """Markdown: the E/R-update attack at round 1 and averaged over the rounds after warm-up."""
    lines = [
        "| rounds | rows | score | top-k precision (k = bag) | precision | recall | base rate |",
        "|---|---|---|---|---|---|---|",
    ]
    late = [r for r in report.updates if r.round > max(1, report.warmup_steps)]
    groups = [("round 1", [r for r in report.updates if r.round == 1])]
    if late:
        first, last = late[0].round, late[-1].round
        groups.append((f"rounds {first}–{last} (mean)", late))
    for label, rows in groups:
        for name, score in dict.fromkeys((r.rows, r.score) for r in rows):
            sel = [r for r in rows if (r.rows, r.score) == (name, score)]
            mean = [sum(getattr(r, f) for r in sel) / len(sel) for f in _FIELDS]
            cells = " | ".join(_pct(x) for x in mean)
            lines.append(f"| {label} | {name} | {score} | {cells} |")
    return "\n".join(lines)


_FIELDS = ("topk_precision", "precision", "recall", "base_rate")


def describe(report: LeakageReport) -> str:
    return "\n".join(
        [
            f"leakage audit: {report.preset}, {report.order} order, P = {report.workers}, "
            f"{report.steps} steps, optimizer {report.optimizer}, "
            f"{'tied' if report.tied else 'untied'} E/R, victim {report.victim}, "
            f"Eq. 8 validation loss {report.eval_loss:.4f}",
            "",
            "Inputs at every hop (exact / top-5 token recovery):",
            "",
            hop_table(report),
            "",
            "What the coordinator learns from the victim's E/R update (token presence):",
            "",
            update_table(report),
        ]
    )
