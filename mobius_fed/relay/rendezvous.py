"""Where tunnels meet: a TCP listener that verifies introductions and pairs tunnels.

Outbound-only successors park ``accept`` tunnels here (a few per edge); a connection that
wants the edge (a relayed predecessor's ``dial`` tunnel, or the local forwarder of a
worker whose successor only dials out) takes one: the rendezvous sends it :data:`PAIRED`
and the two are spliced.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from mobius_fed.relay.splice import (
    ACCEPT,
    NONCE_BYTES,
    PAIRED,
    Intro,
    ReplayCache,
    TunnelRefused,
    close_quietly,
    read_header,
    refuse,
    tune,
)

log = logging.getLogger("mobius.relay")

MAX_WAITING = 4  # parked tunnels per (run, edge); more are refused
Check = Callable[[Intro], str | None]  # why an introduction is refused here, or None


class Paired(NamedTuple):
    """A parked tunnel handed out: told :data:`PAIRED` with ``dial_nonce``; both ends
    confirm over ``accept_nonce`` and ``dial_nonce`` (``splice.confirm_pairing``)."""

    sock: socket.socket
    accept_nonce: bytes
    dial_nonce: bytes


class Rendezvous:
    """A listener for tunnel introductions signed with ``key``.

    ``check`` refuses introductions this rendezvous does not serve; ``on_dial`` handles a
    verified ``dial`` tunnel (None: dial tunnels are refused).
    """

    def __init__(
        self,
        listen: str,
        key: bytes,
        *,
        check: Check | None = None,
        on_dial: Callable[[Intro, socket.socket], None] | None = None,
        name: str = "rendezvous",
    ) -> None:
        if not key:
            raise ValueError("a rendezvous needs a non-empty key")
        self.key, self.check, self.on_dial, self.name = key, check, on_dial, name
        host, _, port = listen.rpartition(":")
        self._sock = socket.create_server(
            (host.strip("[]") or "0.0.0.0", int(port)), reuse_port=False
        )
        self.port = self._sock.getsockname()[1]
        self._waiting: dict[tuple[str, str], list[tuple[socket.socket, bytes]]] = {}
        self.replays = ReplayCache()  # every introduction is taken once
        self._cond = threading.Condition()
        self._closed = False
        self.refused = 0  # introductions refused so far
        self.last_refusals: deque[str] = deque(maxlen=20)
        threading.Thread(target=self._accept_loop, daemon=True, name=name).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._introduce, args=(tune(conn), peer), daemon=True, name=self.name
            ).start()

    def _introduce(self, conn: socket.socket, peer: tuple) -> None:
        try:
            intro = read_header(conn, self.key, replays=self.replays)
            why = self.check(intro) if self.check else None
            if why is None and intro.role != ACCEPT and self.on_dial is None:
                why = f"role {intro.role} is not served here"
            if why is not None:
                raise TunnelRefused(why)
        except TunnelRefused as exc:
            self.refused += 1
            self.last_refusals.append(f"{peer[0]}: {exc}")
            log.warning("%s: refused a tunnel from %s: %s", self.name, peer[0], exc)
            refuse(conn, f"refused: {exc}")
            return
        if intro.role == ACCEPT:
            self._park(intro, conn)
        elif self.on_dial is not None:  # else refused above
            self.on_dial(intro, conn)

    def _park(self, intro: Intro, conn: socket.socket) -> None:
        with self._cond:
            self._prune()
            slot = self._waiting.setdefault((intro.run, intro.edge), [])
            if len(slot) >= MAX_WAITING or self._closed:
                refuse(conn, f"refused: {MAX_WAITING} tunnels already wait for {intro.edge}")
                return
            slot.append((conn, intro.nonce))
            self._cond.notify_all()

    def _prune(self) -> None:
        """Forget parked tunnels whose opener closed them (an old ring incarnation's)."""
        for k, slot in list(self._waiting.items()):
            alive = [s for s in slot if _alive(s[0])]
            for s in slot:
                if s not in alive:
                    close_quietly(s[0])
            if alive:
                self._waiting[k] = alive
            else:
                del self._waiting[k]

    def take(
        self, run: str, edge: str, timeout: float, dial_nonce: bytes | None = None
    ) -> Paired | None:
        """A live parked tunnel for (run, edge), told it is paired with ``dial_nonce`` (the
        dialling side's introduction's; a fresh one for a local taker); None after
        ``timeout``."""
        dial_nonce = dial_nonce or secrets.token_bytes(NONCE_BYTES)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed:
                slot = self._waiting.get((run, edge), [])
                while slot:
                    conn, accept_nonce = slot.pop(0)
                    with contextlib.suppress(OSError):
                        if _alive(conn):
                            conn.sendall(PAIRED + dial_nonce)
                            return Paired(conn, accept_nonce, dial_nonce)
                    close_quietly(conn)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.5))
        return None

    def waiting(self) -> dict[str, int]:
        with self._cond:
            return {f"{r} {e}": len(s) for (r, e), s in self._waiting.items() if s}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for slot in self._waiting.values():
                for s, _ in slot:
                    close_quietly(s)
            self._waiting.clear()
            self._cond.notify_all()
        close_quietly(self._sock)


def _alive(sock: socket.socket) -> bool:
    """False when the parked tunnel's far end closed it (a parked tunnel sends nothing)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
