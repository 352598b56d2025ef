"""What an uneven split costs in model quality: Eq. 8 of ``--layers-per-group 4,4,2,2``
against the even 3,3,3,3 at equal tokens (same steps, batch and data), paired by seed.

Each (split, seed) trains with the reference engine in this process (the ring equals it
bit for bit, so no workers are needed) and reports its final validation loss (Eq. 8);
then Δ = uneven − even per seed, with its mean and spread. One thread: run it alone, or
niced, on a shared machine.

    python benchmarks/uneven.py                               # cpu-small, 3 seeds
    python benchmarks/uneven.py --split 6,2,2,2 --seeds 0 1 --steps 60
    python benchmarks/uneven.py --out benchmarks/results/uneven/cpu-small.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"


def final_eq8(train: dict, sites_root: Path) -> tuple[float, float]:
    """(final Eq. 8, seconds) of one reference-engine run of ``train``."""
    import torch

    from mobius_fed.config import TrainConfig
    from mobius_fed.data import SiteData
    from mobius_fed.engine import ReferenceEngine

    torch.set_num_threads(1)
    cfg = TrainConfig(**train)
    seq = cfg.model().seq_len
    sites = [SiteData(sites_root / f"site-{i}", seq, cfg.encoding) for i in range(cfg.P)]
    engine = ReferenceEngine(cfg, sites)
    start = time.perf_counter()
    for _ in range(cfg.steps):
        engine.train_step()
    return engine.evaluate().loss, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--split", default="4,4,2,2", help="the uneven split (default: %(default)s)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--loops", type=int, default=1)
    ap.add_argument("--order", default="cyclic")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--data", type=Path, default=SHAKESPEARE, help="text (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write the rows and the summary as JSON")
    args = ap.parse_args()

    from mobius_fed.data import embedded_corpus, prepare_sites

    split = [int(n) for n in args.split.split(",")]
    P = len(split)
    base = dict(
        preset=args.preset,
        workers=P,
        loops=args.loops,
        order=args.order,
        steps=args.steps,
        batch_size=args.batch_size,
        eval_every=0,
        eval_batches=args.eval_batches,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "sites"
        if args.data.is_file():
            prepare_sites([args.data], root, P)
        else:
            prepare_sites(None, root, P, text=embedded_corpus())
        for seed in args.seeds:
            for name, lpg in (("even", None), ("uneven", split)):
                loss, secs = final_eq8({**base, "seed": seed, "layers_per_group": lpg}, root)
                rows.append({"seed": seed, "split": name, "eq8": loss, "seconds": secs})
                print(f"seed {seed} {name:>6} {args.split if lpg else 'even':>8}: "
                      f"Eq. 8 {loss:.4f} ({secs:.0f} s)", flush=True)  # fmt: skip
    eq8 = {(r["seed"], r["split"]): r["eq8"] for r in rows}
    deltas = [eq8[s, "uneven"] - eq8[s, "even"] for s in args.seeds]
    mean = statistics.fmean(deltas)
    sd = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
    print(f"Δ Eq. 8 ({args.split} − even), per seed: {', '.join(f'{d:+.4f}' for d in deltas)}")
    print(f"mean Δ {mean:+.4f} ± {sd:.4f} (sd over {len(deltas)} seeds)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = {"split": args.split, "deltas": deltas, "mean": mean, "sd": sd}
        args.out.write_text(json.dumps({"config": base, "rows": rows, **summary}, indent=2))


if __name__ == "__main__":
    main()
