"""``mobius-fed health``: ask a node's standard gRPC health service (for healthchecks).

Torch-free on purpose: compose, systemd and Kubernetes run it every few seconds.
Without an address it probes the coordinator of ``--run DIR`` (default ``./runs/up``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mobius_fed.cli.common import CliError, add_run_flag, run_endpoints

DEFAULT_CERTS = Path("certs")


def _target(args: argparse.Namespace):
    """``(address, NodeTLS | None, server name)`` from the flags, else from endpoints.json."""
    from mobius_fed.transport.tls import NodeTLS

    address, server_name = args.address, args.server_name
    ca, cert, key = args.ca, args.cert, args.key
    if address is None or args.run is not None:
        ep = run_endpoints(args.run)
        if ep is None:
            raise CliError(
                "no address given and no ./runs/up/endpoints.json: pass HOST:PORT "
                "(and --ca/--cert/--key) or --run DIR of a `mobius-fed up`"
            )
        if address is None and ep.alive() is False:
            raise CliError(f"the `mobius-fed up` that wrote {ep.path} (pid {ep.pid}) has exited")
        address = address or ep.grpc
        server_name = server_name or ep.server_name
        ca, cert, key = ca or ep.ca, cert or ep.cert, key or ep.key
    if args.insecure:
        return address, None, server_name
    tls = NodeTLS(
        ca or DEFAULT_CERTS / "ca.crt",
        cert or DEFAULT_CERTS / "operator.crt",
        key or DEFAULT_CERTS / "operator.key",
    )
    return address, tls, server_name


def health_main(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mobius_fed.transport.tls import open_channel

    address, tls, server_name = _target(args)
    channel = open_channel(address, tls, insecure=args.insecure, target_name=server_name)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
        )
    except grpc.RpcError as exc:
        raise CliError(f"{address}: {exc.code().name} {exc.details()}") from exc
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def register(sub) -> None:
    """Add ``health`` to the ``mobius-fed`` subcommands."""
    p = sub.add_parser(
        "health",
        help="query a node's grpc.health.v1 service (exit 0: SERVING)",
        description="Probe a coordinator or worker over mTLS. Without ADDRESS: the "
        "coordinator of --run DIR (default ./runs/up). Does not load torch.",
    )
    p.add_argument(
        "address",
        nargs="?",
        default=None,
        help="host:port of a coordinator or worker (default: from --run's endpoints.json)",
    )
    add_run_flag(p)
    p.add_argument(
        "--server-name",
        default=None,
        help="name expected in the server's certificate (coordinator, worker-<i>)",
    )
    p.add_argument("--service", default="", help="service name ('' = the whole server)")
    p.add_argument("--ca", type=Path, default=None, help="CA certificate (default certs/ca.crt)")
    p.add_argument(
        "--cert", type=Path, default=None, help="client certificate (default certs/operator.crt)"
    )
    p.add_argument("--key", type=Path, default=None, help="client key (default certs/operator.key)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext, for a static ring of mobius-worker started with --insecure",
    )
    p.set_defaults(func=health_main)


def main(argv: list[str] | None = None) -> int:
    """``python -m mobius_fed.cli.health``: the probe alone (a healthcheck's command)."""
    import sys

    from mobius_fed.cli.main import main as fed_main

    return fed_main(["health", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
