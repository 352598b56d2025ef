"""The patient neighbour: every site's first remote hop, attacked over every window an
attacker would choose.

One training run on the reference engine (it hands on exactly the tensors a ring
exchanges). For **every** stream s an observer keeps what the worker receiving s's first
remote hop sees during the run. The attacker then chooses its window: every length of
``windows`` (1, 2, 4, 8, 16, 32 steps) starting at step 0 ("early"), centred mid-run ("mid")
and ending at the last step ("trained"). On each window, per victim and per known fraction
f (1 % and 5 % of the window's positions) and mask seed, it runs:

* floor: the attacker's most frequent own tokens, ignoring the states;
* nearest row of E (the attacker's replica at the window's start);
* known plaintext pooled over the window: a linear map onto E, a codebook, Gaussian class
  means, and a small nonlinear decoder (an MLP fitted on the known pairs only, its capacity
  chosen on held-out known pairs);

and on the longest window of each place the unsupervised attacks, which need many
positions: clusters + own frequencies and the decipher (clusters + an HMM with the bigrams of
a public text, :mod:`mobius_fed.privacy.decipher`), best k of their sweeps.

In a learned-bottleneck mode (``subspace.mode`` ``bottleneck`` or ``bottleneck-home``) the
receiver holds two things of each hop, and every attack above runs on both: the k-wide code
as it crossed the edge ("code"; the linear map is fitted towards the public identity path,
and there is no nearest row of E at width k) and what the receiver's own decoder makes of it
at that step, dec(c) ("dec(c)", the d-wide state its group is applied to). The rows name the
surface; the worst per victim is over both.

The report keeps every (place, window, victim, attack) and, per victim, the worst over all
of them with the window and attack that achieved it: the largest exact recovery above that
victim's floor for that window (docs/privacy.md §4i, §4k).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine.reference import ReferenceEngine
from mobius_fed.privacy import input_attacks as ia
from mobius_fed.privacy.audit import (
    ensure_home_layers,
    first_hop_attacker,
    own_text,
    receiver_rebuild,
)
from mobius_fed.privacy.decipher import CLUSTER_SWEEP, best_over_clusters, decipher
from mobius_fed.privacy.observer import Observer

FLOOR = "floor: most frequent tokens"
DECIPHER_SWEEP = (48, 64, 96)
WINDOWS = (1, 2, 4, 8, 16, 32)  # steps pooled: every length an attacker may choose
PLACES = ("early", "mid", "trained")  # where a window sits: from step 0, mid-run, at the end
KNOWN = (0.01, 0.05)  # fractions of a window's (position, token) pairs the attacker knows
# What a bottleneck receiver holds of a hop: the code as received, its own decoder's output.
SURFACES = ("code", "dec(c)")
UNSUPERVISED = (
    "clusters + own frequencies (best k)",
    "decipher: clusters + public bigrams (best k)",
)


def known_attack(f: float, how: str) -> str:
    """The name of a known-plaintext attack with fraction ``f``."""
    return f"known plaintext {100 * f:g} % pooled{how}"


@dataclass
class PatientRow:
    """One attack on one victim's first remote hop over one window of steps."""

    stage: str  # the window's place: early, mid or trained
    victim: int
    attacker: int
    attack: str
    exact: float
    top5: float
    tokens: int
    clusters: int | None = None  # the best k of a swept attack (the width of a decoder)
    window: int = 0  # the window's length in steps
    start: int = 0  # its first step
    mask_seed: int = 0  # the known-plaintext mask's seed
    surface: str = ""  # a bottleneck's: "code" or "dec(c)" (also in ``attack``); else ""


@dataclass
class Worst:
    """A victim's worst case: the largest exact recovery above its window's floor."""

    victim: int
    margin: float
    exact: float
    floor: float
    stage: str
    window: int
    start: int
    attack: str


