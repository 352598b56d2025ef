"""Input defences against the patient neighbour: cost (Δ Eq. 8) against worst-victim recovery.

Each setting of :data:`SETTINGS` is a set of ``privacy`` fields. A run is either *attacked*
(:class:`mobius_fed.privacy.patient.PatientAudit`: every attack on every site's first remote
hop, early and trained) or *priced* (training only: Eq. 8). The table pairs each setting's
Eq. 8 with "none" on the same preset and seed (docs/privacy.md §4i).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from mobius_fed.plotting import pyplot, save_figure
from mobius_fed.stats import ci95

R = TypeVar("R")

TODAY = ("none", "block", "mlp", "clipped σ=4", "block + noise σ=1", "mlp + noise σ=1")
CODEC = "fwd=int8,bwd=int4,rounding=stochastic"
# A setting is a set of ``privacy`` fields, plus optionally the wire it runs on: ``wire`` (a
# --wire value) and ``subspace`` (compression.py's rank=…,mode=…; rank=d/N is d_model / N).
SETTINGS: dict[str, dict] = {
    "none": {},
    "block": {"home_input": "block"},
    "mlp": {"home_input": "mlp"},
    "clipped σ=4": {"input_noise": 4.0, "input_clip": 4.0},
    "block + noise σ=1": {"home_input": "block", "input_noise": 1.0},
    # new settings (research): noise with a secret per-site transform, a larger private
    # part, or an adversarial (NoPeek) loss
    "noise σ=1": {"input_noise": 1.0},
    "block + noise σ=0.5": {"home_input": "block", "input_noise": 0.5},
    "rotation + noise σ=0.5": {"home_input": "rotation", "input_noise": 0.5},
    "clipped σ=2": {"input_noise": 2.0, "input_clip": 4.0},
    "mlp + noise σ=1": {"home_input": "mlp", "input_noise": 1.0},
    "noise σ=2": {"input_noise": 2.0},
    "rotation + noise σ=1": {"home_input": "rotation", "input_noise": 1.0},
    "rotation + noise σ=2": {"home_input": "rotation", "input_noise": 2.0},
    "mlp + noise σ=2": {"home_input": "mlp", "input_noise": 2.0},
    "block + noise σ=2": {"home_input": "block", "input_noise": 2.0},
    "noise σ=2 + NoPeek 1": {"input_noise": 2.0, "decorrelation": 1.0},
    "block + clipped σ=2": {"home_input": "block", "input_noise": 2.0, "input_clip": 4.0},
    # the wire: what each mode sends (docs/privacy.md §4j)
    "codec": {"wire": CODEC},
    "tokens d/8 + codec": {"subspace": "rank=d/8,mode=tokens,writes=full", "wire": CODEC},
    "home d/4 + codec": {"subspace": "rank=d/4,mode=home,writes=full", "wire": CODEC},
    "home d/2 + codec": {"subspace": "rank=d/2,mode=home,writes=full", "wire": CODEC},
    # the learned bottleneck (issue 55; §4k): attacked on its code and the receiver's dec(c)
    "bottleneck-home d/4 + codec": {
        "subspace": "rank=d/4,mode=bottleneck-home,writes=full",
        "wire": CODEC,
    },
    "bottleneck-home d/8 + codec": {
        "subspace": "rank=d/8,mode=bottleneck-home,writes=full",
        "wire": CODEC,
    },
    "bottleneck d/4 + codec": {"subspace": "rank=d/4,mode=bottleneck,writes=full", "wire": CODEC},
    "codec + mlp + noise σ=1": {"wire": CODEC, "home_input": "mlp", "input_noise": 1.0},
    "codec + mlp + noise σ=2": {"wire": CODEC, "home_input": "mlp", "input_noise": 2.0},
    "home d/4 + codec + mlp": {
        "subspace": "rank=d/4,mode=home,writes=full",
        "wire": CODEC,
        "home_input": "mlp",
    },
    "states-only σ=0.25": {"preset": "states-only", "input_noise": 0.25},
    "states-only σ=0.5": {"preset": "states-only", "input_noise": 0.5},
    "states-only σ=1": {"preset": "states-only"},
    "states-only σ=2": {"preset": "states-only", "input_noise": 2.0},
    "states-only σ=4": {"preset": "states-only", "input_noise": 4.0},
    "states-only d/2 σ=2": {
        "preset": "states-only",
        "input_noise": 2.0,
        "subspace": "rank=d/2,mode=home,writes=full",
    },
}
WIRE_KEYS = ("wire", "subspace")  # a setting's keys that are not privacy fields


@dataclass
class SettingRun:
    """One (setting, preset, seed): Eq. 8 and, when attacked, the worst victim's margin
    above its floor per "stage: attack"."""

    setting: str
    preset: str
    seed: int
    eval_loss: float
    worst: dict[str, float] = field(default_factory=dict)
    floor: float | None = None  # the largest per-victim floor of the run
    ratio: float | None = None  # bytes on the wire: fp32 hidden states / this setting's
    sends: str = ""  # what crosses a hop: "hidden states" or "hidden states + token ids"


def select_named(table: dict[str, dict], names: str | None, what: str) -> dict[str, dict]:
    """The entries of ``table`` named (comma-separated), or all; an unknown name is refused
    (the error calls an entry a ``what``)."""
    if not names:
        return dict(table)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in table]
    if unknown:
        raise ValueError(f"unknown {what} {unknown[0]!r}: expected one of {', '.join(table)}")
    return {n: table[n] for n in wanted}


def select(names: str | None) -> dict[str, dict]:
    """The settings named (comma-separated), or all; an unknown name is refused."""
    return select_named(SETTINGS, names, "setting")


def _delta(
    runs: Sequence[SettingRun], setting: str, preset: str
) -> tuple[float, float, int, float]:
    """Mean and sample std of Eq. 8 − "none" (same preset and seed), the pair count, and
    the half-width of its 95 % Student-t interval (nan for one seed)."""
    base = {r.seed: r.eval_loss for r in runs if r.setting == "none" and r.preset == preset}
    paired = [
        r.eval_loss - base[r.seed]
        for r in runs
        if r.setting == setting and r.preset == preset and r.seed in base
    ]
    if not paired:
        return float("nan"), float("nan"), 0, float("nan")
    spread = statistics.stdev(paired) if len(paired) > 1 else 0.0
    return statistics.fmean(paired), spread, len(paired), ci95(paired)[1]


PLACES = ("early", "mid", "trained")


def front(runs: Sequence[SettingRun]) -> list[dict]:
    """Per setting: the wire ratio, Δ Eq. 8 per preset, and the worst margin per "place:
    attack" over attacked runs (every seed and victim), with its largest and the attack."""
    settings = list(dict.fromkeys(r.setting for r in runs))
    presets = list(dict.fromkeys(r.preset for r in runs))
    out = []
    for s in settings:
        mine = [r for r in runs if r.setting == s]
        row: dict = {"setting": s, "today": s in TODAY, "delta": {}}
        row["ratio"] = next((r.ratio for r in mine if r.ratio is not None), None)
        row["sends"] = next((r.sends for r in mine if r.sends), "")
        for p in presets:
            mean, spread, n, half = _delta(runs, s, p)
            if n:
                row["delta"][p] = (mean, spread, n, half)
        attacked = [r for r in mine if r.worst]
        worst: dict[str, float] = {}
        for r in attacked:
            for k, v in r.worst.items():
                worst[k] = max(worst.get(k, -1.0), v)
        row["worst"] = worst
        row["seeds_attacked"] = sorted({(r.preset, r.seed) for r in attacked})
        row["max_margin"] = max(worst.values()) if worst else None
        row["max_attack"] = max(worst, key=lambda k: worst[k]) if worst else None
        row["floor"] = max((r.floor for r in attacked if r.floor is not None), default=None)
        out.append(row)
    return out


