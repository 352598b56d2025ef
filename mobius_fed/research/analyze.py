"""Depth roles inside the block groups: does one group serve shallow and deep roles at once?

Per group i and depth t (t mod P = d(s, i)): logit-lens loss through origin s's R_s, residual
norm, relative update size, linear CKA and update cosine across depths, and each origin's own
validation loss (Eq. 8's terms); all but the last on shared probe tokens (docs/research.md,
"mobius-fed analyze"). Ordered runs average the P origins' paths (the first origin's states
for the similarities). Hidden states skip the hop stages (defences, wire codecs): this looks at
the model itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mobius_fed import schedule
from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.plotting import pyplot, save_figure
from mobius_fed.run_reader import Model, RunError, read_run


# ------------------------------------------------------------------------- measures
def linear_cka(x: Tensor, y: Tensor) -> float:
    """Linear CKA (Kornblith et al., 2019) between row-aligned representations [n, d]."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA needs the same rows: {x.shape[0]} vs {y.shape[0]}")
    x = x.double() - x.double().mean(0)
    y = y.double() - y.double().mean(0)
    num = (y.T @ x).pow(2).sum()
    den = (x.T @ x).norm() * (y.T @ y).norm()
    return float("nan") if den == 0 else float(num / den)


def mean_cosine(a: Tensor, b: Tensor, eps: float = 1e-12) -> float:
    """Mean over rows of cos(a_r, b_r); nan when either side is all zero."""
    a, b = a.double(), b.double()
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    ok = (na > eps) & (nb > eps)
    if not bool(ok.any()):
        return float("nan")
    return float(((a * b).sum(-1)[ok] / (na[ok] * nb[ok])).mean())


def relative_update(h_in: Tensor, h_out: Tensor) -> float:
    """Mean per-token ‖h_out − h_in‖ / ‖h_in‖."""
    return float(((h_out - h_in).norm(dim=-1) / h_in.norm(dim=-1).clamp_min(1e-12)).mean())


# -------------------------------------------------------------------------- models
def load_model(path: Path) -> Model:
    """The model of a finished run (what :func:`mobius_fed.run_reader.read_run` reads); a
    problem is named as ``analyze``'s."""
    try:
        return read_run(Path(path))
    except RunError as exc:
        raise type(exc)(f"analyze: {exc}") from None


# ------------------------------------------------------------------------ analysis
@dataclass
class Analysis:
    """Everything measured on one model; [i][t] tables hold nan where i never runs at t."""

    name: str
    order: str
    P: int
    K: int
    origin_loss: list[float]
    lens_loss: list[list[float]]
    norm: list[list[float]]
    update: list[list[float]]
    cka: list[list[list[float]]]  # [i][t][t']
    cosine: list[list[list[float]]]
    cka_mean: list[list[float]] = field(default_factory=list)  # [i][t]: mean over other t'

    def to_json(self) -> dict[str, Any]:
        return {k: _jsonable(v) for k, v in self.__dict__.items()}


def _jsonable(v: Any) -> Any:
    if isinstance(v, float):
        return None if math.isnan(v) else v
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def _batches(site: SiteData, cfg: TrainConfig, n: int) -> list[tuple[Tensor, Tensor]]:
    return [site.batch("val", seed=cfg.seed, step=b, batch_size=cfg.batch_size) for b in range(n)]


def refuse_subspace(model: Model) -> None:
    """Analysis reads full-width hidden states along a path: not defined with a subspace."""
    if model.cfg.subspace.on:
        raise ValueError(
            f"analyze: {model.name} has a shared subspace (subspace.rank = "
            f"{model.cfg.subspace.rank}); its per-depth measures are not defined for it yet "
            "(mobius-fed export and eval do handle it)"
        )


@torch.no_grad()
def analyze_model(model: Model, sites: Sequence[SiteData], batches: int = 2) -> Analysis:
    """Measure ``model`` on ``batches`` validation batches per origin (see module doc)."""
    cfg, P, K = model.cfg, model.cfg.P, model.cfg.K
    if len(sites) != P:
        raise ValueError(f"analyze: need one site per origin: P={P}, got {len(sites)}")
    if batches < 1:
        raise ValueError(f"analyze: batches must be ≥ 1, got {batches}")
    refuse_subspace(model)
    data = [_batches(site, cfg, batches) for site in sites]
    tables, outs, deltas = _depth_tables(model, data)
    cka, cos = _similarities(P, K, outs, deltas)
    cka_mean = [
        [
            _avg([cka[i][t][u] for u in range(K) if u != t and not math.isnan(cka[i][t][u])])
            for t in range(K)
        ]
        for i in range(P)
    ]
    return Analysis(
        name=model.name,
        order=cfg.order,
        P=P,
        K=K,
        origin_loss=_origin_losses(model, data),
        cka=cka,
        cosine=cos,
        cka_mean=cka_mean,
        **tables,  # lens_loss, norm, update
    )


