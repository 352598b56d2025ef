"""Make a private CA and one mTLS certificate per node (``mobius-fed certs``; docs/keys.md
"Labs: certs init", "Renewing, a leaked key, a new CA"; docs/security.md).

Layout of ``out``: ``ca.crt``/``ca.key``, ``worker-<i>.crt``/``.key`` (i in 0..N-1),
``coordinator.*``, ``operator.*``, and each node's bundle ``nodes/<name>/{ca.crt,tls.crt,
tls.key}``. Keys: EC P-256, PEM PKCS#8, mode 0600. Leaf SANs: the ``mobius://`` URI, DNS
``localhost`` and the service name, IP 127.0.0.1, every ``hosts`` value; serverAuth and
clientAuth. :func:`renew_node` keeps the identity; :func:`rotate_ca` replaces everything.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mobius_fed.transport.tls import (
    COORDINATOR_IDENTITY,
    OPERATOR_IDENTITY,
    NodeTLS,
    certificate_sans,
    identity_name,
    is_reserved_name,
    spki,
    standby_identity,
    worker_identity,
)

CA_NAME = "mobius-fed CA"

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
PublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey


@dataclass(frozen=True)
class CertLayout:
    """Where :func:`init_certs` put everything."""

    root: Path
    ca_cert: Path
    ca_key: Path
    workers: int
    standbys: int = 0  # standby sites (docs/recovery.md "Handover to a standby")

    def names(self) -> list[str]:
        """All node names: ``worker-0`` .. ``worker-<N-1>``, ``coordinator``, ``operator``,
        then ``standby-0`` .. ``standby-<S-1>``."""
        workers = [f"worker-{i}" for i in range(self.workers)]
        return (
            workers + ["coordinator", "operator"] + [f"standby-{k}" for k in range(self.standbys)]
        )

    def node(self, name: str) -> NodeTLS:
        """TLS paths of node ``name`` (e.g. ``worker-1``); KeyError if unknown."""
        if name not in self.names():
            raise KeyError(f"no certificate for {name!r}; known: {', '.join(self.names())}")
        return NodeTLS(
            ca=self.ca_cert, cert=self.root / f"{name}.crt", key=self.root / f"{name}.key"
        )

    def bundle(self, name: str) -> NodeTLS:
        """``nodes/<name>/{ca.crt,tls.crt,tls.key}``: what one node's host receives."""
        d = self.root / "nodes" / name
        return NodeTLS(ca=d / "ca.crt", cert=d / "tls.crt", key=d / "tls.key")

    def worker(self, index: int) -> NodeTLS:
        """TLS paths of worker ``index``."""
        return self.node(f"worker-{index}")


def identity_of(name: str) -> str:
    """Identity URI of node ``name`` (``worker-3`` -> ``mobius://worker/3``)."""
    if name == "coordinator":
        return COORDINATOR_IDENTITY
    if name == "operator":
        return OPERATOR_IDENTITY
    index = name.removeprefix("worker-")
    if index != name and index.isdigit():
        return worker_identity(int(index))
    index = name.removeprefix("standby-")
    if index != name and index.isdigit():
        return standby_identity(int(index))
    raise ValueError(f"unknown node name {name!r}")


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with exactly ``mode`` (0600 for keys), replacing it."""
    if path.exists():
        path.unlink()  # O_CREAT keeps an existing file's mode; start fresh
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # umask can only narrow; make the mode exact
        f.write(data)


def key_pem(key: PrivateKey) -> bytes:
    """A private key as unencrypted PEM PKCS#8."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


