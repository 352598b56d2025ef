"""What one `mobius-fed health` probe costs: wall time (median of N) and torch's share.

Starts a real coordinator-like gRPC health server over mTLS (certificates from
``mobius-fed certs``), then runs the probe N times as a fresh process, the way compose,
systemd and Kubernetes run it, through ``python -m mobius_fed.cli.health`` and through
``mobius-fed health`` (the main CLI). Prints medians and, for comparison, what importing
torch alone costs in a fresh process.

    python benchmarks/health_probe.py [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path


def _server(certs: Path):
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from mobius_fed.transport.tls import NodeTLS, add_port, grpc_options

    d = certs / "nodes" / "coordinator"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=grpc_options())
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = add_port(server, "127.0.0.1:0", NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key"))
    server.start()
    return server, port


def _median_wall(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    from mobius_fed.transport.certs import init_certs

    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp) / "certs"
        init_certs(certs, 1)
        server, port = _server(certs)
        flags = [f"127.0.0.1:{port}", "--server-name", "coordinator",
                 "--ca", str(certs / "ca.crt"), "--cert", str(certs / "operator.crt"),
                 "--key", str(certs / "operator.key")]  # fmt: skip
        py = sys.executable
        try:
            rows = {
                "python -c pass (interpreter)": _median_wall([py, "-c", "pass"], args.runs),
                "python -m mobius_fed.cli.health": _median_wall(
                    [py, "-m", "mobius_fed.cli.health", *flags], args.runs
                ),
                "mobius-fed health (main CLI)": _median_wall(
                    [py, "-m", "mobius_fed.cli.main", "health", *flags], args.runs
                ),
                "python -c 'import torch' (for comparison)": _median_wall(
                    [py, "-c", "import torch"], args.runs
                ),
            }
        finally:
            server.stop(0)
    print(f"health probe wall time, median of {args.runs} fresh processes:")
    for name, t in rows.items():
        print(f"  {name:45s} {t * 1000:8.0f} ms")
    torch_wall = rows["python -c 'import torch' (for comparison)"]
    for name, cmd in (
        ("python -m mobius_fed.cli.health", [py, "-m", "mobius_fed.cli.health", *flags]),
        ("mobius-fed health (main CLI)", [py, "-m", "mobius_fed.cli.main", "health", *flags]),
    ):
        share = _torch_share(cmd, rows[name])
        print(
            f"  {name}: torch import share {share:.0%} of its wall time; "
            f"{rows[name] / torch_wall:.2f}x the cost of `import torch` alone"
        )


def _torch_share(cmd: list[str], wall: float) -> float:
    """torch's cumulative import time (``-X importtime``) over the probe's median wall."""
    proc = subprocess.run(
        [cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True, timeout=120
    )
    for line in proc.stderr.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2] == "torch":
            return int(parts[1]) / 1e6 / wall
    return 0.0


if __name__ == "__main__":
    main()
