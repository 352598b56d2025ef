"""Revocation (docs/security.md "Revocation"): the CA's signed list of revoked certificates.

``mobius-fed certs revoke`` (:func:`revoke`) writes ``crl.pem``, an X.509 CRL signed by the
CA key, in the CA directory and in every ``nodes/<name>/`` bundle beside it. A node reads
the ``crl.pem`` beside its ``ca.crt`` (:class:`CrlSource`), and a coordinated worker takes
the coordinator's copy from every registration and heartbeat reply (:func:`apply_crl`):
each list is verified against the node's own CA before its serials go to
:func:`~mobius_fed.transport.tls.set_revoked`, which every incoming call checks. A list
older than the one a node holds is ignored (no roll-back).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from mobius_fed.transport.certs import identity_of, load_ca, read_registry, write_file
from mobius_fed.transport.tls import NodeTLS, set_revoked

log = logging.getLogger(__name__)

CRL_FILE = "crl.pem"
CRL_DAYS = 30
"""The list's ``nextUpdate``: informational; a node keeps enforcing an older list."""


class RevocationError(ValueError):
    """A revocation request or a list that cannot be used (the message says why)."""


def serials_of(ca_dir: Path, target: str) -> dict[int, str]:
    """Serial → what it is, for ``target``: a node name (every certificate of it on
    record) or a serial number (decimal, or hex with ``0x``). RevocationError if unknown."""
    ca_dir = Path(ca_dir)
    with contextlib.suppress(ValueError):
        serial = int(target, 0)
        return {serial: f"serial {serial}"}
    try:
        identity = identity_of(target)
    except ValueError:
        raise RevocationError(
            f"{target!r} is neither a node name (worker-<i>, coordinator, operator) nor a "
            "serial number"
        ) from None
    found = {
        int(e["serial"]): f"{target} ({identity})"
        for e in read_registry(ca_dir)
        if e.get("identity") == identity
    }
    for p in (f"{target}.crt", f"issued/{target}.crt", f"nodes/{target}/tls.crt"):
        if (ca_dir / p).is_file():  # the certificates it holds: flat, issued/, bundles
            cert = x509.load_pem_x509_certificate((ca_dir / p).read_bytes())
            found[cert.serial_number] = f"{target} ({identity})"
    if not found:
        raise RevocationError(f"no certificate of {target} is on record in {ca_dir}")
    return found


def read_crl(data: bytes) -> x509.CertificateRevocationList:
    """A CRL from PEM or DER bytes (RevocationError if neither)."""
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_crl(data)
        return x509.load_der_x509_crl(data)
    except ValueError as exc:
        raise RevocationError(f"not a certificate revocation list ({exc})") from None


def revoke(ca_dir: Path, targets: Iterable[str], *, days: int = CRL_DAYS) -> dict[int, str]:
    """Add ``targets`` (node names or serials) to the CA's list and write it signed:
    ``<ca_dir>/crl.pem`` and ``<ca_dir>/nodes/*/crl.pem``. Returns serial → what it is."""
    ca_dir = Path(ca_dir)
    ca_key, ca_cert = load_ca(ca_dir / "ca.crt", ca_dir / "ca.key")
    added: dict[int, str] = {}
    for t in targets:
        added.update(serials_of(ca_dir, t))
    now = dt.datetime.now(dt.UTC)
    path = ca_dir / CRL_FILE
    old: Iterable[x509.RevokedCertificate] = read_crl(path.read_bytes()) if path.is_file() else []
    entries = {r.serial_number: r.revocation_date_utc for r in old}
    for serial in added:
        entries.setdefault(serial, now)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + dt.timedelta(days=days))
    )
    for serial, when in sorted(entries.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    pem = crl.public_bytes(serialization.Encoding.PEM)
    write_file(path, pem, 0o644)
    for bundle_ca in sorted(ca_dir.glob("nodes/*/ca.crt")):
        if bundle_ca.is_file():
            write_file(bundle_ca.parent / CRL_FILE, pem, 0o644)
    return added


def verified_serials(crl: x509.CertificateRevocationList, ca_pem: bytes) -> set[int]:
    """The serials of ``crl`` once it verifies against a CA in ``ca_pem``."""
    for ca in x509.load_pem_x509_certificates(ca_pem):
        key = ca.public_key()  # the node CAs sign with EC or RSA keys
        if not isinstance(key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey):
            continue
        if crl.issuer == ca.subject and crl.is_signature_valid(key):
            return {r.serial_number for r in crl}
    raise RevocationError("the revocation list is not signed by this node's CA")


class CrlState:
    """The newest verified list this process enforces (one per process, like the serials)."""

    def __init__(self) -> None:
        self.last_update: dt.datetime | None = None
        self.data = b""
        self._lock = threading.Lock()

    def apply(self, data: bytes, ca_pem: bytes, source: str) -> bool:
        """Enforce ``data`` if it verifies and is not older; True when it was taken."""
        if not data:
            return False
        crl = read_crl(data)
        serials = verified_serials(crl, ca_pem)
        with self._lock:
            if self.last_update is not None and crl.last_update_utc < self.last_update:
                return False  # an older list: never roll back
            if data == self.data:
                return False
            self.last_update, self.data = crl.last_update_utc, data
            set_revoked(serials)
        log.info("revocation list from %s: %d revoked", source, len(serials))
        return True


STATE = CrlState()


def apply_crl(data: bytes, tls: NodeTLS, source: str) -> bool:
    """Verify ``data`` (PEM or DER) against ``tls.ca`` and enforce it; a bad list is logged
    and ignored (the previous one stays in force)."""
    try:
        return STATE.apply(data, Path(tls.ca).read_bytes(), source)
    except (RevocationError, OSError) as exc:
        log.error("revocation list from %s ignored: %s", source, exc)
        return False


class CrlSource:
    """``crl.pem`` beside a node's ``ca.crt``: enforced at once and re-read when it changes
    (:meth:`poll`, cheap: one ``stat``). ``data`` is what the coordinator hands out."""

    def __init__(self, tls: NodeTLS) -> None:
        self.tls = tls
        self.path = Path(tls.ca).parent / CRL_FILE
        self._seen: tuple[float, int] | None = None
        self.poll()

    def poll(self) -> None:
        try:
            st = self.path.stat()
        except OSError:
            return
        if (st.st_mtime, st.st_size) == self._seen:
            return
        self._seen = (st.st_mtime, st.st_size)
        apply_crl(self.path.read_bytes(), self.tls, str(self.path))

    def watch(self, interval: float = 1.0) -> CrlSource:
        """Poll in a daemon thread every ``interval`` seconds."""

        def loop() -> None:
            while True:
                threading.Event().wait(interval)
                try:
                    self.poll()
                except Exception:  # a list being rewritten: read it on the next poll
                    log.exception("reading %s", self.path)

        threading.Thread(target=loop, daemon=True, name="crl-watch").start()
        return self

    @property
    def data(self) -> bytes:
        return STATE.data
