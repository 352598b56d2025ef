"""``mobius-relay``: splices the two tunnels of ring edges whose ends both only dial out.

It pairs a successor's parked ``accept`` tunnel with the predecessor's ``dial`` tunnel for
the same (ring, edge), both signed with the relay's key, and pipes bytes. It never
terminates TLS: what it carries is the workers' end-to-end mTLS. It counts bytes per edge
and answers ``GET /status`` (JSON) on an optional plain status port.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mobius_fed.relay.rendezvous import Rendezvous
from mobius_fed.relay.splice import PAIRED, Intro, close_quietly, refuse, splice
from mobius_fed.relay.tunnels import ByteCounter

log = logging.getLogger("mobius.relay")
PAIR_TIMEOUT_S = 10.0


@dataclass
class EdgeStats:
    """One (ring, edge) through this relay."""

    bytes: ByteCounter = field(default_factory=ByteCounter)
    connections: int = 0


class Relay:
    """The splice as a daemon; ``listen`` is where both ends of relayed edges dial."""

    def __init__(self, listen: str, key: bytes, pair_timeout: float = PAIR_TIMEOUT_S) -> None:
        self.pair_timeout = pair_timeout
        self.edges: dict[tuple[str, str], EdgeStats] = {}
        self._lock = threading.Lock()
        self.rendezvous = Rendezvous(listen, key, on_dial=self._dial, name="relay")
        self.port = self.rendezvous.port
        self._http: ThreadingHTTPServer | None = None

    def _dial(self, intro: Intro, conn: socket.socket) -> None:
        paired = self.rendezvous.take(intro.run, intro.edge, self.pair_timeout, intro.nonce)
        if paired is None:
            log.info(
                "relay: no tunnel from the successor of %s within %.0fs",
                intro.edge,
                self.pair_timeout,
            )
            refuse(conn, f"no tunnel from the successor of {intro.edge} is parked here")
            return
        with self._lock:
            stats = self.edges.setdefault((intro.run, intro.edge), EdgeStats())
            stats.connections += 1
        log.info("relay: %s of ring %s spliced", intro.edge, intro.run)
        far = paired.sock
        try:  # the dialling side waits for this verdict, then both ends confirm
            conn.sendall(PAIRED + paired.accept_nonce)
        except OSError:
            close_quietly(conn)
            close_quietly(far)
            return
        splice(conn, far, stats.bytes.add, name=f"relay {intro.edge}")

    def status(self) -> dict:
        """Every edge seen: bytes, bytes/s since the previous status, connections."""
        with self._lock:
            edges = [
                {
                    "run": run,
                    "edge": edge,
                    "bytes": s.bytes.total,
                    "bytes_per_s": round(s.bytes.rate(), 1),
                    "connections": s.connections,
                }
                for (run, edge), s in sorted(self.edges.items())
            ]
        return {
            "port": self.port,
            "edges": edges,
            "waiting": self.rendezvous.waiting(),
            "refused": self.rendezvous.refused,
            "last_refusals": list(self.rendezvous.last_refusals),
        }

    def serve_status(self, listen: str) -> int:
        """Answer ``GET /status`` on ``listen`` (plain HTTP: run it on a private address)."""
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.rstrip("/") not in ("/status", ""):
                    self.send_error(404, "only /status")
                    return
                body = json.dumps(relay.status()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        host, _, port = listen.rpartition(":")
        self._http = ThreadingHTTPServer((host.strip("[]") or "127.0.0.1", int(port)), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True, name="relay-status").start()
        return self._http.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.rendezvous.close()
