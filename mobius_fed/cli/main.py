"""mobius-fed: train one transformer across machines with Möbius Learning.

Commands for one machine (local, experiment, up), for operators (status, health,
dashboard, certs, prepare) and for testing and research (testbed, audit, sweep, analyze).
The daemons are separate programs: mobius-coordinator and mobius-worker.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mobius_fed import __version__
from mobius_fed.cli.common import (
    CliError,
    add_checkpoint_flag,
    add_data_flag,
    add_threads_flag,
    add_train_flags,
    apply_threads,
    console,
    resolve_sites,
    run_guarded,
    step_progress,
    train_config_from_args,
)
from mobius_fed.tracking import add_tracker_flag, tracked

EPILOG = """\
settings: every training setting is a flag (--steps), a MOBIUS_* variable (MOBIUS_STEPS,
nested: MOBIUS_PRIVACY__LABEL_NOISE) and a key of a TOML file's [train] table (--config);
flags win over variables, variables over the file. See docs/configuration.md.

examples:
  mobius-fed local --preset cpu-tiny --steps 50
  mobius-fed up --workers 4 --steps 200 && mobius-fed status
  mobius-coordinator --help; mobius-worker --help
"""

# Subcommands defined by their own modules: module → the commands it registers.
PLUGINS: dict[str, tuple[str, ...]] = {
    "up": ("up",),
    "status": ("status",),
    "replace": ("replace",),
    "health": ("health",),
    "dashboard": ("dashboard",),
    "testbed": ("testbed",),
    "audit": ("audit",),
    "research": ("experiment", "sweep", "analyze"),
    "certs": ("certs",),
    "export": ("export", "generate", "eval"),
    "relay": ("relay",),
    "plan": ("plan",),
}


def cmd_local(args: argparse.Namespace) -> int:
    from mobius_fed.engine import ReferenceEngine
    from mobius_fed.engine.trainer import CHECKPOINT, train

    cfg = train_config_from_args(args)
    threads = apply_threads(args)
    out = Path(args.out)
    if args.resume and not (out / CHECKPOINT).is_file():
        raise CliError(f"--resume: no checkpoint at {out / CHECKPOINT}")
    sites = resolve_sites(cfg, args.data, out)
    engine = ReferenceEngine(cfg, sites)
    mc = cfg.model()
    console.print(
        f"[bold]mobius-fed local[/]: {cfg.preset} ({mc.n_layer} layers as {cfg.split}, "
        f"d={mc.d_model}), "
        f"P={cfg.P} L={cfg.loops} K={cfg.K} order={cfg.order}, {cfg.steps} steps, "
        f"{threads} thread(s), data: {', '.join(str(s.directory) for s in sites)}"
    )
    if cfg.sync.active:
        console.print(f"E/R every {cfg.sync_every} step(s): {cfg.sync.named()}")
    start = time.perf_counter()
    with step_progress("loss {task.fields[loss]:.4f}", "{task.fields[tps]:,.0f} tok/s") as bar:
        task = bar.add_task("train", total=cfg.steps, loss=float("nan"), tps=0.0)

        def on_step(r) -> None:
            bar.update(task, completed=r.step + 1, loss=r.loss, tps=r.tokens / max(r.seconds, 1e-9))

        def on_eval(e) -> None:
            bar.console.print(f"step {e.step}: validation loss (Eq. 8) {e.loss:.4f}")

        config = cfg.model_dump(mode="json")
        with tracked(args.tracker, out / "metrics.jsonl", config=config):
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


def cmd_prepare(args: argparse.Namespace) -> int:
    from mobius_fed.data import DataError, embedded_corpus
    from mobius_fed.data.prepare import PrepareOptions, prepare_site, prepare_sites

    out = Path(args.out)
    own_site = args.site is not None and args.sites is None and args.only is None
    only = args.only if args.only is not None else (None if own_site else args.site)
    sites = args.sites or 4
    wanted = [args.site] if own_site else (range(sites) if only is None else [only])
    if args.if_missing and all((out / f"site-{i}" / "meta.json").is_file() for i in wanted):
        print(f"sites already prepared in {out}; nothing to do")
        return 0
    if own_site and not args.inputs:
        raise CliError("--site I prepares site I from its own files: give the files")
    opts = PrepareOptions(
        encoding=args.encoding,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        text_field=args.text_field,
        skip_bad=args.skip_bad,
        resume=args.resume,
        overwrite=args.overwrite or args.if_missing,
    )
    text = embedded_corpus() if not args.inputs else None
    try:
        if own_site:
            dirs = [prepare_site(args.inputs, out, args.site, options=opts)]
        else:
            if only is not None:
                print(
                    f"site {only} of {sites}: cutting one corpus into equal token slices "
                    "needs its total length, so every input is read and tokenized "
                    f"(only site-{only} is written)",
                    file=sys.stderr,
                )
            dirs = prepare_sites(
                args.inputs or None,
                out,
                sites,
                args.encoding,
                args.val_fraction,
                text=text,
                overwrite=opts.overwrite,
                only=only,
                options=opts,
            )
    except DataError as exc:
        raise CliError(str(exc)) from None
    for d in dirs:
        print(d)
    return 0


def _add_local_parser(sub) -> None:
    p = sub.add_parser(
        "local",
        help="train with the single-process reference engine",
        description="Train every block group and origin in this process: the oracle the "
        "distributed ring reproduces bit for bit, and the quickest way to try a config.",
        epilog="settings: flags > MOBIUS_* variables > --config's [train] table > defaults",
    )
    add_train_flags(p)
    add_data_flag(p)
    add_threads_flag(p)
    p.add_argument(
        "--out",
        default="runs/local",
        help="run directory: checkpoint, metrics (default: %(default)s)",
    )
    add_checkpoint_flag(p, default=50)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    add_tracker_flag(p)
    p.set_defaults(func=cmd_local)


def _wanted(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(built-in commands, plugin modules) to build: only what the command asked for needs
    (so ``health`` loads neither torch nor another command), everything for the overview."""
    words = [a for a in (argv or []) if not a.startswith("-")]
    if words:
        if words[0] in BUILTIN:
            return [words[0]], []
        for module, commands in PLUGINS.items():
            if words[0] in commands:
                return [], [module]
    if list(argv or []) == ["--version"]:
        return [], []
    return list(BUILTIN), list(PLUGINS)


