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

``--input-defence`` measures the private input layer (``privacy.home_input``): every
variant (or ``--variants``) on every ``--seeds``, the input attacks at the first remote hop
and the Eq. 8 price against "none" on the same seed (input_defence.md / .json in --out;
``--merge`` joins earlier input_defence.json files instead of training):

    python benchmarks/privacy_audit.py --input-defence --preset cpu-tiny --steps 60 \
        --seeds 0,1,2 --out runs/input-defence
``--patient`` runs the patient neighbour's attacks (docs/privacy.md §4i) on every site's
first remote hop, over every window an attacker may choose (``--windows`` lengths, each from
step 0, mid-run and at the end; ``--known`` fractions, ``--mask-seeds``; linear map, codebook,
class means and an MLP decoder), against every setting of
:data:`mobius_fed.privacy.pareto.SETTINGS` (or ``--variants``);
``--price-only`` trains without attacking (Eq. 8 only, e.g. at cpu-small). A learned
bottleneck's setting (``bottleneck-home d/4 + codec`` …) is attacked on its code and on the
receiver's decoder output, the worst of both counting (docs/privacy.md §4k). Each run is
appended to pareto.json in --out; ``--merge`` joins pareto.json files and draws the front:

    python benchmarks/privacy_audit.py --patient --preset cpu-tiny --steps 60 \
        --seeds 0 --public ../shared/data/tinyshakespeare.txt --out runs/patient
    python benchmarks/privacy_audit.py --patient --price-only --preset cpu-small \
        --steps 60 --seeds 0 --out runs/patient-small
    python benchmarks/privacy_audit.py --patient --merge runs/patient/pareto.json \
        runs/patient-small/pareto.json --out runs/pareto --figure docs/privacy_pareto.png

Any other flag (``--seed``, ``--optimizer``, ``--no-tied`` …) goes on to ``mobius-fed audit``.

Every Δ in the table is measured against the no-defence row of the same run.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mobius_fed.cli.main import main


def run() -> int:
    # No abbreviations: "--seed N" must reach the audit, not be read as this script's "--seeds".
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
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
    p.add_argument("--input-defence", action="store_true", help="the input layer's price")
    p.add_argument("--seeds", default="0", help="with --input-defence: comma-separated seeds")
    p.add_argument("--variants", default=None, help="with --input-defence: a subset of rows")
    p.add_argument("--patient", action="store_true", help="the patient neighbour's attacks")
    p.add_argument("--price-only", action="store_true", help="with --patient: Eq. 8 only")
    p.add_argument(
        "--windows", default="1,2,4,8,16,32", help="with --patient: window lengths (steps)"
    )
    p.add_argument("--known", default="0.01,0.05", help="with --patient: known fractions")
    p.add_argument("--mask-seeds", default="0", help="with --patient: known-mask seeds")
    p.add_argument("--no-decoder", action="store_true", help="with --patient: skip the MLP")
    p.add_argument(
        "--subspace", default="off", help="with --patient: rank=K[,mode=…] (compression.py)"
    )
    p.add_argument("--wire", default="none", help="with --patient: the wire codecs")
    p.add_argument(
        "--public",
        default="../shared/data/tinyshakespeare.txt",
        help="with --patient: the attacker's public text (bigrams)",
    )
    p.add_argument("--cluster-sweep", default="16,32,48,64,96", help="with --patient: k values")
    p.add_argument("--decipher-sweep", default="48,64,96", help="with --patient: k values")
    p.add_argument("--figure", default=None, help="with --patient --merge: the front's PNG")
    a, extra = p.parse_known_args()
    if a.patient:
        return patient(a)
    if a.input_defence:
        return input_defence(a)
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


def input_defence(a: argparse.Namespace) -> int:
    """``--input-defence``: each variant × seed, the table rewritten after every run."""
    from pathlib import Path

    import torch

    from mobius_fed.cli.common import resolve_sites
    from mobius_fed.config import TrainConfig
    from mobius_fed.defences.stages import write_site_keys
    from mobius_fed.privacy import input_defence as idf

    out = Path(a.out)
    if a.merge:
        runs = idf.load_runs([Path(x) for x in a.merge])
        idf.write_outputs(runs, out)
        print((out / "input_defence.md").read_text(), end="")
        return 0
    torch.set_num_threads(a.threads)
    keys = out / "keys"
    if not keys.exists():
        write_site_keys(keys, a.workers)
    variants, runs = idf.select_variants(a.variants), []
    for seed in [int(x) for x in a.seeds.split(",")]:
        cfg = TrainConfig(
            preset=a.preset,
            workers=a.workers,
            steps=a.steps,
            batch_size=a.batch_size,
            eval_every=0,
            seed=seed,
            privacy={"noise_key_dir": str(keys)},
        )
        sites = resolve_sites(cfg, None, out)
        for name in variants:
            runs.append(idf.measure(cfg, sites, name, inverter_steps=a.inverter_steps))
            idf.write_outputs(runs, out)
            print(f"{name} seed {seed}: Eq. 8 {runs[-1].eval_loss:.4f}", flush=True)
    print((out / "input_defence.md").read_text(), end="")
    return 0