def _avg(cell: list[float]) -> float:
    return sum(cell) / len(cell) if cell else math.nan


def _origin_losses(model: Model, data) -> list[float]:
    """Eq. 8's terms: each origin on its own data and targets, along its own path."""
    cfg = model.cfg
    out = []
    for s in range(cfg.P):
        route = schedule.path(cfg.order, s, cfg.P, cfg.loops)
        losses = []
        for x, y in data[s]:
            h = model.replicas[s].embed(x)
            for t, i in enumerate(route):
                h = model.groups[i](h, t)
            losses.append(float(model.replicas[s].loss(h, y)))
        out.append(sum(losses) / len(losses))
    return out


def _depth_tables(model: Model, data):
    """Logit-lens loss, output norm and relative update of every group i at every depth t, on
    the pooled probe tokens of the module doc; and each (i, t)'s outputs and updates."""
    cfg, P, K = model.cfg, model.cfg.P, model.cfg.K
    probe = torch.cat([x for per in data for x, _ in per])
    targets = torch.cat([y for per in data for _, y in per])
    sums: dict[str, list[list[list[float]]]] = {
        k: [[[] for _ in range(K)] for _ in range(P)] for k in ("lens_loss", "norm", "update")
    }
    outs: dict[tuple[int, int], Tensor] = {}
    deltas: dict[tuple[int, int], Tensor] = {}
    for s in range(P):
        h = model.replicas[s].embed(probe)
        for t, i in enumerate(schedule.path(cfg.order, s, P, cfg.loops)):
            out = model.groups[i](h, t)
            sums["lens_loss"][i][t].append(float(model.replicas[s].loss(out, targets)))
            sums["norm"][i][t].append(float(out.norm(dim=-1).mean()))
            sums["update"][i][t].append(relative_update(h, out))
            if (i, t) not in outs:  # ordered paths all pass (i, t); the first origin's is kept
                outs[i, t] = out.reshape(-1, out.size(-1))
                deltas[i, t] = (out - h).reshape(-1, out.size(-1))
            h = out
    tables = {k: [[_avg(c) for c in row] for row in v] for k, v in sums.items()}
    return tables, outs, deltas


def _similarities(P: int, K: int, outs, deltas):
    """Linear CKA of each group's outputs and mean cosine of its updates, depth × depth."""
    cka = [[[math.nan] * K for _ in range(K)] for _ in range(P)]
    cos = [[[math.nan] * K for _ in range(K)] for _ in range(P)]
    for i in range(P):
        depths = [t for t in range(K) if (i, t) in outs]
        for a in depths:
            for b in depths:
                if b < a:
                    cka[i][a][b], cos[i][a][b] = cka[i][b][a], cos[i][b][a]
                    continue
                cka[i][a][b] = linear_cka(outs[i, a], outs[i, b])
                cos[i][a][b] = mean_cosine(deltas[i, a], deltas[i, b])
    return cka, cos


# --------------------------------------------------------------------------- report
def _fmt(v: float, spec: str = ".3f") -> str:
    return "·" if math.isnan(v) else format(v, spec)


def _grid(title: str, table: list[list[float]], spec: str = ".3f") -> list[str]:
    K = len(table[0])
    lines = [f"**{title}** (rows: group i; columns: depth t = application index)", ""]
    lines.append("| group | " + " | ".join(f"t={t}" for t in range(K)) + " |")
    lines.append("|---" * (K + 1) + "|")
    for i, row in enumerate(table):
        lines.append(f"| F_{i} | " + " | ".join(_fmt(v, spec) for v in row) + " |")
    return [*lines, ""]


