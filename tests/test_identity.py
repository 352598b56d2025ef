"""Identity at both ends (docs/security.md "The identity rule"): an impostor holding a
genuinely signed certificate with a borrowed extra name (what an older ``certs sign``, or
``certs init --host coordinator``, let through) is refused as coordinator, as successor, as
predecessor and as the far end of a relayed edge. Real processes and real mTLS: the
impostor is ``python -m tests.impostor``, the worker a real ``mobius-worker`` or the real
ring link; each refusal has a control run in which the same impostor, holding the genuine
certificate of the node it claims to be, does receive the calls (so the test can fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from mobius_fed.config import TrainConfig
from mobius_fed.relay.daemon import Relay
from mobius_fed.relay.tunnels import Forwarder, relay_dialer
from mobius_fed.transport.certs import (
    CertLayout,
    init_certs,
    leaf_certificate,
    load_ca,
    node_sans,
    validity,
    write_file,
)
from mobius_fed.transport.tls import NodeTLS, open_channel
from mobius_fed.worker.frames import FrameRules
from mobius_fed.worker.link import PeerError, RingLinks
from tests.cert_util import sign_leaf

REPO = Path(__file__).resolve().parents[1]
RUN = "identity-test"
BORROWED = ["coordinator", "worker-0", "worker-1", "relay"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "MOBIUS_THREADS": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[CertLayout, Path]:
    """A lab PKI and the impostor's bundle: worker-2's real key, certified by the real CA
    with the borrowed extra names (no ``sign`` of this release writes them any more)."""
    root = tmp_path_factory.mktemp("pki")
    layout = init_certs(root / "certs", workers=3)
    ca_key, ca_cert = load_ca(layout.ca_cert, layout.ca_key)
    key = serialization.load_pem_private_key(layout.bundle("worker-2").key.read_bytes(), None)
    start, end = validity(1)
    cert = leaf_certificate(
        key.public_key(),  # type: ignore[arg-type]
        "worker-2",
        node_sans("worker-2", BORROWED),
        ca_key,
        ca_cert,
        start,
        end,
    )
    d = root / "impostor"
    d.mkdir()
    write_file(d / "ca.crt", layout.ca_cert.read_bytes(), 0o644)
    write_file(d / "tls.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    write_file(d / "tls.key", layout.bundle("worker-2").key.read_bytes(), 0o600)
    dns = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(BORROWED) <= set(dns.get_values_for_type(x509.DNSName))  # the attack's premise
    return layout, d


class Impostor:
    """``python -m tests.impostor``: its port and every event it printed."""

    def __init__(self, bundle: Path, claim: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.impostor",
                "--bundle",
                str(bundle),
                "--claim",
                claim,
                *extra,
            ],
            cwd=REPO,
            env=ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        self.port = int(json.loads(first)["port"])
        self.events: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def calls(self) -> list[str]:
        return [e["call"] for e in self.events if "call" in e]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@contextmanager
def impostor(bundle: Path, claim: str, *extra: str) -> Iterator[Impostor]:
    imp = Impostor(bundle, claim, *extra)
    try:
        yield imp
    finally:
        imp.close()


def _bundle_dir(layout: CertLayout, name: str) -> Path:
    return layout.bundle(name).cert.parent


# --------------------------------------------------------------------------- coordinator
@pytest.mark.parametrize("holder", ["impostor", "genuine"])
def test_a_worker_refuses_an_impostor_coordinator(
    pki: tuple[CertLayout, Path], tmp_path: Path, holder: str
) -> None:
    """A real mobius-worker dials the impostor as its coordinator: the TLS handshake fails
    (the certificate lacks ``coordinator.id.mobius.invalid``), so no Register reaches it."""
    layout, forged = pki
    bundle = forged if holder == "impostor" else _bundle_dir(layout, "coordinator")
    w0 = layout.bundle("worker-0")
    with impostor(bundle, "mobius://coordinator") as imp:
        argv = ["--coordinator", f"127.0.0.1:{imp.port}", "--data-dir", str(tmp_path / "d")]
        argv += ["--out-dir", str(tmp_path / "o"), "--threads", "1", "--peer-timeout", "6"]
        argv += ["--ca", str(w0.ca), "--cert", str(w0.cert), "--key", str(w0.key)]
        proc = subprocess.run(
            [sys.executable, "-m", "mobius_fed.cli.worker", *argv],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        time.sleep(0.3)
        calls = imp.calls()
    assert proc.returncode != 0, proc.stderr[-2000:]
    if holder == "impostor":
        assert calls == [], calls  # not one call: the worker never sent Register
        assert "unreachable" in proc.stderr, proc.stderr[-2000:]
    else:
        assert "/mobius_fed.control.v1.Control/Register" in calls, calls


# --------------------------------------------------------------------------- successor
def _link(layout: CertLayout, rank: int, successor: str, timeout: float) -> RingLinks:
    cfg = TrainConfig(preset="cpu-base", batch_size=8, workers=3)
    return RingLinks(
        FrameRules(cfg, rank, RUN, lambda: 0),
        listen="127.0.0.1:0",
        successor=successor,
        tls=layout.bundle(f"worker-{rank}"),
        peer_timeout=timeout,
    )


def _dial(link: RingLinks) -> str:
    try:
        link.connect()
    except PeerError as exc:
        return str(exc)
    finally:
        link.close()
    return ""


@pytest.mark.parametrize("holder", ["impostor", "genuine"])
def test_a_worker_refuses_an_impostor_successor(pki: tuple[CertLayout, Path], holder: str) -> None:
    """worker-0's real ring link dials the impostor as worker-1: no Ping, no Stream, no frame
    reaches it (the certificate lacks ``worker-1.id.mobius.invalid``)."""
    layout, forged = pki
    bundle = forged if holder == "impostor" else _bundle_dir(layout, "worker-1")
    with impostor(bundle, "mobius://worker/1") as imp:
        link = _link(layout, 0, f"127.0.0.1:{imp.port}", timeout=4.0)
        link.start_server()
        why = _dial(link)
        time.sleep(0.3)
        calls = imp.calls()
    if holder == "impostor":
        assert calls == [], calls
        assert "unreachable" in why, why
    else:
        assert "/mobius_fed.ring.v1.RingLink/Ping" in calls, calls


# --------------------------------------------------------------------------- relayed edge
@pytest.mark.parametrize("holder", ["impostor", "genuine"])
def test_a_relayed_edge_refuses_an_impostor_at_its_far_end(
    pki: tuple[CertLayout, Path], holder: str
) -> None:
    """The impostor (it holds the relay key, as every site of the relay does) parks the
    successor's tunnels of edge worker-0 → worker-1 at a real relay: the relay splices
    worker-0's connection to it, and worker-0's TLS refuses it end to end."""
    layout, forged = pki
    bundle = forged if holder == "impostor" else _bundle_dir(layout, "worker-1")
    key = "ab" * 32
    relay = Relay("127.0.0.1:0", key.encode(), pair_timeout=3.0)
    edge = "worker-0 → worker-1"
    relay_at = f"127.0.0.1:{relay.port}"
    fwd = Forwarder(relay_dialer(relay_at, key.encode(), RUN, edge), edge)
    try:
        with impostor(
            bundle,
            "mobius://worker/1",
            "--relay",
            relay_at,
            "--relay-key",
            key,
            "--run",
            RUN,
            "--edge",
            edge,
        ) as imp:
            link = _link(layout, 0, fwd.address, timeout=4.0)
            link.start_server()
            why = _dial(link)
            time.sleep(0.3)
            calls = imp.calls()
            spliced = sum(e["connections"] for e in relay.status()["edges"])
    finally:
        fwd.close()
        relay.close()
    assert spliced >= 1  # the relay did pair worker-0 with the impostor's tunnel
    if holder == "impostor":
        assert calls == [], calls
        assert "unreachable" in why, why
    else:
        assert "/mobius_fed.ring.v1.RingLink/Ping" in calls, calls


# --------------------------------------------------------------------------- predecessor
def _stream(addr: str, tls: NodeTLS) -> tuple[grpc.StatusCode, str]:
    """Open worker-1's Stream as its predecessor would; how the server answered."""
    with open_channel(addr, tls, target_name="worker-1") as ch:
        call = ch.stream_stream(
            "/mobius_fed.ring.v1.RingLink/Stream",
            request_serializer=None,
            response_deserializer=None,
        )
        it = call(iter(()), metadata=[("mobius-run", RUN), ("mobius-ack", "0")], timeout=10)
        try:
            md = dict(it.initial_metadata() or ())
            if "mobius-session" in md:
                it.cancel()
                return grpc.StatusCode.OK, "session offered"
            for _ in it:
                pass
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        return it.code(), it.details() or ""


