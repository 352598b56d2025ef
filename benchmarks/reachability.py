"""Throughput of one ring edge by path: direct, reversed, relayed (a benchmark, not a test).

    python benchmarks/reachability.py                 # 16 MiB fp32 tensors, 3 rounds
    python benchmarks/reachability.py --n 20 --rounds 5

Two worker processes (``spawn``) each hold a real :class:`RingLinks` (P=2, mTLS) with the
edge worker-0 → worker-1 planned as ``direct`` (worker-1 accepts), ``reversed`` (worker-1
only dials out and parks tunnels at worker-0's rendezvous port) or ``relayed`` (worker-1
only dials out, worker-0 opens no rendezvous port: both dial a ``mobius-relay`` process).
Worker 0 sends ``--n`` tensors forward; worker 1 times them from the first complete tensor
to the last (the first is a warm-up). The figure is MB/s = 16 MiB × (n − 1) / that time.
The modes take turns in every round and each mode's median over rounds is reported.
Loopback only: every path shares this host's CPUs, so a tunnel's copies count in full.

``ring`` (root, the namespace testbed; shaped links as in benchmarks/wan.py): a static
P = 4 ring of ``mobius-worker`` processes, one namespace each plus a ``mobius-fed relay``
host, every site's link shaped (default 1 Gbit/s, 25 ms one way). Only edge
worker-0 → worker-1 changes: ``direct``; ``reversed`` (worker-1 only dials out, tunnels
to worker-0's rendezvous port); ``relayed`` (worker-1 only dials out, worker-0 opens no
rendezvous: both ends dial the relay, whose own link is shaped too). Tokens/s as in
benchmarks/wan.py ring (the first ``--skip`` steps left out)::

    python benchmarks/reachability.py ring --shape 1gbit/25ms --steps 10
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = (8, 512, 1024)
RUN = "bench/reach"
MODES = ("direct", "reversed", "relayed")


def _entries(mode: str, ports: list[int]) -> list[str]:
    p0, p1, rendezvous, relay = ports
    if mode == "direct":
        return [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"]
    if mode == "reversed":
        return [f"127.0.0.1:{p0};rendezvous=127.0.0.1:{rendezvous}", f"127.0.0.1:{p1};reachable=no"]
    return [f"127.0.0.1:{p0}", f"127.0.0.1:{p1};reachable=no;relay=127.0.0.1:{relay}"]


def _worker(rank: int, mode: str, root: str, ports: list[int], n: int, out) -> None:
    import torch

    from mobius_fed.config import TrainConfig
    from mobius_fed.relay.edges import EdgeTunnels, TunnelKeys
    from mobius_fed.relay.keys import read_relay_key
    from mobius_fed.transport.tls import NodeTLS
    from mobius_fed.worker.frames import FORWARD, TRAIN, FrameKey, FrameRules
    from mobius_fed.worker.link import RingLinks

    torch.set_num_threads(1)
    now = [0]
    rules = FrameRules(
        TrainConfig(preset="cpu-base", workers=2, batch_size=8), rank, RUN, lambda: now[0]
    )
    rules.shape = SHAPE
    key = read_relay_key(Path(root) / "relay.key")
    tunnels = EdgeTunnels(
        _entries(mode, ports),
        rank,
        RUN,
        TunnelKeys(run=key, relay=key),
        f"127.0.0.1:{ports[2]}" if rank == 0 else None,
    )
    bundle = Path(root) / "certs" / "nodes" / f"worker-{rank}"
    links = RingLinks(
        rules,
        listen=f"127.0.0.1:{ports[rank]}",
        successor="",
        tls=NodeTLS(bundle / "ca.crt", bundle / "tls.crt", bundle / "tls.key"),
        peer_timeout=60,
        tunnels=tunnels,
    )
    links.start_server()
    links.connect()
    t = torch.randn(SHAPE)
    stamps = []
    for j in range(n):
        now[0] = j
        k = FrameKey(TRAIN, j, FORWARD, 0, 1, 0)
        if rank == 0:
            links.send_tensor(k, t)
        else:
            links.inbox.get(k, 120, f"tensor {j}")
            stamps.append(time.perf_counter())
    if rank == 1:
        out.put((n - 1) * t.numel() * 4 / (stamps[-1] - stamps[0]) / 1e6)
    links.finish(timeout=30)


def run_mode(mode: str, root: Path, n: int) -> float:
    from mobius_fed.ops.ports import free_ports

    ports = free_ports(4)
    relay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mobius_fed.cli.relay",
            "--listen",
            f"127.0.0.1:{ports[3]}",
            "--key-file",
            str(root / "relay.key"),
            "--log-level",
            "WARNING",
        ]
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, mode, str(root), ports, n, out)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        mbps = out.get(timeout=600)
        for p in procs:
            p.join(60)
        return mbps
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        relay.terminate()
        relay.wait(10)


def _ring_entries(mode: str, P: int) -> list[str]:
    """Ring entries of the testbed ring: only edge worker-0 → worker-1 differs."""
    entries = [f"worker-{i}:7000" for i in range(P)]
    if mode == "reversed":
        entries[0] += ";rendezvous=worker-0:7001"
        entries[1] += ";reachable=no"
    elif mode == "relayed":
        entries[1] += ";reachable=no;relay=relay:7100"
    return entries


def _ring_services(root: Path, mode: str, args) -> dict[str, list[str]]:
    P, key = 4, str(root / "relay.key")
    peers = ",".join(_ring_entries(mode, P))
    services = {
        "relay": [
            sys.executable,
            "-m",
            "mobius_fed.cli.relay",
            "--listen",
            "0.0.0.0:7100",
            "--key-file",
            key,
        ]
    }
    for i in range(P):
        node = root / "certs" / "nodes" / f"worker-{i}"
        argv = [sys.executable, "-m", "mobius_fed.cli.worker", "--rank", str(i), "--workers"]
        argv += [str(P), "--peers", peers, "--listen", "0.0.0.0:7000", "--relay-key", key]
        argv += ["--data-dir", str(root / "sites" / f"site-{i}")]
        argv += ["--out-dir", str(root / "out" / f"worker-{i}")]
        argv += ["--ca", str(node / "ca.crt"), "--cert", str(node / "tls.crt")]
        argv += ["--key", str(node / "tls.key"), "--threads", "1", "--run-id", "reach-bench"]
        argv += ["--preset", args.preset, "--steps", str(args.steps), "--eval-every", "0"]
        argv += ["--peer-timeout", "300"]
        if i == 0 and mode == "reversed":
            argv += ["--tunnel-listen", "0.0.0.0:7001"]
        services[f"worker-{i}"] = argv
    return services


def bench_ring(args) -> list[dict]:
    from mobius_fed.data import embedded_corpus, prepare_sites
    from mobius_fed.relay.keys import write_relay_key
    from mobius_fed.testbed import Testbed
    from mobius_fed.transport.certs import init_certs

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from wan import _ring_row, parse_shape

    rows = []
    for mode in MODES:
        with tempfile.TemporaryDirectory(prefix="reachring") as tmp:
            root = Path(tmp)
            init_certs(root / "certs", 4)
            prepare_sites(None, root / "sites", 4, text=embedded_corpus())
            write_relay_key(root / "relay.key")
            services = _ring_services(root, mode, args)
            env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
            lines = ["name: reachbench", "services:"]
            for name, argv in services.items():
                lines += [f"  {name}:", f"    command: {json.dumps(argv)}", "    environment:"]
                lines += [f"      {k}: {json.dumps(v)}" for k, v in env.items()]
            compose = root / "compose.yaml"
            compose.write_text("\n".join(lines) + "\n")
            wan = {s: parse_shape(args.shape) for s in services}
            workers = [s for s in services if s != "relay"]
            with Testbed(compose, root / "tb", wan=wan) as tb:
                tb.up(timeout=60)
                deadline = time.monotonic() + args.timeout
                while not all(tb.finished(s) for s in workers):
                    if time.monotonic() > deadline or tb.failed():
                        raise RuntimeError(f"{mode}: {tb.failed()} {tb.log_tail('worker-1')}")
                    time.sleep(1)
            row = _ring_row(root / "out", 4, args, "none", args.shape)
            rows.append({"path": mode, **row})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def ring_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="reachability.py ring")
    ap.add_argument("--shape", default="1gbit/25ms", help="every site's link (RATE/DELAY)")
    ap.add_argument("--preset", default="cpu-tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2, help="untimed first steps")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    rows = bench_ring(args)
    base = rows[0]["tokens_s"]
    print(f"\n| edge 0 → 1 | tokens/s ({args.preset}, {args.shape}) | vs direct |\n|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['tokens_s']:.0f} | {r['tokens_s'] / base:.2f} |")


def main() -> None:
    if sys.argv[1:2] == ["ring"]:
        ring_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=12, help="tensors per measurement (default 12)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, modes interleaved")
    args = ap.parse_args()
    from mobius_fed.relay.keys import write_relay_key
    from mobius_fed.transport.certs import init_certs

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        init_certs(root / "certs", 2)
        write_relay_key(root / "relay.key")
        got: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES:
                got[mode].append(run_mode(mode, root, args.n))
                print(f"round {r + 1} {mode:8s} {got[mode][-1]:8.1f} MB/s", flush=True)
    base = statistics.median(got["direct"])
    print(f"\n| path | MB/s (median of {args.rounds}) | vs direct |\n|---|---|---|")
    for mode in MODES:
        med = statistics.median(got[mode])
        print(f"| {mode} | {med:.1f} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
