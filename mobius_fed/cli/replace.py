"""``mobius-fed replace worker-<i> --with standby-<n>``: hand a worker's rank to a standby
site registered with the coordinator (docs/recovery.md "Handover to a standby")."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mobius_fed.cli.common import CliError, run_endpoints
from mobius_fed.cli.status import DEFAULT_COORDINATOR, add_operator_flags, operator_tls


def register(subparsers: Any) -> None:
    """Register ``replace`` on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "replace",
        help="hand a worker's rank to a standby site",
        description="Hand WORKER's rank to a standby registered with the coordinator: the "
        "standby takes the group from the newest round every survivor and the coordinator "
        "hold, with its own data; WORKER's identity is refused from then on. A worker that "
        "is alive is replaced only with --force.",
    )
    p.add_argument("worker", metavar="WORKER", help="worker-<i>: the rank to hand over")
    p.add_argument("--with", dest="standby", required=True, metavar="STANDBY", help="standby-<n>")
    p.add_argument(
        "--force", action="store_true", help="replace a worker that is alive (it is refused)"
    )
    add_operator_flags(
        p, "the operator's certificates (as for status; default: from --run, else certs)"
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
    p.set_defaults(func=replace_main)


def replace_main(args: argparse.Namespace) -> int:
    """Ask the coordinator; print what it did, or CliError (exit 2) with its refusal."""
    import grpc

    from mobius_fed.coordinator.rest_client import replace_worker

    ep = run_endpoints(getattr(args, "run", None)) if not args.coordinator else None
    addr = args.coordinator or (ep.grpc if ep else DEFAULT_COORDINATOR)
    certs = Path(args.certs or (ep.certs_dir if ep else "certs"))
    try:
        done = replace_worker(
            addr, operator_tls(certs), args.worker, args.standby, args.force, args.timeout
        )
    except grpc.RpcError as exc:
        raise CliError(f"coordinator at {addr}: {exc.details()}") from None
    print(done)
    return 0
