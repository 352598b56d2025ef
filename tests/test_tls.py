"""Certificates and real mutual TLS over loopback gRPC."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mobius_fed.proto import ring_pb2, ring_pb2_grpc
from mobius_fed.transport import (
    CertLayout,
    NodeTLS,
    add_port,
    decode_tensor,
    grpc_options,
    init_certs,
    make_frame,
    open_channel,
    parse_identity,
    peer_identity,
    require_peer,
    worker_identity,
)
from mobius_fed.transport.certs import renew_node, rotate_ca
from mobius_fed.transport.tls import (
    certificate_identity,
    channel_options,
    check_node_secrets,
    identity_or_reason,
    keepalive_scale,
    peer_identity_or_reason,
)
from tests.cert_util import sign_leaf

SERVER = worker_identity(2)
W1_NAME = "worker-1.id.mobius.invalid"  # its reserved identity name (docs/security.md)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertLayout:
    return init_certs(tmp_path_factory.mktemp("pki") / "certs", 3, hosts=["10.0.0.7", "gpu-a"])


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> CertLayout:
    return init_certs(tmp_path_factory.mktemp("pki2") / "certs", 3)


def test_identities() -> None:
    assert worker_identity(4) == "mobius://worker/4"
    assert parse_identity("mobius://worker/4") == ("worker", 4)
    assert parse_identity("mobius://coordinator") == ("coordinator", None)
    assert parse_identity("mobius://operator") == ("operator", None)
    for bad in ("spiffe://worker/1", "mobius://worker/x", "mobius://coordinator/1", "mobius://"):
        with pytest.raises(ValueError, match="not a mobius identity"):
            parse_identity(bad)


def test_the_keepalive_scale_multiplies_every_keepalive_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read at each call (a warm-started child keeps its parent's modules), applied to the
    ping, its timeout and the pings a server accepts, and refused outside 1..10000."""
    base = dict(grpc_options())
    monkeypatch.setenv("MOBIUS_KEEPALIVE_SCALE", "2.5")
    scaled = dict(channel_options())
    for name in (
        "grpc.keepalive_time_ms",
        "grpc.keepalive_timeout_ms",
        "grpc.http2.ping_timeout_ms",
        "grpc.http2.min_ping_interval_without_data_ms",
    ):
        assert scaled[name] == round(2.5 * int(base[name])), name
    assert scaled["grpc.max_receive_message_length"] == base["grpc.max_receive_message_length"]
    assert base["grpc.keepalive_timeout_ms"] == 10_000
    for bad in ("0.5", "0", "-3", "nan", "inf", "1e6", "fast"):
        with pytest.raises(ValueError, match=f"MOBIUS_KEEPALIVE_SCALE='{bad}': expected a number"):
            keepalive_scale({"MOBIUS_KEEPALIVE_SCALE": bad})
    assert keepalive_scale({"MOBIUS_KEEPALIVE_SCALE": " "}) == 1.0


def test_layout_and_modes(certs: CertLayout) -> None:
    names = sorted(p.name for p in certs.root.iterdir() if p.is_file())
    expected = ["ca", "coordinator", "operator", "worker-0", "worker-1", "worker-2"]
    assert names == sorted(f"{n}.{ext}" for n in expected for ext in ("crt", "key"))
    for p in certs.root.rglob("*"):
        if p.is_file():
            mode = stat.S_IMODE(p.stat().st_mode)
            assert mode == (0o600 if p.suffix == ".key" else 0o644), p
    # one bundle per node, holding that node's key and nobody else's
    assert sorted(p.name for p in (certs.root / "nodes").iterdir()) == sorted(expected[1:])
    for name in expected[1:]:
        bundle = certs.bundle(name)
        assert sorted(p.name for p in bundle.cert.parent.iterdir()) == [
            "ca.crt",
            "tls.crt",
            "tls.key",
        ]
        assert bundle.key.read_bytes() == certs.node(name).key.read_bytes()
        assert bundle.cert.read_bytes() == certs.node(name).cert.read_bytes()
        assert bundle.ca.read_bytes() == certs.ca_cert.read_bytes()
    node = certs.node("coordinator")
    assert node == NodeTLS(
        certs.ca_cert, certs.root / "coordinator.crt", certs.root / "coordinator.key"
    )
    with pytest.raises(KeyError, match="worker-3"):
        certs.node("worker-3")


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "c"
    first = init_certs(out, 1)
    before = first.ca_cert.read_bytes()
    with pytest.raises(FileExistsError, match="not empty"):
        init_certs(out, 1)
    assert first.ca_cert.read_bytes() == before
    init_certs(out, 1, overwrite=True)
    assert first.ca_cert.read_bytes() != before
    assert stat.S_IMODE(first.ca_key.stat().st_mode) == 0o600


