"""``audit --sweep``: attack success against Eq. 8 validation loss, per defence strength."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.plotting import pyplot, save_figure
from mobius_fed.privacy.audit import DERIVED, Audit, AuditReport, InputAttack, TargetAttack

# (label, order, privacy overrides); noise_key_dir is filled in by the caller. In ordered
# order origin 0's first hop is F_0's output (as in cyclic order), so the ordered rows
# attack origin 1, whose embedding output itself is sent to worker 0.
DEFAULT_GRID: list[tuple[str, str, dict[str, Any]]] = [
    ("none", "cyclic", {}),
    ("label σ=0.1", "cyclic", {"label_noise": 0.1}),
    ("label σ=0.25", "cyclic", {"label_noise": 0.25}),
    ("label σ=0.5", "cyclic", {"label_noise": 0.5}),
    ("label σ=1", "cyclic", {"label_noise": 1.0}),
    ("label σ=2", "cyclic", {"label_noise": 2.0}),
    ("label σ=4", "cyclic", {"label_noise": 4.0}),
    ("input σ=0.5", "cyclic", {"input_noise": 0.5}),
    ("input σ=1", "cyclic", {"input_noise": 1.0}),
    ("input σ=2", "cyclic", {"input_noise": 2.0}),
    ("input σ=4", "cyclic", {"input_noise": 4.0}),
    ("label σ=1 + input σ=1", "cyclic", {"label_noise": 1.0, "input_noise": 1.0}),
    ("none (ordered)", "ordered", {}),
    ("input σ=1 (ordered)", "ordered", {"input_noise": 1.0}),
    ("nopeek α=0.1", "cyclic", {"decorrelation": 0.1}),
    ("nopeek α=0.3", "cyclic", {"decorrelation": 0.3}),
    ("nopeek α=1", "cyclic", {"decorrelation": 1.0}),
    ("nopeek α=3", "cyclic", {"decorrelation": 3.0}),
    ("nopeek α=1 (ordered)", "ordered", {"decorrelation": 1.0}),
    ("home mlp", "cyclic", {"home_layer": "mlp"}),
    ("home mlp frozen", "cyclic", {"home_layer": "mlp", "home_layer_trained": False}),
    ("home block", "cyclic", {"home_layer": "block"}),
    ("home mlp + label σ=0.5", "cyclic", {"home_layer": "mlp", "label_noise": 0.5}),
    ("home mlp (ordered)", "ordered", {"home_layer": "mlp"}),
]


def select(labels: str | None) -> list[tuple[str, str, dict[str, Any]]]:
    """The grid rows named in a comma-separated list (all rows for None)."""
    if not labels:
        return list(DEFAULT_GRID)
    wanted = [w.strip() for w in labels.split(",") if w.strip()]
    known = {row[0]: row for row in DEFAULT_GRID}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"unknown sweep rows {unknown} (known: {', '.join(known)})")
    return [known[w] for w in wanted]


def sweep(
    base: TrainConfig,
    sites: Sequence[SiteData],
    *,
    grid: Sequence[tuple[str, str, dict[str, Any]]] = DEFAULT_GRID,
    noise_key_dir: str | None = None,
    inverter_steps: int = 400,
    log: Callable[[str], None] | None = None,
) -> list[tuple[str, AuditReport]]:
    """Run one audit per grid entry on ``base`` (same seed and data for every entry)."""
    log = log or (lambda _msg: None)
    rows = []
    for label, order, privacy in grid:
        pc = {**base.privacy.model_dump(), **privacy, "noise_key_dir": noise_key_dir}
        cfg = TrainConfig.model_validate({**base.model_dump(), "order": order, "privacy": pc})
        victim = 1 if order == "ordered" and cfg.P > 1 else 0
        report = Audit(cfg, sites, victim=victim, inverter_steps=inverter_steps).run()
        log(f"{label}: {one_line(report)}")
        rows.append((label, report))
    return rows


def one_line(r: AuditReport) -> str:
    inv = r.inversion
    text = (
        f"Eq.8 {r.eval_loss:.4f}; targets {100 * r.target.best_accuracy:.1f}% "
        f"(model alone {100 * r.target.model_accuracy:.1f}%, chance {100 * r.chance:.2f}%)"
    )
    if r.target.home_layer != "off":
        text += f" [{attack_split(r.target)}]"
    if inv is not None:
        text += f"; first hop exact {100 * inv.exact:.1f}% top-5 {100 * inv.top5:.1f}%"
    if r.epsilon is not None:
        text += f"; ε={r.epsilon:.3g}"
    return text


def markdown_table(rows: Sequence[tuple[str, AuditReport]]) -> str:
    """The trade-off table: cost in Eq. 8 loss against the no-defence row of the same order."""
    base = {r.order: r.eval_loss for label, r in rows if not _defended(r)}
    lines = [
        "| defence | order | Eq. 8 val loss | Δ vs none | target recovery | attacks: R on h / "
        "linear map / stand-in per token / stand-in matching / clusters | model alone | chance "
        "| first-hop exact | first-hop top-5 | most frequent token | ε, q=1 | ε, q=batch/site |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows:
        inv = r.inversion
        delta = r.eval_loss - base[r.order] if r.order in base else float("nan")
        eps = "—" if r.epsilon is None else f"{r.epsilon:.3g}"
        eps_q = "—" if r.epsilon_sampled is None else f"{r.epsilon_sampled:.3g}"
        lines.append(
            f"| {label} | {r.order} | {r.eval_loss:.4f} | {delta:+.4f} | "
            f"{100 * r.target.best_accuracy:.1f} % | "
            f"{attack_split(r.target) if r.target.home_layer != 'off' else '—'} | "
            f"{100 * r.target.model_accuracy:.1f} % | "
            f"{100 * r.chance:.2f} % | "
            + (
                f"{100 * inv.exact:.1f} % | {100 * inv.top5:.1f} % | "
                f"{100 * inv.frequency_baseline:.1f} % | "
                if inv
                else "— | — | — | "
            )
            + f"{eps} | {eps_q} |"
        )
    return "\n".join(lines) + "\n"


def attack_split(t: TargetAttack) -> str:
    """The home-layer attacks side by side: R on h / linear map / stand-in (per token) /
    stand-in (matching) / clusters."""

    def pct(a: float | None) -> str:
        return "—" if a is None else f"{100 * a:.1f} %"

    return (
        f"{pct(t.accuracy)} / {pct(t.linear_accuracy)} / {pct(t.surrogate_accuracy)} / "
        f"{pct(t.matching_accuracy)} / {pct(t.cluster_accuracy)} "
        f"(purity {pct(t.cluster_purity)}, "
        f"shuffled {pct(t.cluster_purity_chance)})"
    )


def _defended(r: AuditReport) -> bool:
    pc = r.privacy
    return (
        pc["label_noise"] > 0
        or pc["input_noise"] > 0
        or pc.get("decorrelation", 0) > 0
        or pc.get("home_layer", "off") != "off"
    )


def write_outputs(rows: Sequence[tuple[str, AuditReport]], out: Path) -> list[Path]:
    """sweep.md, sweep.json and (with matplotlib, the ``plot`` extra) sweep.png."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sweep.md", out / "sweep.json"]
    paths[0].write_text(markdown_table(rows))
    paths[1].write_text(
        json.dumps([{"label": label, **r.as_dict()} for label, r in rows], indent=2) + "\n"
    )
    png = plot(rows, out / "sweep.png")
    if png is not None:
        paths.append(png)
    return paths


