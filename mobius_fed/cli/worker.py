"""``mobius-worker``: one ring worker with its private data and one block group."""

from __future__ import annotations

import argparse
import logging

from mobius_fed.cli.common import (
    GracefulStop,
    add_daemon_train_flags,
    apply_threads,
    config_path,
    daemon_main,
    daemon_parser,
    print_config,
)
from mobius_fed.cli.flags import add_settings_flags, daemon_flags, flag_values

DESCRIPTION = """\
Run one Möbius ring worker: its private data, one block group, a ring link to each
neighbour. Coordinated (--coordinator): the rank comes from the certificate and the
training config from the coordinator. Static ring: --rank and --peers.

Settings come from --config (TOML with [worker] and [train] tables), then MOBIUS_*
environment variables, then flags; every flag below names its variable."""


def __getattr__(name: str):  # FLAGS, built on first use (it loads the config models)
    if name == "FLAGS":  # {flag: (setting dest, value type)} of the worker's own settings
        from mobius_fed.worker.config import SETTINGS

        return daemon_flags(SETTINGS)
    raise AttributeError(name)


def build_parser() -> argparse.ArgumentParser:
    from mobius_fed.worker.config import SETTINGS, WorkerConfig

    p = daemon_parser("mobius-worker", DESCRIPTION, "[worker] and [train] tables")
    own = p.add_argument_group("worker")
    add_settings_flags(own, WorkerConfig, skip=("train", "verify_train"))
    own.add_argument(
        "--data",
        dest="data_dir",
        default=None,
        metavar="PATH",
        help="same as --data-dir (this worker's site directory)",
    )
    add_daemon_train_flags(
        p,
        "training (coordinated: checked against the coordinator's; static: the run's)",
        WorkerConfig,
        SETTINGS,
    )
    return p


def run(args: argparse.Namespace, stop: GracefulStop | None = None) -> int:
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
    return daemon_main("mobius-worker", build_parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
