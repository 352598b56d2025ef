"""Keys that never leave their site: certificate signing requests (``mobius-fed certs``; the
flow and its refusals: docs/keys.md "The walk-through").

Admin :func:`make_ca` (CA plus the operator's client) → site :func:`request_node` (``tls.key``
mode 0600, or the site's own ``key=``, and ``<node>.csr`` with exactly one URI, its
``mobius://`` identity) → admin :func:`sign_request` (:func:`check_request`, then public
``<out>/<node>/{tls.crt,ca.crt}``) → site :func:`check_bundle` (``tls.check_node_secrets``
plus the node's name). Every refusal names the file and the problem.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from mobius_fed.transport.certs import (
    KEY_REGISTRY,
    PrivateKey,
    PublicKey,
    check_extra_names,
    extra_name_rule,
    identity_of,
    key_fingerprint,
    key_pem,
    leaf_certificate,
    load_ca,
    new_pki,
    node_sans,
    read_registry,
    record_issued,
    validity,
    write_file,
)
from mobius_fed.transport.tls import (
    NodeTLS,
    SecretsError,
    certificate_uris,
    check_node_secrets,
    identity_name,
    key_file_problem,
    node_name_of,
    parse_identity,
    spki,
)

KEY_FILE = "tls.key"
CERT_FILE = "tls.crt"
CA_FILE = "ca.crt"
ISSUED = "issued"
"""Subdirectory of the CA directory where :func:`sign_request` keeps what it issued."""
EC_CURVES = ("secp256r1", "secp384r1")
MIN_RSA_BITS = 2048


class EnrollError(ValueError):
    """A signing request or a key that must not be signed or used."""


def node_name(node: str) -> str:
    """``node`` if it is a node name (``worker-<i>``, ``standby-<n>``, ``coordinator``,
    ``operator``)."""
    try:
        canonical = node_name_of(identity_of(node))
    except ValueError:
        raise EnrollError(
            f"unknown node name {node!r}: worker-<i>, standby-<n>, coordinator or operator"
        ) from None
    if canonical != node:
        raise EnrollError(f"node name {node!r} is not canonical; write {canonical!r}")
    return node


# --------------------------------------------------------------------------- admin: CA
def make_ca(out: Path, *, days: int = 365, overwrite: bool = False) -> Path:
    """A CA and the operator's client certificate in ``out`` (no node keys at all).

    Writes ``ca.crt``, ``ca.key``, ``operator.crt``/``.key`` and the operator's bundle
    ``nodes/operator/{ca.crt,tls.crt,tls.key}``, laid out as :func:`init_certs` does.
    """
    return new_pki(out, 0, days=days, overwrite=overwrite, what="a CA", names=["operator"]).root


# --------------------------------------------------------------------------- site: request
@dataclass(frozen=True)
class Request:
    """What :func:`request_node` wrote: the key (or the site's own) and the request."""

    key: Path
    csr: Path
    identity: str


def _usable_key(data: bytes, path: Path) -> PrivateKey:
    """An unencrypted EC (P-256/P-384) or RSA (>= 2048 bits) private key from PEM."""
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise EnrollError(
            f"{path} is encrypted: a daemon reads its key without a passphrase; export it "
            "unencrypted to a file only the node's user can read (mode 0600)"
        ) from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise EnrollError(f"{path} is not a PEM private key ({exc})") from None
    _check_key_type(key.public_key(), str(path))
    return cast(PrivateKey, key)  # _check_key_type refused any other kind


def _check_key_type(public_key: object, where: str) -> None:
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        if public_key.curve.name not in EC_CURVES:
            raise EnrollError(f"{where}: EC curve {public_key.curve.name} (use P-256 or P-384)")
    elif isinstance(public_key, rsa.RSAPublicKey):
        if public_key.key_size < MIN_RSA_BITS:
            raise EnrollError(f"{where}: RSA key of {public_key.key_size} bits (>= 2048)")
    else:
        raise EnrollError(f"{where}: {type(public_key).__name__} keys are not supported (EC, RSA)")


def request_node(
    node: str,
    out: Path,
    hosts: Sequence[str] = (),
    *,
    key: Path | None = None,
    overwrite: bool = False,
    csr_dir: Path | None = None,
    readable_key: bool = False,
) -> Request:
    """Write ``out/tls.key`` (0600, unless ``key`` brings the site's own) and ``<node>.csr``
    (in ``csr_dir``, default ``out``).

    The request carries the node's SANs: its one ``mobius://`` identity, ``localhost``, its
    name, 127.0.0.1 and ``hosts`` (each must pass ``certs.extra_name_rule``).
    An existing ``tls.key`` is kept (FileExistsError) unless ``overwrite``; ``key=out/tls.key``
    asks again for the same key (to renew). A ``key`` others can read is refused unless
    ``readable_key``.
    """
    node_name(node)
    try:
        check_extra_names(hosts, node)
    except ValueError as exc:
        raise EnrollError(f"the request for {node}: {exc}") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    csr_path = Path(csr_dir if csr_dir is not None else out) / f"{node}.csr"
    csr_path.parent.mkdir(parents=True, exist_ok=True)
    if key is not None:
        key_path = Path(key)
        if not key_path.is_file():
            raise FileNotFoundError(f"key {key_path} not found")
        private = _usable_key(key_path.read_bytes(), key_path)
        problem = key_file_problem(key_path)
        if problem is not None and not readable_key:
            raise EnrollError(f"{problem}; or pass --allow-readable-key to go on anyway")
    else:
        key_path = out / KEY_FILE
        if key_path.exists() and not overwrite:
            raise FileExistsError(
                f"{key_path} exists: this site has a key already. Ask again for it with "
                f"--key {key_path}, or make a new one with --overwrite"
            )
        private = ec.generate_private_key(ec.SECP256R1())
        write_file(key_path, key_pem(private), 0o600)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .add_extension(x509.SubjectAlternativeName(node_sans(node, hosts)), critical=False)
        .sign(private, hashes.SHA256())
    )
    write_file(csr_path, csr.public_bytes(serialization.Encoding.PEM), 0o644)
    return Request(key=key_path, csr=csr_path, identity=identity_of(node))


