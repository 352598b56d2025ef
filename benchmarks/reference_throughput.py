"""Throughput of the single-process reference engine on the CPU presets.

For each preset (P=4, L=1, cyclic, batch size 8, the preset's sequence length) this builds
a ReferenceEngine on sites cut from the embedded corpus, runs warm-up steps, then times
``--steps`` training steps and prints one table row per preset.

    python benchmarks/reference_throughput.py [--steps 5] [--presets cpu-tiny cpu-small]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.engine import ReferenceEngine
from mobius_fed.model import count_parameters

CPU_PRESETS = ("cpu-tiny", "cpu-small", "cpu-base")


def bench(preset: str, sites_root: Path, args: argparse.Namespace) -> dict:
    cfg = TrainConfig(
        preset=preset,
        workers=args.workers,
        loops=args.loops,
        order=args.order,
        batch_size=args.batch_size,
        steps=args.warmup + args.steps,
        warmup_steps=0,
    )
    mc = cfg.model()
    dirs = prepare_sites(
        None, sites_root, cfg.P, cfg.encoding, text=embedded_corpus(), overwrite=True
    )
    sites = [SiteData(d, mc.seq_len, cfg.encoding) for d in dirs]
    engine = ReferenceEngine(cfg, sites)
    for _ in range(args.warmup):
        engine.train_step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.train_step()
        times.append(time.perf_counter() - t0)
    per_step = statistics.median(times)
    return {
        "preset": preset,
        "params": count_parameters(mc),
        "tokens": cfg.tokens_per_step,
        "s/step": per_step,
        "tokens/s": cfg.tokens_per_step / per_step,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per preset")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps")
    parser.add_argument("--presets", nargs="+", default=list(CPU_PRESETS))
    parser.add_argument("--workers", type=int, default=4, help="P")
    parser.add_argument("--loops", type=int, default=1, help="L")
    parser.add_argument("--order", default="cyclic", choices=("cyclic", "ordered"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be ≥ 1 and --warmup ≥ 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    print(
        f"reference engine, P={args.workers} L={args.loops} {args.order}, "
        f"batch {args.batch_size}/origin, {args.warmup} warm-up + {args.steps} timed steps "
        f"(median), torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print()
    print("| preset | params | tokens/step | s/step | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            r = bench(preset, Path(tmp) / preset, args)
            print(
                f"| {r['preset']} | {r['params'] / 1e6:.2f}M | {r['tokens']:,} "
                f"| {r['s/step']:.3f} | {r['tokens/s']:,.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
