"""``mobius-worker``: one ring worker with its private data and one block group."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mobius_fed.cli.common import DAEMON_TRAIN_FLAGS as TRAIN_FLAGS
from mobius_fed.cli.common import add_flags, flag_values, run_guarded

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
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mobius-worker",
        description="Run one Möbius ring worker. Settings come from --config (TOML with "
        "[worker] and [train] tables), then MOBIUS_* environment variables, then flags.",
    )
    p.add_argument("--config", type=Path)
    add_flags(p, {**FLAGS, **TRAIN_FLAGS})
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="plaintext gRPC, no authentication (local debugging only)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def run(args: argparse.Namespace) -> int:
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
        return run_with_coordinator(cfg)
    metrics = run_static_ring(cfg)
    print(f"worker-{cfg.rank} finished; metrics {metrics}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run_guarded(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
