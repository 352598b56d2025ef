"""Keys that never leave their site: request at the site, sign at the admin, real mTLS.

Every key here is real and every handshake is a real gRPC mTLS connection over loopback.
"""

from __future__ import annotations

import datetime as dt
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from mobius_fed.proto import ring_pb2, ring_pb2_grpc
from mobius_fed.transport import add_port, grpc_options, open_channel, peer_identity
from mobius_fed.transport.certs import init_certs, leaf_certificate, load_ca, node_sans
from mobius_fed.transport.enroll import (
    EnrollError,
    check_bundle,
    make_ca,
    read_request,
    request_node,
    sign_request,
)
from mobius_fed.transport.tls import NodeTLS, SecretsError, check_node_secrets

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers
def _site(root: Path, node: str, ca: Path, **kw) -> NodeTLS:
    """The whole flow for one node: request at its site, sign at the admin, install."""
    site = root / f"site-{node}"
    req = request_node(node, site, **kw)
    signed = sign_request(req.csr, node, ca)
    shutil.copy(signed.cert, site / "tls.crt")
    shutil.copy(signed.ca, site / "ca.crt")
    return NodeTLS(site / "ca.crt", site / "tls.crt", req.key)


def _csr(key, sans: list[x509.GeneralName] | None, extensions=()) -> bytes:
    b = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
    )
    if sans is not None:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    for ext, critical in extensions:
        b = b.add_extension(ext, critical=critical)
    return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _uri(u: str) -> x509.UniformResourceIdentifier:
    return x509.UniformResourceIdentifier(u)


def _private_bytes(d: Path) -> bytes:
    return b"".join(p.read_bytes() for p in d.rglob("*") if p.is_file())


@pytest.fixture()
def ca(tmp_path: Path) -> Path:
    return make_ca(tmp_path / "admin")


class _Echo(ring_pb2_grpc.RingLinkServicer):
    def Ping(self, request, context):
        return ring_pb2.PingReply(identity="server", peer=peer_identity(context) or "")


@pytest.fixture()
def serve() -> Iterator:
    servers: list[grpc.Server] = []

    def start(tls: NodeTLS) -> str:
        srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=grpc_options())
        ring_pb2_grpc.add_RingLinkServicer_to_server(_Echo(), srv)
        port = add_port(srv, "127.0.0.1:0", tls)
        srv.start()
        servers.append(srv)
        return f"127.0.0.1:{port}"

    yield start
    for srv in servers:
        srv.stop(grace=None)


def _ping(address: str, tls: NodeTLS, server_name: str) -> str:
    with open_channel(address, tls, target_name=server_name) as ch:
        return ring_pb2_grpc.RingLinkStub(ch).Ping(ring_pb2.PingRequest(), timeout=10).peer


# --------------------------------------------------------------------------- the flow
def test_request_writes_a_private_key_and_one_identity(tmp_path: Path) -> None:
    req = request_node("worker-2", tmp_path / "w2", ["w2.example.org", "10.1.2.3"])
    assert stat.S_IMODE(req.key.stat().st_mode) == 0o600
    assert stat.S_IMODE(req.csr.stat().st_mode) == 0o644
    assert req.csr.name == "worker-2.csr" and b"PRIVATE KEY" not in req.csr.read_bytes()
    csr = read_request(req.csr)
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["mobius://worker/2"]
    assert san.get_values_for_type(x509.DNSName) == [
        "worker-2.id.mobius.invalid",  # the reserved identity name (docs/security.md)
        "localhost",
        "worker-2",
        "w2.example.org",
    ]
    key = serialization.load_pem_private_key(req.key.read_bytes(), None)
    assert csr.public_key() == key.public_key()
    # a second request never replaces the key silently; --key asks again for the same key
    before = req.key.read_bytes()
    with pytest.raises(FileExistsError, match=r"--key .*tls\.key.*--overwrite"):
        request_node("worker-2", tmp_path / "w2")
    again = request_node("worker-2", tmp_path / "w2", key=req.key)
    assert (
        req.key.read_bytes() == before and read_request(again.csr).public_key() == key.public_key()
    )


