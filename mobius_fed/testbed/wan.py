"""Shaped WAN links for the namespace testbed: rate by ``tc tbf`` on both ends of a site's
veth, one-way delay by a userspace delay line (kernel ``netem`` is absent on these machines).
Model, what it is and is not faithful to, and measurements: docs/wan.md §1.

Path A → B is delayed by A's delay, B → A by B's. The relay holds at most ``hold_bytes`` per
direction (default 2 × rate × delay, at least 4 MiB), then stops reading. :func:`serve_probe`
and :func:`probe` measure a link; ``python -m mobius_fed.testbed.wan`` runs them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mobius_fed.transport.link_tuning import UnitError as WanError
from mobius_fed.transport.link_tuning import parse_delay, parse_rate

RELAY_PORT = 47990
"""Port of the delay-line relay inside every site namespace (redirect target)."""
RELAY_MARK = 0x4D42
"""Socket mark of the relay's own outgoing connections: the redirect lets them pass."""
SO_ORIGINAL_DST = 80
CHUNK = 256 << 10
MIN_HOLD = 4 << 20


@dataclass(frozen=True)
class WanShape:
    """One site's access link: ``rate`` bits/s each way (None: unshaped) and the one-way
    ``delay`` (seconds) of what it sends."""

    rate: int | None = None
    delay: float = 0.0

    @property
    def shaped(self) -> bool:
        return self.rate is not None or self.delay > 0

    def describe(self) -> str:
        rate = f"{self.rate / 1e6:g} Mbit/s" if self.rate else "unshaped"
        return f"{rate}, {self.delay * 1e3:g} ms one way"

    def with_overrides(self, text: str) -> WanShape:
        """Apply ``"rate=100mbit,delay=50ms"`` (either part optional) to this shape."""
        rate, delay = self.rate, self.delay
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise WanError(f"{item!r}: expected rate=… or delay=…")
            if key == "rate":
                rate = parse_rate(value)
            elif key == "delay":
                delay = parse_delay(value)
            else:
                raise WanError(f"{item!r}: unknown key {key!r} (rate, delay)")
        return WanShape(rate, delay)


def parse_site_shapes(
    default: WanShape, items: list[str] | None, services: list[str]
) -> dict[str, WanShape]:
    """Every service's shape: ``default`` unless ``SERVICE:rate=…,delay=…`` overrides it."""
    shapes = dict.fromkeys(services, default)
    for item in items or []:
        svc, sep, rest = item.partition(":")
        if not sep:
            raise WanError(f"--wan-site {item!r}: expected SERVICE:rate=…,delay=…")
        if svc not in shapes:
            raise WanError(f"--wan-site {item!r}: no service {svc!r} ({', '.join(services)})")
        shapes[svc] = shapes[svc].with_overrides(rest)
    return shapes


# ----------------------------------------------------------------------- tc / iptables


SEND_BUFFER_S = 0.25
"""Seconds of its link a shaped site's queues may hold: TCP send buffers and the delay
line. A host's default send buffer (up to 4 MiB) is 32 ms at 1 Gbit/s and 0.3 s at
0.1 Gbit/s; left at 4 MiB on a link a thousand times slower (a race's emulated links,
``benchmarks/race.py``), it would queue 30 s ahead of a keepalive ping's answer, and gRPC
closes a connection whose ping goes unanswered for 10 s (transport/tls.py)."""
MIN_BUFFER = 64 << 10


def hold_bytes(shape: WanShape) -> int:
    """Bytes the delay line holds per direction before it stops reading: twice the
    bandwidth-delay product, and on a shaped link no less than SEND_BUFFER_S of it."""
    if shape.rate is None:
        return max(MIN_HOLD, int(2 * 10**10 / 8 * shape.delay))
    per_s = shape.rate / 8
    return max(MIN_BUFFER, int(per_s * max(SEND_BUFFER_S, 2 * shape.delay)))


def send_buffer_bytes(shapes: Iterable[WanShape]) -> int | None:
    """The largest TCP send buffer of every namespace of a testbed with shaped rates: what
    the slowest link carries in SEND_BUFFER_S (or in two round trips, if longer), at least
    64 KiB; None when no link is rate-shaped (the host's default stays)."""
    shaped = [s for s in shapes if s.rate is not None]
    if not shaped:
        return None
    slowest = min(s.rate for s in shaped if s.rate is not None)
    rtt = 2 * max(s.delay for s in shaped)
    return max(MIN_BUFFER, int(slowest / 8 * max(SEND_BUFFER_S, 2 * rtt)))