def ints(text: str) -> list[int]:
    """A comma-separated list of integers."""
    return [int(x) for x in text.split(",")]


def setting_config(a: argparse.Namespace, fields: dict, seed: int, keys):
    """The TrainConfig of one setting: its privacy fields, and its wire (``wire``,
    ``subspace`` with rank=d/N read as d_model / N; else --wire and --subspace)."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.model.config import PRESETS
    from mobius_fed.privacy.pareto import WIRE_KEYS
    from mobius_fed.transport.wire_config import WireConfig

    sys.path.insert(0, str(Path(__file__).parent))
    from compression import parse_subspace

    privacy = {k: v for k, v in fields.items() if k not in WIRE_KEYS}
    wire_text, sub_text = fields.get("wire", a.wire), fields.get("subspace", a.subspace)
    d = PRESETS[a.preset]["d_model"]
    sub_text = re.sub(r"rank=d/(\d+)", lambda m: f"rank={d // int(m.group(1))}", sub_text)
    extra: dict = {}
    if wire_text != "none":
        extra["wire"] = WireConfig.parse_flag(wire_text)
    if sub_text != "off":
        extra["subspace"] = parse_subspace(sub_text)
    return TrainConfig(
        preset=a.preset, workers=a.workers, steps=a.steps, batch_size=a.batch_size,
        eval_every=0, seed=seed, privacy={"noise_key_dir": str(keys), **privacy}, **extra,
    )  # fmt: skip


def patient(a: argparse.Namespace) -> int:
    """``--patient``: each setting × seed attacked (or priced), pareto.json after every run."""
    import time

    import torch

    from mobius_fed.cli.common import resolve_sites
    from mobius_fed.defences.stages import write_site_keys
    from mobius_fed.engine.reference import ReferenceEngine
    from mobius_fed.privacy import pareto
    from mobius_fed.privacy.patient import PatientAudit, public_tokens, write_report

    sys.path.insert(0, str(Path(__file__).parent))
    from compression import step_bytes

    out = Path(a.out)
    if a.merge:
        runs = pareto.load([Path(x) for x in a.merge])
        pareto.save(runs, out)
        if a.figure:
            pareto.figure(runs, Path(a.figure), a.preset)
        print((out / "pareto.md").read_text(), end="")
        return 0
    torch.set_num_threads(a.threads)
    keys = out / "keys"
    if not keys.exists():
        write_site_keys(keys, a.workers)
    public = None if a.price_only else public_tokens(Path(a.public))
    runs = pareto.load([out / "pareto.json"]) if (out / "pareto.json").exists() else []
    for seed in ints(a.seeds):
        for name, fields in pareto.select(a.variants).items():
            cfg = setting_config(a, fields, seed, keys)
            sites = resolve_sites(cfg, None, out)
            sent, fp32 = step_bytes(cfg)
            ids = cfg.subspace.on and cfg.subspace.mode == "tokens"
            sends = "hidden states + token ids" if ids else "hidden states"
            if cfg.subspace.bottleneck:
                sends = "a learned code of hidden states"
            t0 = time.perf_counter()
            if public is None or ids:  # token ids in the clear: nothing for an attack to read
                eng = ReferenceEngine(cfg, sites)
                for _ in range(cfg.steps):
                    eng.train_step()
                run = pareto.SettingRun(name, a.preset, seed, eng.evaluate().loss)
            else:
                report = PatientAudit(
                    cfg, sites, public, windows=ints(a.windows),
                    known=[float(f) for f in a.known.split(",")],
                    mask_seeds=ints(a.mask_seeds), decoder=not a.no_decoder,
                    cluster_sweep=ints(a.cluster_sweep), decipher_sweep=ints(a.decipher_sweep),
                ).run()  # fmt: skip
                tag = name.replace(" ", "_").replace("=", "").replace("+", "").replace("/", "")
                write_report(report, out / "reports", f"{tag}-seed{seed}")
                worst = {f"{st}: {k}": v for st, d in report.worst().items() for k, v in d.items()}
                floor = max(r.exact for r in report.rows if r.attack.startswith("floor"))
                run = pareto.SettingRun(name, a.preset, seed, report.eval_loss, worst, floor)
            run.ratio, run.sends = fp32 / sent, sends
            runs.append(run)
            pareto.save(runs, out)
            print(f"{name} seed {seed}: Eq. 8 {run.eval_loss:.4f}, {run.ratio:.1f}× "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    print((out / "pareto.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(run())
