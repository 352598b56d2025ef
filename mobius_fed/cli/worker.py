"""``mobius-worker``: one ring worker with its private data and one block group."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mobius_fed.cli.common import DAEMON_TRAIN_FLAGS as TRAIN_FLAGS
from mobius_fed.cli.common import GracefulStop, add_flags, flag_values, run_daemon

FLAGS = {
    "--rank": ("rank", int),
    "--peers": ("peers", str),
    "--listen": ("listen", str),
    "--coordinator": ("coordinator", str),
    "--advertise": ("advertise", str),
    "--data-dir": ("data_dir", Path),
    "--out-dir": ("out_dir", Path),
    "--run-id": ("run_id", str),
    "--ca": ("ca", Path),
    "--cert": ("cert", Path),
    "--key": ("key", Path),
    "--peer-timeout": ("peer_timeout", float),
    "--threads": ("threads", int),
    "--capture-frames": ("capture_frames", Path),
    "--link-grace": ("link_grace", float),
}

HELP = {
    "--rank": "static ring only: this worker's rank (coordinated: from its certificate)",
    "--peers": "static ring only: host:port of every worker in ring order, comma-separated",
    "--listen": "ring bind address (default 0.0.0.0:7000)",
    "--coordinator": "host:port of mobius-coordinator",
    "--advertise": "the ring address the predecessor dials (default: the listen address)",
    "--data-dir": "this worker's site: train_*.bin, val_*.bin, meta.json",
    "--out-dir": "worker checkpoints and metrics",
    "--run-id": "static ring only (a coordinated worker takes the coordinator's)",
    "--ca": "CA certificate (the node bundle's ca.crt)",
    "--cert": "this worker's certificate (tls.crt); it decides the rank",
    "--key": "this worker's key (tls.key)",
    "--peer-timeout": "seconds to wait for the coordinator and ring peers",
    "--threads": "torch intra-op threads",
    "--capture-frames": "append every ring frame this worker sends to this file (audit)",
    "--link-grace": "seconds a dropped ring link may take to reconnect and resend before "
    "it counts as a lost peer",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mobius-worker",
        description="Run one Möbius ring worker. Settings come from --config (TOML with "
        "[worker] and [train] tables), then MOBIUS_* environment variables, then flags.",
    )
    p.add_argument("--config", type=Path, help="TOML file with [worker] and [train]")
    add_flags(p, {**FLAGS, **TRAIN_FLAGS}, HELP)
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="plaintext gRPC, no authentication (local debugging only)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def run(args: argparse.Namespace, stop: GracefulStop | None = None) -> int:
    from mobius_fed.worker.config import load_worker_config
    from mobius_fed.worker.coordinated import run_with_coordinator
    from mobius_fed.worker.daemon import run_static_ring

    flags = flag_values(args, FLAGS)
    flags["insecure"] = args.insecure
    if flags["peers"] is not None:
        flags["peers"] = [p.strip() for p in flags["peers"].split(",") if p.strip()]
    train = flag_values(args, TRAIN_FLAGS)
    cfg = load_worker_config(args.config, flags, train)
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
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    stop = GracefulStop("mobius-worker").install()
    return run_daemon("mobius-worker", run, args, stop)


if __name__ == "__main__":
    raise SystemExit(main())