def limit_send_buffer(netns: str, nbytes: int) -> None:
    """Cap TCP send buffers in ``netns`` at ``nbytes`` (its own ``net.ipv4.tcp_wmem``)."""
    value = f"4096 {min(16384, nbytes)} {nbytes}"
    _run(
        ["ip", "netns", "exec", netns, "sh", "-c", f"echo '{value}' > /proc/sys/net/ipv4/tcp_wmem"]
    )


def tbf_args(rate: int) -> list[str]:
    """``tc qdisc … tbf`` parameters for ``rate`` bits/s: a burst of 4 ms of traffic (at
    least 128 KiB, so a 64 KiB GSO packet always fits) and a 50 ms queue."""
    per_s = rate / 8
    burst = max(128 << 10, int(per_s * 0.004))
    limit = burst + int(per_s * 0.05)
    return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "limit", str(limit)]


def shape_device(netns: str, dev: str, rate: int) -> None:
    """Shape the egress of ``dev`` in ``netns`` to ``rate`` bits/s."""
    tc = ["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root"]
    _run([*tc, *tbf_args(rate)])


def redirect_rules(netns: str, subnet: str) -> None:
    """Send the namespace's outgoing TCP to ``subnet`` through its delay-line relay."""
    rule = ["-p", "tcp", "-d", subnet, "-m", "mark", "!", "--mark", hex(RELAY_MARK)]
    target = ["-j", "REDIRECT", "--to-ports", str(RELAY_PORT)]
    _run(["ip", "netns", "exec", netns, "iptables", "-t", "nat", "-A", "OUTPUT", *rule, *target])


# The system tools WAN shaping execs inside the namespaces, and the Debian package of each.
WAN_TOOLS = {"tc": "iproute2", "iptables": "iptables"}


def wan_tools_missing(shapes: Iterable[WanShape]) -> str | None:
    """None when the tools these shapes need are installed, else which are missing and how
    to install them (a rate needs ``tc``, a delay ``iptables`` for the delay-line redirect)."""
    shapes = list(shapes)
    need = {"tc": any(s.rate for s in shapes), "iptables": any(s.delay > 0 for s in shapes)}
    missing = [t for t, used in need.items() if used and shutil.which(t) is None]
    if not missing:
        return None
    pkgs = " ".join(sorted({WAN_TOOLS[t] for t in missing}))
    return (
        f"WAN shaping needs {' and '.join(missing)}, not installed here: apt-get install {pkgs} "
        "(or scripts/install_system_tools.sh)"
    )


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise WanError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")


def relay_argv(own: WanShape, peers: Mapping[str, WanShape]) -> list[str]:
    """The command that runs one site's delay line (inside its namespace)."""
    argv = [sys.executable, "-m", "mobius_fed.testbed.wan", "relay", "--delay", str(own.delay)]
    argv += ["--hold", str(hold_bytes(own))]
    for addr, shape in peers.items():
        argv += ["--peer", f"{addr}={shape.delay}"]
    return argv


# --------------------------------------------------------------------------- delay line


