"""Make a leaf certificate signed by an existing CA with any identity (for refusal tests)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mobius_fed.transport.tls import NodeTLS, identity_name


def sign_leaf(
    certs: Path, out: Path, uri: str | Sequence[str], name: str, dns: Sequence[str] = ()
) -> NodeTLS:
    """A leaf for ``name`` signed by the CA in ``certs``, with URI SAN(s) ``uri`` (forgeries
    with several or no ``mobius://`` URIs included: pass a list), the reserved identity
    name of the first URI when it is an identity, and the DNS names ``dns`` (what an
    older ``sign`` let through, e.g. a borrowed ``coordinator``). Key mode 0600."""
    uris = [uri] if isinstance(uri, str) else list(uri)
    try:
        names = [identity_name(uris[0]), *dns]
    except (ValueError, IndexError):
        names = list(dns)
    ca_cert = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(u) for u in uris]
                + [x509.DNSName(n) for n in names]
                + [x509.DNSName(name), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "leaf.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "leaf.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (out / "leaf.key").chmod(0o600)
    return NodeTLS(certs / "ca.crt", out / "leaf.crt", out / "leaf.key")
