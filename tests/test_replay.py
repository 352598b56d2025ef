"""Introductions are fresh and single-use (docs/security.md "Introductions are fresh and
single-use"): a replayed or stale introduction takes no slot and no pairing, and a tunnel
that cannot prove its own introduction is closed before any TLS byte. The live test
captures the introductions of a relayed edge on the wire while a ring trains and replays
them from another process: every replay is refused, and the ring ends on the reference
losses.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mobius_fed.config import TrainConfig
from mobius_fed.relay.daemon import Relay
from mobius_fed.relay.splice import (
    ACCEPT,
    DIAL,
    MAGIC,
    MAX_SKEW_S,
    PAIRED,
    REFUSED,
    ReplayCache,
    make_intro,
)
from mobius_fed.relay.tunnels import TunnelKeeper, relay_dialer

REPO = Path(__file__).resolve().parents[1]
KEY = b"0123456789abcdef" * 4
EDGE = "worker-1 → worker-2"

REPLAYER = r"""
import json, socket, sys
port = int(sys.argv[1])
for blob in sys.argv[2:]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(bytes.fromhex(blob))
        s.settimeout(10)
        try:
            got = s.recv(300)
        except OSError as exc:
            got = repr(exc).encode()
    print(json.dumps({"verdict": got.decode(errors="replace")}), flush=True)