class _DelayPipe:
    """One direction of a relayed connection: bytes read from ``src`` are written to
    ``dst`` ``delay`` seconds later, at most ``hold`` bytes held at once."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay: float, hold: int) -> None:
        self.src, self.dst, self.delay, self.hold = src, dst, delay, hold
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.held = 0
        self.cond = threading.Condition()
        self.dead = False

    def start(self) -> None:
        for fn in (self._read, self._write):
            threading.Thread(target=fn, daemon=True).start()

    def _stop(self) -> None:
        with self.cond:
            self.dead = True
            self.cond.notify_all()
        for s in (self.src, self.dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        buf = bytearray(CHUNK)
        try:
            while True:
                n = self.src.recv_into(buf)
                chunk = bytes(buf[:n]) if n else None
                with self.cond:
                    self.cond.wait_for(lambda: self.held < self.hold or self.dead)
                    if self.dead:
                        return
                    self.queue.append((time.monotonic() + self.delay, chunk))
                    self.held += n
                    self.cond.notify_all()
                if not n:
                    return
        except OSError:
            self._stop()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.queue or self.dead)
                    if self.dead:
                        return
                    due, chunk = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                with self.cond:
                    self.queue.popleft()
                if chunk is None:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(chunk)
                with self.cond:
                    self.held -= len(chunk)
                    self.cond.notify_all()
        except OSError:
            self._stop()


def _original_destination(conn: socket.socket) -> tuple[str, int]:
    raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


def _relay_one(conn: socket.socket, delay: float, peers: dict[str, float], hold: int) -> None:
    try:
        host, port = _original_destination(conn)
        out = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        out.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, RELAY_MARK)
        out.connect((host, port))
    except OSError:
        conn.close()
        return
    for s in (conn, out):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _DelayPipe(conn, out, delay, hold).start()
    _DelayPipe(out, conn, peers.get(host, 0.0), hold).start()


def run_relay(delay: float, peers: dict[str, float], hold: int, port: int = RELAY_PORT) -> None:
    """Serve the delay line of one site until killed."""
    srv = socket.create_server(("0.0.0.0", port), backlog=128)  # with SO_REUSEADDR
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        _relay_one(conn, delay, peers, hold)


# ------------------------------------------------------------------------------- probe


def serve_probe(port: int) -> None:
    """Answer :func:`probe`: echo 1-byte pings, swallow bulk bytes and report their count."""
    srv = socket.create_server(("0.0.0.0", port), backlog=16)  # with SO_REUSEADDR
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_probe_session, args=(conn,), daemon=True).start()


def _probe_session(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        mode = conn.recv(1)
        if mode == b"p":  # ping-pong
            while conn.recv(1) == b"x":
                conn.sendall(b"y")
        elif mode == b"b":  # bulk: count bytes until EOF; answer the count and the span
            buf, total, first = bytearray(CHUNK), 0, 0.0
            while n := conn.recv_into(buf):
                first = first or time.perf_counter()
                total += n
            conn.sendall(struct.pack("!Qd", total, time.perf_counter() - first))


def probe(host: str, port: int, seconds: float = 3.0, pings: int = 10) -> dict[str, float]:
    """Median round trip of ``pings`` 1-byte messages (ms) and the throughput (Mbit/s) of
    one TCP stream sending for ``seconds``, as the receiver saw it (bytes over the span
    from its first to its last byte)."""
    deadline = time.monotonic() + 10
    while True:  # the server may still be starting (a relay accepts, then drops us)
        try:
            rtts = _pings(host, port, pings)
            break
        except (ConnectionError, WanError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with socket.create_connection((host, port)) as s:
        s.sendall(b"b")
        data = bytes(CHUNK)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        answer = s.recv(16, socket.MSG_WAITALL)
    if len(answer) < 16:
        raise WanError("probe: the server closed the connection early")
    total, span = struct.unpack("!Qd", answer)
    return {"rtt_ms": rtts[len(rtts) // 2] * 1e3, "mbit_s": total * 8 / span / 1e6}


def _pings(host: str, port: int, count: int) -> list[float]:
    with socket.create_connection((host, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"p")
        rtts = []
        for _ in range(count):
            t = time.perf_counter()
            s.sendall(b"x")
            if s.recv(1) != b"y":
                raise WanError("probe: the server did not answer")
            rtts.append(time.perf_counter() - t)
        s.sendall(b".")
    return sorted(rtts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mobius_fed.testbed.wan")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("relay", help="run a site's delay line (inside its namespace)")
    r.add_argument("--delay", type=float, required=True, help="own one-way delay, seconds")
    r.add_argument("--peer", action="append", default=[], metavar="ADDR=SECONDS")
    r.add_argument("--hold", type=int, default=MIN_HOLD, help="bytes held per direction")
    r.add_argument("--port", type=int, default=RELAY_PORT)
    s = sub.add_parser("probe-server", help="answer probes on PORT")
    s.add_argument("--port", type=int, required=True)
    c = sub.add_parser("probe", help="measure RTT and one stream's rate to HOST:PORT")
    c.add_argument("target", help="HOST:PORT")
    c.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args(argv)
    if args.cmd == "relay":
        peers = {a: float(d) for a, _, d in (x.partition("=") for x in args.peer)}
        run_relay(args.delay, peers, args.hold, args.port)
    elif args.cmd == "probe-server":
        serve_probe(args.port)
    else:
        host, _, port = args.target.rpartition(":")
        print(json.dumps(probe(host, int(port), args.seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
