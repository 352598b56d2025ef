"""Outbound-only sites: the ring plan, the tunnel splice, and a real coordinated run where
two adjacent workers only dial out (one edge reversed, one relayed through mobius-relay)
whose losses equal the reference engine's."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.replies import heartbeat_problem
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.ops.ports import free_ports
from mobius_fed.proto import control_pb2, control_pb2_grpc
from mobius_fed.relay.daemon import Relay
from mobius_fed.relay.keys import RelayKeyError, read_relay_key, write_relay_key
from mobius_fed.relay.plan import (
    DIRECT,
    RELAYED,
    REVERSED,
    RingEntry,
    RingPlanError,
    check_known_edges,
    plan_ring,
)
from mobius_fed.relay.splice import DIAL, REFUSED, make_header
from mobius_fed.relay.tunnels import Forwarder, TunnelKeeper, dial, relay_dialer
from mobius_fed.transport.certs import init_certs
from mobius_fed.transport.tls import open_channel
from mobius_fed.worker.frames import FrameRules
from mobius_fed.worker.link import PeerError, RingLinks
from tests.ring_harness import Ring
from tests.test_coordinator import BASE, max_diff, reference, ring_history
from tests.test_ring import assert_matches_reference

KEY = b"0123456789abcdef" * 4
RELAY = [sys.executable, "-m", "mobius_fed.cli.relay"]


# ----------------------------------------------------------------------------- plan
def test_each_edge_gets_its_path_from_what_both_ends_declared():
    entries = [
        RingEntry("h0:7000", rendezvous="h0:7001").encode(),
        RingEntry("h1:7000", reachable=False, relay="r:7100").encode(),
        RingEntry("h2:7000", reachable=False, relay="r:7100").encode(),
        "h3:7000",
    ]
    plan = plan_ring(entries)
    assert [(e.path, e.meet) for e in plan] == [
        (REVERSED, "h0:7001"),  # worker-1 dials worker-0's rendezvous
        (RELAYED, "r:7100"),  # nobody can dial worker-2 and worker-1 cannot accept
        (DIRECT, "h3:7000"),
        (DIRECT, "h0:7000"),
    ]
    assert RingEntry.parse(entries[1]) == RingEntry("h1:7000", False, "", "r:7100")
    assert RingEntry.parse("h3:7000") == RingEntry("h3:7000")


def test_an_edge_that_cannot_connect_is_refused_naming_it():
    no_relay = ["h0:1;rendezvous=h0:2", "h1:1;reachable=no", "h2:1;reachable=no", "h3:1"]
    with pytest.raises(RingPlanError, match=r"worker-1 → worker-2.*relay"):
        check_known_edges(no_relay)
    check_known_edges(["h0:1;rendezvous=h0:2", "h1:1;reachable=no", "", "h3:1"])  # 2: later
    with pytest.raises(RingPlanError, match=r"worker-0 → worker-1.*--tunnel-listen"):
        plan_ring(["h0:7000", "h1:7000;reachable=no"])
    (there, _) = plan_ring(["h0:7000;relay=r:1", "h1:7000;reachable=no"])  # no rendezvous:
    assert there.path == RELAYED and there.meet == "r:1"  # the relay serves the edge instead
    for bad in ("h:1;reachable=maybe", "h:1;relay=nowhere", "h:1;colour=red"):
        with pytest.raises(RingPlanError, match="ring entry"):
            RingEntry.parse(bad)


def test_a_heartbeat_with_an_unknown_edge_path_never_reaches_status():
    def problem(out: dict) -> str | None:
        links = json.dumps({"out": {"state": "up", **out}})
        return heartbeat_problem(control_pb2.HeartbeatRequest(links_json=links), 10)

    assert problem({"path": RELAYED, "tunnel_bytes": 5e9, "tunnel_bytes_per_s": 1e6}) is None
    assert "path" in problem({"path": "<script>"})
    assert "tunnel_bytes_per_s" in problem({"path": RELAYED, "tunnel_bytes_per_s": -1})


def test_relay_key_file_is_private_and_long_enough(tmp_path: Path):
    path = write_relay_key(tmp_path / "relay.key")
    assert path.stat().st_mode & 0o777 == 0o600 and len(read_relay_key(path)) == 64
    with pytest.raises(RelayKeyError, match="refusing to overwrite"):
        write_relay_key(path)
    path.chmod(0o644)
    with pytest.raises(RelayKeyError, match="readable by others"):
        read_relay_key(path)
    short = tmp_path / "short.key"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(RelayKeyError, match="at least 32"):
        read_relay_key(short)


# --------------------------------------------------------------------------- splice
def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return

            def echo(c: socket.socket) -> None:
                with c:
                    while data := c.recv(1 << 16):
                        c.sendall(data)

            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def _refusal(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        return s.recv(300)


def test_a_relay_splices_signed_tunnels_and_refuses_strangers():
    srv, port = _echo_server()
    relay = Relay("127.0.0.1:0", KEY, pair_timeout=1.0)
    meet = f"127.0.0.1:{relay.port}"
    keeper = TunnelKeeper(meet, KEY, "ring/1", "worker-1 → worker-2", f"127.0.0.1:{port}")
    fwd = Forwarder(relay_dialer(meet, KEY, "ring/1", "worker-1 → worker-2"), "edge")
    try:
        blob = bytes(range(256)) * 4096
        with dial(fwd.address) as c:
            c.sendall(blob)
            got = bytearray()
            while len(got) < len(blob):
                got += c.recv(1 << 16)
        assert bytes(got) == blob
        assert _refusal(relay.port, b"GET / HTTP/1.1\r\n\r\n").startswith(REFUSED + b"refused")
        wrong = make_header(b"x" * 64, "ring/1", "worker-1 → worker-2", DIAL)
        assert b"bad HMAC" in _refusal(relay.port, wrong)
        other = make_header(KEY, "ring/1", "worker-3 → worker-0", DIAL)
        assert b"no tunnel" in _refusal(relay.port, other)  # nothing parked for that edge
        lonely = Forwarder(relay_dialer(meet, KEY, "ring/1", "worker-2 → worker-3"), "lonely")
        with dial(lonely.address) as c:  # nobody parked a tunnel for that edge
            assert c.recv(10) == b""  # the forwarder closes the connection ...
        assert "no tunnel from the successor" in lonely.last_error  # ... knowing why
        lonely.close()
        (edge,) = relay.status()["edges"]
        assert edge["edge"] == "worker-1 → worker-2" and edge["bytes"] >= 2 * len(blob)
        assert relay.status()["refused"] == 2
    finally:
        fwd.close()
        keeper.close()
        relay.close()
        srv.close()


def test_a_site_that_wrongly_declares_itself_reachable_is_named_with_its_edge(tmp_path: Path):
    """worker-1 registered as reachable but nothing answers at its address: worker-0's
    error names the edge and the flag that fixes it."""
    certs = init_certs(tmp_path / "certs", workers=2)
    with socket.create_server(("127.0.0.1", 0)) as s:  # a port nobody listens on afterwards
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = TrainConfig(preset="cpu-tiny", batch_size=4, workers=2)
    link = RingLinks(FrameRules(cfg, 0, "r", lambda: 0), listen="127.0.0.1:0", successor=dead,
                     tls=certs.bundle("worker-0"), peer_timeout=1.0)  # fmt: skip
    try:
        with pytest.raises(PeerError) as info:
            link.connect()
    finally:
        link.close()
    msg = str(info.value)
    assert "ring edge worker-0 → worker-1" in msg and dead in msg, msg
    assert "--reachable no" in msg, msg


# ------------------------------------------------------------------------ real ring
class ReachFederation(LocalFederation):
    """Workers 1 and 2 only dial out; worker 0 offers a rendezvous; 1 and 2 use a relay."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.relay_port, self.status_port, self.tunnel_port = free_ports(3)
        self.relay_key = self.root / "relay.key"
        self.relay_proc: subprocess.Popen | None = None

    def start_relay(self) -> None:
        if not self.relay_key.exists():
            write_relay_key(self.relay_key)
        cmd = [*RELAY, "--listen", f"127.0.0.1:{self.relay_port}", "--key-file",
               str(self.relay_key), "--status-listen", f"127.0.0.1:{self.status_port}"]  # fmt: skip
        with open(self.logs / "relay.log", "a") as log:
            self.relay_proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def worker_cmd(self, i: int) -> list[str]:
        cmd = super().worker_cmd(i)
        if i == 0:
            cmd += ["--tunnel-listen", f"127.0.0.1:{self.tunnel_port}"]
        if i in (1, 2):
            cmd += ["--reachable", "no", "--relay", f"127.0.0.1:{self.relay_port}"]
            cmd += ["--relay-key", str(self.relay_key)]
        return cmd

    def relay_status(self) -> dict:
        url = f"http://127.0.0.1:{self.status_port}/status"
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())

    def stop(self, *args, **kwargs):
        if self.relay_proc is not None and self.relay_proc.poll() is None:
            self.relay_proc.terminate()
            self.relay_proc.wait(10)
        return super().stop(*args, **kwargs)