def table(runs: Sequence[SettingRun]) -> str:
    """Markdown, the three-way front: wire ratio, Δ Eq. 8 per preset (mean, its 95 %
    t-interval [low, high] over n paired seeds; one seed: the value alone),
    and the worst victim's margin above its floor (percentage points, the worst over every
    attack and window at each place, every attacked seed), with the attack that achieved
    the largest."""
    rows = front(runs)
    presets = list(dict.fromkeys(r.preset for r in runs))
    head = ["setting", "sends", "wire ratio", *(f"Δ Eq. 8 {p}" for p in presets)]
    head += [f"worst − floor, {place}" for place in PLACES]
    head += ["max", "by", "attacked (preset: seeds)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        cells = [row["setting"] + (" (today)" if row["today"] else ""), row["sends"] or "—"]
        cells.append("—" if row["ratio"] is None else f"{row['ratio']:.1f}×")
        for p in presets:
            if p in row["delta"]:
                m, _, n, half = row["delta"][p]
                if math.isnan(half):
                    cells.append(f"{m:+.3f} (1)")
                else:
                    cells.append(f"{m:+.3f} [{m - half:+.3f}, {m + half:+.3f}] ({n})")
            else:
                cells.append("—")
        for place in PLACES:
            got = [v for k, v in row["worst"].items() if k.startswith(f"{place}: ")]
            cells.append(f"{100 * max(got):+.1f}" if got else "—")
        mm = row["max_margin"]
        cells.append("—" if mm is None else f"{100 * mm:+.1f}")
        cells.append(row["max_attack"] or "—")
        by: dict[str, list[int]] = {}
        for p, seed in row["seeds_attacked"]:
            by.setdefault(p, []).append(seed)
        cells.append("; ".join(f"{p}: {','.join(map(str, v))}" for p, v in by.items()) or "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(runs: Sequence[SettingRun], path: Path, preset: str) -> Path | None:
    """The three-way front: cost (Δ Eq. 8 at ``preset``) against the worst margin over
    attacks, windows and places, each point labelled with its wire ratio."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for row in front(runs):
        if preset not in row["delta"] or row["max_margin"] is None:
            continue
        m, _, _, half = row["delta"][preset]
        y = 100 * row["max_margin"]
        colour = "tab:grey" if row["today"] else "tab:blue"
        ax.errorbar(m, y, xerr=0.0 if math.isnan(half) else half, fmt="o", color=colour)
        ratio = "" if row["ratio"] is None else f" ({row['ratio']:.0f}×)"
        ax.annotate(
            row["setting"] + ratio, (m, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    ax.axhline(5, color="tab:red", ls="--", lw=1, label="target: floor + 5 points")
    ax.axvline(0.05, color="tab:red", ls=":", lw=1, label="target: +0.05 Eq. 8")
    ax.set_xlabel(f"Δ Eq. 8 validation loss vs none ({preset}, mean and 95 % interval over seeds)")
    ax.set_ylabel("worst victim: best attack − floor (points)")
    ax.set_title("Wire ratio × price × worst margin (grey: settings that shipped before)")
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path)


def write_runs(runs: Sequence[Any], out: Path, stem: str, table: str) -> list[Path]:
    """``<stem>.json`` (every run, a dataclass each) and ``<stem>.md`` (``table``) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    data, md = out / f"{stem}.json", out / f"{stem}.md"
    data.write_text(json.dumps([asdict(r) for r in runs], indent=2) + "\n")
    md.write_text(table + "\n")
    return [data, md]


def read_runs(kind: Callable[..., R], paths: Sequence[Path]) -> list[R]:
    """The runs of earlier ``write_runs`` JSON files, in order, rebuilt as ``kind``."""
    return [kind(**r) for p in paths for r in json.loads(Path(p).read_text())]


def save(runs: Sequence[SettingRun], out: Path) -> list[Path]:
    return write_runs(runs, out, "pareto", table(runs))


def load(paths: Sequence[Path]) -> list[SettingRun]:
    return read_runs(SettingRun, paths)
