"""``mobius-fed testbed``: run docker/compose.yaml without Docker, one network namespace per
service, until the coordinator reports the run finished; then tear everything down.

    mobius-fed testbed up -f docker/compose.yaml --root runs/tb --set coordinator:MOBIUS_STEPS=10
    mobius-fed testbed up --rings 2                  # 2 rings of 2 of the 4 compose workers
    mobius-fed testbed up --wan-rate 1gbit --wan-delay 25ms --wan-site worker-3:rate=100mbit
    mobius-fed testbed cleanup mtb1a2b3c     # leftovers of a testbed that was killed
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from mobius_fed.cli.common import CliError, console
from mobius_fed.cli.status import render_status, ring_summary

DEFAULT_COMPOSE = "docker/compose.yaml"


def parse_sets(items: list[str] | None) -> dict[str, dict[str, str]]:
    """``["coordinator:MOBIUS_STEPS=10", ...]`` -> ``{"coordinator": {"MOBIUS_STEPS": "10"}}``."""
    out: dict[str, dict[str, str]] = {}
    for item in items or []:
        svc, sep, assign = item.partition(":")
        key, eq, value = assign.partition("=")
        if not (sep and eq and svc and key):
            raise CliError(f"--set {item!r}: expected SERVICE:KEY=VALUE")
        out.setdefault(svc, {})[key] = value
    return out


class _Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP, handled like Ctrl-C so the testbed is torn down."""


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise _Terminated(f"signal {signum}")


def rings_override(compose: Path, rings: int, coordinator: str = "coordinator") -> dict[str, str]:
    """``--rings R``: the coordinator's ``MOBIUS_RINGS``, once R divides the compose file's
    workers (services ``worker-<g>``; worker-g is ring g // P, docs/rings.md); else refused
    with the reason."""
    from mobius_fed.testbed import ComposeError, load_compose

    try:
        services = load_compose(compose).services
    except ComposeError as exc:
        raise CliError(str(exc)) from exc
    workers = sum(1 for name in services if re.fullmatch(r"worker-\d+", name))
    if rings < 1 or workers % rings:
        raise CliError(
            f"--rings {rings} does not divide the {workers} workers of {compose} "
            "(R rings of P groups need R·P workers)"
        )
    if coordinator not in services:
        raise CliError(f"--rings: {compose} has no service {coordinator!r}")
    return {"MOBIUS_RINGS": str(rings)}


def cmd_up(args: argparse.Namespace) -> int:
    from mobius_fed.testbed import Testbed, netns_available, wait_for_run

    compose = Path(args.file)
    if not compose.is_file():
        raise CliError(f"compose file not found: {compose}")
    overrides = parse_sets(args.set)
    if args.rings is not None:
        rings = rings_override(compose, args.rings, args.coordinator)
        overrides.setdefault(args.coordinator, {}).update(rings)
    reason = netns_available()
    if reason:
        raise CliError(f"cannot run the namespace testbed: {reason}")
    root = Path(args.root)
    if args.fresh and (root / "volumes").exists():
        shutil.rmtree(root / "volumes")
    wan = _wan_shapes(args, compose)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    logging.basicConfig(level=logging.INFO, format="testbed: %(message)s", stream=sys.stderr)
    t0 = time.monotonic()
    last: list[tuple[Any, Any, str] | None] = [None]

    def progress(doc: dict[str, Any]) -> None:
        key = (doc.get("phase"), doc.get("step"), ring_summary(doc))
        if key != last[0]:
            last[0] = key
            rings = ring_summary(doc)  # R > 1: the rings that are not healthy
            console.print(
                f"[{time.monotonic() - t0:6.1f}s] phase {doc.get('phase')} "
                f"step {doc.get('step', 0)}/{doc.get('steps', 0)}"
                + (f"  {rings}" if rings else ""),
                highlight=False,
            )

    with Testbed(compose, root, env_overrides=overrides, prefix=args.prefix, wan=wan) as tb:
        console.print(
            f"testbed [bold]{tb.prefix}[/]: {len(tb.project.services)} services from {compose}, "
            f"logs in {tb.logs_dir}",
            highlight=False,
        )
        tb.up(timeout=args.timeout)
        remaining = max(1.0, args.timeout - (time.monotonic() - t0))
        final = wait_for_run(tb, remaining, service=args.coordinator, on_status=progress)
    if args.json:
        print(json.dumps(final, indent=2))
    else:
        render_status(final, console)
    console.print(f"testbed removed after {time.monotonic() - t0:.1f}s", highlight=False)
    return 0 if final.get("phase") == "done" else 1


