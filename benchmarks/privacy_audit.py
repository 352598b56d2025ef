"""The privacy trade-off: attack success against Eq. 8 validation loss per defence strength.

Runs ``mobius-fed audit --sweep`` (one audited training per row of
:data:`mobius_fed.privacy.sweep.DEFAULT_GRID`, all on the same seed and data) and prints
the Markdown table; sweep.md, sweep.json and sweep.png (with matplotlib) land in --out.

    python benchmarks/privacy_audit.py [--preset cpu-small] [--steps 60] [--out runs/privacy]
    python benchmarks/privacy_audit.py --only "label σ=0.1,input σ=4" --out runs/privacy-b
    python benchmarks/privacy_audit.py --merge runs/privacy/sweep.json \
        runs/privacy-b/sweep.json --out runs/privacy-all
    python benchmarks/privacy_audit.py --leakage --preset cpu-tiny --out runs/leakage

``--leakage`` runs ``mobius-fed audit --leakage`` instead: input attacks at every hop and
the coordinator's attack on the victim's E/R update (leakage.md, leakage.json in --out).
Any other flag (``--seed``, ``--optimizer``, ``--no-tied`` …) goes on to ``mobius-fed audit``.

Every Δ in the table is measured against the no-defence row of the same run.
"""

from __future__ import annotations

import argparse
import sys

from mobius_fed.cli.main import main


def run() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--inverter-steps", type=int, default=400)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/privacy")
    p.add_argument("--only", default=None, help="comma-separated subset of the sweep's rows")
    p.add_argument("--leakage", action="store_true", help="every hop and the E/R update")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="SWEEP_JSON",
        help="join the rows of earlier runs' sweep.json files into --out instead of training",
    )
    a, extra = p.parse_known_args()
    if a.merge:
        from pathlib import Path

        from mobius_fed.privacy.sweep import merge

        paths = merge([Path(x) for x in a.merge], Path(a.out))
        print((Path(a.out) / "sweep.md").read_text(), end="")
        return 0 if paths else 1
    argv = [
        "audit",
        "--leakage" if a.leakage else "--sweep",
        "--preset", a.preset,
        "--steps", str(a.steps),
        "--batch-size", str(a.batch_size),
        "--workers", str(a.workers),
        "--eval-every", "0",
        "--inverter-steps", str(a.inverter_steps),
        "--threads", str(a.threads),
        "--out", a.out,
    ]  # fmt: skip
    return main(argv + (["--only", a.only] if a.only else []) + extra)


if __name__ == "__main__":
    sys.exit(run())
