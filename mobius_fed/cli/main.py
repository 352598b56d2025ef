"""``mobius-fed``: local training, the paper's experiment, data preparation, certificates."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from mobius_fed.cli.common import (
    CliError,
    add_resume_flag,
    console,
    resolve_sites,
    run_guarded,
)

if TYPE_CHECKING:  # torch loads only for the commands that train
    from mobius_fed.config import TrainConfig

TRAIN_FLAGS = {
    # flag: (config key, type, help)
    "--preset": ("preset", str, "model preset (cpu-tiny, cpu-small, cpu-base, gpt2-small)"),
    "--workers": ("workers", int, "P: workers / block groups / origins"),
    "--steps": ("steps", int, "training steps"),
    "--batch-size": ("batch_size", int, "sequences per origin per step"),
    "--seq-len": ("seq_len", int, "sequence length (default: the preset's)"),
    "--micro-batches": ("micro_batches", int, "micro-batches per stream"),
    "--optimizer": ("optimizer", str, "muon (blocks) + adamw, or adamw for everything"),
    "--lr-adam": ("lr_adam", float, "AdamW learning rate"),
    "--lr-muon": ("lr_muon", float, "Muon learning rate"),
    "--sync-every": ("sync_every", int, "average E/R replicas every k steps (0 = never)"),
    "--eval-every": ("eval_every", int, "evaluate (Eq. 8) every k steps"),
    "--eval-batches": ("eval_batches", int, "validation batches per origin"),
    "--seed": ("seed", int, "random seed"),
    "--encoding": ("encoding", str, "tokenizer: bytes (no download) or gpt2"),
}


def add_train_flags(p: argparse.ArgumentParser, *, with_loops: bool = True) -> None:
    p.add_argument("--config", type=Path, help="TOML file with a [train] table")
    for flag, (key, typ, help_) in TRAIN_FLAGS.items():
        p.add_argument(flag, dest=key, type=typ, help=help_)
    if with_loops:
        p.add_argument("--loops", dest="loops", type=int, help="L: passes over the P groups")
        p.add_argument("--order", dest="order", help="cyclic (Möbius) or ordered (baseline)")
    p.add_argument(
        "--untied",
        dest="tied",
        action="store_false",
        default=None,
        help="separate embedding and head",
    )


def train_overrides(args: argparse.Namespace, keys: list[str]) -> dict:
    return {k: getattr(args, k, None) for k in keys}


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
        console=console,
    )


def cmd_local(args: argparse.Namespace) -> int:
    from mobius_fed.config import load_train_config
    from mobius_fed.engine import ReferenceEngine
    from mobius_fed.engine.trainer import CHECKPOINT, train

    keys = [v[0] for v in TRAIN_FLAGS.values()] + ["loops", "order", "tied"]
    cfg = load_train_config(args.config, train_overrides(args, keys))
    out = Path(args.out)
    if args.resume and not (out / CHECKPOINT).is_file():
        raise CliError(f"--resume: no checkpoint at {out / CHECKPOINT}")
    sites = resolve_sites(cfg, args.data, out)
    engine = ReferenceEngine(cfg, sites)
    mc = cfg.model()
    console.print(
        f"[bold]mobius-fed local[/]: {cfg.preset} ({mc.n_layer} layers, d={mc.d_model}), "
        f"P={cfg.P} L={cfg.loops} K={cfg.K} order={cfg.order}, {cfg.steps} steps, "
        f"data: {', '.join(str(s.directory) for s in sites)}"
    )
    start = time.perf_counter()
    with _progress() as bar:
        task = bar.add_task("train", total=cfg.steps, loss=float("nan"), tps=0.0)

        def on_step(r) -> None:
            bar.update(task, completed=r.step + 1, loss=r.loss, tps=r.tokens / max(r.seconds, 1e-9))

        def on_eval(e) -> None:
            bar.console.print(f"step {e.step}: validation loss (Eq. 8) {e.loss:.4f}")

        evals = train(
            engine,
            out,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            on_step=on_step,
            on_eval=on_eval,
        )
    wall = time.perf_counter() - start
    if evals:
        final = evals[-1]
        per = ", ".join(f"s{s}={v:.4f}" for s, v in enumerate(final.origin_losses))
        print(f"final validation loss (Eq. 8): {final.loss:.4f}  per origin: {per}")
    print(f"wall time {wall:.1f}s; checkpoint {out / CHECKPOINT}; metrics {out / 'metrics.jsonl'}")
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from mobius_fed.config import load_train_config
    from mobius_fed.engine.experiment import markdown_table, plot_curves, run_experiment
    from mobius_fed.schedule import ORDERS

    keys = [v[0] for v in TRAIN_FLAGS.values()] + ["tied"]
    cfg = load_train_config(args.config, train_overrides(args, keys))
    for order in args.orders:
        if order not in ORDERS:
            raise CliError(f"unknown order {order!r} (expected one of {', '.join(ORDERS)})")
    for L in args.loops:
        if L < 1:
            raise CliError(f"--loops: L must be ≥ 1, got {L}")
    out = Path(args.out)
    sites = resolve_sites(cfg, args.data, out)

    def on_arm(c: TrainConfig) -> None:
        console.print(f"training L={c.loops} order={c.order} (K={c.K}, {c.steps} steps)")

    arms = run_experiment(cfg, sites, args.loops, args.orders, out, on_arm=on_arm)
    table = markdown_table(arms, cfg.P)
    (out / "table.md").write_text(table)
    print(table)
    png = plot_curves(arms, out / "validation.png")
    print(f"table: {out / 'table.md'}; curves: {png or 'matplotlib not installed, no PNG'}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from mobius_fed.data import embedded_corpus, prepare_sites

    out = Path(args.out)
    wanted = [out / f"site-{i}" for i in (range(args.sites) if args.site is None else [args.site])]
    if args.if_missing and all((d / "meta.json").is_file() for d in wanted):
        print(f"sites already prepared in {out}; nothing to do")
        return 0
    text = embedded_corpus() if not args.inputs else None
    dirs = prepare_sites(
        args.inputs or None,
        out,
        args.sites,
        args.encoding,
        args.val_fraction,
        text=text,
        overwrite=args.overwrite or args.if_missing,
        only=args.site,
    )
    for d in dirs:
        print(d)
    return 0


def cmd_certs_init(args: argparse.Namespace) -> int:
    from mobius_fed.transport.certs import init_certs

    if args.if_missing and (Path(args.out) / "ca.crt").is_file():
        print(f"certificates already in {args.out}; nothing to do")
        return 0
    layout = init_certs(Path(args.out), args.workers, args.host or (), overwrite=args.overwrite)
    print(f"CA and certificates for {args.workers} workers, coordinator, operator in {layout.root}")
    return 0


def cmd_certs_renew(args: argparse.Namespace) -> int:
    from mobius_fed.transport.certs import identity_of, renew_node

    try:
        node = renew_node(Path(args.out), args.node, args.host or (), days=args.days)
    except KeyError as exc:
        raise CliError(str(exc)) from None
    print(
        f"new key and certificate for {args.node} ({identity_of(args.node)}) in "
        f"{node.cert.parent}: deploy it to that node only. Its old certificate stays valid "
        "until it expires; `mobius-fed certs rotate` cuts it off now."
    )
    return 0


def cmd_certs_rotate(args: argparse.Namespace) -> int:
    from mobius_fed.transport.certs import rotate_ca

    layout = rotate_ca(Path(args.out), args.host or (), days=args.days)
    print(
        f"new CA and certificates for {layout.workers} workers, coordinator, operator in "
        f"{layout.root}: deploy every nodes/<node>/ bundle and restart every node"
    )
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from mobius_fed.cli.coordinator import parse_options
    from mobius_fed.cli.up import cmd_up as run_up
    from mobius_fed.config import load_train_config

    keys = [v[0] for v in TRAIN_FLAGS.values()] + ["loops", "order", "tied"]
    cfg = load_train_config(args.config, train_overrides(args, keys))
    args.strategy_options = parse_options(args.strategy_option)
    return run_up(args, cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mobius-fed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("local", help="train with the single-process reference engine")
    add_train_flags(p)
    p.add_argument(
        "--data",
        type=Path,
        nargs="+",
        help="a prepared directory of site-<i>/ folders, or .txt/.jsonl files "
        "(default: the embedded corpus)",
    )
    p.add_argument("--out", default="runs/local", help="run directory (checkpoint, metrics)")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.set_defaults(func=cmd_local)

    p = sub.add_parser("experiment", help="the paper's Table 1: ordered-loop vs Möbius")
    add_train_flags(p, with_loops=False)
    p.add_argument("--loops", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--orders", nargs="+", default=["ordered", "cyclic"])
    p.add_argument("--data", type=Path, nargs="+")
    p.add_argument("--out", default="runs/experiment")
    p.set_defaults(func=cmd_experiment)

    p = sub.add_parser("up", help="coordinator + P workers as processes on this machine")
    add_train_flags(p)
    p.add_argument("--out", default="runs/up", help="certs, sites, logs, checkpoints")
    p.add_argument("--strategy", default="fedavg", help="fedavg, fedavgm, fedadam, fedyogi, …")
    p.add_argument("--strategy-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--checkpoint-every", type=int, default=0, help="rounds (0: at the end)")
    p.add_argument(
        "--keep-checkpoints", type=int, help="complete manifests to keep (coordinator's default)"
    )
    p.add_argument(
        "--rejoin-timeout",
        type=float,
        help="seconds an incident waits for a lost worker to come back (coordinator's default)",
    )
    p.add_argument(
        "--max-incidents",
        type=int,
        help="incidents the run recovers from before it fails (coordinator's default)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="times up restarts each crashed process (0: never); a worker comes back with the "
        "same command, the coordinator with --resume auto",
    )
    add_resume_flag(
        p,
        "continue from the newest complete manifest; --resume auto: only if there is one",
    )
    p.set_defaults(func=cmd_up)

    from mobius_fed.cli.health import add_health_parser
    from mobius_fed.cli.status import add_status_parser
    from mobius_fed.cli.testbed import add_testbed_parser

    add_status_parser(sub)
    add_health_parser(sub)
    add_testbed_parser(sub)

    p = sub.add_parser("prepare", help="split text into per-site shard directories")
    p.add_argument("inputs", type=Path, nargs="*", help=".txt/.jsonl/.parquet (default: embedded)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--encoding", default="bytes")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--site", type=int, help="write only site I (same split)")
    p.add_argument(
        "--if-missing", action="store_true", help="do nothing when the site(s) exist already"
    )
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("certs", help="certificate authority and node certificates")
    csub = p.add_subparsers(dest="certs_command", required=True)
    c = csub.add_parser("init", help="make a CA and certificates for every node")
    c.add_argument("--workers", type=int, required=True)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--host", action="append", help="extra DNS name or IP for every node")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when OUT/ca.crt exists (a one-shot init job)",
    )
    c.set_defaults(func=cmd_certs_init)
    c = csub.add_parser("renew", help="new key and certificate for one node, same identity")
    c.add_argument("--node", required=True, help="worker-<i>, coordinator or operator")
    c.add_argument("--out", type=Path, required=True, help="the directory certs init wrote")
    c.add_argument("--host", action="append", help="extra DNS name or IP for the node")
    c.add_argument("--days", type=int, default=365, help="validity (default: 365)")
    c.set_defaults(func=cmd_certs_renew)
    c = csub.add_parser(
        "rotate", help="new CA and certificates for every node (old ones stop working)"
    )
    c.add_argument("--out", type=Path, required=True, help="the directory certs init wrote")
    c.add_argument("--host", action="append", help="extra DNS name or IP for every node")
    c.add_argument("--days", type=int, default=365, help="validity (default: 365)")
    c.set_defaults(func=cmd_certs_rotate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(args.func, args)


if __name__ == "__main__":
    raise SystemExit(main())
