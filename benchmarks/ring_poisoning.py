"""Poisoning across rings: one ring lies about its F_i at every ring sync; what each
``ring_aggregate`` leaves of the honest rings' held-out Eq. 8 (docs/rings.md "Robust
aggregation across rings").

In-process (the reference engine under the run's own ``RingSync`` strategy, exactly what a
coordinator and real workers compute): R rings of P groups, every group synced every H
steps. At each sync the last ring's reply is replaced before the strategy sees it; with θ
the F_i it trained and g the F_i it last loaded (the seed's before the first sync):

- ``flip``: −θ, and ``x10``: 10·θ (its F_i sign-flipped or scaled);
- ``update-flip``: g − (θ − g), and ``update-x10``: g + 10·(θ − g) (its update, the
  pseudo-gradient, sign-flipped or scaled: a subtler lie).

Per aggregate and attack: Δ Eq. 8 = the honest rings' mean held-out loss at the end minus
the clean run's (same aggregate, same seed). ``mean`` is today's weighted average.

    python benchmarks/ring_poisoning.py                  # R = 5, P = 1, 3 seeds, ~2 min
    python benchmarks/ring_poisoning.py --seeds 0 --rings 3 --aggregates mean,median,trimmed
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.serverapp.strategy import Strategy  # noqa: E402

from mobius_fed.config import TrainConfig  # noqa: E402
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites  # noqa: E402
from mobius_fed.engine.federated import train_with_strategy  # noqa: E402
from mobius_fed.engine.rings import make_engine  # noqa: E402
from mobius_fed.messages import GROUP  # noqa: E402
from mobius_fed.strategies import (  # noqa: E402
    RingPlan,
    RoundPlan,
    StrategyWrapper,
    make_strategy,
)
from mobius_fed.transport.flower_wire import rank_of_node  # noqa: E402

# attack → (scale, of the update?): the lie is base + scale·(θ − base), base g or 0
ATTACKS = {"flip": (-1.0, False), "x10": (10.0, False)}
ATTACKS |= {"update-flip": (-1.0, True), "update-x10": (10.0, True)}
AGGREGATES = ("mean", "median", "trimmed", "krum")
TEXT_CHARS = 120_000  # the tests' sites (tests/conftest.py SITE_TEXT_CHARS) …
SITES = 5  # … cut 5 ways, the first R·P used (as tests/test_rings_robust.py does)


class PoisonRing(StrategyWrapper):
    """Sits outside ``RingSync``: replaces ring ``bad``'s F_i in each ring-sync reply by
    ``scale``·θ, or with ``update`` by g + ``scale``·(θ − g), g the F_i that worker last
    loaded (the seed's at first)."""

    def __init__(
        self, strategy: Strategy, plan: RingPlan, bad: int, scale: float, update: bool = False
    ) -> None:
        super().__init__(strategy)
        self.plan, self.bad, self.scale, self.update = plan, bad, scale, update
        self.base: dict[int, ArrayRecord] = {}  # rank → the synced F_i it was last sent

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        for msg in messages:
            if GROUP in msg.content:
                self.base[rank_of_node(msg.metadata.dst_node_id)] = msg.content[GROUP]
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        for reply in replies:
            rank = rank_of_node(reply.metadata.src_node_id)
            if rank // self.plan.P != self.bad or GROUP not in reply.content:
                continue
            reply.content[GROUP] = self.lie(rank, reply.content.array_records[GROUP])
        return self.strategy.aggregate_train(server_round, replies)

    def lie(self, rank: int, theta: ArrayRecord) -> ArrayRecord:
        assert self.plan.initial is not None
        g = self.base[rank] if rank in self.base else self.plan.initial(rank % self.plan.P)
        out = {}
        for name, a in theta.items():
            base = g[name].numpy() if self.update else np.zeros_like(a.numpy())
            out[name] = Array(np.asarray(base + self.scale * (a.numpy() - base)))
        return ArrayRecord(out)


def config(rings: int, P: int, aggregate: str, seed: int, **kw: Any) -> TrainConfig:
    """The run: cpu-tiny, AdamW, H = 2 over 12 steps, evaluated at the end."""
    base: dict[str, Any] = dict(
        preset="cpu-tiny", batch_size=4, optimizer="adamw", steps=12, eval_every=0
    )
    base |= dict(warmup_steps=2, ring_sync_every=2, seed=seed, eval_batches=4)
    return TrainConfig(workers=rings * P, rings=rings, ring_aggregate=aggregate, **{**base, **kw})


def honest_eq8(cfg: TrainConfig, dirs: list[Path], attack: str | None) -> float:
    """The honest rings' mean held-out loss (Eq. 8 over their origins) at the end, with the
    last ring lying by ``attack`` at every sync (None: the clean run)."""
    sites = [SiteData(d, cfg.model().seq_len) for d in dirs]
    plan = RingPlan.of(cfg)
    assert plan is not None
    strategy = make_strategy("fedavg", cfg.workers, RoundPlan.of(cfg), rings=plan)
    if attack is not None:
        scale, update = ATTACKS[attack]
        strategy.strategy = PoisonRing(strategy.strategy, plan, cfg.rings - 1, scale, update)
    grid = train_with_strategy(make_engine(cfg, sites), strategy)
    honest = grid.evals[-1].origin_losses[: (cfg.rings - 1) * cfg.P]
    return float(np.mean(honest))


def table(
    dirs: list[Path], rings: int, P: int, aggregates: Iterable[str], seeds: Iterable[int]
) -> dict[tuple[str, str], list[float]]:
    """(aggregate, attack) → Δ Eq. 8 per seed (and (aggregate, "clean") → its Eq. 8)."""
    out: dict[tuple[str, str], list[float]] = {}
    for aggregate in aggregates:
        for seed in seeds:
            cfg = config(rings, P, aggregate, seed)
            clean = honest_eq8(cfg, dirs, None)
            out.setdefault((aggregate, "clean"), []).append(clean)
            for attack in ATTACKS:
                delta = honest_eq8(cfg, dirs, attack) - clean
                out.setdefault((aggregate, attack), []).append(delta)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rings", type=int, default=5)
    ap.add_argument("--groups", type=int, default=1, help="P")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--aggregates", default=",".join(AGGREGATES))
    args = ap.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        n = args.rings * args.groups
        text = embedded_corpus()[:TEXT_CHARS]
        dirs = prepare_sites(None, Path(tmp), max(n, SITES), text=text)[:n]
        rows = table(dirs, args.rings, args.groups, args.aggregates.split(","), args.seeds)
    print(f"R = {args.rings}, P = {args.groups}, seeds {args.seeds}: Δ Eq. 8 of the honest rings")
    print("| aggregate | clean Eq. 8 | " + " | ".join(f"Δ {a}" for a in ATTACKS) + " |")
    print("|---|---|" + "---|" * len(ATTACKS))
    for aggregate in args.aggregates.split(","):
        cells = [f"{np.mean(rows[aggregate, 'clean']):.4f}"]
        cells += [_cell(rows[aggregate, a]) for a in ATTACKS]
        print(f"| {aggregate} | " + " | ".join(cells) + " |")


def _cell(values: list[float]) -> str:
    """``+0.0123`` (one seed) or ``+0.0123 (+0.0101 … +0.0150)`` (mean, min … max)."""
    if len(values) == 1:
        return f"{values[0]:+.4f}"
    return f"{np.mean(values):+.4f} ({min(values):+.4f} … {max(values):+.4f})"


if __name__ == "__main__":
    main()