def test_the_ca_directory_holds_no_node_key(ca: Path) -> None:
    files = sorted(p.relative_to(ca).as_posix() for p in ca.rglob("*") if p.is_file())
    assert files == [
        "ca.crt",
        "ca.key",
        "nodes/operator/ca.crt",
        "nodes/operator/tls.crt",
        "nodes/operator/tls.key",
        "operator.crt",
        "operator.key",
    ]
    for p in ca.rglob("*.key"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    with pytest.raises(FileExistsError, match="--overwrite"):
        make_ca(ca)


def test_signed_bundles_pass_a_real_mtls_handshake(tmp_path: Path, ca: Path, serve) -> None:
    w1 = _site(tmp_path, "worker-1", ca)
    w2 = _site(tmp_path, "worker-2", ca, hosts=["w2.example.org"])
    coord = _site(tmp_path, "coordinator", ca)
    assert check_bundle("worker-2", w2).not_valid_after_utc > dt.datetime.now(dt.UTC)
    assert check_node_secrets(coord, role="coordinator") == "mobius://coordinator"
    # the admin saw public files only: no private key but the CA's and its own operator's
    admin = _private_bytes(ca)
    for site in (w1, w2, coord):
        assert site.key.read_bytes() not in admin
    assert _private_bytes(ca / "signed").count(b"PRIVATE KEY") == 0
    address = serve(w2)
    assert _ping(address, w1, "worker-2") == "mobius://worker/1"
    operator = NodeTLS(ca / "ca.crt", ca / "operator.crt", ca / "operator.key")
    assert _ping(address, operator, "worker-2") == "mobius://operator"
    assert _ping(serve(coord), w2, "coordinator") == "mobius://worker/2"


def test_a_site_brings_its_own_pki_key(tmp_path: Path, ca: Path, serve) -> None:
    """An RSA key made by the site's own tools: the request is made for it, never copied."""
    own = tmp_path / "pki" / "worker-3.pem"
    own.parent.mkdir()
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    own.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    own.chmod(0o600)
    site = tmp_path / "site-3"
    req = request_node("worker-3", site, key=own)
    assert req.key == own and not (site / "tls.key").exists()
    signed = sign_request(req.csr, "worker-3", ca)
    tls = NodeTLS(signed.ca, signed.cert, own)
    assert check_bundle("worker-3", tls)
    w0 = _site(tmp_path, "worker-0", ca)
    assert _ping(serve(tls), w0, "worker-3") == "mobius://worker/0"
    locked = tmp_path / "locked.pem"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(EnrollError, match="is encrypted"):
        request_node("worker-3", site, key=locked)
    weak = tmp_path / "weak.pem"
    weak.write_bytes(
        rsa.generate_private_key(public_exponent=65537, key_size=1024).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(EnrollError, match="RSA key of 1024 bits"):
        request_node("worker-3", site, key=weak)


def test_sign_works_with_a_certs_init_directory(tmp_path: Path, serve) -> None:
    """A lab CA made by `certs init` signs a site's request; its nodes accept the result."""
    lab = init_certs(tmp_path / "lab", 2)
    w1 = _site(tmp_path, "worker-1", lab.root)
    assert _ping(serve(lab.bundle("worker-0")), w1, "worker-0") == "mobius://worker/1"


# --------------------------------------------------------------------------- sign refuses
KEY = ec.generate_private_key(ec.SECP256R1())
CA_EXT = (x509.BasicConstraints(ca=True, path_length=None), True)
SIGNS = (
    x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    ),
    True,
)
REFUSED = {
    "another node": (
        [_uri("mobius://worker/1")],
        (),
        r"asks for identity mobius://worker/1, not worker-2's mobius://worker/2",
    ),
    "the coordinator": ([_uri("mobius://coordinator")], (), "not worker-2's"),
    "a CA": ([_uri("mobius://worker/2")], (CA_EXT,), "asks to be a CA"),
    "a signing key": ([_uri("mobius://worker/2")], (SIGNS,), "signs certificates"),
    "an extra URI": (
        [_uri("mobius://worker/2"), _uri("spiffe://site/worker")],
        (),
        r"extra URIs \['spiffe://site/worker'\]",
    ),
    "two identities": (
        [_uri("mobius://worker/2"), _uri("MOBIUS://worker/2")],
        (),
        "2 mobius:// identities",
    ),
    "no identity": ([x509.DNSName("worker-2")], (), "no mobius:// identity"),
    "no SAN": (None, (), "no mobius:// identity"),
    "an e-mail name": (
        [_uri("mobius://worker/2"), x509.RFC822Name("a@b.c")],
        (),
        "RFC822Name",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_sign_refuses_a_request_for_the_wrong_thing(tmp_path: Path, ca: Path, case: str) -> None:
    sans, extensions, message = REFUSED[case]
    csr = tmp_path / "w2.csr"
    csr.write_bytes(_csr(KEY, sans, extensions))
    with pytest.raises(EnrollError, match=message):
        sign_request(csr, "worker-2", ca)
    assert not (ca / "signed").exists() and not (ca / "issued").exists()


def test_sign_refuses_bad_signature_ca_key_and_another_nodes_key(tmp_path: Path, ca: Path) -> None:
    # altered after it was made: the identity bytes changed, the signature did not
    req = request_node("worker-2", tmp_path / "w2")
    forged = tmp_path / "forged.csr"
    der = x509.load_pem_x509_csr(req.csr.read_bytes()).public_bytes(serialization.Encoding.DER)
    assert der.count(b"mobius://worker/2") == 1
    forged_der = der.replace(b"mobius://worker/2", b"mobius://worker/3")
    forged.write_bytes(x509.load_der_x509_csr(forged_der).public_bytes(serialization.Encoding.PEM))
    with pytest.raises(EnrollError, match="bad signature"):
        sign_request(forged, "worker-3", ca)
    # the CA's own key
    ca_key, _ = load_ca(ca / "ca.crt", ca / "ca.key")
    csr = tmp_path / "ca.csr"
    csr.write_bytes(_csr(ca_key, [_uri("mobius://worker/2")]))
    with pytest.raises(EnrollError, match="CA's own key"):
        sign_request(csr, "worker-2", ca)
    # worker-2's key, already certified, asked for again as worker-4
    sign_request(req.csr, "worker-2", ca)
    stolen = request_node("worker-4", tmp_path / "w4", key=req.key)
    with pytest.raises(EnrollError, match=r"already certified as mobius://worker/2"):
        sign_request(stolen.csr, "worker-4", ca)
    sign_request(request_node("worker-2", tmp_path / "w2", key=req.key).csr, "worker-2", ca)
    # the operator's key (made by certs ca) is another identity too
    op = request_node("worker-5", tmp_path / "w5", key=ca / "operator.key")
    with pytest.raises(EnrollError, match="already certified as mobius://operator"):
        sign_request(op.csr, "worker-5", ca)
    not_csr = tmp_path / "x.csr"
    not_csr.write_bytes(req.key.read_bytes())
    with pytest.raises(EnrollError, match="not a PEM certificate signing request"):
        sign_request(not_csr, "worker-2", ca)


@pytest.mark.parametrize("name", ["worker-02", "worker-x", "ca", "Worker-1"])
def test_unknown_node_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(EnrollError, match="node name"):
        request_node(name, tmp_path / "x")
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- bundle refusals
def test_the_bundle_is_refused_when_it_is_not_this_nodes(tmp_path: Path, ca: Path) -> None:
    w1 = _site(tmp_path, "worker-1", ca)
    with pytest.raises(SecretsError, match=r"is mobius://worker/1, not worker-2's"):
        check_bundle("worker-2", w1)
    with pytest.raises(SecretsError, match="not a coordinator's identity"):
        check_node_secrets(w1, role="coordinator")
    # a certificate from another CA (the site installed the wrong ca.crt)
    other = make_ca(tmp_path / "other")
    shutil.copy(other / "ca.crt", w1.ca)
    with pytest.raises(SecretsError, match=r"was not issued by the CA in .*ca\.crt"):
        check_bundle("worker-1", w1)


def test_the_bundle_is_refused_with_a_ca_key_or_another_nodes_key(tmp_path: Path, ca: Path) -> None:
    w1 = _site(tmp_path, "worker-1", ca)
    w2 = _site(tmp_path, "worker-2", ca)
    shutil.copy(ca / "ca.key", w1.key.parent / "backup.pem")
    with pytest.raises(SecretsError, match=r"backup\.pem holds the CA key"):
        check_bundle("worker-1", w1)
    (w1.key.parent / "backup.pem").unlink()
    shutil.copy(w2.key, w1.key.parent / "w2.key")
    with pytest.raises(SecretsError, match=r"w2\.key holds another node's private key"):
        check_bundle("worker-1", w1)
    (w1.key.parent / "w2.key").unlink()
    shutil.copy(w2.key, w1.key)  # the key of another node in place of its own
    with pytest.raises(SecretsError, match="does not match certificate"):
        check_bundle("worker-1", w1)


def test_an_expired_certificate_is_refused(tmp_path: Path, ca: Path) -> None:
    w1 = _site(tmp_path, "worker-1", ca)
    ca_key, ca_cert = load_ca(ca / "ca.crt", ca / "ca.key")
    key = serialization.load_pem_private_key(w1.key.read_bytes(), None)
    now = dt.datetime.now(dt.UTC)
    old = leaf_certificate(
        key.public_key(),
        "worker-1",
        node_sans("worker-1", ()),
        ca_key,
        ca_cert,
        now - dt.timedelta(days=30),
        now - dt.timedelta(days=1),
    )
    w1.cert.write_bytes(old.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(SecretsError, match=r"tls\.crt expired on .* UTC.*certs request --key"):
        check_bundle("worker-1", w1)
    fresh = _site(tmp_path, "worker-2", ca)
    with pytest.raises(SecretsError, match=r"is not valid before .*check the clock"):
        check_node_secrets(fresh, now=now - dt.timedelta(days=1))
    with pytest.raises(SecretsError, match=r"CA certificate .*ca\.crt expired"):
        check_node_secrets(fresh, now=now + dt.timedelta(days=366))


# --------------------------------------------------------------------------- command line
def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.main", "certs", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_command_line_flow_and_refusal(tmp_path: Path) -> None:
    assert _cli("ca", "--out", "admin", cwd=tmp_path).returncode == 0
    done = _cli("request", "--node", "worker-0", "--host", "w0.example.org", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "worker-0" / "tls.key").is_file()
    _cli("request", "--node", "worker-1", cwd=tmp_path)
    csrs = ("worker-0/worker-0.csr", "worker-1/worker-1.csr")
    mixed = _cli(
        "sign", *csrs, "--node", "worker-1", "--node", "worker-0", "--ca", "admin", cwd=tmp_path
    )
    assert mixed.returncode == 2 and "asks for identity mobius://worker/0" in mixed.stderr
    done = _cli(
        "sign", *csrs, "--node", "worker-0", "--node", "worker-1", "--ca", "admin", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "extra names: w0.example.org" in done.stdout
    for f in ("tls.crt", "ca.crt"):
        shutil.copy(tmp_path / "admin" / "signed" / "worker-0" / f, tmp_path / "worker-0" / f)
    ok = _cli("check", "--node", "worker-0", "--dir", "worker-0", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("ok:"), ok.stderr
    wrong = _cli("check", "--node", "worker-1", "--dir", "worker-0", cwd=tmp_path)
    assert wrong.returncode == 2 and "not worker-1's mobius://worker/1" in wrong.stderr
    again = _cli("request", "--node", "worker-0", "--if-missing", cwd=tmp_path)
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_the_worker_daemon_refuses_an_expired_certificate_at_startup(
    tmp_path: Path, ca: Path
) -> None:
    """mobius-worker itself: exit 2 and one line naming the file, before it dials anyone."""
    w1 = _site(tmp_path, "worker-1", ca)
    ca_key, ca_cert = load_ca(ca / "ca.crt", ca / "ca.key")
    key = serialization.load_pem_private_key(w1.key.read_bytes(), None)
    now = dt.datetime.now(dt.UTC)
    old = leaf_certificate(
        key.public_key(),
        "worker-1",
        node_sans("worker-1", ()),
        ca_key,
        ca_cert,
        now - dt.timedelta(days=9),
        now - dt.timedelta(days=2),
    )
    w1.cert.write_bytes(old.public_bytes(serialization.Encoding.PEM))
    argv = ["--coordinator", "127.0.0.1:9", "--data-dir", str(tmp_path / "data"), "--threads", "1"]
    argv += ["--ca", str(w1.ca), "--cert", str(w1.cert), "--key", str(w1.key)]
    proc = subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.worker", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert f"certificate {w1.cert} expired on" in proc.stderr


@pytest.mark.skipif(
    shutil.which("openssl") is None,
    reason="openssl is not installed: apt-get install openssl (or scripts/install_system_tools.sh)",
)
def test_a_request_made_with_openssl_is_signed(tmp_path: Path, ca: Path, serve) -> None:
    """The site's own tools (docs/keys.md): openssl makes the key and the request."""
    key, csr = tmp_path / "site.key", tmp_path / "worker-3.csr"
    subprocess.run(
        ["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key)],
        check=True,
    )
    san = "subjectAltName=URI:mobius://worker/3,DNS:worker-3,DNS:w3.example.org"
    base = ["openssl", "req", "-new", "-key", str(key), "-subj", "/CN=worker-3"]
    subprocess.run([*base, "-addext", san, "-out", str(csr)], check=True)
    signed = sign_request(csr, "worker-3", ca)
    assert signed.hosts == ("w3.example.org",)
    tls = NodeTLS(signed.ca, signed.cert, key)
    check_bundle("worker-3", tls)
    w0 = _site(tmp_path, "worker-0", ca)
    assert _ping(serve(tls), w0, "worker-3") == "mobius://worker/0"
    extra = tmp_path / "extra.csr"
    subprocess.run([*base, "-addext", san + ",URI:https://site.example", "-out", str(extra)])
    with pytest.raises(EnrollError, match=r"extra URIs \['https://site.example'\]"):
        sign_request(extra, "worker-3", ca)


def test_a_certificate_from_the_sites_own_ca(tmp_path: Path, ca: Path, serve) -> None:
    """A site's PKI issues its certificate: it works once every node trusts that CA too
    (both CAs in ca.crt), with the same one-mobius://-URI rule; a site CA certificate
    that nobody was given is named."""
    site_ca = make_ca(tmp_path / "site-pki")
    w1 = _site(tmp_path, "worker-1", site_ca)  # issued by the site's own CA
    w0 = _site(tmp_path, "worker-0", ca)
    with pytest.raises(SecretsError, match="not issued by the CA"):
        check_bundle("worker-1", NodeTLS(ca / "ca.crt", w1.cert, w1.key))
    both = tmp_path / "trust" / "ca.crt"
    both.parent.mkdir()
    both.write_bytes((ca / "ca.crt").read_bytes() + (site_ca / "ca.crt").read_bytes())
    for site in (w0, w1):
        shutil.copy(both, site.ca)
    check_bundle("worker-1", w1)
    assert _ping(serve(w1), w0, "worker-1") == "mobius://worker/0"
    # the same rule: a site certificate with two mobius:// identities is refused
    ca_key, ca_cert = load_ca(site_ca / "ca.crt", site_ca / "ca.key")
    key = serialization.load_pem_private_key(w1.key.read_bytes(), None)
    now = dt.datetime.now(dt.UTC)
    sans = [*node_sans("worker-1", ()), _uri("mobius://coordinator")]
    two = leaf_certificate(
        key.public_key(), "worker-1", sans, ca_key, ca_cert, now, now + dt.timedelta(days=1)
    )
    w1.cert.write_bytes(two.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(SecretsError, match="2 mobius:// URIs"):
        check_bundle("worker-1", w1)


def test_a_coordinator_started_with_a_workers_certificate_is_refused(
    tmp_path: Path, ca: Path
) -> None:
    """mobius-coordinator checks the role of its own identity at startup (exit 2, named)."""
    w1 = _site(tmp_path, "worker-1", ca)
    argv = ["--listen", "127.0.0.1:0", "--out-dir", str(tmp_path / "coord"), "--workers", "2"]
    argv += ["--ca", str(w1.ca), "--cert", str(w1.cert), "--key", str(w1.key)]
    proc = subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.coordinator", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "not a coordinator's identity" in proc.stderr, proc.stderr[-2000:]


# --------------------------------------------------------------------------- borrowed names
BORROWED = [
    "coordinator",
    "Coordinator",
    "COORDINATOR.lab.example.org",
    "operator",
    "relay",
    "relay.example.org",
    "worker-1",
    "WORKER-3",
    "worker-1.lab.example.org",
    "worker-02",
]
NOT_HOST_NAMES = {
    "an ANSI escape": ("\x1b[2K\rcoordinator", "control characters"),
    "a NUL": ("worker-1\x00.evil.org", "control characters"),
    "a newline": ("a.example.org\ncoordinator", "control characters"),
    "a space": ("gpu a.example.org", "a space"),
    "a wildcard": ("*.example.org", "a wildcard"),
    "a wildcard inside a label": ("gpu*.example.org", "a wildcard"),
    "an empty label": ("gpu..example.org", "not a host name label"),
    "a leading hyphen": ("-gpu.example.org", "not a host name label"),
    "an underscore": ("gpu_a.example.org", "not a host name label"),
    "the identity domain": ("id.mobius.invalid", "reserved identity domain"),
    "another identity's name": ("worker-1.id.mobius.invalid", "reserved identity domain"),
    "its own identity name in another case": ("WORKER-2.ID.MOBIUS.INVALID", "reserved"),
}


def _hostile_csr(tmp_path: Path, key, names: list[str]) -> Path:
    """A request a hostile site writes itself (not with ``certs request``, which refuses)."""
    sans = [_uri("mobius://worker/2"), *(x509.DNSName(n) for n in names)]
    path = tmp_path / "hostile.csr"
    path.write_bytes(_csr(key, sans))
    return path


@pytest.mark.parametrize("name", BORROWED)
def test_sign_refuses_another_nodes_or_a_roles_name(tmp_path: Path, ca: Path, name: str) -> None:
    """Issue 33 case 1: worker-2 asking for a role's or another node's name is refused,
    the error naming the request, the name and the rule; nothing is issued."""
    csr = _hostile_csr(tmp_path, KEY, ["w2.example.org", name])
    with pytest.raises(EnrollError) as exc:
        sign_request(csr, "worker-2", ca)
    text = str(exc.value)
    assert str(csr) in text and repr(name) in text, text
    assert "another node's or a role's name" in text, text
    assert not (ca / "signed").exists() and not (ca / "issued").exists()
    with pytest.raises(EnrollError, match="another node's or a role's name"):
        request_node("worker-2", tmp_path / "site", [name])  # the site's own tool says so too


def test_a_nodes_own_name_with_a_domain_is_signed(tmp_path: Path, ca: Path) -> None:
    signed = sign_request(_hostile_csr(tmp_path, KEY, ["worker-2.lab.example.org"]), "worker-2", ca)
    assert signed.hosts == ("worker-2.lab.example.org",)


@pytest.mark.parametrize("case", sorted(NOT_HOST_NAMES))
def test_sign_refuses_names_that_are_not_host_names(tmp_path: Path, ca: Path, case: str) -> None:
    """Issue 33 case 2: control characters, NUL, spaces, wildcards, bad labels, reserved."""
    name, rule = NOT_HOST_NAMES[case]
    csr = _hostile_csr(tmp_path, KEY, [name])
    with pytest.raises(EnrollError) as exc:
        sign_request(csr, "worker-2", ca)
    text = str(exc.value)
    assert str(csr) in text and repr(name) in text and rule in text, text
    assert "\x1b" not in text and "\x00" not in text  # the message itself is escaped
    assert not (ca / "issued").exists()


def test_non_ascii_names_need_punycode_and_wildcards_a_flag(tmp_path: Path, ca: Path) -> None:
    with pytest.raises(EnrollError, match="not ASCII: write an international name in punycode"):
        request_node("worker-2", tmp_path / "s", ["bücher.example.org"])
    csr = _hostile_csr(tmp_path, KEY, ["xn--bcher-kva.example.org", "*.gpu.example.org"])
    with pytest.raises(EnrollError, match="a wildcard: refused unless --allow-wildcard"):
        sign_request(csr, "worker-2", ca)
    signed = sign_request(csr, "worker-2", ca, wildcards=True)
    assert signed.hosts == ("xn--bcher-kva.example.org", "*.gpu.example.org")


def test_certs_init_and_renew_refuse_borrowed_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'coordinator' for every node refused"):
        init_certs(tmp_path / "c", 2, hosts=["coordinator"])
    from mobius_fed.transport.certs import renew_node

    layout = init_certs(tmp_path / "d", 2, hosts=["gpu.example.org"])
    with pytest.raises(ValueError, match="'worker-0' for node worker-1 refused"):
        renew_node(layout.root, "worker-1", ["worker-0"])


def test_the_sign_summary_shows_every_extra_name_on_its_own_line(tmp_path: Path) -> None:
    assert _cli("ca", "--out", "admin", cwd=tmp_path).returncode == 0
    hosts = ["a.example.org", "b.example.org", "10.0.0.9"]
    args = [a for h in hosts for a in ("--host", h)]
    assert _cli("request", "--node", "worker-0", *args, cwd=tmp_path).returncode == 0
    done = _cli(
        "sign", "worker-0/worker-0.csr", "--node", "worker-0", "--ca", "admin", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1:] == [
        "  extra names: a.example.org",
        "               b.example.org",
        "               10.0.0.9",
    ], done.stdout
    borrowed = tmp_path / "hostile.csr"
    borrowed.write_bytes(_csr(KEY, [_uri("mobius://worker/3"), x509.DNSName("\x1b[1Acoordinator")]))
    refused = _cli("sign", "hostile.csr", "--node", "worker-3", "--ca", "admin", cwd=tmp_path)
    assert refused.returncode == 2 and "\x1b" not in refused.stderr, refused.stderr
    assert "hostile.csr" in refused.stderr and "control characters" in refused.stderr


# --------------------------------------------------------------------------- recycled keys
def test_a_renewed_nodes_old_key_is_never_certified_again(tmp_path: Path) -> None:
    """Issue 33 case 3: after renew, the old key of worker-1 asked for as worker-3."""
    from mobius_fed.transport.certs import renew_node

    layout = init_certs(tmp_path / "lab", 4)
    old_key = tmp_path / "old.key"
    shutil.copy(layout.bundle("worker-1").key, old_key)
    renew_node(layout.root, "worker-1")
    reused = request_node("worker-3", tmp_path / "w3", key=old_key)
    with pytest.raises(EnrollError, match=r"already certified as mobius://worker/1 \(serial"):
        sign_request(reused.csr, "worker-3", layout.root)
    # the same through sign alone: worker-2 signed with key A, re-signed with key B, then A
    ca = make_ca(tmp_path / "admin")
    first = request_node("worker-2", tmp_path / "w2")
    sign_request(first.csr, "worker-2", ca)
    kept = tmp_path / "first.key"
    shutil.copy(first.key, kept)
    second = request_node("worker-2", tmp_path / "w2", overwrite=True)
    sign_request(second.csr, "worker-2", ca)
    again = request_node("worker-5", tmp_path / "w5", key=kept)
    with pytest.raises(EnrollError, match="already certified as mobius://worker/2"):
        sign_request(again.csr, "worker-5", ca)
    sign_request(request_node("worker-2", tmp_path / "w2b", key=kept).csr, "worker-2", ca)


# --------------------------------------------------------------------------- key files
def test_a_key_others_can_read_is_refused_naming_the_fix(tmp_path: Path, ca: Path) -> None:
    """Issue 33 case 4: certs check, certs request --key and mobius-worker refuse a 0644 key."""
    tls = _site(tmp_path, "worker-0", ca)
    tls.key.chmod(0o644)
    with pytest.raises(SecretsError, match=rf"mode 0644.*chmod 600 {tls.key}"):
        check_bundle("worker-0", tls)
    check_bundle("worker-0", tls, readable_key=True)  # the documented way to only warn
    d = tls.key.parent
    cli = _cli("check", "--node", "worker-0", "--dir", str(d), cwd=tmp_path)
    assert cli.returncode == 2 and f"chmod 600 {tls.key}" in cli.stderr, cli.stderr
    cli = _cli("check", "--node", "worker-0", "--dir", str(d), "--allow-readable-key", cwd=tmp_path)
    assert cli.returncode == 0 and "chmod 600" in cli.stderr, cli.stderr
    req = _cli("request", "--node", "worker-0", "--key", str(tls.key), "--out", "r", cwd=tmp_path)
    assert req.returncode == 2 and f"chmod 600 {tls.key}" in req.stderr, req.stderr
    tls.key.chmod(0o640)
    with pytest.raises(SecretsError, match="its group can read"):
        check_bundle("worker-0", tls)
    argv = ["--coordinator", "127.0.0.1:9", "--data-dir", str(tmp_path / "data"), "--threads", "1"]
    argv += ["--ca", str(tls.ca), "--cert", str(tls.cert), "--key", str(tls.key)]
    proc = subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.worker", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and f"chmod 600 {tls.key}" in proc.stderr, proc.stderr[-2000:]
    tls.key.chmod(0o600)
    check_bundle("worker-0", tls)
