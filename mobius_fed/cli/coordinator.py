"""``mobius-coordinator``: registers workers, runs the Flower strategy, serves status."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from mobius_fed.cli.common import DAEMON_TRAIN_FLAGS as TRAIN_FLAGS
from mobius_fed.cli.common import add_flags, flag_values, run_guarded

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
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mobius-coordinator",
        description="Coordinate a Möbius ring with a Flower strategy. Settings come from "
        "--config (TOML with [coordinator] and [train] tables), then MOBIUS_* environment "
        "variables, then flags.",
    )
    p.add_argument("--config", type=Path)
    add_flags(p, {**FLAGS, **TRAIN_FLAGS})
    p.add_argument(
        "--strategy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="strategy keyword, e.g. server_momentum=0.9 (repeatable)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="continue from the newest complete checkpoint manifest",
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


def run(args: argparse.Namespace) -> int:
    from mobius_fed.coordinator.config import load_coordinator_config
    from mobius_fed.coordinator.server import Coordinator

    flags = flag_values(args, FLAGS)
    flags.update(resume=args.resume, insecure=args.insecure)
    if args.strategy_option:
        flags["strategy_options"] = parse_options(args.strategy_option)
    train = flag_values(args, TRAIN_FLAGS)
    cfg = load_coordinator_config(args.config, flags, train)
    coordinator = Coordinator(cfg)
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
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run_guarded(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