@dataclass
class PatientReport:
    preset: str
    steps: int
    window: int  # the longest window swept
    privacy: dict
    eval_loss: float
    rows: list[PatientRow] = field(default_factory=list)
    seconds: float = 0.0

    def floor_of(self, row: PatientRow) -> float:
        """The floor of ``row``'s victim over ``row``'s window."""
        return next(
            r.exact
            for r in self.rows
            if r.attack == FLOOR
            and (r.stage, r.victim, r.window, r.start)
            == (row.stage, row.victim, row.window, row.start)
        )

    def margins(self) -> list[tuple[PatientRow, float]]:
        """Every attack row with its margin above its own window's floor."""
        return [(r, r.exact - self.floor_of(r)) for r in self.rows if r.attack != FLOOR]

    def worst(self) -> dict[str, dict[str, float]]:
        """{place: attack: largest exact − floor over victims, windows and mask seeds}."""
        out: dict[str, dict[str, float]] = {}
        for r, margin in self.margins():
            cell = out.setdefault(r.stage, {})
            cell[r.attack] = max(cell.get(r.attack, -1.0), margin)
        return out

    def worst_per_victim(self) -> list[Worst]:
        """Per victim, the worst over every window, known fraction, attack and seed."""
        best: dict[int, Worst] = {}
        for r, margin in self.margins():
            if r.victim not in best or margin > best[r.victim].margin:
                best[r.victim] = Worst(
                    r.victim, margin, r.exact, r.exact - margin, r.stage, r.window, r.start,
                    r.attack,
                )  # fmt: skip
        return [best[v] for v in sorted(best)]

    def worst_margin(self) -> float:
        """The largest margin above the floor of any victim, window and attack."""
        return max(w.margin for w in self.worst_per_victim())

    def table(self) -> str:
        """Markdown: per victim its worst case, then per place and attack the worst margin
        over victims and windows, with the window that gave it."""
        lines = [
            "| victim | worst exact | its floor | worst − floor | place | window | attack |",
            "|---|---|---|---|---|---|---|",
        ]
        for w in self.worst_per_victim():
            lines.append(
                f"| site {w.victim} | {100 * w.exact:.1f} % | {100 * w.floor:.1f} % | "
                f"{100 * w.margin:+.1f} | {w.stage} | {w.window} (steps {w.start}–"
                f"{w.start + w.window - 1}) | {w.attack} |"
            )
        lines += [
            "",
            "| place | attack | mean exact | worst − floor | its victim | its window | k |",
            "|---|---|---|---|---|---|---|",
        ]
        margins = self.margins()
        for stage in dict.fromkeys(r.stage for r in self.rows):
            for attack in dict.fromkeys(r.attack for r in self.rows if r.attack != FLOOR):
                sel = [(r, m) for r, m in margins if r.stage == stage and r.attack == attack]
                if not sel:
                    continue
                mean = sum(r.exact for r, _ in sel) / len(sel)
                r, m = max(sel, key=lambda rm: rm[1])
                k = "" if r.clusters is None else str(r.clusters)
                lines.append(
                    f"| {stage} | {attack} | {100 * mean:.1f} % | {100 * m:+.1f} | "
                    f"site {r.victim} | {r.window} from step {r.start} | {k} |"
                )
        return "\n".join(lines)