def test_certificate_contents(certs: CertLayout) -> None:
    ca = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign

    leaf = x509.load_pem_x509_certificate(certs.worker(1).cert.read_bytes())
    assert leaf.issuer == ca.subject
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "worker-1"
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["mobius://worker/1"]
    assert san.get_values_for_type(x509.DNSName) == [W1_NAME, "localhost", "worker-1", "gpu-a"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.0.0.7"]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

    op = x509.load_pem_x509_certificate(certs.node("operator").cert.read_bytes())
    op_san = op.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert op_san.get_values_for_type(x509.UniformResourceIdentifier) == ["mobius://operator"]


def test_missing_file_is_named(tmp_path: Path) -> None:
    node = NodeTLS(tmp_path / "ca.crt", tmp_path / "x.crt", tmp_path / "x.key")
    with pytest.raises(FileNotFoundError, match=r"CA certificate not found: .*ca\.crt"):
        node.load()


class _Servicer(ring_pb2_grpc.RingLinkServicer):
    """Ping reports the caller; Stream accepts worker 1 only and echoes frames backward."""

    def Ping(
        self, request: ring_pb2.PingRequest, context: grpc.ServicerContext
    ) -> ring_pb2.PingReply:
        return ring_pb2.PingReply(identity=SERVER, peer=peer_identity(context) or "")

    def Stream(
        self, request_iterator: Iterator[ring_pb2.Frame], context: grpc.ServicerContext
    ) -> Iterator[ring_pb2.Frame]:
        require_peer(context, {worker_identity(1)})
        for frame in request_iterator:
            frame.direction = ring_pb2.BACKWARD
            yield frame


@pytest.fixture(scope="module")
def server(certs: CertLayout) -> Iterator[str]:
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=grpc_options())
    ring_pb2_grpc.add_RingLinkServicer_to_server(_Servicer(), srv)
    port = add_port(srv, "127.0.0.1:0", certs.bundle("worker-2"))
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(grace=None)


def _ping(channel: grpc.Channel) -> ring_pb2.PingReply:
    with channel:
        return ring_pb2_grpc.RingLinkStub(channel).Ping(ring_pb2.PingRequest(), timeout=5)


def test_mtls_client_is_identified(server: str, certs: CertLayout) -> None:
    reply = _ping(open_channel(server, certs.bundle("worker-1")))
    assert reply.identity == SERVER and reply.peer == "mobius://worker/1"
    port = server.rsplit(":", 1)[1]  # by DNS name, overriding the name checked against SANs
    operator = certs.bundle("operator")
    reply = _ping(open_channel(f"localhost:{port}", operator, target_name="worker-2"))
    assert reply.peer == "mobius://operator"