def test_a_worker_refuses_an_impostor_predecessor(pki: tuple[CertLayout, Path], tmp_path: Path):
    """The impostor dials worker-1's real ring server as its predecessor worker-0: refused,
    naming the identity its certificate really holds. A certificate carrying another
    identity's reserved name (a forgery only an older ``sign`` could have made) is refused
    as a caller too; the genuine worker-0 is offered a session."""
    layout, forged = pki
    w1 = _link(layout, 1, "127.0.0.1:9", timeout=4.0)
    port = w1.start_server()
    addr = f"127.0.0.1:{port}"
    try:
        code, details = _stream(
            addr, NodeTLS(forged / "ca.crt", forged / "tls.crt", forged / "tls.key")
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert "mobius://worker/2" in details, details
        reserved = sign_leaf(
            layout.root,
            tmp_path / "r",
            "mobius://worker/2",
            "w",
            dns=["worker-0.id.mobius.invalid"],
        )
        code, details = _stream(addr, reserved)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert "another identity's name 'worker-0.id.mobius.invalid'" in details, details
        code, details = _stream(addr, layout.bundle("worker-0"))
        assert code == grpc.StatusCode.OK, (code, details)
    finally:
        w1.close()


# --------------------------------------------------------------------------- operator → REST
@pytest.mark.parametrize("holder", ["impostor", "genuine"])
def test_the_operator_refuses_an_impostor_rest_server(
    pki: tuple[CertLayout, Path], holder: str
) -> None:
    """The real REST server, started with the impostor's certificate: the operator's client
    (``mobius-fed status --rest``, the dashboard proxy) refuses it at the TLS handshake."""
    from mobius_fed.coordinator.rest import RestServer
    from mobius_fed.coordinator.rest_client import RestClientError, rest_get
    from mobius_fed.coordinator.state import RunState

    layout, forged = pki
    bundle = forged if holder == "impostor" else _bundle_dir(layout, "coordinator")
    tls = NodeTLS(bundle / "ca.crt", bundle / "tls.crt", bundle / "tls.key")
    state = RunState(run_id="r", P=3, steps=4, strategy="fedavg", num_rounds=1)
    srv = RestServer(state, "127.0.0.1", 0, tls=tls, allowed=lambda who: True).start()
    try:
        url = f"https://127.0.0.1:{srv.port}"
        if holder == "impostor":
            with pytest.raises(RestClientError, match=r"CERTIFICATE_VERIFY_FAILED|hostname"):
                rest_get(url, "/v1/status", layout.bundle("operator"))
        else:
            assert rest_get(url, "/v1/status", layout.bundle("operator"))["run_id"] == "r"
    finally:
        srv.stop()