def identity_path(k: int, wte: Tensor) -> Tensor:
    """The bottleneck's public identity path as a map from a k-wide code onto E's width d:
    code entry j on channel j·d/k ([k, d], what the decoder is at step 0)."""
    d = wte.size(-1)
    prior = torch.zeros(k, d)
    prior[torch.arange(k), torch.arange(k) * (d // k)] = 1.0
    return prior


def public_tokens(path: Path, limit: int = 400_000) -> Tensor:
    """The attacker's public text as byte tokens (the ``bytes`` encoding)."""
    if not path.is_file():
        raise FileNotFoundError(f"public corpus {path} not found (the decipher's bigrams)")
    return torch.tensor(list(path.read_bytes()[:limit]), dtype=torch.long)


def window_starts(steps: int, length: int) -> dict[str, int]:
    """The first step of a window of ``length`` steps at each place of a run of ``steps``."""
    return {"early": 0, "mid": max(0, (steps - length) // 2), "trained": steps - length}


class PatientAudit:
    """One training run with every stream's first remote hop observed, attacked over every
    window of ``windows`` at every place."""

    def __init__(
        self,
        cfg: TrainConfig,
        sites: Sequence[SiteData],
        public: Tensor,
        *,
        windows: Sequence[int] = WINDOWS,
        known: Sequence[float] = KNOWN,
        mask_seeds: Sequence[int] = (0,),
        cluster_sweep: Sequence[int] = CLUSTER_SWEEP,
        decipher_sweep: Sequence[int] = DECIPHER_SWEEP,
        decoder: bool = True,
        unsupervised: bool = True,
        attacker_batches: int = 64,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if cfg.encoding != "bytes":
            raise ValueError(
                "the patient audit's public corpus is read as bytes: use encoding bytes"
            )
        if not windows or min(windows) < 1:
            raise ValueError(f"every window must be ≥ 1 step, not {tuple(windows)}")
        self.cfg, self.sites, self.public = cfg, list(sites), public
        self.known, self.mask_seeds = tuple(known), tuple(mask_seeds)
        self.cluster_sweep, self.decipher_sweep = tuple(cluster_sweep), tuple(decipher_sweep)
        self.decoder, self.unsupervised = decoder, unsupervised
        self.attacker_batches = attacker_batches
        self.log = log or (lambda _msg: None)
        lengths = sorted({min(w, cfg.steps) for w in windows})
        self.window = lengths[-1]
        seen: set[tuple[int, int]] = set()
        self.windows: list[
            tuple[str, int, int]
        ] = []  # (place, length, start), each (length, start) once
        for length in lengths:
            for place, start in window_starts(cfg.steps, length).items():
                if (length, start) not in seen:
                    seen.add((length, start))
                    self.windows.append((place, length, start))
        steps = frozenset(n for _, length, a in self.windows for n in range(a, a + length))
        self.starts = frozenset(a for _, _, a in self.windows)
        self.engine = ReferenceEngine(cfg, self.sites)
        ensure_home_layers(self.engine)
        self.hops: dict[int, tuple[int, int]] = {}
        self.observers: dict[int, Observer] = {}
        self._observe(steps)
        self.wte: dict[int, list[Tensor]] = {}  # step → every replica's E at its start

    def _observe(self, steps: frozenset[int]) -> None:
        """An observer at every stream's first remote hop, over the windows' ``steps`` (in a
        bottleneck mode it also keeps the receiver's decoder output on arrival)."""
        cfg = self.cfg
        for s in range(cfg.P):
            first = first_hop_attacker(cfg, s)
            if first is None:
                continue
            slot, receiver = self.hops[s] = first
            obs = Observer(
                rank=receiver,
                forward_slots={s: slot},
                phases=("train",),
                train_steps=steps,
                rebuild=receiver_rebuild(self.engine),
            )
            obs.attach(self.engine.hops)
            self.observers[s] = obs
        if not self.hops:
            raise ValueError("no stream leaves its home (P = 1): nothing to attack")

    def _snapshot(self) -> None:
        self.wte[self.engine.step] = [r.wte.weight.detach().clone() for r in self.engine.replicas]

    def _window(self, s: int, start: int, length: int) -> tuple[dict[str, Tensor], Tensor]:
        """What the attacker holds of stream s over ``length`` steps, per surface ([n, T, width]
        each), and the tokens [n, T]: the received states (with a U: U·c), under ""; in a
        bottleneck mode the code as received and its own decoder's output at that step."""
        slot, _ = self.hops[s]
        obs, basis = self.observers[s], self.engine.maps.basis
        held: dict[str, list[Tensor]] = {}
        xs = []
        for n in range(start, start + length):
            for m, (x, _) in enumerate(self.engine._micro("train", s, n)):
                key = ("train", n, s, slot, m)
                h = obs.received[key]
                if self.cfg.subspace.bottleneck:
                    views = dict(zip(SURFACES, (h, obs.rebuilt[key])))
                else:
                    views = {"": h if basis is None else basis.expand(h)}
                for name, view in views.items():
                    held.setdefault(name, []).append(view)
                xs.append(x)
        return {name: torch.cat(v).float() for name, v in held.items()}, torch.cat(xs)

    def _attack(self, place: str, length: int, start: int, s: int) -> list[PatientRow]:
        cfg, vocab = self.cfg, self.cfg.model().vocab_size
        _, attacker = self.hops[s]
        views, x = self._window(s, start, length)
        tok = x.reshape(-1)
        own = own_text(cfg, self.sites[attacker], self.attacker_batches)
        floor = ia.recovery(ia.frequency_floor(own, tok.numel(), vocab), tok)
        rows = [
            PatientRow(
                place, s, attacker, FLOOR, floor.exact, floor.top5, floor.tokens, None, length,
                start,
            )
        ]  # fmt: skip
        for surface, h in views.items():
            for name, r, k, seed in self._attacks(h, tok, own, attacker, start, length):
                rows.append(
                    PatientRow(
                        place, s, attacker, f"{name} [{surface}]" if surface else name,
                        r.exact, r.top5, r.tokens, k, length, start, seed, surface,
                    )
                )  # fmt: skip
        return rows

    def _attacks(
        self, h: Tensor, tok: Tensor, own: Tensor, attacker: int, start: int, length: int
    ) -> Iterator[tuple[str, ia.Recovery, int | None, int]]:
        """(attack, recovery, k or decoder width, mask seed) of every attack on one surface
        ``h`` [n, T, width] of a window; a surface narrower than E (a bottleneck's code) has
        no nearest row and fits its linear map towards the public identity path."""
        cfg, vocab = self.cfg, self.cfg.model().vocab_size
        flat = h.reshape(-1, h.size(-1))
        wte = self.wte[start][attacker]
        prior = None if flat.size(-1) == wte.size(-1) else identity_path(flat.size(-1), wte)
        if prior is None:
            yield "nearest row of E", ia.recovery(ia.nearest_row(flat, wte), tok), None, 0
        for seed in self.mask_seeds:
            for f in self.known:
                mask = ia.known_mask(tok.numel(), f, cfg.seed + seed)
                if int(mask.sum()) < 2:
                    continue  # too few positions for this fraction
                g, rest = ia.known_plaintext(flat, tok, wte, mask, prior=prior)
                yield known_attack(f, " + linear map"), ia.recovery(g, rest), None, seed
                g, rest = ia.known_codebook(flat, tok, mask)
                yield known_attack(f, " as a codebook"), ia.recovery(g, rest), None, seed
                g, rest = ia.known_class_means(flat, tok, mask)
                yield known_attack(f, ": class means"), ia.recovery(g, rest), None, seed
                if self.decoder:
                    g, rest, width = ia.known_decoder(flat, tok, mask, seed=cfg.seed + seed)
                    yield known_attack(f, ": MLP decoder"), ia.recovery(g, rest), width, seed
        if self.unsupervised and length == self.window:
            r, k = best_over_clusters(
                lambda k: ia.cluster_frequency(flat, own, vocab, clusters=k, seed=cfg.seed),
                tok,
                self.cluster_sweep,
            )
            yield UNSUPERVISED[0], r, k, 0
            r, k = best_over_clusters(
                lambda k: decipher(h, self.public, vocab, clusters=k, seed=cfg.seed),
                tok,
                self.decipher_sweep,
            )
            yield UNSUPERVISED[1], r, k, 0

    def run(self) -> PatientReport:
        cfg, t0 = self.cfg, time.perf_counter()
        for _ in range(cfg.steps):
            if self.engine.step in self.starts:
                self._snapshot()
            self.engine.train_step()
        loss = self.engine.evaluate().loss
        self.log(f"eval loss (Eq. 8) {loss:.4f}")
        report = PatientReport(
            cfg.preset, cfg.steps, self.window, cfg.privacy.model_dump(mode="json"), loss
        )
        for place, length, start in self.windows:
            self.log(f"attacking every first hop: {place} window of {length} from step {start}")
            for s in self.hops:
                report.rows.extend(self._attack(place, length, start, s))
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
    if raw["rows"] and "window" not in raw["rows"][0]:
        raise ValueError(f"{path}: a report of the earlier two-window audit; run it again")
    rows = [PatientRow(**r) for r in raw.pop("rows")]
    return PatientReport(**raw, rows=rows)