def _wait_for(fed: LocalFederation, ok, timeout: float = 180, what: str = "") -> dict:
    deadline = time.monotonic() + timeout
    while True:
        doc = fed.status()
        if doc is not None and ok(doc):
            return doc
        assert time.monotonic() < deadline, (what, doc and doc.get("error"), fed.tail("worker-1"))
        assert doc is None or doc["phase"] not in ("done", "failed"), (what, doc.get("error"))
        time.sleep(0.2)


def _finish(fed: ReachFederation) -> tuple[dict, dict, dict]:
    """Wait for the run to end done: its final status, its losses and the relay's status."""
    final = fed.wait(timeout=300)
    assert final["phase"] == "done", (final.get("error"), fed.tail("coordinator", 30))
    got, _ = ring_history(fed)
    return final, got, fed.relay_status()


@pytest.mark.slow
def test_outbound_only_sites_train_through_reversed_and_relayed_edges(tmp_path: Path):
    """4 workers, 1 and 2 declared not reachable: 0 → 1 reversed, 1 → 2 relayed, the rest
    direct. Losses equal the reference engine's; strangers at the relay and at worker-0's
    rendezvous port are refused while the ring trains; status shows every edge's path."""
    train = TrainConfig(**BASE, steps=24, sync_every=2)  # long enough to probe mid-run
    fed = ReachFederation(tmp_path, train, threads=1).prepare()
    fed.start_relay()
    fed.start()
    try:
        doc = _wait_for(
            fed,
            lambda d: d["step"] >= 2 and all(e.get("path") for e in d["ring"]),
            what="training through the tunnels, every edge reported",
        )
        paths = [e.get("path") for e in doc["ring"]]
        assert paths == [REVERSED, RELAYED, DIRECT, DIRECT], doc["ring"]
        for port in (fed.relay_port, fed.tunnel_port):
            assert _refusal(port, b"\x16\x03\x01 hello").startswith(REFUSED), port
            forged = make_header(b"not the key" * 4, "local-up/x", "worker-0 → worker-1", DIAL)
            assert b"bad HMAC" in _refusal(port, forged), port
        assert (fed.status() or {}).get("phase") == "training", "probed after the run ended"
        _, got, relay = _finish(fed)
    finally:
        fed.stop()
    ref, _ = reference(fed)
    assert max_diff(got, ref) <= 1e-5, "tunnelled edges must not change the losses"
    relayed = [e for e in relay["edges"] if e["edge"] == "worker-1 → worker-2"]
    assert relayed and sum(e["bytes"] for e in relayed) > 0, relay
    assert relay["refused"] >= 2
    assert {e["edge"] for e in relay["edges"]} == {"worker-1 → worker-2"}, "only that edge"


