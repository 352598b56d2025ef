"""A tunnel's introduction (authenticated header) and the byte pump between two sockets
(docs/reachability.md "How a tunnelled edge works", "Threat model").

Header: ``b"MBT1" | u16 length | JSON {run, edge, role, ts, nonce} | HMAC-SHA256(key, JSON)``.
``role`` is ``accept`` (ends at its opener's gRPC server: the successor) or ``dial`` (carries
its opener's gRPC client connection: the predecessor, at a relay). After :data:`PAIRED` both
sides only move the workers' TLS records: the splice never sees a key or a frame.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAGIC = b"MBT1"
ACCEPT, DIAL = "accept", "dial"
PAIRED = b"\x01"
REFUSED = b"\x15"  # followed by the reason, then the rendezvous closes the connection
MAX_BODY = 1024
MAX_SKEW_S = 300.0  # a header older (or newer) than this is refused
HEADER_TIMEOUT_S = 5.0
_MAC = 32


class TunnelRefused(Exception):
    """A tunnel introduction that is not accepted (the message says why)."""


@dataclass(frozen=True)
class Intro:
    """A verified tunnel introduction."""

    run: str
    edge: str
    role: str


def make_header(key: bytes, run: str, edge: str, role: str) -> bytes:
    """The introduction a tunnel opener sends first."""
    body = json.dumps(
        {"run": run, "edge": edge, "role": role, "ts": time.time(), "nonce": secrets.token_hex(8)}
    ).encode()
    mac = hmac.new(key, body, hashlib.sha256).digest()
    return MAGIC + struct.pack("!H", len(body)) + body + mac


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise TunnelRefused(f"connection closed after {len(buf)} of {n} header bytes")
        buf += got
    return bytes(buf)


def read_header(sock: socket.socket, key: bytes, timeout: float = HEADER_TIMEOUT_S) -> Intro:
    """Read and verify a tunnel introduction; TunnelRefused says what is wrong with it."""
    sock.settimeout(timeout)
    try:
        head = _recv_exact(sock, len(MAGIC) + 2)
        if head[:4] != MAGIC:
            raise TunnelRefused("not a tunnel introduction (bad magic)")
        (n,) = struct.unpack("!H", head[4:])
        if n > MAX_BODY:
            raise TunnelRefused(f"introduction of {n} bytes (at most {MAX_BODY})")
        body = _recv_exact(sock, n)
        mac = _recv_exact(sock, _MAC)
    except (TimeoutError, OSError) as exc:
        raise TunnelRefused(f"no complete introduction within {timeout:.0f}s ({exc})") from exc
    finally:
        sock.settimeout(None)
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        raise TunnelRefused("introduction not signed with this rendezvous' key (bad HMAC)")
    try:
        doc = json.loads(body)
        intro = Intro(str(doc["run"]), str(doc["edge"]), str(doc["role"]))
        skew = abs(time.time() - float(doc["ts"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise TunnelRefused(f"malformed introduction: {exc}") from exc
    if skew > MAX_SKEW_S:
        raise TunnelRefused(f"introduction {skew:.0f}s off this host's clock (a replay?)")
    if intro.role not in (ACCEPT, DIAL):
        raise TunnelRefused(f"unknown role {intro.role[:20]!r}")
    return intro


def refuse(sock: socket.socket, reason: str) -> None:
    """Tell the opener why (best effort) and close."""
    with contextlib.suppress(OSError):
        sock.sendall(REFUSED + reason.encode()[:200] + b"\n")
    close_quietly(sock)


def close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def tune(sock: socket.socket) -> socket.socket:
    """No Nagle delay (gRPC frames are small and latency-bound), keepalive for idle tunnels."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def splice(
    a: socket.socket,
    b: socket.socket,
    count: Callable[[int], None] | None = None,
    name: str = "splice",
) -> None:
    """Pipe bytes both ways between ``a`` and ``b`` in two threads; both close at the end."""
    left = [2]
    lock = threading.Lock()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        buf = memoryview(bytearray(1 << 20))  # one buffer per direction, no allocation
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                dst.sendall(buf[:n])
                if count is not None:
                    count(n)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            # a reset on one side ends both directions
            close_quietly(a)
            close_quietly(b)
        finally:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                close_quietly(a)
                close_quietly(b)

    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=pump, args=(src, dst), daemon=True, name=name).start()
