"""``mobius-fed audit``: what a curious neighbour learns from the ring, measured.

Trains on the reference engine (it hands on exactly what a ring exchanges) while two
workers keep what they legitimately receive, then attacks: target recovery at the last
hop, input inversion at the first remote hop. ``--sweep`` repeats this for each defence
strength and writes a trade-off table (and a figure with matplotlib). ``--leakage`` runs
the input attacks at every hop of the victim's stream and the coordinator's attack on the
victim's E/R update instead. ``--patient`` runs the patient neighbour (every site's first
remote hop, every window of ``--windows``, known plaintext, an MLP decoder, clusters and a
decipher with ``--public``'s bigrams): the audit that takes every subspace mode, the learned
bottleneck included (its code and the receiver's decoder output are both attacked).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from mobius_fed.cli.common import (
    CliError,
    add_data_flag,
    add_threads_flag,
    add_train_flags,
    apply_threads,
    console,
    resolve_sites,
    train_config_from_args,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mobius_fed.config import TrainConfig
    from mobius_fed.data import SiteData
    from mobius_fed.privacy.audit import AuditReport


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit",
        help="measure what a curious ring neighbour learns (target recovery, input inversion)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_flags(p)
    add_data_flag(p)
    add_threads_flag(p)
    p.add_argument("--out", type=Path, default=Path("runs/audit"), help="output directory")
    p.add_argument("--victim", type=int, default=0, help="origin whose stream is attacked")
    p.add_argument(
        "--inverter-steps", type=int, default=400, help="training steps of the inversion model"
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="one audit per defence strength: sweep.md, sweep.json, sweep.png in --out",
    )
    p.add_argument(
        "--only",
        metavar="ROWS",
        help="with --sweep: a comma-separated subset of the sweep's rows, e.g. "
        "'none,label σ=1,input σ=1' (default: all)",
    )
    p.add_argument(
        "--leakage",
        action="store_true",
        help="input attacks at every hop (nearest row of E, clusters, known plaintext, "
        "inverter) and the coordinator's attack on the victim's E/R update: "
        "leakage.md and leakage.json in --out",
    )
    add_patient_flags(p)
    p.add_argument(
        "--public-seed-noise",
        action="store_true",
        help="key noise by the public seed instead of fresh site secrets in OUT/keys "
        "(shows that the attacker then subtracts it)",
    )
    p.add_argument(
        "--write-keys",
        type=Path,
        metavar="DIR",
        help="only write one fresh noise key per site (DIR/site-<s>.key, for "
        "--privacy-noise-key-dir; give each site only its own file) and the coordinator's "
        "(DIR/coordinator.key, for --privacy-er-noise; the coordinator's host only) and exit",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_audit)


def add_patient_flags(p: argparse.ArgumentParser) -> None:
    """``--patient`` and what only it reads."""
    p.add_argument(
        "--patient",
        action="store_true",
        help="the patient neighbour at every site's first remote hop, every window and "
        "attack (any subspace mode, the bottleneck's code included): patient.md and "
        "patient.json in --out",
    )
    p.add_argument(
        "--public",
        type=Path,
        default=Path("../shared/data/tinyshakespeare.txt"),
        help="with --patient: a public text (read as bytes) whose bigrams the decipher uses",
    )
    p.add_argument(
        "--windows", default="1,2,4,8,16,32", help="with --patient: window lengths in steps"
    )
    p.add_argument("--known", default="0.01,0.05", help="with --patient: known fractions")


def cmd_audit(args: argparse.Namespace) -> int:
    from mobius_fed.defences.stages import write_site_keys
    from mobius_fed.privacy.audit import Audit
    from mobius_fed.privacy.sweep import select, sweep, write_outputs

    cfg = train_config_from_args(args)
    if args.write_keys is not None:
        if any(args.write_keys.glob("site-*.key")):
            raise CliError(f"{args.write_keys} already holds site keys; not overwriting them")
        for path in write_site_keys(args.write_keys, cfg.P):
            console.print(f"wrote {path}")
        return 0
    apply_threads(args)
    if args.inverter_steps < 1:
        raise CliError(f"--inverter-steps must be >= 1 (got {args.inverter_steps})")
    grid = select(args.only)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sites = resolve_sites(cfg, args.data, out)
    if args.leakage and args.patient:
        raise CliError("--leakage and --patient are two audits: run one at a time")
    if (args.leakage or args.patient) and (args.sweep or args.only):
        raise CliError(
            f"--{'leakage' if args.leakage else 'patient'} runs no sweep: drop --sweep and --only"
        )
    if args.leakage:
        return leakage(cfg, sites, args, out)
    keys = cfg.privacy.noise_key_dir
    if keys is None and not args.public_seed_noise:
        keys = str(out / "keys")
        write_site_keys(keys, cfg.P)
    if args.patient:
        return patient(with_keys(cfg, keys), sites, args, out)
    if args.sweep:
        rows = sweep(
            cfg,
            sites,
            grid=grid,
            noise_key_dir=keys,
            inverter_steps=args.inverter_steps,
            log=console.print,
        )
        for path in write_outputs(rows, out):
            console.print(f"wrote {path}")
        print((out / "sweep.md").read_text(), end="")
        return 0
    cfg = with_keys(cfg, keys)
    report = Audit(
        cfg, sites, victim=args.victim, inverter_steps=args.inverter_steps, log=console.print
    ).run()
    doc = json.dumps(report.as_dict(), indent=2)
    (out / "audit.json").write_text(doc + "\n")
    print(doc if args.json else describe(report))
    return 0


def with_keys(cfg: TrainConfig, keys: str | None) -> TrainConfig:
    """``cfg`` with its noise keyed by the site keys in ``keys`` (None: the public seed)."""
    return cfg.model_copy(
        update={"privacy": cfg.privacy.model_copy(update={"noise_key_dir": keys})}
    )


def leakage(
    cfg: TrainConfig, sites: Sequence[SiteData], args: argparse.Namespace, out: Path
) -> int:
    """``--leakage``: what every hop and the coordinator learn of the victim's tokens."""
    from mobius_fed.privacy.leakage import LeakageAudit
    from mobius_fed.privacy.leakage_report import describe as describe_leakage

    report = LeakageAudit(
        cfg, sites, victim=args.victim, inverter_steps=args.inverter_steps, log=console.print
    ).run()
    doc, text = json.dumps(report.as_dict(), indent=2), describe_leakage(report)
    (out / "leakage.json").write_text(doc + "\n")
    (out / "leakage.md").write_text(text + "\n")
    print(doc if args.json else text)
    return 0


