"""``mobius-worker``: one ring worker with its private data and one block group."""

from __future__ import annotations

import argparse
import logging

from mobius_fed import __version__
from mobius_fed.cli.common import (
    GracefulStop,
    add_config_flag,
    add_log_level_flag,
    add_print_config_flag,
    print_config,
    run_daemon,
)

DESCRIPTION = """\
Run one Möbius ring worker: its private data, one block group, a ring link to each
neighbour. Coordinated (--coordinator): the rank comes from the certificate and the
training config from the coordinator. Static ring: --rank and --peers.

Settings come from --config (TOML with [worker] and [train] tables), then MOBIUS_*
environment variables, then flags; every flag below names its variable."""


def own_flags() -> dict[str, tuple[str, type]]:
    """``{flag: (setting dest, value type)}`` of this daemon's own (non-training) settings."""
    from mobius_fed.cli.flags import daemon_flags
    from mobius_fed.worker.config import SETTINGS

    return daemon_flags(SETTINGS)


def __getattr__(name: str):  # FLAGS, built on first use (it loads the config models)
    if name == "FLAGS":
        return own_flags()
    raise AttributeError(name)


def build_parser() -> argparse.ArgumentParser:
    from mobius_fed.cli.flags import add_settings_flags
    from mobius_fed.worker.config import WorkerConfig

    p = argparse.ArgumentParser(
        prog="mobius-worker",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_config_flag(p, "[worker] and [train] tables")
    add_log_level_flag(p)
    add_print_config_flag(p)
    own = p.add_argument_group("worker")
    add_settings_flags(own, WorkerConfig, skip=("train", "verify_train"))
    own.add_argument(
        "--data",
        dest="data_dir",
        default=None,
        metavar="PATH",
        help="same as --data-dir (this worker's site directory)",
    )
    train = p.add_argument_group(
        "training (coordinated: checked against the coordinator's; static: the run's)"
    )
    add_settings_flags(train, WorkerConfig, flatten=("train",), skip=_own_keys())
    train.add_argument("--untied", dest="tied", action="store_false", help="same as --no-tied")
    return p


def _own_keys() -> set[str]:
    from mobius_fed.worker.config import SETTINGS

    return {s.key for s in SETTINGS if s.path[0] != "train"}


def run(args: argparse.Namespace, stop: GracefulStop | None = None) -> int:
    from mobius_fed.cli.common import apply_threads, config_path
    from mobius_fed.cli.flags import flag_values
    from mobius_fed.cli.variables import refuse_unknown
    from mobius_fed.worker.config import WorkerConfig, load_worker_config
    from mobius_fed.worker.coordinated import run_with_coordinator
    from mobius_fed.worker.daemon import run_static_ring

    refuse_unknown()
    flags = flag_values(args, WorkerConfig, flatten=("train",))
    cfg = load_worker_config(config_path(args), flags)
    if args.print_config:
        return print_config(cfg)
    threads = apply_threads(argparse.Namespace(threads=cfg.threads))
    logging.getLogger("mobius").info("mobius-worker: %d torch thread(s)", threads)
    if cfg.coordinator:
        rc = run_with_coordinator(cfg)
    else:
        metrics = run_static_ring(cfg)
        print(f"worker-{cfg.rank} finished; metrics {metrics}")
        rc = 0
    if stop is not None:  # the run is over: a stop signal from here on exits 0
        stop.finished = lambda: True
    return rc


def main(argv: list[str] | None = None) -> int:
    """SIGTERM, SIGINT or SIGHUP stop it within 2 s: exit 0 once its run has finished,
    128 + signal otherwise (143 for SIGTERM); ring links close on the way out."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    stop = GracefulStop("mobius-worker").install()
    return run_daemon("mobius-worker", run, args, stop)


if __name__ == "__main__":
    raise SystemExit(main())
