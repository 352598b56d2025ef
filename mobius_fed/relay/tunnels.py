"""A worker's two ends of a tunnelled ring edge (docs/reachability.md "How a tunnelled edge
works").

:class:`Forwarder` (predecessor): a 127.0.0.1 listener the gRPC channel targets, pairing each
connection with a tunnel. :class:`TunnelKeeper` (successor): keeps ``accept`` tunnels parked,
re-parking with backoff while the rendezvous point is gone.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from mobius_fed.relay.splice import (
    ACCEPT,
    DIAL,
    NONCE_BYTES,
    PAIRED,
    REFUSED,
    close_quietly,
    confirm_pairing,
    make_intro,
    splice,
    tune,
)

log = logging.getLogger("mobius.relay")

IDLE_TUNNELS = 2
CONNECT_TIMEOUT_S = 5.0
VERDICT_TIMEOUT_S = 20.0  # a relay answers within its pair timeout (10 s)


class ByteCounter:
    """Bytes through one edge's tunnels, and a rate between two readings."""

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()
        self._last = (time.monotonic(), 0)

    def add(self, n: int) -> None:
        with self._lock:
            self.total += n

    def rate(self) -> float:
        """Bytes/s since the previous call."""
        with self._lock:
            now, total = time.monotonic(), self.total
            t0, b0 = self._last
            self._last = (now, total)
        return (total - b0) / max(now - t0, 1e-6)


def await_paired(sock: socket.socket, where: str) -> bytes:
    """Wait for the rendezvous' verdict on a tunnel: PAIRED and the other side's nonce
    (returned), else ConnectionError (why)."""
    first = sock.recv(1)
    if first != PAIRED:
        why = sock.recv(200).decode(errors="replace").strip() if first == REFUSED else ""
        raise ConnectionError(f"{where}: {why or 'closed the tunnel'}")
    nonce = b""
    while len(nonce) < NONCE_BYTES:
        got = sock.recv(NONCE_BYTES - len(nonce))
        if not got:
            raise ConnectionError(f"{where}: closed the tunnel in its verdict")
        nonce += got
    return nonce


def dial(address: str, timeout: float = CONNECT_TIMEOUT_S) -> socket.socket:
    host, _, port = address.rpartition(":")
    return tune(socket.create_connection((host.strip("[]"), int(port)), timeout=timeout))


class Forwarder:
    """127.0.0.1:<port> → a tunnel from ``open_tunnel()`` (None: none came; the gRPC
    connection is closed and the channel retries)."""

    def __init__(self, open_tunnel: Callable[[], socket.socket | None], name: str) -> None:
        self.open_tunnel, self.name = open_tunnel, name
        self.counter = ByteCounter()
        self.last_error = ""  # why the latest connection got no tunnel
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._loop, daemon=True, name=f"fwd {name}").start()

    def _loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._pair, args=(tune(conn),), daemon=True).start()

    def _pair(self, conn: socket.socket) -> None:
        try:
            far = self.open_tunnel()
        except OSError as exc:
            log.info("%s: no tunnel (%s)", self.name, exc)
            self.last_error, far = str(exc) or type(exc).__name__, None
        if far is None and not self.last_error:
            self.last_error = "no tunnel from the successor arrived"
        if far is None or self._closed:
            close_quietly(conn)
            if far is not None:
                close_quietly(far)
            return
        self.last_error = ""
        splice(conn, far, self.counter.add, name=f"splice {self.name}")

    def close(self) -> None:
        self._closed = True
        close_quietly(self._sock)


def relay_dialer(relay: str, key: bytes, run: str, edge: str) -> Callable[[], socket.socket]:
    """Open a ``dial`` tunnel for ``edge`` at ``relay`` (the relay pairs it or closes it)."""

    def open_tunnel() -> socket.socket:
        sock = dial(relay)
        try:
            header, nonce = make_intro(key, run, edge, DIAL)
            sock.sendall(header)
            sock.settimeout(VERDICT_TIMEOUT_S)
            accept_nonce = await_paired(sock, f"relay {relay}")
            sock.settimeout(None)
            confirm_pairing(sock, key, DIAL, accept_nonce, nonce)
        except OSError:
            close_quietly(sock)
            raise
        return sock

    return open_tunnel


class TunnelKeeper:
    """Keeps ``idle`` ``accept`` tunnels for ``edge`` parked at ``meet``; a paired one is
    connected to ``local`` (this worker's gRPC server)."""

    def __init__(
        self,
        meet: str,
        key: bytes,
        run: str,
        edge: str,
        local: str,
        idle: int = IDLE_TUNNELS,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.meet, self.key, self.run, self.edge, self.local = meet, key, run, edge, local
        self.max_backoff_s = max_backoff_s
        self.counter = ByteCounter()
        self.last_error = ""
        self._closing = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        for k in range(idle):
            threading.Thread(target=self._keep, daemon=True, name=f"tunnel {edge} #{k}").start()

    def _keep(self) -> None:
        """One slot: park a tunnel, serve it once paired, park the next; back off on errors."""
        delay, failures = 0.1, 0
        while not self._closing.is_set():
            try:
                if self._serve_one():
                    delay, failures = 0.1, 0
                    continue
            except OSError as exc:
                failures += 1
                # once is what a ring's end looks like from here; again and again is news
                level = logging.WARNING if failures == 3 else logging.DEBUG
                if self.last_error != str(exc) or failures == 3:
                    log.log(level, "tunnel %s via %s: %s", self.edge, self.meet, exc)
                self.last_error = str(exc)
            self._closing.wait(delay)
            delay = min(delay * 2, self.max_backoff_s)

    def _serve_one(self) -> bool:
        """Park one tunnel and wait; True once it was paired and handed to the server."""
        sock = dial(self.meet)
        with self._lock:
            if self._closing.is_set():
                close_quietly(sock)
                return False
            self._open.add(sock)
        try:
            sock.settimeout(None)
            header, nonce = make_intro(self.key, self.run, self.edge, ACCEPT)
            sock.sendall(header)
            dial_nonce = await_paired(sock, f"rendezvous {self.meet}")
            confirm_pairing(sock, self.key, ACCEPT, nonce, dial_nonce)
            local = dial(self.local)
        except BaseException:
            close_quietly(sock)
            raise
        finally:
            with self._lock:
                self._open.discard(sock)
        self.last_error = ""
        splice(sock, local, self.counter.add, name=f"splice {self.edge}")
        return True

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            for s in self._open:
                close_quietly(s)
            self._open.clear()