def _heatmaps(analyses: Sequence[Analysis], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    metrics = [
        ("lens_loss", "logit-lens val loss"),
        ("update", "‖F(h) − h‖ / ‖h‖"),
        ("norm", "residual-stream norm"),
        ("cka_mean", "mean CKA with other depths"),
    ]
    n = len(analyses)
    size = (3.2 + 2.6 * n, 2.2 * len(metrics))
    fig, axes = plt.subplots(len(metrics), n, figsize=size, squeeze=False)
    for r, (key, label) in enumerate(metrics):
        for c, a in enumerate(analyses):
            ax = axes[r][c]
            im = ax.imshow(getattr(a, key), aspect="auto", cmap="viridis")
            ax.set_title(f"{a.order} K={a.K}: {label}", fontsize=7)
            ax.set_xlabel("depth t", fontsize=7)
            ax.set_ylabel("group i", fontsize=7)
            ax.tick_params(labelsize=6)
            ax.set_yticks(range(a.P))
            fig.colorbar(im, ax=ax)
    return save_figure(fig, path, dpi=110)


def _similarity(analyses: Sequence[Analysis], key: str, label: str, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    P = max(a.P for a in analyses)
    fig, axes = plt.subplots(
        len(analyses), P, figsize=(2.3 * P, 2.3 * len(analyses)), squeeze=False
    )
    im = None
    for r, a in enumerate(analyses):
        for i in range(P):
            ax = axes[r][i]
            if i < a.P:
                im = ax.imshow(getattr(a, key)[i], vmin=-1 if key == "cosine" else 0, vmax=1)
                ax.set_title(f"{a.order}: F_{i} {label}", fontsize=7)
            ax.set_xlabel("depth t'", fontsize=6)
            ax.set_ylabel("depth t", fontsize=6)
            ax.tick_params(labelsize=5)
    fig.tight_layout()
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(analyses: Sequence[Analysis], out: Path) -> Path:
    """``report.md``, ``analysis.json`` and the PNGs in ``out``; returns the report's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(json.dumps([a.to_json() for a in analyses], indent=1))
    pngs = [
        _heatmaps(analyses, out / "depth_roles.png"),
        _similarity(analyses, "cka", "CKA", out / "cka.png"),
        _similarity(analyses, "cosine", "update cos", out / "update_cosine.png"),
    ]
    lines = ["# Depth roles of the block groups", ""]
    lines += [
        "Depth t is the application index on a stream's path (t mod P is the source-relative "
        "depth d(s, i)). Cyclic runs use every group at every depth (one origin per cell); "
        "ordered runs use group i only at depths t ≡ i (mod P) (· elsewhere). Similarities "
        "compare a group's outputs on the same probe tokens at two depths.",
        "",
        "| run | order | K | per-origin validation loss | mean (Eq. 8) |",
        "|---|---|---|---|---|",
    ]
    for a in analyses:
        per = ", ".join(f"s{s}={v:.4f}" for s, v in enumerate(a.origin_loss))
        lines.append(f"| {a.name} | {a.order} | {a.K} | {per} | {sum(a.origin_loss) / a.P:.4f} |")
    lines.append("")
    for a in analyses:
        lines += [f"## {a.name}", ""]
        lines += _grid("logit-lens validation loss", a.lens_loss)
        lines += _grid("relative update size ‖F_i(h) − h‖ / ‖h‖", a.update, ".4f")
        lines += _grid("residual-stream norm", a.norm, ".2f")
        lines += _grid("mean linear CKA with the group's other depths", a.cka_mean)
    lines += [f"![{p.stem}]({p.name})" for p in pngs if p is not None]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def analyze_paths(
    runs: Sequence[Path],
    out: Path | None,
    *,
    data: Sequence[Path] | None = None,
    batches: int = 2,
) -> Path:
    """Analyse each run (cyclic and ordered side by side) and write one report."""
    if not runs:
        raise ValueError("analyze: no runs given")
    out = Path(out) if out else _run_dir(Path(runs[0])) / "analysis"
    models = [load_model(Path(run)) for run in runs]
    for model in models:
        refuse_subspace(model)  # before any data is prepared or any run analysed
    analyses = [
        analyze_model(model, sites_for(model.cfg, Path(run), data, out), batches)
        for run, model in zip(runs, models, strict=True)
    ]
    return write_report(analyses, out)


def _run_dir(path: Path) -> Path:
    return path if path.is_dir() else path.parent


def sites_for(cfg: TrainConfig, run: Path, data: Sequence[Path] | None, out: Path) -> list:
    """The run's validation data: ``data`` if given, else what the run trained on."""
    from mobius_fed.research.cell import CELL, load_sites

    seq, run_dir = cfg.model().seq_len, _run_dir(run)
    if not data and (run_dir / CELL).is_file():  # a sweep cell names its sites
        spec = json.loads((run_dir / CELL).read_text())
        return load_sites(
            Path(spec["sites"]), cfg.P, seq, cfg.encoding, coupled=spec.get("coupled_batches")
        )
    if not data:  # local / experiment: next to the run; up: a few levels above a manifest
        for root in [d / "sites" for d in (run_dir, *run_dir.parents[:4])]:
            if all((root / f"site-{i}" / "meta.json").is_file() for i in range(cfg.P)):
                return [SiteData(root / f"site-{i}", seq, cfg.encoding) for i in range(cfg.P)]
    from mobius_fed.data import embedded_corpus, prepare_sites

    if data and len(data) == 1 and Path(data[0]).is_dir():
        root = Path(data[0])
    else:
        root = Path(out) / "sites"
        text = None if data else embedded_corpus()
        prepare_sites(list(data or ()), root, cfg.P, cfg.encoding, text=text, overwrite=True)
    return [SiteData(root / f"site-{i}", seq, cfg.encoding) for i in range(cfg.P)]