def test_stream_large_frame_and_authorization(server: str, certs: CertLayout) -> None:
    x = torch.randn(2, 1024, 1024)  # 8 MiB fp32: above gRPC's 4 MiB default limit
    frame = make_frame(
        run_id="r", step=1, origin=1, tick=0, micro=0, direction=ring_pb2.FORWARD, tensor=x
    )
    with open_channel(server, certs.bundle("worker-1")) as ch:
        (back,) = list(ring_pb2_grpc.RingLinkStub(ch).Stream(iter([frame]), timeout=10))
    assert back.direction == ring_pb2.BACKWARD
    assert torch.equal(
        decode_tensor(back.tensor, expected_shape=(2, 1024, 1024), expected_dtype="fp32"), x
    )
    with open_channel(server, certs.bundle("worker-0")) as ch, pytest.raises(grpc.RpcError) as err:
        list(ring_pb2_grpc.RingLinkStub(ch).Stream(iter([frame]), timeout=5))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "mobius://worker/0" in err.value.details()


def _assert_refused(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _ping(channel)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_without_certificate_is_refused(server: str, certs: CertLayout) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=certs.ca_cert.read_bytes())
    _assert_refused(grpc.secure_channel(server, creds))


def test_client_from_another_ca_is_refused(
    server: str, certs: CertLayout, other_ca: CertLayout
) -> None:
    # Trusts our CA (so the server passes the client's check) but presents a foreign
    # worker-1 certificate: the server must refuse it.
    foreign = other_ca.bundle("worker-1")
    _assert_refused(open_channel(server, NodeTLS(certs.ca_cert, foreign.cert, foreign.key)))
    _assert_refused(open_channel(server, foreign))


def test_plaintext_client_is_refused(server: str) -> None:
    _assert_refused(grpc.insecure_channel(server))


def test_plaintext_needs_explicit_flag(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="insecure=True"):
        open_channel("127.0.0.1:1", None)
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=grpc_options())
    with pytest.raises(ValueError, match="insecure=True"):
        add_port(srv, "127.0.0.1:0", None)
    ring_pb2_grpc.add_RingLinkServicer_to_server(_Servicer(), srv)
    with caplog.at_level(logging.WARNING, logger="mobius_fed.transport.tls"):
        port = add_port(srv, "127.0.0.1:0", None, insecure=True)
        srv.start()
        try:
            reply = _ping(open_channel(f"127.0.0.1:{port}", None, insecure=True))
        finally:
            srv.stop(grace=None)
    assert reply.peer == ""  # no certificate, no identity
    assert sum("INSECURE" in r.getMessage() for r in caplog.records) == 2


# --------------------------------------------------------------------------- strict identities
@pytest.mark.parametrize(
    ("uris", "why"),
    [
        (["mobius://worker/1", "mobius://worker/0"], "certificate carries 2 mobius:// URIs"),
        (["mobius://worker/0", "mobius://worker/1"], "certificate carries 2 mobius:// URIs"),
        (["mobius://worker/1", "MOBIUS://worker/0"], "certificate carries 2 mobius:// URIs"),
        (["mobius://worker/1"] * 3, "certificate carries 3 mobius:// URIs"),
        ([], "certificate carries no mobius:// URI"),
        (["spiffe://example.org/worker/1"], "certificate carries no mobius:// URI"),
        (["mobius://worker/1/x"], "is not a valid mobius identity"),
    ],
)
def test_forged_identities_are_refused(
    server: str, certs: CertLayout, tmp_path: Path, uris: list[str], why: str
) -> None:
    # Signed by the real CA (as by a careless or compromised CA holder): TLS accepts it,
    # authorization must not.
    forged = sign_leaf(certs.root, tmp_path, uris, "worker-1")
    assert _ping(open_channel(server, forged)).peer == ""  # no identity at all
    frame = make_frame(
        run_id="r", step=1, origin=1, tick=0, micro=0, direction=ring_pb2.FORWARD,
        tensor=torch.zeros(2),
    )  # fmt: skip
    with open_channel(server, forged) as ch, pytest.raises(grpc.RpcError) as err:
        list(ring_pb2_grpc.RingLinkStub(ch).Stream(iter([frame]), timeout=5))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert why in err.value.details(), err.value.details()