def patient(
    cfg: TrainConfig, sites: Sequence[SiteData], args: argparse.Namespace, out: Path
) -> int:
    """``--patient``: every site's first remote hop against the patient neighbour."""
    from mobius_fed.privacy.patient import PatientAudit, public_tokens, write_report

    try:
        windows = [int(w) for w in args.windows.split(",")]
        known = [float(f) for f in args.known.split(",")]
    except ValueError as e:
        raise CliError(
            f"--windows takes integers, --known fractions, comma-separated: {e}"
        ) from None
    report = PatientAudit(
        cfg, sites, public_tokens(args.public), windows=windows, known=known, log=console.print
    ).run()
    for path in write_report(report, out):
        console.print(f"wrote {path}")
    print((out / "patient.md").read_text(), end="")
    return 0


def describe(report: AuditReport) -> str:
    t, inv = report.target, report.inversion
    lines = [
        f"audit: {report.preset}, {report.order} order, {report.steps} steps, "
        f"Eq. 8 validation loss {report.eval_loss:.4f}",
        f"(a) target recovery at the last hop (worker {t.attacker} attacks origin {t.victim}): "
        f"{100 * t.accuracy:.2f} % of {t.tokens} targets "
        f"(step 0: {100 * (t.first_step or 0):.1f} %, last step: {100 * (t.last_step or 0):.1f} %;"
        f" the head alone: {100 * t.model_accuracy:.2f} %; chance {100 * report.chance:.2f} %)",
    ]
    if t.home_layer != "off":
        per_token = (
            "not run (the block layer mixes tokens)"
            if t.surrogate_accuracy is None
            else f"{100 * t.surrogate_accuracy:.2f} %"
        )
        lines.append(
            f"    with the private home layer ({t.home_layer}): the head R on h "
            f"{100 * t.accuracy:.2f} %, a fitted linear map {100 * (t.linear_accuracy or 0):.2f} "
            f"%, through {t.surrogate} as a stand-in: per token {per_token}, gradient matching "
            f"{100 * (t.matching_accuracy or 0):.2f} %, gradient clusters labelled by its model "
            f"{100 * (t.cluster_accuracy or 0):.2f} % (groups of one target: "
            f"{100 * (t.cluster_purity or 0):.1f} %, shuffled targets "
            f"{100 * (t.cluster_purity_chance or 0):.1f} %); best {100 * t.best_accuracy:.2f} %"
        )
    if inv is not None:
        lines.append(
            f"(b) input inversion at the first remote hop (slot {inv.slot}, worker "
            f"{inv.attacker} attacks origin {inv.victim}'s held-out text): exact "
            f"{100 * inv.exact:.2f} %, top-5 {100 * inv.top5:.2f}% of {inv.tokens} tokens "
            f"(most frequent token {100 * inv.frequency_baseline:.2f} %; "
            f"chance {100 * report.chance:.2f} %)"
        )
    if report.epsilon is not None:
        lines.append(
            f"label defence: (ε, δ) = ({report.epsilon:.3g}, {report.privacy['delta']:g}) "
            f"after {report.steps} steps"
        )
    return "\n".join(lines)
