"""``mobius-coordinator``: registers workers, runs the Flower strategy, serves status."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from mobius_fed.cli.common import DAEMON_TRAIN_FLAGS as TRAIN_FLAGS
from mobius_fed.cli.common import (
    GracefulStop,
    add_flags,
    add_resume_flag,
    flag_values,
    run_daemon,
)

FLAGS = {
    "--listen": ("listen", str),
    "--rest-listen": ("rest_listen", str),
    "--rest-mode": ("rest_mode", str),
    "--run-id": ("run_id", str),
    "--ca": ("ca", Path),
    "--cert": ("cert", Path),
    "--key": ("key", Path),
    "--out-dir": ("out_dir", Path),
    "--strategy": ("strategy", str),
    "--checkpoint-every": ("checkpoint_every", int),
    "--heartbeat-interval": ("heartbeat_interval", float),
    "--heartbeat-timeout": ("heartbeat_timeout", float),
    "--registration-timeout": ("registration_timeout", float),
    "--linger": ("linger", float),
    "--rejoin-timeout": ("rejoin_timeout", float),
    "--max-incidents": ("max_incidents", int),
    "--keep-checkpoints": ("keep_checkpoints", int),
    "--state-copy": ("state_copy", str),
    "--restore-timeout": ("restore_timeout", float),
}

HELP = {
    "--listen": "gRPC bind address: control, status, grpc.health.v1 (default 0.0.0.0:7300)",
    "--rest-listen": "REST status bind address (default 0.0.0.0:7380)",
    "--rest-mode": "tls (mutual TLS), local (read-only HTTP on 127.0.0.1) or off",
    "--run-id": "run name, carried in every ring frame",
    "--ca": "CA certificate (the node bundle's ca.crt)",
    "--cert": "this coordinator's certificate (tls.crt)",
    "--key": "this coordinator's key (tls.key)",
    "--out-dir": "checkpoint manifests and metrics",
    "--strategy": "Flower strategy: fedavg, fedavgm, fedadam, fedyogi, ...",
    "--checkpoint-every": "rounds between checkpoints (0: at the end only)",
    "--heartbeat-interval": "seconds between worker heartbeats",
    "--heartbeat-timeout": "seconds without a heartbeat before a worker counts as lost",
    "--registration-timeout": "seconds to wait for all P workers to register",
    "--linger": "seconds to keep serving status after the run ends (-1: until stopped)",
    "--rejoin-timeout": "seconds an incident waits for the lost worker to re-register "
    "before the run fails",
    "--max-incidents": "incidents (lost workers) the run recovers from before it fails",
    "--keep-checkpoints": "complete checkpoint manifests to keep, older rounds are deleted "
    "(0: all)",
    "--state-copy": "coordinator: workers also send their checkpoint here, so a host replaced "
    "without its disk can rejoin; off: workers keep it to themselves",
    "--restore-timeout": "seconds every worker has to load the rollback state",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mobius-coordinator",
        description="Coordinate a Möbius ring with a Flower strategy. Settings come from "
        "--config (TOML with [coordinator] and [train] tables), then MOBIUS_* environment "
        "variables, then flags.",
    )
    p.add_argument("--config", type=Path, help="TOML file with [coordinator] and [train]")
    add_flags(p, {**FLAGS, **TRAIN_FLAGS}, HELP)
    p.add_argument(
        "--strategy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="strategy keyword, e.g. server_momentum=0.9 (repeatable)",
    )
    add_resume_flag(
        p,
        "continue from the newest complete checkpoint manifest; --resume auto: resume when "
        "one exists, else start fresh (what a restart policy wants)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="plaintext gRPC, no authentication (local debugging only)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def parse_options(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--strategy-option {item!r}: expected KEY=VALUE")
        out[key.strip()] = json.loads(value)
    return out


def run(args: argparse.Namespace, stop: GracefulStop | None = None) -> int:
    from mobius_fed.coordinator.config import load_coordinator_config
    from mobius_fed.coordinator.server import Coordinator

    flags = flag_values(args, FLAGS)
    flags.update(resume=args.resume, insecure=args.insecure)
    if args.strategy_option:
        flags["strategy_options"] = parse_options(args.strategy_option)
    train = flag_values(args, TRAIN_FLAGS)
    cfg = load_coordinator_config(args.config, flags, train)
    coordinator = Coordinator(cfg)
    if stop is not None:  # a stop signal exits 0 once the run is done (e.g. while lingering)
        stop.finished = lambda: coordinator.state.phase == "done"
    rc = coordinator.run()
    doc = coordinator.state.status_doc()
    if rc:
        print(f"run {cfg.run_id} failed: {doc['error']}")
    else:
        print(
            f"run {cfg.run_id} done: step {doc['step']}, validation loss (Eq. 8) "
            f"{doc['eval_loss']}, checkpoint {doc['checkpoint']}"
        )
    return rc


def main(argv: list[str] | None = None) -> int:
    """SIGTERM, SIGINT or SIGHUP stop it within 2 s: exit 0 after a finished run (e.g.
    while lingering), 128 + signal otherwise; the newest complete manifest stays intact."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    stop = GracefulStop("mobius-coordinator").install()
    return run_daemon("mobius-coordinator", run, args, stop)


if __name__ == "__main__":
    raise SystemExit(main())