def test_identity_or_reason() -> None:
    assert identity_or_reason(["spiffe://a", "mobius://operator"]) == ("mobius://operator", "")
    who, why = identity_or_reason(["mobius://worker/1", "mobius://worker/2"])
    assert who is None
    assert why == (
        "certificate carries 2 mobius:// URIs (mobius://worker/1, mobius://worker/2); "
        "exactly one is required"
    )


class _Ctx:
    def __init__(self, auth: dict) -> None:
        self.auth = auth

    def auth_context(self) -> dict:
        return self.auth


def test_peer_identity_needs_tls13(certs: CertLayout) -> None:
    pem = certs.bundle("worker-1").cert.read_bytes()
    auth = {
        "transport_security_type": [b"ssl"],
        "x509_pem_cert": [pem],
        "peer_uri": [b"mobius://worker/1"],
        "ssl_tls_version": [b"TLSv1.3"],
    }
    assert peer_identity_or_reason(_Ctx(auth)) == ("mobius://worker/1", "")
    for version, shown in (([b"TLSv1.2"], "TLSv1.2"), ([], "an unknown TLS version")):
        who, why = peer_identity_or_reason(_Ctx({**auth, "ssl_tls_version": version}))
        assert who is None and why == f"connection negotiated {shown}; TLS 1.3 is required"
    assert peer_identity_or_reason(_Ctx({"transport_security_type": [b"insecure"]}))[0] is None
    # No PEM in the context: gRPC's peer_uri list is used, with the same one-URI rule.
    no_pem = {k: v for k, v in auth.items() if k != "x509_pem_cert"}
    two = {**no_pem, "peer_uri": [b"mobius://worker/1", b"mobius://worker/0"]}
    assert peer_identity_or_reason(_Ctx(two))[1].startswith("certificate carries 2 mobius://")


def test_certificate_identity(certs: CertLayout, tmp_path: Path) -> None:
    assert certificate_identity(certs.bundle("worker-0").cert.read_bytes()) == "mobius://worker/0"
    forged = sign_leaf(certs.root, tmp_path, ["mobius://worker/0", "mobius://worker/1"], "w")
    with pytest.raises(ValueError, match="2 mobius:// URIs"):
        certificate_identity(forged.cert.read_bytes())


# --------------------------------------------------------------------------- TLS 1.3 only
_CHILD_SERVER = """
import sys
{first}
from concurrent import futures

from mobius_fed.transport.tls import (
    grpc_options, NodeTLS, add_port, peer_identity_or_reason, tls13_handshakes_enforced,
)
import grpc
from mobius_fed.proto import ring_pb2, ring_pb2_grpc


class S(ring_pb2_grpc.RingLinkServicer):
    def Ping(self, request, context):
        who, why = peer_identity_or_reason(context)
        return ring_pb2.PingReply(identity="child", peer=who or why)


srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=grpc_options())
ring_pb2_grpc.add_RingLinkServicer_to_server(S(), srv)
port = add_port(srv, "127.0.0.1:0", NodeTLS(*sys.argv[1:4]))
srv.start()
print(port, tls13_handshakes_enforced(), flush=True)
sys.stdin.read()
srv.stop(None)
"""


