"""``mobius-fed health``: ask a node's standard gRPC health service (for healthchecks)."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mobius_fed.cli.common import CliError
from mobius_fed.transport.tls import NodeTLS, open_channel


def health_main(args: argparse.Namespace) -> int:
    tls = None if args.insecure else NodeTLS(args.ca, args.cert, args.key)
    channel = open_channel(args.address, tls, insecure=args.insecure, target_name=args.server_name)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
        )
    except grpc.RpcError as exc:
        raise CliError(f"{args.address}: {exc.code().name} {exc.details()}") from exc
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def add_health_parser(sub) -> None:
    p = sub.add_parser("health", help="query a node's grpc.health.v1 service")
    p.add_argument("address", help="host:port of a coordinator or worker")
    p.add_argument(
        "--server-name",
        default=None,
        help="name expected in the server's certificate (coordinator, worker-<i>)",
    )
    p.add_argument("--service", default="", help="service name ('' = the whole server)")
    p.add_argument("--ca", type=Path, default=Path("certs/ca.crt"))
    p.add_argument("--cert", type=Path, default=Path("certs/operator.crt"))
    p.add_argument("--key", type=Path, default=Path("certs/operator.key"))
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--insecure", action="store_true")
    p.set_defaults(func=health_main)