@pytest.mark.slow
def test_two_adjacent_outbound_only_workers_without_a_relay_are_refused(tmp_path: Path):
    """The coordinator refuses the registration that makes an edge impossible, naming it."""
    train = TrainConfig(workers=4, preset="cpu-tiny", steps=4, batch_size=4)
    fed = LocalFederation(tmp_path, train).prepare().start(workers=False)
    channels = []
    try:
        _wait_for(fed, lambda d: True, 60, "the coordinator")

        def register(rank: int) -> None:
            ch = open_channel(f"127.0.0.1:{fed.coord_port}", fed.bundle(f"worker-{rank}"),
                              target_name="coordinator")  # fmt: skip
            channels.append(ch)
            req = control_pb2.RegisterRequest(listen_address="127.0.0.1:9", unreachable=True)
            control_pb2_grpc.ControlStub(ch).Register(req, timeout=10)

        register(1)
        with pytest.raises(grpc.RpcError) as info:
            register(2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "worker-1 → worker-2" in info.value.details()
        assert "relay" in info.value.details()
    finally:
        for ch in channels:
            with contextlib.suppress(Exception):
                ch.close()
        fed.stop()


@pytest.mark.slow
def test_a_relay_that_dies_mid_run_heals_once_it_is_back(tmp_path: Path):
    """The relay is killed at step 3 and restarted 4 s later on the same port: the relayed
    edge reconnects (session resume or incident recovery) and the losses are unchanged."""
    train = TrainConfig(**BASE, steps=8, sync_every=2)
    fed = ReachFederation(tmp_path, train, threads=1).prepare()
    fed.start_relay()
    fed.start()
    try:
        _wait_for(fed, lambda d: d["step"] >= 3, what="training before the cut")
        assert fed.relay_proc is not None
        fed.relay_proc.kill()
        fed.relay_proc.wait(10)
        time.sleep(4.0)
        fed.start_relay()
        final, got, relay = _finish(fed)
    finally:
        fed.stop()
    ref, _ = reference(fed)
    assert max_diff(got, ref) <= 1e-5, "a relay restart must not change the losses"
    assert any(e["bytes"] > 0 for e in relay["edges"]), "the restarted relay carried the edge"
    edge = final["ring"][1]
    # its sender's last report shows the reconnect, or (when the run ended before the next
    # heartbeat) the edge still down from the 4 s outage; or the cut became an incident
    seen = edge["reconnects"] >= 1 or edge["down_s"] >= 3.0 or final["incidents"]
    assert seen, ("the cut was not seen", edge)


class StaticReachRing(Ring):
    """A static ring (--peers as ring entries): 0 → 1 reversed, 1 → 2 relayed, 2 → 0 direct."""

    def prepare(self) -> StaticReachRing:
        super().prepare()
        self.tunnel_port, self.relay_port = free_ports(2)
        self.relay_key = write_relay_key(self.root / "relay.key")
        return self

    def worker_cmd(self, i: int, extra: list[str] = ()) -> list[str]:  # type: ignore[assignment]
        cmd = super().worker_cmd(i, extra)
        p = self.ports
        entries = [
            f"127.0.0.1:{p[0]};rendezvous=127.0.0.1:{self.tunnel_port}",
            f"127.0.0.1:{p[1]};reachable=no",
            f"127.0.0.1:{p[2]};reachable=no;relay=127.0.0.1:{self.relay_port}",
        ]
        cmd[cmd.index("--peers") + 1] = ",".join(entries)
        cmd += ["--relay-key", str(self.relay_key)]  # a static ring's tunnels all use it
        return cmd + (["--tunnel-listen", f"127.0.0.1:{self.tunnel_port}"] if i == 0 else [])


@pytest.mark.slow
def test_a_static_ring_takes_ring_entries_and_equals_the_reference(tmp_path: Path):
    train = dict(preset="cpu-tiny", steps=6, batch_size=4, sync_every=0, eval_every=0)
    ring = StaticReachRing(tmp_path, 3, train).prepare()
    relay = Relay(f"127.0.0.1:{ring.relay_port}", read_relay_key(ring.relay_key))
    try:
        ring.start().wait()
        status = relay.status()
    finally:
        relay.close()
    assert_matches_reference(ring)
    (edge,) = status["edges"]
    assert edge["edge"] == "worker-1 → worker-2" and edge["bytes"] > 0, status