def _handshake(port: int, client: NodeTLS, ca: Path, tls12: bool) -> str:
    """A raw TLS handshake with a valid client certificate: the version, or the error."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(str(ca))
    ctx.load_cert_chain(str(client.cert), str(client.key))
    ctx.set_alpn_protocols(["h2"])
    ctx.check_hostname = False
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            ctx.wrap_socket(raw) as tls,
        ):
            return str(tls.version())
    except (ssl.SSLError, OSError) as exc:
        return f"refused: {exc}"


@pytest.mark.parametrize("grpc_first", [False, True])
def test_grpc_server_handshakes_tls13_only(certs: CertLayout, grpc_first: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_SSL_CIPHER_SUITES"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    script = _CHILD_SERVER.format(first="import grpc" if grpc_first else "")
    node = certs.bundle("worker-2")
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(node.ca), str(node.cert), str(node.key)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd=REPO,
    )  # fmt: skip
    try:
        line = child.stdout.readline().split()  # type: ignore[union-attr]
        assert line, child.communicate(timeout=10)[1]
        port, enforced = int(line[0]), line[1] == "True"
        client = certs.bundle("worker-1")
        tls13 = _handshake(port, client, certs.ca_cert, tls12=False)
        tls12 = _handshake(port, client, certs.ca_cert, tls12=True)
        reply = _ping(open_channel(f"127.0.0.1:{port}", client))
        assert reply.peer == "mobius://worker/1"  # a TLS 1.3 gRPC client is identified
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=10)
    assert tls13 == "TLSv1.3"
    if grpc_first:
        # gRPC read its environment before this module could set it: the handshake
        # layer is off (and says so), TLS 1.2 completes, and only the per-RPC check
        # (test_peer_identity_needs_tls13) refuses such a peer.
        assert not enforced and tls12 == "TLSv1.2"
    else:
        assert enforced and tls12.startswith("refused"), tls12


# --------------------------------------------------------------------------- key rotation
def _grpc_server(node: NodeTLS) -> tuple[grpc.Server, str]:
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=grpc_options())
    ring_pb2_grpc.add_RingLinkServicer_to_server(_Servicer(), srv)
    port = add_port(srv, "127.0.0.1:0", node)
    srv.start()
    return srv, f"127.0.0.1:{port}"


def test_renew_one_node_keeps_its_identity(tmp_path: Path) -> None:
    layout = init_certs(tmp_path / "c", 3, hosts=["gpu-a", "10.0.0.7"])
    old = NodeTLS(*(tmp_path / "old" / f for f in ("ca.crt", "tls.crt", "tls.key")))
    shutil.copytree(layout.bundle("worker-1").cert.parent, old.cert.parent)
    untouched = layout.bundle("worker-0").key.read_bytes()

    new = renew_node(layout.root, "worker-1")
    assert new == layout.bundle("worker-1")
    assert new.key.read_bytes() != old.key.read_bytes()
    assert layout.node("worker-1").key.read_bytes() == new.key.read_bytes()
    assert layout.bundle("worker-0").key.read_bytes() == untouched
    sans = x509.load_pem_x509_certificate(new.cert.read_bytes()).extensions
    san = sans.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["mobius://worker/1"]
    assert san.get_values_for_type(x509.DNSName) == [W1_NAME, "localhost", "worker-1", "gpu-a"]
    check_node_secrets(new)
    with pytest.raises(KeyError):
        renew_node(layout.root, "worker-9")

    srv, addr = _grpc_server(layout.bundle("worker-2"))
    try:
        assert _ping(open_channel(addr, new)).peer == "mobius://worker/1"
        # Honest limit: no revocation list, so the old certificate works until it expires.
        assert _ping(open_channel(addr, old)).peer == "mobius://worker/1"
    finally:
        srv.stop(grace=None)


def test_rotate_ca_cuts_off_every_old_certificate(tmp_path: Path) -> None:
    layout = init_certs(tmp_path / "c", 2, hosts=["gpu-a"])
    old = NodeTLS(*(tmp_path / "old" / f for f in ("ca.crt", "tls.crt", "tls.key")))
    shutil.copytree(layout.bundle("worker-0").cert.parent, old.cert.parent)
    new_layout = rotate_ca(layout.root)
    assert new_layout.workers == 2
    assert new_layout.ca_cert.read_bytes() != old.ca.read_bytes()
    leaf = x509.load_pem_x509_certificate(new_layout.bundle("worker-0").cert.read_bytes())
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "gpu-a" in san.get_values_for_type(x509.DNSName)  # hosts kept
    srv, addr = _grpc_server(new_layout.bundle("worker-1"))
    try:
        assert _ping(open_channel(addr, new_layout.bundle("worker-0"))).peer == "mobius://worker/0"
        _assert_refused(open_channel(addr, NodeTLS(new_layout.ca_cert, old.cert, old.key)))
    finally:
        srv.stop(grace=None)
