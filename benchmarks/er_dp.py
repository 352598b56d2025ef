"""The price of DP-FedAvg on the shared E/R: Eq. 8 and (ε, δ) per noise multiplier z and
clip C, with the reference engine driven by the same Flower strategy as a coordinated run.

    python benchmarks/er_dp.py                          # cpu-small, P = 4, 60 steps
    python benchmarks/er_dp.py --arms 1,0.1 4,0.01 --steps 120

Every arm trains from the same seed and data with a barrier every step; Δ is against the
arm without DP from the same run. ε is for replacing one whole site's data (z/2, q = 1).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.defences.accounting import er_epsilon_spent
from mobius_fed.defences.er_dp import ErPrivacy
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.strategies import RoundPlan, make_strategy


def eq8(cfg: TrainConfig, sites: list[Path]) -> float:
    engine = ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len) for d in sites])
    strategy = make_strategy("fedavg", cfg.P, RoundPlan.of(cfg), er_privacy=ErPrivacy.of(cfg))
    grid = train_with_strategy(engine, strategy)
    return grid.evals[-1].loss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--arms",
        nargs="+",
        default=["0.1,0.1", "1,0.1", "1,0.01", "4,0.01", "1,1"],
        help="z,C pairs (noise multiplier, clip)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("runs/er_dp"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    sites = prepare_sites(
        None, args.out / "sites", args.workers, text=embedded_corpus(), overwrite=True
    )
    base = dict(preset=args.preset, workers=args.workers, steps=args.steps, sync_every=1)
    base["eval_every"] = args.steps
    t0 = time.perf_counter()
    plain = eq8(TrainConfig(**base), sites)
    print(f"{args.preset}, P = {args.workers}, {args.steps} steps, barrier every step")
    print(f"{'z':>6} {'C':>7} {'epsilon':>10} {'Eq. 8':>8} {'delta':>8}")
    print(f"{'off':>6} {'':>7} {'':>10} {plain:8.4f} {'':>8}")
    for arm in args.arms:
        z, c = (float(v) for v in arm.split(","))
        cfg = TrainConfig(**base, privacy={"er_noise": z, "er_clip": c})
        loss = eq8(cfg, sites)
        eps = er_epsilon_spent(cfg.privacy, cfg.steps)
        print(f"{z:6g} {c:7g} {eps:10.3g} {loss:8.4f} {loss - plain:+8.4f}", flush=True)
    print(f"(delta = {TrainConfig(**base).privacy.delta:g}; {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