# --------------------------------------------------------------------------- admin: sign
@dataclass(frozen=True)
class Signed:
    """What :func:`sign_request` wrote for one node: its certificate and the CA's."""

    cert: Path
    ca: Path
    identity: str
    hosts: tuple[str, ...]
    not_after: dt.datetime


def read_request(path: Path) -> x509.CertificateSigningRequest:
    """A PEM request whose signature verifies (EnrollError naming the file otherwise)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"signing request {path} not found")
    try:
        csr = x509.load_pem_x509_csr(path.read_bytes())
    except ValueError as exc:
        raise EnrollError(f"{path} is not a PEM certificate signing request ({exc})") from None
    if not csr.is_signature_valid:
        raise EnrollError(
            f"{path}: bad signature: the request was altered after it was made, or was not "
            "signed by the key it names"
        )
    return csr


def _requested_sans(csr: x509.CertificateSigningRequest, where: str) -> list[x509.GeneralName]:
    """The request's SANs, refusing a request to be a CA or to sign certificates."""
    try:
        extensions = list(csr.extensions)
    except ValueError as exc:
        raise EnrollError(f"{where}: unreadable extensions ({exc})") from None
    sans: list[x509.GeneralName] = []
    for ext in extensions:
        value = ext.value
        if isinstance(value, x509.BasicConstraints) and value.ca:
            raise EnrollError(f"{where} asks to be a CA: a node's certificate never is")
        if isinstance(value, x509.KeyUsage) and (value.key_cert_sign or value.crl_sign):
            raise EnrollError(f"{where} asks for a key that signs certificates: refused")
        if isinstance(value, x509.SubjectAlternativeName):
            sans = list(value)
    return sans


def _check_identity(sans: list[x509.GeneralName], node: str, where: str) -> list[str]:
    """Exactly one URI, ``node``'s ``mobius://`` identity; returns the DNS/IP host names."""
    want = identity_of(node)
    uris = [str(n.value) for n in sans if isinstance(n, x509.UniformResourceIdentifier)]
    ours = [u for u in uris if u[:9].lower() == "mobius://"]
    others = [type(n).__name__ for n in sans if not isinstance(n, _ALLOWED_NAMES)]
    if not ours:
        raise EnrollError(f"{where} asks for no mobius:// identity ({node}'s is {want})")
    if len(ours) > 1:
        raise EnrollError(
            f"{where} asks for {len(ours)} mobius:// identities ({', '.join(ours)}); a "
            "certificate carries exactly one"
        )
    if ours[0] != want:
        raise EnrollError(
            f"{where} asks for identity {ours[0]}, not {node}'s {want}: it was made for "
            "another node (or signed with --node for the wrong one)"
        )
    if len(uris) > 1:
        extra = [u for u in uris if u != want]
        raise EnrollError(
            f"{where} carries extra URIs {extra}: a node's certificate carries exactly one "
            f"URI, its identity {want}"
        )
    if others:
        raise EnrollError(f"{where} asks for names of types {others}: only DNS names and IPs")
    return [str(n.value) for n in sans if isinstance(n, x509.DNSName | x509.IPAddress)]


_ALLOWED_NAMES = (x509.UniformResourceIdentifier, x509.DNSName, x509.IPAddress)


def _issued_certificates(ca_dir: Path) -> list[Path]:
    """Every node certificate this CA directory knows: :data:`ISSUED` and ``certs init``'s."""
    flat = [p for p in ca_dir.glob("*.crt") if p.name != CA_FILE]
    return sorted(flat) + sorted((ca_dir / ISSUED).glob("*.crt"))


