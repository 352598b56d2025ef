"""Ring or DiLoCo? Quality per token of the arms of issue 44 on the same sites, in the
reference engine (one process; ring == reference is tested, so these are the losses a
ring of real workers would report).

Every arm sees the same S sites (embedded corpus, cut into S parts), the same tokens per
site per step and the same model preset; printed per arm: the held-out Eq. 8 loss over all
S sites at the end (mean and the spread over seeds), and the fp32 bytes a site sends per
step, *computed* from the shapes (not measured): the ring ships 2·P·L hidden states or
gradients of batch×seq×d_model per site and step; a ring sync or DiLoCo round ships each
site's F_i (and E/R) out and back once per H steps.

    python benchmarks/peers.py                        # 4 sites, cpu-tiny, 100 steps, 3 seeds
    python benchmarks/peers.py --steps 200 --seeds 0 1 2 --json benchmarks/results/peers.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.engine.rings import make_engine
from mobius_fed.strategies import RingPlan, RoundPlan, make_strategy


@dataclass(frozen=True)
class Arm:
    name: str
    train: dict[str, Any]  # TrainConfig fields beyond the common ones
    strategy: str = "fedavg"
    alone: bool = False  # each site trains its own whole model, never averaged


def arms(S: int) -> list[Arm]:
    def diloco(H: int) -> Arm:
        train = dict(workers=S, rings=S, sync_every=H, ring_sync_every=H, ring_outer="diloco")
        return Arm(f"DiLoCo H={H} (P=1, R={S})", train, "diloco")

    out = [
        Arm(f"cyclic ring (P={S})", dict(workers=S)),
        Arm(f"ordered ring (P={S})", dict(workers=S, order="ordered")),
        *(diloco(H) for H in (1, 10, 50)),
        Arm(f"FedAvg every step (P=1, R={S})", dict(workers=S, rings=S)),
    ]
    if S % 2 == 0 and S > 2:
        out.append(Arm(f"rings of rings (R=2, P={S // 2}, H=1)", dict(workers=S, rings=2)))
    out.append(Arm("each site alone (P=1)", dict(workers=1, sync_every=0), alone=True))
    return out


def bytes_per_site_step(cfg: TrainConfig, strategy_rounds: int) -> float:
    """fp32 bytes one site sends per step, from the shapes (see the module docstring)."""
    mc = cfg.model()
    hidden = cfg.batch_size * mc.seq_len * mc.d_model * 4
    ring = 2 * cfg.P * cfg.loops * hidden if cfg.P > 1 else 0
    from mobius_fed.model import build_group, build_replica

    group = sum(p.numel() for p in build_group(mc, 0, 0).parameters()) * 4
    er = sum(t.numel() for t in build_replica(mc, 0).shared_state_dict().values()) * 4
    syncs = (group / cfg.ring_sync_every if cfg.rings > 1 else 0) + er / max(1, cfg.sync_every)
    return ring + (syncs if strategy_rounds else 0)


def run_arm(arm: Arm, common: dict, sites: list[Path], seed: int) -> tuple[float, float]:
    """(held-out Eq. 8 over every site at the end, bytes per site and step)."""
    cfg = TrainConfig(**common, **arm.train, seed=seed)
    seq = cfg.model().seq_len
    if arm.alone:
        losses = []
        for d in sites:
            engine = ReferenceEngine(cfg, [SiteData(d, seq)])
            for _ in range(cfg.steps):
                engine.train_step()
            losses.append(engine.evaluate().loss)
        return statistics.fmean(losses), 0.0
    engine = make_engine(cfg, [SiteData(d, seq) for d in sites])
    strategy = make_strategy(arm.strategy, cfg.workers, RoundPlan.of(cfg), rings=RingPlan.of(cfg))
    grid = train_with_strategy(engine, strategy)
    return grid.evals[-1].loss, bytes_per_site_step(cfg, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--preset", default="cpu-tiny")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    common = dict(
        preset=args.preset,
        steps=args.steps,
        batch_size=args.batch_size,
        optimizer="adamw",
        eval_every=0,
        eval_batches=4,
    )
    with tempfile.TemporaryDirectory() as tmp:
        sites = prepare_sites(None, Path(tmp) / "sites", args.sites, text=embedded_corpus())
        rows = []
        for arm in arms(args.sites):
            t0 = time.perf_counter()
            runs = [run_arm(arm, common, sites, s) for s in args.seeds]
            losses = [r[0] for r in runs]
            rows.append(
                {
                    "arm": arm.name,
                    "eval_loss_mean": statistics.fmean(losses),
                    "eval_loss_sd": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                    "eval_losses": losses,
                    "bytes_per_site_step": runs[0][1],
                    "seconds": time.perf_counter() - t0,
                }
            )
            r = rows[-1]
            print(
                f"| {r['arm']} | {r['eval_loss_mean']:.4f} ± {r['eval_loss_sd']:.4f} | "
                f"{r['bytes_per_site_step'] / 1e6:.3f} MB |",
                flush=True,
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
