"""R rings of P groups in one process: the reference for ``rings = R > 1`` (docs/rings.md).

Ring r is a :class:`ReferenceEngine` of its own over sites r·P .. r·P+P-1, exactly as a ring
of P workers trains today. Site (worker) g = r·P + i holds F_i of ring r and its E/R
replica. Nothing is averaged here: the Flower strategy of ``engine/federated.py`` averages
the E/R over all R·P sites at each barrier and each F_i over the R rings at each ring sync
(``strategies.RingSync``), as the coordinator does over real workers.
"""

from __future__ import annotations

from collections.abc import Sequence

from mobius_fed.config import ConfigError, TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine.reference import EvalResult, ReferenceEngine, StepResult
from mobius_fed.er_sync import ErSite
from mobius_fed.model import BlockGroup, Replica


def ring_config(cfg: TrainConfig) -> TrainConfig:
    """The config one ring of ``cfg`` trains under: its P workers, one ring."""
    return cfg.model_copy(update={"workers": cfg.P, "rings": 1})


class RingsEngine:
    """R reference engines, one per ring; site g = r·P + i is ring r's origin i."""

    def __init__(self, cfg: TrainConfig, sites: Sequence[SiteData]) -> None:
        if len(sites) != cfg.workers:
            raise ValueError(
                f"need one site per worker: {cfg.rings} rings of P={cfg.P}, got {len(sites)} sites"
            )
        self.cfg, P = cfg, cfg.P
        one = ring_config(cfg)
        self.rings = [ReferenceEngine(one, sites[r * P : (r + 1) * P]) for r in range(cfg.rings)]
        self.replicas: list[Replica] = [rep for ring in self.rings for rep in ring.replicas]
        # site g's end of the E/R round (sync codec, residual), as its worker keeps it
        self.er_sites: list[ErSite] = [site for ring in self.rings for site in ring.er_sites]
        self.average_replicas = True  # train_with_strategy sets False: Flower averages

    @property
    def step(self) -> int:
        return self.rings[0].step

    def group(self, site: int) -> BlockGroup:
        """F_i of site g's ring (i = g mod P)."""
        return self.rings[site // self.cfg.P].groups[site % self.cfg.P]

    def train_step(self) -> StepResult:
        """One step of every ring (ring 0 first); origin losses in site order."""
        if self.average_replicas:
            raise ConfigError(
                f"rings={self.cfg.rings}: the ring syncs are Flower rounds; drive this engine "
                "with mobius_fed.engine.federated.train_with_strategy and a strategy built "
                "with make_strategy(..., rings=RingPlan.of(cfg)), as the coordinator does"
            )
        results = []
        for ring in self.rings:
            ring.average_replicas = False
            results.append(ring.train_step())
        losses = [v for r in results for v in r.origin_losses]
        return StepResult(
            step=results[0].step,
            loss=sum(losses) / len(losses),
            origin_losses=losses,
            seconds=sum(r.seconds for r in results),
            tokens=self.cfg.tokens_per_step,
        )

    def evaluate(self) -> EvalResult:
        """Paper Eq. 8 over every site: each origin's held-out loss through its own ring's
        groups (the synced model when evaluated right after a ring sync), equally weighted
        over all R·P origins."""
        losses = [v for ring in self.rings for v in ring.evaluate().origin_losses]
        return EvalResult(step=self.step, loss=sum(losses) / len(losses), origin_losses=losses)


def make_engine(cfg: TrainConfig, sites: Sequence[SiteData]) -> ReferenceEngine | RingsEngine:
    """The reference engine of ``cfg``: today's with one ring, :class:`RingsEngine` with R > 1."""
    return ReferenceEngine(cfg, sites) if cfg.rings == 1 else RingsEngine(cfg, sites)
