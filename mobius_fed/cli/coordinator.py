"""``mobius-coordinator``: registers workers, runs the Flower strategy, serves status."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mobius_fed.cli.common import (
    GracefulStop,
    add_daemon_train_flags,
    add_resume_flag,
    config_path,
    daemon_main,
    daemon_parser,
    print_config,
)
from mobius_fed.cli.flags import add_settings_flags, daemon_flags, flag_values
from mobius_fed.tracking import add_tracker_flag, tracked

DESCRIPTION = """\
Coordinate a Möbius ring with a Flower strategy: register P workers, run one Flower round
per step barrier, write checkpoint manifests, serve status (gRPC, REST, metrics).

Settings come from --config (TOML with [coordinator] and [train] tables), then MOBIUS_*
environment variables, then flags; every flag below names its variable."""


def __getattr__(name: str):  # FLAGS, built on first use (it loads the config models)
    if name == "FLAGS":  # {flag: (setting dest, value type)} of the coordinator's own settings
        from mobius_fed.coordinator.config import SETTINGS

        return daemon_flags(SETTINGS)
    raise AttributeError(name)


def build_parser() -> argparse.ArgumentParser:
    from mobius_fed.coordinator.config import SETTINGS, CoordinatorConfig

    p = daemon_parser("mobius-coordinator", DESCRIPTION, "[coordinator] and [train] tables")
    own = p.add_argument_group("coordinator")
    add_settings_flags(own, CoordinatorConfig, skip=("train", "resume", "strategy_options"))
    own.add_argument(
        "--strategy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="strategy keyword, e.g. server_momentum=0.9; repeatable (default: none; env "
        "MOBIUS_STRATEGY_OPTIONS=KEY=VALUE,...)",
    )
    add_resume_flag(
        own,
        "continue from the newest complete checkpoint manifest; --resume auto: resume when "
        "one exists, else start fresh (what a restart policy wants) (default: false; env "
        "MOBIUS_RESUME)",
    )
    title = "training (the run's TrainConfig, sent to every worker)"
    add_daemon_train_flags(p, title, CoordinatorConfig, SETTINGS)
    add_tracker_flag(own)
    return p


def parse_options(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--strategy-option {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"--strategy-option {item!r}: {value!r} is not a number") from None
    return out


def run(args: argparse.Namespace, stop: GracefulStop | None = None) -> int:
    from mobius_fed.cli.variables import refuse_unknown
    from mobius_fed.coordinator.config import CoordinatorConfig, load_coordinator_config
    from mobius_fed.coordinator.recorder import METRICS_FILE
    from mobius_fed.coordinator.server import Coordinator

    refuse_unknown()
    flags = flag_values(args, CoordinatorConfig, flatten=("train",))
    flags["resume"] = args.resume
    if args.strategy_option:
        flags["strategy_options"] = parse_options(args.strategy_option)
    cfg = load_coordinator_config(config_path(args), flags)
    if args.print_config:
        return print_config(cfg)
    coordinator = Coordinator(cfg)
    if stop is not None:  # a stop signal exits 0 once the run is done (e.g. while lingering)
        stop.finished = lambda: coordinator.state.succeeded
    metrics, config = Path(cfg.out_dir) / METRICS_FILE, cfg.train.model_dump(mode="json")
    with tracked(args.tracker, metrics, run_name=cfg.run_id, config=config):
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
    return daemon_main("mobius-coordinator", build_parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
