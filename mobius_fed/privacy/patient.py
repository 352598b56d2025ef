"""The patient neighbour: every site's first remote hop, attacked with pooled windows of steps.

One training run on the reference engine (it hands on exactly the tensors a ring
exchanges). For **every** stream s an observer keeps what the worker receiving s's first
remote hop sees during two windows of ``window`` training steps: the first steps
("early": from step 0) and the last ("trained"). On each window, per victim, run:

* floor: the attacker's most frequent own tokens, ignoring the states;
* nearest row of E (the attacker's replica);
* clusters + own frequencies, with the best cluster count of a sweep (an upper bound on an
  attacker who picks k well);
* known plaintext pooled over the window: a fraction ``f`` of the window's positions is
  known; a linear map, a codebook and Gaussian class means fitted on all of them read the
  rest;
* decipher: clusters + an HMM with the bigram statistics of a public text the attacker
  holds (:mod:`mobius_fed.privacy.decipher`), best k of its sweep.

The report keeps every (stage, victim, attack) and the worst victim per attack: the largest
exact recovery above that victim's floor (docs/privacy.md §4i).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine.reference import ReferenceEngine
from mobius_fed.privacy import input_attacks as ia
from mobius_fed.privacy.audit import ensure_home_layers, first_hop_attacker, own_text
from mobius_fed.privacy.decipher import CLUSTER_SWEEP, best_over_clusters, decipher
from mobius_fed.privacy.observer import Observer

FLOOR = "floor: most frequent tokens"
DECIPHER_SWEEP = (48, 64, 96)


@dataclass
class PatientRow:
    """One attack on one victim's first remote hop over one window of steps."""

    stage: str
    victim: int
    attacker: int
    attack: str
    exact: float
    top5: float
    tokens: int
    clusters: int | None = None  # the best k of a swept attack


@dataclass
class PatientReport:
    preset: str
    steps: int
    window: int
    privacy: dict
    eval_loss: float
    rows: list[PatientRow] = field(default_factory=list)
    seconds: float = 0.0

    def floor(self, stage: str, victim: int) -> float:
        return next(
            r.exact
            for r in self.rows
            if r.stage == stage and r.victim == victim and r.attack == FLOOR
        )

    def worst(self) -> dict[str, dict[str, float]]:
        """{stage: attack: largest exact − floor over victims} (the worst victim's margin)."""
        out: dict[str, dict[str, float]] = {}
        for r in self.rows:
            if r.attack == FLOOR:
                continue
            margin = r.exact - self.floor(r.stage, r.victim)
            cell = out.setdefault(r.stage, {})
            cell[r.attack] = max(cell.get(r.attack, -1.0), margin)
        return out

    def table(self) -> str:
        """Markdown: per stage and attack, mean and worst-victim exact recovery and floor."""
        lines = [
            "| stage | attack | mean exact | worst victim exact | its floor | worst − floor | k |",
            "|---|---|---|---|---|---|---|",
        ]
        for stage in dict.fromkeys(r.stage for r in self.rows):
            for attack in dict.fromkeys(r.attack for r in self.rows):
                sel = [r for r in self.rows if r.stage == stage and r.attack == attack]
                if not sel:
                    continue
                mean = sum(r.exact for r in sel) / len(sel)
                worst = max(sel, key=lambda r: r.exact - self.floor(stage, r.victim))
                fl = self.floor(stage, worst.victim)
                k = "" if worst.clusters is None else str(worst.clusters)
                lines.append(
                    f"| {stage} | {attack} | {100 * mean:.1f} % | {100 * worst.exact:.1f} % "
                    f"(site {worst.victim}) | {100 * fl:.1f} % | "
                    f"{100 * (worst.exact - fl):+.1f} | {k} |"
                )
        return "\n".join(lines)


def public_tokens(path: Path, limit: int = 400_000) -> Tensor:
    """The attacker's public text as byte tokens (the ``bytes`` encoding)."""
    if not path.is_file():
        raise FileNotFoundError(f"public corpus {path} not found (the decipher's bigrams)")
    return torch.tensor(list(path.read_bytes()[:limit]), dtype=torch.long)