def plot(rows: Sequence[tuple[str, AuditReport]], path: Path) -> Path | None:
    """Two panels against Eq. 8 loss: target recovery (rows without input noise) and
    first-hop exact-token inversion (rows without label noise). None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    label_rows = [
        (k, r)
        for k, r in rows
        if r.privacy["input_noise"] == 0
        and r.privacy.get("decorrelation", 0) == 0
        and r.order == "cyclic"
    ]
    input_rows = [
        (k, r)
        for k, r in rows
        if r.privacy["label_noise"] == 0 and r.privacy.get("home_layer", "off") == "off"
    ]
    for k, r in label_rows:
        left.scatter([r.eval_loss], [100 * r.target.best_accuracy], color="tab:red")
        left.scatter([r.eval_loss], [100 * r.target.model_accuracy], color="grey", marker="x")
        left.annotate(k, (r.eval_loss, 100 * r.target.best_accuracy), fontsize=7)
    left.scatter([], [], color="tab:red", label="target recovery (last hop, best attack)")
    left.scatter([], [], color="grey", marker="x", label="the head alone (no gradient)")
    left.set_title("label defence and home layer (cyclic)")
    for k, r in input_rows:
        if r.inversion is None:
            continue
        marker = "s" if r.order == "cyclic" else "^"
        right.scatter([r.eval_loss], [100 * r.inversion.exact], color="tab:blue", marker=marker)
        right.annotate(k, (r.eval_loss, 100 * r.inversion.exact), fontsize=7)
    right.scatter([], [], color="tab:blue", marker="s", label="first-hop exact token, cyclic")
    right.scatter([], [], color="tab:blue", marker="^", label="first-hop exact token, ordered")
    right.set_title("input defences (noise, NoPeek)")
    for ax in (left, right):
        ax.set_xlabel("Eq. 8 validation loss")
        ax.set_ylabel("attack success (%)")
        ax.set_ylim(-2, 102)
    return save_figure(fig, path, left, right)


def report_from_dict(d: dict[str, Any]) -> AuditReport:
    """Rebuild an :class:`AuditReport` from a row of sweep.json."""
    known = {f.name for f in fields(AuditReport)} - {"target", "inversion"}
    target = {k: v for k, v in d["target"].items() if k not in DERIVED}
    inv = d["inversion"]
    return AuditReport(
        **{k: v for k, v in d.items() if k in known},
        target=TargetAttack(**target),
        inversion=InputAttack(**inv) if inv else None,
    )


def merge(paths: Sequence[Path], out: Path) -> list[Path]:
    """Join the rows of several sweep.json files (same base config), in the grid's order."""
    rows: dict[str, AuditReport] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            rows[row["label"]] = report_from_dict(row)
    order = [label for label, _, _ in DEFAULT_GRID]
    ranked = sorted(rows, key=lambda k: order.index(k) if k in order else len(order))
    return write_outputs([(k, rows[k]) for k in ranked], out)