def _check_key_is_new(csr: x509.CertificateSigningRequest, node: str, ca_dir: Path) -> None:
    """Refuse the CA's key and a key already certified for another identity."""
    where = f"the request for {node}"
    _check_key_type(csr.public_key(), where)
    pub = spki(csr)
    ca_cert = x509.load_pem_x509_certificate((ca_dir / CA_FILE).read_bytes())
    if pub == spki(ca_cert):
        raise EnrollError(f"{where} is for the CA's own key: the CA key never goes to a node")
    want = identity_of(node)
    fingerprint = key_fingerprint(csr.public_key())
    for entry in read_registry(ca_dir):
        if entry.get("key_sha256") == fingerprint and entry.get("identity") != want:
            raise EnrollError(
                f"{where} is for a key already certified as {entry.get('identity')} (serial "
                f"{entry.get('serial')}, on record in {ca_dir / KEY_REGISTRY}): a key serves "
                "one identity for life; the site makes a new key (certs request)"
            )
    for path in _issued_certificates(ca_dir):
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        if spki(cert) != pub:
            continue
        held = list(certificate_uris(cert.public_bytes(serialization.Encoding.PEM)))
        if held != [want]:
            raise EnrollError(
                f"{where} is for a key already certified as {', '.join(held) or 'no identity'} "
                f"({path}): every node needs its own key"
            )


def default_names(node: str) -> tuple[str, ...]:
    """The names every certificate of ``node`` carries besides the extra ones."""
    return (identity_name(identity_of(node)), "localhost", "127.0.0.1", node)


def check_request(
    csr: x509.CertificateSigningRequest, node: str, ca_dir: Path, *, wildcards: bool = False
) -> list[str]:
    """Check a verified request for ``node`` against the CA directory; its extra names
    (the defaults of :func:`default_names` left out)."""
    node_name(node)
    where = f"the request for {node}"
    hosts = _check_identity(_requested_sans(csr, where), node, where)
    extra = [h for h in hosts if h not in default_names(node)]
    for h in extra:
        rule = extra_name_rule(h, node, wildcards=wildcards)
        if rule is not None:
            raise EnrollError(f"{where} asks for the extra name {h!r}: refused: {rule}")
    _check_key_is_new(csr, node, Path(ca_dir))
    return extra


def sign_request(
    csr_path: Path,
    node: str,
    ca_dir: Path,
    out: Path | None = None,
    *,
    days: int = 365,
    wildcards: bool = False,
) -> Signed:
    """Check ``csr_path`` for ``node`` and write ``<out>/<node>/{tls.crt,ca.crt}``.

    ``out`` defaults to ``<ca_dir>/signed``. A copy of the certificate is kept in
    ``<ca_dir>/issued/<node>.crt``: later requests for another node with the same key are
    refused. The certificate ends ``days`` from now, or when the CA does if that is sooner.
    """
    ca_dir = Path(ca_dir)
    ca_key, ca_cert = load_ca(ca_dir / CA_FILE, ca_dir / "ca.key")
    csr = read_request(csr_path)
    try:
        hosts = check_request(csr, node, ca_dir, wildcards=wildcards)
    except EnrollError as exc:
        raise EnrollError(f"{csr_path}: {exc}") from None
    if ca_cert.not_valid_after_utc <= dt.datetime.now(dt.UTC):
        raise EnrollError(f"the CA certificate {ca_dir / CA_FILE} expired: make a new CA")
    not_before, not_after = validity(days, ca_cert)
    public_key = cast(PublicKey, csr.public_key())  # check_request refused any other kind
    sans = node_sans(node, hosts)
    cert = leaf_certificate(public_key, node, sans, ca_key, ca_cert, not_before, not_after)
    pem = cert.public_bytes(serialization.Encoding.PEM)
    dest = Path(out if out is not None else ca_dir / "signed") / node
    dest.mkdir(parents=True, exist_ok=True)
    write_file(dest / CERT_FILE, pem, 0o644)
    write_file(dest / CA_FILE, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    (ca_dir / ISSUED).mkdir(exist_ok=True)
    previous = ca_dir / ISSUED / f"{node}.crt"
    if previous.is_file():  # replaced below: its key stays on record
        record_issued(ca_dir, node, x509.load_pem_x509_certificate(previous.read_bytes()))
    write_file(previous, pem, 0o644)
    record_issued(ca_dir, node, cert)
    return Signed(dest / CERT_FILE, dest / CA_FILE, identity_of(node), tuple(hosts), not_after)


# --------------------------------------------------------------------------- site: check
def check_bundle(node: str, tls: NodeTLS, *, readable_key: bool | None = None) -> x509.Certificate:
    """The checks a daemon runs at startup, and that the certificate is ``node``'s own."""
    role, _ = parse_identity(identity_of(node_name(node)))
    identity = check_node_secrets(tls, role=role, readable_key=readable_key)
    if identity != identity_of(node):
        raise SecretsError(
            f"certificate {tls.cert} is {identity}, not {node}'s {identity_of(node)}: "
            "install the certificate the admin signed for this node"
        )
    return x509.load_pem_x509_certificate(Path(tls.cert).read_bytes())