ROLE_NAMES = ("coordinator", "operator", "relay", "worker", "standby")
_WORKER_NAME = re.compile(r"(worker|standby)-?[0-9]+")
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def extra_name_rule(host: str, node: str | None, *, wildcards: bool = False) -> str | None:
    """The rule an extra name (DNS name or IP) of node ``node`` breaks, or None.

    ``node`` None: a name for every node (``certs init --host``). Refused: names that are
    not host names (control characters, NUL, spaces, non-ASCII: write punycode, empty or
    over-long labels, ``*`` unless ``wildcards``), a reserved identity name, and a node's or
    role's name (``coordinator``, ``operator``, ``relay``, ``worker-<i>``; any case, with or
    without a domain) other than the node's own.
    """
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if not host.isascii():
        return "not ASCII: write an international name in punycode (xn--…)"
    if not host.isprintable():
        return "holds control characters (a NUL, an escape, a newline…): not a host name"
    if " " in host:
        return "holds a space: not a host name"
    if len(host) > 253:
        return "longer than 253 characters: not a host name"
    lower = host.lower()
    if is_reserved_name(lower):
        return "lies in the reserved identity domain: only the CA writes a node's own"
    labels = lower.split(".")
    for i, label in enumerate(labels):
        if label == "*" and i == 0 and len(labels) > 2 and wildcards:
            continue
        if label == "*" or "*" in label:
            return "a wildcard: refused unless --allow-wildcard (and only as a whole first label)"
        if not _LABEL.fullmatch(label):
            return (
                f"label {label!r} is not a host name label (letters, digits, inner hyphens, "
                "1-63 characters)"
            )
    first = labels[0]
    if (first in ROLE_NAMES or _WORKER_NAME.fullmatch(first)) and first != node:
        return f"another node's or a role's name ({first}): a certificate names only its own node"
    return None


def check_extra_names(hosts: Sequence[str], node: str | None, *, wildcards: bool = False) -> None:
    """ValueError naming the first extra name that breaks a rule (:func:`extra_name_rule`)."""
    for h in hosts:
        rule = extra_name_rule(h, node, wildcards=wildcards)
        if rule is not None:
            who = f"node {node}" if node else "every node"
            raise ValueError(f"extra name {h!r} for {who} refused: {rule}")


def node_sans(name: str, hosts: Sequence[str]) -> list[x509.GeneralName]:
    """SANs of node ``name``: its identity URI, its reserved identity name (what a dialler
    checks: docs/security.md "The identity rule"), ``localhost``, its name (not the
    operator's), 127.0.0.1 and every ``hosts`` value (DNS name or IP)."""
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity_of(name))]
    dns: list[str] = [identity_name(identity_of(name)), "localhost"]
    ips: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [ipaddress.ip_address("127.0.0.1")]
    if name != "operator":
        dns.append(name)
    for h in hosts:
        try:
            ips.append(ipaddress.ip_address(h))
        except ValueError:
            dns.append(h)
    sans += [x509.DNSName(d) for d in dict.fromkeys(dns)]  # each name once, first place kept
    sans += [x509.IPAddress(ip) for ip in dict.fromkeys(ips)]
    return sans


def leaf_certificate(
    public_key: PublicKey,
    name: str,
    sans: Sequence[x509.GeneralName],
    ca_key: PrivateKey,
    ca_cert: x509.Certificate,
    not_before: dt.datetime,
    not_after: dt.datetime,
) -> x509.Certificate:
    """A leaf for node ``name`` (CN ``name``, SANs ``sans``) signed by the CA: never a CA
    itself, digitalSignature only, serverAuth and clientAuth (a worker is both)."""
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return (
        _builder(subject, ca_cert.subject, public_key, not_before, not_after, ca=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: PublicKey,
    not_before: dt.datetime,
    not_after: dt.datetime,
    *,
    ca: bool,
) -> x509.CertificateBuilder:
    """What a CA certificate (path length 0, signs certificates and CRLs) and a leaf share:
    names, key, a random serial, validity, basic constraints and key usage."""
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        .add_extension(usage, critical=True)
    )


def new_ca(
    not_before: dt.datetime, not_after: dt.datetime
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A fresh EC P-256 CA key and its self-signed certificate (path length 0)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), not_before, not_after, ca=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_cert


def load_ca(ca_cert: Path, ca_key: Path) -> tuple[PrivateKey, x509.Certificate]:
    """The CA's key and certificate from PEM files; errors name the file."""
    for path in (ca_cert, ca_key):
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"{path} not found: not a CA directory (make one: mobius-fed certs ca)"
            )
    key = serialization.load_pem_private_key(Path(ca_key).read_bytes(), None)
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ValueError(f"{ca_key} is not an EC or RSA key")
    cert = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
    if spki(key) != spki(cert):
        raise ValueError(f"{ca_key} is not the key of {ca_cert}")
    return key, cert


KEY_REGISTRY = "issued/record.json"
"""Beside ``ca.key``: the certificates this CA directory issued and later replaced or still
holds (node, identity, serial, key fingerprint, end), kept from the first ``renew`` or
``sign`` on; with the certificates on file it is what ``sign`` refuses a key by (once
certified under another identity) and where ``revoke`` finds a node's serials. No secret
(mode 0644)."""