class PatientAudit:
    """One training run with every stream's first remote hop observed in two windows."""

    def __init__(
        self,
        cfg: TrainConfig,
        sites: Sequence[SiteData],
        public: Tensor,
        *,
        window: int = 32,
        known: Sequence[float] = (0.05, 0.25),
        cluster_sweep: Sequence[int] = CLUSTER_SWEEP,
        decipher_sweep: Sequence[int] = DECIPHER_SWEEP,
        attacker_batches: int = 64,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if cfg.encoding != "bytes":
            raise ValueError(
                "the patient audit's public corpus is read as bytes: use encoding bytes"
            )
        if window < 1:
            raise ValueError(f"window must be ≥ 1 step, not {window}")
        self.cfg, self.sites, self.public = cfg, list(sites), public
        self.known, self.cluster_sweep = tuple(known), tuple(cluster_sweep)
        self.decipher_sweep, self.attacker_batches = tuple(decipher_sweep), attacker_batches
        self.log = log or (lambda _msg: None)
        w = min(window, cfg.steps)
        self.windows = {"early": range(0, w), "trained": range(cfg.steps - w, cfg.steps)}
        self.window = w
        steps = frozenset(s for r in self.windows.values() for s in r)
        self.engine = ReferenceEngine(cfg, self.sites)
        ensure_home_layers(self.engine)
        self.hops: dict[int, tuple[int, int]] = {}
        self.observers: dict[int, Observer] = {}
        for s in range(cfg.P):
            first = first_hop_attacker(cfg, s)
            if first is None:
                continue
            slot, receiver = self.hops[s] = first
            obs = Observer(
                rank=receiver, forward_slots={s: slot}, phases=("train",), train_steps=steps
            )
            obs.attach(self.engine.hops)
            self.observers[s] = obs
        if not self.hops:
            raise ValueError("no stream leaves its home (P = 1): nothing to attack")
        self.start_wte = {
            w: r.wte.weight.detach().clone() for w, r in enumerate(self.engine.replicas)
        }

    def _window(self, s: int, steps: range) -> tuple[Tensor, Tensor]:
        """(received states [n, T, d], tokens [n, T]) of stream s over ``steps``."""
        slot, _ = self.hops[s]
        hs, xs = [], []
        for n in steps:
            micro = self.engine._micro("train", s, n)
            for m, (x, _) in enumerate(micro):
                h = self.observers[s].received[("train", n, s, slot, m)]
                basis = self.engine.maps.basis
                hs.append(h if basis is None else basis.expand(h))
                xs.append(x)
        return torch.cat(hs).float(), torch.cat(xs)

    def _attack(self, stage: str, s: int) -> list[PatientRow]:
        cfg, vocab = self.cfg, self.cfg.model().vocab_size
        _, attacker = self.hops[s]
        h, x = self._window(s, self.windows[stage])
        flat = h.reshape(-1, h.size(-1))
        tok = x.reshape(-1)
        wte = (
            self.start_wte[attacker]
            if stage == "early"
            else self.engine.replicas[attacker].wte.weight.detach()
        )
        own = own_text(cfg, self.sites[attacker], self.attacker_batches)
        rows: list[PatientRow] = []

        def add(name: str, r: ia.Recovery, k: int | None = None) -> None:
            rows.append(PatientRow(stage, s, attacker, name, r.exact, r.top5, r.tokens, k))

        add(FLOOR, ia.recovery(ia.frequency_floor(own, tok.numel(), vocab), tok))
        add("nearest row of E", ia.recovery(ia.nearest_row(flat, wte), tok))
        r, k = best_over_clusters(
            lambda k: ia.cluster_frequency(flat, own, vocab, clusters=k, seed=cfg.seed),
            tok,
            self.cluster_sweep,
        )
        add("clusters + own frequencies (best k)", r, k)
        for f in self.known:
            mask = ia.known_mask(tok.numel(), f, cfg.seed)
            g, rest = ia.known_plaintext(flat, tok, wte, mask)
            add(f"known plaintext {100 * f:g} % pooled + linear map", ia.recovery(g, rest))
            g, rest = ia.known_codebook(flat, tok, mask)
            add(f"known plaintext {100 * f:g} % pooled as a codebook", ia.recovery(g, rest))
            g, rest = ia.known_class_means(flat, tok, mask)
            add(f"known plaintext {100 * f:g} % pooled: class means", ia.recovery(g, rest))
        r, k = best_over_clusters(
            lambda k: decipher(h, self.public, vocab, clusters=k, seed=cfg.seed),
            tok,
            self.decipher_sweep,
        )
        add("decipher: clusters + public bigrams (best k)", r, k)
        return rows

    def run(self) -> PatientReport:
        cfg, t0 = self.cfg, time.perf_counter()
        for _ in range(cfg.steps):
            self.engine.train_step()
        loss = self.engine.evaluate().loss
        self.log(f"eval loss (Eq. 8) {loss:.4f}")
        report = PatientReport(
            cfg.preset, cfg.steps, self.window, cfg.privacy.model_dump(mode="json"), loss
        )
        for stage in self.windows:
            for s in self.hops:
                self.log(f"attacking site {s}'s first hop ({stage})")
                report.rows.extend(self._attack(stage, s))
        report.seconds = time.perf_counter() - t0
        return report


def write_report(report: PatientReport, out: Path, name: str = "patient") -> list[Path]:
    """``<name>.json`` (every row) and ``<name>.md`` (the table) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    data, table = out / f"{name}.json", out / f"{name}.md"
    data.write_text(json.dumps(asdict(report), indent=2) + "\n")
    table.write_text(report.table() + "\n")
    return [data, table]


def load_report(path: Path) -> PatientReport:
    raw = json.loads(Path(path).read_text())
    rows = [PatientRow(**r) for r in raw.pop("rows")]
    return PatientReport(**raw, rows=rows)