def _add_prepare_parser(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize text into per-site shard directories",
        description="--site I FILES…: site I from its own files (each host its own corpus). "
        "Otherwise one corpus cut into --sites P equal slices (--only I writes slice I). "
        "Streams in bounded memory; see docs/data.md.",
    )
    p.add_argument(
        "inputs",
        type=Path,
        nargs="*",
        help=".txt/.jsonl (also .gz/.zst), .parquet, .arrow, directories of them, or a "
        "Hugging Face datasets directory (default: the embedded corpus)",
    )
    p.add_argument("--out", type=Path, required=True, help="directory for site-<i>/ folders")
    p.add_argument("--site", type=int, help="prepare site I from FILES (with --sites: = --only)")
    p.add_argument("--sites", type=int, help="cut one corpus into P slices (default: 4)")
    p.add_argument("--only", type=int, metavar="I", help="with --sites: write only slice I")
    p.add_argument(
        "--encoding",
        default="bytes",
        help="bytes, a tiktoken encoding (gpt2, cl100k_base, o200k_base, …) or "
        "hf:PATH/tokenizer.json (default: %(default)s)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="share of each site held out for validation (default: %(default)s)",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        help="tokens per shard (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenizer threads (tiktoken encodings) or processes (tokenizer.json)"
        " (default: %(default)s)",
    )
    p.add_argument(
        "--text-field", default="text", help="JSON/Parquet/Arrow field (default: %(default)s)"
    )
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip and count bad documents/files instead of stopping at the first",
    )
    p.add_argument("--resume", action="store_true", help="continue after the last complete part")
    p.add_argument(
        "--if-missing", action="store_true", help="do nothing when the site(s) exist already"
    )
    p.add_argument("--overwrite", action="store_true", help="replace existing site folders")
    p.set_defaults(func=cmd_prepare)


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = train_config_from_args(args)
    print(json.dumps({"train": cfg.model_dump(mode="json")}, indent=2))
    return 0


def cmd_config_env(args: argparse.Namespace) -> int:
    from mobius_fed.cli.variables import env_markdown, env_reference

    if args.markdown:
        print(env_markdown(), end="")
    else:
        for name, where, default, text in env_reference():
            print(f"{name}={default}\t# {where}: {text}")
    return 0


def _add_config_parser(sub) -> None:
    p = sub.add_parser(
        "config", help="show the resolved training config, or every MOBIUS_* variable"
    )
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    c = csub.add_parser(
        "show",
        help="the TrainConfig that --config, MOBIUS_* and these flags give, as JSON",
    )
    add_train_flags(c)
    c.set_defaults(func=cmd_config_show)
    c = csub.add_parser("env", help="every MOBIUS_* variable: who reads it, default, meaning")
    c.add_argument("--markdown", action="store_true", help="as a Markdown table")
    c.set_defaults(func=cmd_config_env)


BUILTIN = {
    "local": _add_local_parser,
    "prepare": _add_prepare_parser,
    "config": _add_config_parser,
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``mobius-fed`` parser; with ``argv``, only the plugin its command needs."""
    parser = argparse.ArgumentParser(
        prog="mobius-fed",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    builtins, plugins = _wanted(argv)
    if "local" in builtins:
        BUILTIN["local"](sub)
    for module in plugins:
        importlib.import_module(f"mobius_fed.cli.{module}").register(sub)
    for name in ("prepare", "config"):
        if name in builtins:
            BUILTIN[name](sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return run_guarded(args.func, args)


if __name__ == "__main__":
    raise SystemExit(main())