def key_fingerprint(public_key: CertificatePublicKeyTypes) -> str:
    """SHA-256 of the DER SubjectPublicKeyInfo, hex."""
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def read_registry(ca_dir: Path) -> list[dict]:
    """The CA directory's record of issued certificates ([] before the first)."""
    path = Path(ca_dir) / KEY_REGISTRY
    if not path.is_file():
        return []
    try:
        doc = json.loads(path.read_text())
        entries = doc["issued"]
        if not isinstance(entries, list):
            raise TypeError("issued is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not this CA's record of issued certificates ({exc})") from None
    return entries


def record_issued(ca_dir: Path, name: str, cert: x509.Certificate) -> None:
    """Add ``cert`` (issued to node ``name``) to the CA directory's record (once)."""
    entries = read_registry(ca_dir)
    if any(e.get("serial") == str(cert.serial_number) for e in entries):
        return
    # the issuing CA's key is on record too: entries of an earlier CA stay
    ca = x509.load_pem_x509_certificate((Path(ca_dir) / "ca.crt").read_bytes())
    entries.append(
        {
            "node": name,
            "identity": identity_of(name),
            "serial": str(cert.serial_number),
            "key_sha256": key_fingerprint(cert.public_key()),
            "not_after": cert.not_valid_after_utc.isoformat(),
            "ca_sha256": key_fingerprint(ca.public_key()),
        }
    )
    doc = json.dumps({"issued": entries}, indent=1).encode()
    (Path(ca_dir) / KEY_REGISTRY).parent.mkdir(exist_ok=True)
    write_file(Path(ca_dir) / KEY_REGISTRY, doc, 0o644)