def _wan_shapes(args: argparse.Namespace, compose: Path) -> dict[str, Any]:
    """Every service's access-link shape from --wan-rate/--wan-delay/--wan-site."""
    from mobius_fed.testbed import load_compose
    from mobius_fed.testbed.wan import (
        WanError,
        WanShape,
        parse_delay,
        parse_rate,
        parse_site_shapes,
    )

    if args.wan_rate is None and args.wan_delay is None and not args.wan_site:
        return {}
    try:
        default = WanShape(
            parse_rate(args.wan_rate) if args.wan_rate else None,
            parse_delay(args.wan_delay) if args.wan_delay else 0.0,
        )
        services = list(load_compose(compose).services)
        return parse_site_shapes(default, args.wan_site, services)
    except WanError as exc:
        raise CliError(str(exc)) from exc


def cmd_cleanup(args: argparse.Namespace) -> int:
    from mobius_fed.testbed import cleanup_stale, netns_available

    reason = netns_available()
    if reason:
        raise CliError(reason)
    removed = cleanup_stale(args.prefix)
    console.print(f"removed {len(removed)} namespaces: {' '.join(removed) or '-'}")
    return 0


def register(subparsers: Any) -> None:
    """Register ``testbed`` (``up``, ``cleanup``) on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "testbed",
        help="run the compose file without Docker (one network namespace per service)",
        description="Run every compose service as its own host in a Linux network namespace "
        "(root only): own address, service names resolving, the service's command, "
        "environment and volumes.",
    )
    sub = p.add_subparsers(dest="testbed_command", required=True)
    _add_up_parser(sub)
    c = sub.add_parser("cleanup", help="remove namespaces <PREFIX>-* left by a killed testbed")
    c.add_argument("prefix")
    c.set_defaults(func=cmd_cleanup)


def _add_up_parser(sub: Any) -> None:
    """``testbed up`` and its flags."""
    u = sub.add_parser(
        "up",
        help="bring the compose project up, wait for the run to finish, tear it down",
        description="Start the services in dependency order, poll the coordinator's REST "
        "status from inside its namespace until the run is done or failed, print it, and "
        "remove every namespace. Exit status 0 when the run is done, 1 otherwise.",
    )
    u.add_argument("-f", "--file", default=DEFAULT_COMPOSE, help="compose file")
    u.add_argument(
        "--root",
        default="runs/testbed",
        help="volumes (root/volumes/<name>) and logs (root/logs/<service>.log)",
    )
    u.add_argument(
        "--timeout", type=float, default=900.0, help="seconds for the whole run (default 900)"
    )
    u.add_argument(
        "--set",
        action="append",
        metavar="SERVICE:KEY=VALUE",
        help="override one environment variable of one service (repeatable)",
    )
    u.add_argument("--coordinator", default="coordinator", help="service to read status from")
    u.add_argument(
        "--rings",
        type=int,
        metavar="R",
        help="R rings of P = workers / R groups (sets the coordinator's MOBIUS_RINGS; R must "
        "divide the compose file's workers; docs/rings.md)",
    )
    u.add_argument("--prefix", help="namespace name prefix (default: a fresh mtbXXXXXX)")
    u.add_argument("--fresh", action="store_true", help="delete root/volumes first")
    u.add_argument("--json", action="store_true", help="print the final status as JSON")
    _add_wan_flags(u)
    u.set_defaults(func=cmd_up)


def _add_wan_flags(u: Any) -> None:
    """``testbed up``'s emulated wide-area links."""
    u.add_argument(
        "--wan-rate",
        metavar="RATE",
        help="shape every site's link to RATE each way with tc tbf (e.g. 1gbit, 100mbit)",
    )
    u.add_argument(
        "--wan-delay",
        metavar="DELAY",
        help="one-way delay of what every site sends (e.g. 25ms: 50 ms round trip), "
        "emulated by a delay line in each site's namespace",
    )
    u.add_argument(
        "--wan-site",
        action="append",
        metavar="SERVICE:rate=R,delay=D",
        help="override one site's rate and/or delay (repeatable)",
    )


def main(argv: list[str] | None = None) -> int:
    from mobius_fed.cli.main import main as fed_main

    return fed_main(["testbed", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
