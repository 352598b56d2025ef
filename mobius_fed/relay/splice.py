"""A tunnel's introduction (authenticated header) and the byte pump between two sockets
(docs/reachability.md "How a tunnelled edge works", "Threat model"; docs/security.md
"Introductions are fresh and single-use").

Header: ``b"MBT2" | u16 length | JSON {run, edge, role, ts, nonce} | HMAC-SHA256(key, JSON)``.
``role`` is ``accept`` (ends at its opener's gRPC server: the successor) or ``dial`` (carries
its opener's gRPC client connection: the predecessor, at a relay). An introduction is taken
once: ``ts`` within :data:`MAX_SKEW_S` of the reader's clock and a ``nonce`` the reader's
:class:`ReplayCache` has not seen. The verdict :data:`PAIRED` carries the other side's
nonce, and both ends then prove the key over both nonces (:func:`pair_proof`) before any
byte of the workers' TLS moves: a pairing is bound to both sides' fresh introductions.
After that the splice only moves the workers' TLS records: it never sees a key or a frame.
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

MAGIC = b"MBT2"
ACCEPT, DIAL = "accept", "dial"
PAIRED = b"\x01"  # followed by the other side's nonce (NONCE_BYTES)
REFUSED = b"\x15"  # followed by the reason, then the rendezvous closes the connection
MAX_BODY = 1024
MAX_SKEW_S = 30.0  # the freshness window: a header older (or newer) than this is refused
HEADER_TIMEOUT_S = 5.0
NONCE_BYTES = 16
REPLAY_CACHE_SIZE = 65536
_MAC = 32


class TunnelRefused(Exception):
    """A tunnel introduction that is not accepted (the message says why)."""


@dataclass(frozen=True)
class Intro:
    """A verified tunnel introduction."""

    run: str
    edge: str
    role: str
    nonce: bytes = b""


class ReplayCache:
    """Nonces of introductions taken within the freshness window: a second use is refused.

    Bounded: an entry is forgotten once its introduction is older than the window (the
    clock check refuses it then anyway); when ``capacity`` fresh nonces are held, new
    introductions are refused until some expire (fail closed).
    """

    def __init__(self, window: float = MAX_SKEW_S, capacity: int = REPLAY_CACHE_SIZE) -> None:
        self.window, self.capacity = window, capacity
        self._seen: dict[bytes, float] = {}  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def admit(self, nonce: bytes, ts: float) -> str | None:
        """Why ``nonce`` is refused (seen before, cache full), or None: taken now."""
        now = time.time()
        with self._lock:
            if len(self._seen) >= self.capacity or len(self._seen) % 256 == 0:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
            if nonce in self._seen:
                return "replayed introduction (its nonce was used already)"
            if len(self._seen) >= self.capacity:
                return f"{self.capacity} introductions within {self.window:.0f}s: try again"
            self._seen[nonce] = max(ts, now) + self.window
        return None

    def __len__(self) -> int:
        return len(self._seen)


def make_intro(key: bytes, run: str, edge: str, role: str) -> tuple[bytes, bytes]:
    """The introduction a tunnel opener sends first, and its nonce."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    body = json.dumps(
        {"run": run, "edge": edge, "role": role, "ts": time.time(), "nonce": nonce.hex()}
    ).encode()
    mac = hmac.new(key, body, hashlib.sha256).digest()
    return MAGIC + struct.pack("!H", len(body)) + body + mac, nonce


def make_header(key: bytes, run: str, edge: str, role: str) -> bytes:
    """The introduction a tunnel opener sends first (see :func:`make_intro`)."""
    return make_intro(key, run, edge, role)[0]


def pair_proof(key: bytes, accept_nonce: bytes, dial_nonce: bytes, role: str) -> bytes:
    """What the ``role`` end of a pairing sends first: only a holder of ``key`` whose
    introduction carried its nonce can make it, so a replayed tunnel pairs with nothing."""
    msg = b"MBT2 pair|" + accept_nonce + b"|" + dial_nonce + b"|" + role.encode()
    return hmac.new(key, msg, hashlib.sha256).digest()


def confirm_pairing(
    sock: socket.socket,
    key: bytes,
    role: str,
    accept_nonce: bytes,
    dial_nonce: bytes,
    timeout: float = HEADER_TIMEOUT_S,
) -> None:
    """Send this end's :func:`pair_proof` and check the other end's; ConnectionError if it
    is wrong or missing (the tunnel is then closed by the caller)."""
    other = DIAL if role == ACCEPT else ACCEPT
    sock.settimeout(timeout)
    try:
        sock.sendall(pair_proof(key, accept_nonce, dial_nonce, role))
        got = _recv_exact(sock, _MAC)
    except (TunnelRefused, OSError) as exc:
        raise ConnectionError(
            f"the other end of the tunnel did not confirm the pairing ({exc})"
        ) from None
    finally:
        sock.settimeout(None)
    if not hmac.compare_digest(got, pair_proof(key, accept_nonce, dial_nonce, other)):
        raise ConnectionError(
            "the other end of the tunnel could not prove its introduction (a replayed or "
            "stolen tunnel): closed before any TLS byte"
        )


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise TunnelRefused(f"connection closed after {len(buf)} of {n} header bytes")
        buf += got
    return bytes(buf)


def read_header(
    sock: socket.socket,
    key: bytes,
    timeout: float = HEADER_TIMEOUT_S,
    replays: ReplayCache | None = None,
) -> Intro:
    """Read and verify a tunnel introduction: signed with ``key``, fresh, and (with
    ``replays``) never seen before; TunnelRefused says what is wrong with it."""
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
        nonce = bytes.fromhex(str(doc["nonce"]))
        intro = Intro(str(doc["run"]), str(doc["edge"]), str(doc["role"]), nonce)
        ts = float(doc["ts"])
        skew = abs(time.time() - ts)
    except (ValueError, KeyError, TypeError) as exc:
        raise TunnelRefused(f"malformed introduction: {exc}") from exc
    if len(nonce) != NONCE_BYTES:
        raise TunnelRefused(f"introduction nonce of {len(nonce)} bytes ({NONCE_BYTES} needed)")
    if not skew <= MAX_SKEW_S:  # NaN too
        raise TunnelRefused(
            f"introduction {skew:.0f}s off this host's clock (fresh means within "
            f"{MAX_SKEW_S:.0f}s: a replay, or a clock to set right)"
        )
    if intro.role not in (ACCEPT, DIAL):
        raise TunnelRefused(f"unknown role {intro.role[:20]!r}")
    if replays is not None and (why := replays.admit(nonce, ts)) is not None:
        raise TunnelRefused(why)
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