def _issue(
    layout: CertLayout,
    name: str,
    ca_key: PrivateKey,
    ca_cert: x509.Certificate,
    sans: list[x509.GeneralName],
    not_before: dt.datetime,
    not_after: dt.datetime,
) -> NodeTLS:
    """A fresh key and certificate for node ``name``, written flat and as its bundle
    (ca.crt, tls.crt, tls.key: for exactly one host or container, no other node's key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = leaf_certificate(key.public_key(), name, sans, ca_key, ca_cert, not_before, not_after)
    node, bundle = layout.node(name), layout.bundle(name)
    bundle.cert.parent.mkdir(parents=True, exist_ok=True)
    write_file(bundle.ca, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    for tls in (node, bundle):
        write_file(tls.key, key_pem(key), 0o600)
        write_file(tls.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return bundle


def fresh_dir(out: Path, overwrite: bool, what: str) -> Path:
    """``out``, created; a non-empty one is refused unless ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out} is not empty; refusing to replace {what} (pass overwrite=True / "
            "--overwrite, which invalidates every certificate already handed out)"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


def validity(days: int, ca_cert: x509.Certificate | None = None) -> tuple[dt.datetime, dt.datetime]:
    """(not before, not after): from five minutes ago (clock skew) for ``days`` days, or
    until ``ca_cert`` ends if that is sooner."""
    now = dt.datetime.now(dt.UTC)
    end = now + dt.timedelta(days=days)
    return now - dt.timedelta(minutes=5), min(end, ca_cert.not_valid_after_utc) if ca_cert else end


def init_certs(
    out: Path,
    workers: int,
    hosts: Sequence[str] = (),
    *,
    days: int = 365,
    overwrite: bool = False,
    standbys: int = 0,
) -> CertLayout:
    """Create a CA and certificates for ``workers`` workers, the coordinator, an operator
    and ``standbys`` standby sites (``standby-<n>``, never a worker rank).

    ``hosts`` (DNS names or IP addresses) are added as SANs to every leaf so nodes can be
    dialled by those names. Refuses a non-empty ``out`` unless ``overwrite``.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if standbys < 0:
        raise ValueError(f"standbys must be >= 0, got {standbys}")
    check_extra_names(hosts, None)
    return new_pki(
        out, workers, hosts, days=days, overwrite=overwrite, what="certificates", standbys=standbys
    )


def new_pki(
    out: Path,
    workers: int,
    hosts: Sequence[str] = (),
    *,
    days: int,
    overwrite: bool,
    what: str,
    names: Sequence[str] | None = None,
    standbys: int = 0,
) -> CertLayout:
    """A fresh CA in ``out`` (``what`` names it when ``out`` is refused) and certificates
    for ``names`` (default: every node of the layout)."""
    out = fresh_dir(Path(out), overwrite, what)
    not_before, not_after = validity(days)
    ca_key, ca_cert = new_ca(not_before, not_after)
    layout = CertLayout(out, out / "ca.crt", out / "ca.key", workers, standbys)
    write_file(layout.ca_key, key_pem(ca_key), 0o600)
    write_file(layout.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    for name in layout.names() if names is None else names:
        _issue(layout, name, ca_key, ca_cert, node_sans(name, hosts), not_before, not_after)
    return layout


def load_layout(root: Path) -> CertLayout:
    """The layout :func:`init_certs` wrote in ``root`` (worker count read from the files)."""
    root = Path(root)
    for f in ("ca.crt", "ca.key"):
        if not (root / f).is_file():
            raise FileNotFoundError(f"{root / f} not found: not a directory made by certs init")
    workers = 0
    while (root / f"worker-{workers}.crt").is_file():
        workers += 1
    if workers == 0:
        raise FileNotFoundError(f"no worker-0.crt in {root}")
    standbys = 0
    while (root / f"standby-{standbys}.crt").is_file():
        standbys += 1
    return CertLayout(root, root / "ca.crt", root / "ca.key", workers, standbys)


def renew_node(root: Path, name: str, hosts: Sequence[str] = (), *, days: int = 365) -> NodeTLS:
    """Issue node ``name`` a new key and certificate with the same identity from the CA.

    For a leaked or lost node key: the node's flat files and ``nodes/<name>/`` bundle are
    replaced (deploy it to that node only), keeping the old certificate's SANs plus
    ``hosts``. The OLD certificate stays valid until it expires (see the module doc).
    """
    layout = load_layout(root)
    old = layout.node(name).cert  # KeyError for an unknown node
    ca_key, ca_cert = load_ca(layout.ca_cert, layout.ca_key)
    check_extra_names(hosts, name)
    sans = node_sans(name, hosts)  # a bad host is refused before the old certificate is read
    previous = [  # what an older release signed and the rules now refuse is dropped
        n
        for n in _san_list(old)
        if not isinstance(n, x509.DNSName)
        or n.value == identity_name(identity_of(name))
        or extra_name_rule(n.value, name) is None
    ]
    sans = previous + [n for n in sans if n not in previous]
    uris = [n.value for n in sans if isinstance(n, x509.UniformResourceIdentifier)]
    if uris != [identity_of(name)]:
        raise ValueError(f"{old} carries URIs {uris}, not {identity_of(name)}")
    not_before, not_after = validity(days, ca_cert)
    if old.is_file():  # its key stays on record: never certified again for another node
        record_issued(layout.root, name, x509.load_pem_x509_certificate(old.read_bytes()))
    bundle = _issue(layout, name, ca_key, ca_cert, sans, not_before, not_after)
    record_issued(layout.root, name, x509.load_pem_x509_certificate(bundle.cert.read_bytes()))
    return bundle


def rotate_ca(root: Path, hosts: Sequence[str] = (), *, days: int = 365) -> CertLayout:
    """A new CA and new certificates for every node (same nodes): every old one stops working.

    The same as ``certs init --overwrite`` with the worker count read from ``root``.
    """
    layout = load_layout(root)
    kept: list[str] = []
    for n in _san_list(layout.node("coordinator").cert):  # the hosts given to init
        value = str(n.value)
        default = ("localhost", "coordinator") if isinstance(n, x509.DNSName) else ("127.0.0.1",)
        if isinstance(n, x509.DNSName) and extra_name_rule(value, None) is not None:
            continue  # the reserved identity name, or one an older release let through
        if isinstance(n, x509.DNSName | x509.IPAddress) and value not in default:
            kept.append(value)
    hosts = kept + [h for h in hosts if h not in kept]
    return init_certs(
        root, layout.workers, hosts, days=days, overwrite=True, standbys=layout.standbys
    )


def _san_list(cert_path: Path) -> list[x509.GeneralName]:
    return list(certificate_sans(cert_path.read_bytes())) if cert_path.is_file() else []