"""


def replay_from_another_process(port: int, blobs: list[bytes]) -> list[str]:
    """Send each captured introduction from a separate process; the verdicts it read."""
    out = subprocess.run(
        [sys.executable, "-c", REPLAYER, str(port), *(b.hex() for b in blobs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["verdict"] for line in out.stdout.splitlines()]


def _verdict(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        return s.recv(300)


def _signed(key: bytes, doc: dict) -> bytes:
    body = json.dumps(doc).encode()
    return (
        MAGIC + struct.pack("!H", len(body)) + body + hmac.new(key, body, hashlib.sha256).digest()
    )


def test_a_replayed_introduction_takes_no_slot() -> None:
    """A captured accept introduction is parked once; its replay (from another process)
    is refused and parks nothing; a stale one and a nonce-less one are refused too."""
    relay = Relay("127.0.0.1:0", KEY, pair_timeout=1.0)
    try:
        header, _ = make_intro(KEY, "ring/1", EDGE, ACCEPT)
        genuine = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
        genuine.sendall(header)
        deadline = time.monotonic() + 5
        while relay.status()["waiting"] != {f"ring/1 {EDGE}": 1}:
            assert time.monotonic() < deadline, relay.status()
            time.sleep(0.05)
        verdicts = replay_from_another_process(relay.port, [header, header])
        assert all(v.startswith(REFUSED.decode()) for v in verdicts), verdicts
        assert all("replayed introduction" in v for v in verdicts), verdicts
        assert relay.status()["waiting"] == {f"ring/1 {EDGE}": 1}  # still only the genuine
        stale = _signed(
            KEY,
            {"run": "ring/1", "edge": EDGE, "role": ACCEPT, "ts": time.time() - MAX_SKEW_S - 2,
             "nonce": secrets.token_hex(16)},
        )  # fmt: skip
        assert b"off this host's clock" in _verdict(relay.port, stale)
        no_nonce = _signed(
            KEY, {"run": "ring/1", "edge": EDGE, "role": ACCEPT, "ts": time.time(), "nonce": ""}
        )
        assert b"nonce of 0 bytes" in _verdict(relay.port, no_nonce)
        assert relay.status()["refused"] == 4
        genuine.close()
    finally:
        relay.close()


def test_the_replay_cache_is_bounded_and_forgets_only_stale_nonces() -> None:
    cache = ReplayCache(window=0.5, capacity=3)
    now = time.time()
    nonces = [secrets.token_bytes(16) for _ in range(4)]
    assert [cache.admit(n, now) for n in nonces[:3]] == [None, None, None]
    assert "replayed" in (cache.admit(nonces[0], now) or "")
    assert "try again" in (cache.admit(nonces[3], now) or "")  # full: fail closed
    time.sleep(1.1)  # the window passed: the entries (and their introductions) are stale
    assert cache.admit(nonces[3], time.time()) is None and len(cache) == 1


def test_a_tunnel_that_cannot_prove_its_introduction_pairs_with_nothing() -> None:
    """Someone on the wire who got a fresh accept introduction to the relay first (its
    maker's copy never arrived) is paired with a dial tunnel, but cannot prove the key over
    both nonces: the dialling end closes after its own proof, before any TLS byte."""
    relay = Relay("127.0.0.1:0", KEY, pair_timeout=3.0)
    try:
        header, _ = make_intro(KEY, "ring/1", EDGE, ACCEPT)  # captured, never delivered
        thief = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
        thief.sendall(header)
        got: list[bytes] = []

        def listen() -> None:
            thief.settimeout(10)
            buf = b""
            try:
                while chunk := thief.recv(4096):
                    buf += chunk
            except OSError:
                pass
            got.append(buf)

        t = threading.Thread(target=listen, daemon=True)
        t.start()
        time.sleep(0.3)
        open_tunnel = relay_dialer(f"127.0.0.1:{relay.port}", KEY, "ring/1", EDGE)
        thief_proof = secrets.token_bytes(32)
        threading.Timer(0.5, lambda: thief.sendall(thief_proof)).start()
        with pytest.raises(ConnectionError, match="could not prove its introduction"):
            open_tunnel()
        t.join(15)
        # the thief read the verdict and the dialler's proof, nothing more: no ClientHello
        assert got and got[0][:1] == PAIRED and len(got[0]) == 1 + 16 + 32, got
    finally:
        relay.close()


def test_a_genuine_pair_confirms_and_carries_bytes() -> None:
    """The control: both ends hold the key, confirm each other and the bytes flow."""
    srv = socket.create_server(("127.0.0.1", 0))
    relay = Relay("127.0.0.1:0", KEY, pair_timeout=3.0)
    meet = f"127.0.0.1:{relay.port}"
    keeper = TunnelKeeper(meet, KEY, "ring/1", EDGE, f"127.0.0.1:{srv.getsockname()[1]}")
    try:
        sock = relay_dialer(meet, KEY, "ring/1", EDGE)()
        conn, _ = srv.accept()
        sock.sendall(b"hello")
        assert conn.recv(5) == b"hello"
        sock.close()
        conn.close()
    finally:
        keeper.close()
        relay.close()
        srv.close()


# --------------------------------------------------------------------------- live ring
class CaptureProxy:
    """A TCP proxy in front of the relay that records every introduction it carries."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.intros: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._carry, args=(conn,), daemon=True).start()

    def _carry(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            up.settimeout(None)
        except OSError:
            conn.close()
            return
        head = b""
        try:
            while len(head) < 6:
                head += conn.recv(6 - len(head)) or b"!" * 6
            n = struct.unpack("!H", head[4:6])[0]
            rest = b""
            while len(rest) < n + 32:
                chunk = conn.recv(n + 32 - len(rest))
                if not chunk:
                    break
                rest += chunk
            self.intros.append(head + rest)
            up.sendall(head + rest)
        except OSError:
            conn.close()
            up.close()
            return
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._sock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.close()


@pytest.mark.slow
def test_introductions_captured_while_a_ring_trains_are_refused_when_replayed(tmp_path: Path):
    """4 workers, edge 1 → 2 relayed through a proxy that records its introductions. While
    the ring trains, another process replays every one captured so far (some seconds old,
    inside the freshness window): each is refused as a replay, the relay parks none of
    them, and the ring ends on the reference losses."""
    from tests.test_coordinator import BASE, max_diff, reference, ring_history
    from tests.test_reachability import ReachFederation, _wait_for

    class Captured(ReachFederation):
        def worker_cmd(self, i: int) -> list[str]:
            cmd = super().worker_cmd(i)
            return [c.replace(f":{self.relay_port}", f":{proxy.port}") for c in cmd]

    train = TrainConfig(**BASE, steps=12, sync_every=2)
    fed = Captured(tmp_path, train, threads=1).prepare()
    fed.start_relay()
    (relay_port,) = [fed.relay_port]
    proxy = CaptureProxy(relay_port)
    fed.start()
    try:
        _wait_for(fed, lambda d: d["step"] >= 2, what="training through the relay")
        captured = list(proxy.intros)
        assert captured, "no introduction went through the proxy"
        before = fed.relay_status()
        verdicts = replay_from_another_process(relay_port, captured)
        assert len(verdicts) == len(captured)
        for v in verdicts:
            assert v.startswith(REFUSED.decode()), verdicts
            assert "replayed introduction" in v or "off this host's clock" in v, verdicts
        after = fed.relay_status()
        assert after["refused"] - before["refused"] == len(captured), after
        assert (fed.status() or {}).get("phase") == "training", "replayed after the run ended"
        final = fed.wait(timeout=300)
        assert final["phase"] == "done", (final.get("error"), fed.tail("coordinator", 30))
        got, _ = ring_history(fed)
    finally:
        fed.stop()
        proxy.close()
    ref, _ = reference(fed)
    assert max_diff(got, ref) <= 1e-5, "replays must not change the losses"
    roles = {json.loads(c[6:-32])["role"] for c in captured}
    assert roles == {DIAL, ACCEPT}, roles
