"""Mutual TLS for every gRPC link: node identities, credentials, channel/server options
(docs/security.md "One identity per certificate", "The identity rule", "TLS 1.3 only").

Identity: the one ``mobius://`` URI SAN, read by :func:`peer_identity_or_reason` and
authorized by :func:`require_peer`; a dialler checks the server's reserved identity name
(:func:`identity_name`) and every incoming call refuses a revoked certificate
(:func:`set_revoked`, docs/security.md "Revocation"). TLS 1.3 is enforced twice (gRPC
Python keeps ``set_min_tls_version`` internal): at the handshake by
:data:`GRPC_TLS13_CIPHER_SUITES`, which gRPC's core reads only at the process's first
``import grpc`` (``mobius_fed/__init__`` sets it; :func:`tls13_handshakes_enforced` says
whether in time), and on every RPC from the auth context's ``ssl_tls_version``. A node's
own secrets only: :func:`check_node_secrets`.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import math
import os
import re
import stat
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc  # the package's __init__, imported first, set GRPC_SSL_CIPHER_SUITES

from mobius_fed import TLS13_HANDSHAKES as _HANDSHAKE_TLS13

GRPC_TLS13_CIPHER_SUITES = (
    "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256:PSK-AES128-CBC-SHA"
)
"""Value of ``GRPC_SSL_CIPHER_SUITES`` that leaves a TLS 1.2 peer no usable cipher."""

log = logging.getLogger(__name__)

SCHEME = "mobius://"
COORDINATOR_IDENTITY = "mobius://coordinator"
OPERATOR_IDENTITY = "mobius://operator"
ROLES = ("worker", "coordinator", "operator", "standby")
INDEXED_ROLES = ("worker", "standby")
"""Roles whose identity carries an index: ``mobius://worker/<rank>``, ``mobius://standby/<n>``
(a standby site, docs/recovery.md "Handover to a standby": it never names a rank)."""

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Send/receive limit on both sides (gRPC's default receive limit is only 4 MiB)."""

KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_RECV_PING_INTERVAL_MS = 10_000
"""Server accepts pings this often; must be <= the client's KEEPALIVE_TIME_MS."""

KEEPALIVE_SCALE_ENV = "MOBIUS_KEEPALIVE_SCALE"
MAX_KEEPALIVE_SCALE = 10_000.0
"""Largest keepalive scale: gRPC reads its times as 32-bit milliseconds."""

Options = list[tuple[str, int | str]]

assert MIN_RECV_PING_INTERVAL_MS <= KEEPALIVE_TIME_MS  # else GOAWAY "too_many_pings"


def keepalive_scale(environ: Mapping[str, str] | None = None) -> float:
    """``MOBIUS_KEEPALIVE_SCALE`` (of ``environ``, default the process's), which multiplies
    every keepalive time and timeout of this process's gRPC links (docs/configuration.md):
    1 unless set; a value that is not a number from 1 to MAX_KEEPALIVE_SCALE is refused.
    Read at each call, not at import: a warm-started child keeps its parent's modules."""
    text = (os.environ if environ is None else environ).get(KEEPALIVE_SCALE_ENV, "").strip()
    if not text:
        return 1.0
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not 1.0 <= scale <= MAX_KEEPALIVE_SCALE:  # NaN fails too
        raise ValueError(
            f"{KEEPALIVE_SCALE_ENV}={text!r}: expected a number from 1 to "
            f"{MAX_KEEPALIVE_SCALE:g} (it multiplies the keepalive times: "
            f"{KEEPALIVE_TIME_MS // 1000} s ping, {KEEPALIVE_TIMEOUT_MS // 1000} s timeout)"
        )
    return scale


def grpc_options() -> Options:
    """Options shared by servers and channels (ring links are long-lived and large), with
    the keepalive times multiplied by :func:`keepalive_scale`."""
    scale = keepalive_scale()
    ping, timeout, min_recv = (
        round(ms * scale)
        for ms in (KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, MIN_RECV_PING_INTERVAL_MS)
    )
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", ping),
        ("grpc.keepalive_timeout_ms", timeout),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # The server's name for it (gRPC silently ignores unknown option names): without it the
        # server keeps its 5 min default and answers 30 s pings with GOAWAY "too_many_pings".
        ("grpc.http2.min_ping_interval_without_data_ms", min_recv),
        # grpcio 1.85 closes a connection whose keepalive ping goes unanswered only with this.
        ("grpc.http2.ping_timeout_ms", timeout),
    ]


def worker_identity(index: int) -> str:
    """The identity URI of worker ``index`` (0-based)."""
    if index < 0:
        raise ValueError(f"worker index must be >= 0, got {index}")
    return f"{SCHEME}worker/{index}"


def standby_identity(index: int) -> str:
    """The identity URI of standby site ``index`` (``mobius://standby/<index>``)."""
    if index < 0:
        raise ValueError(f"standby index must be >= 0, got {index}")
    return f"{SCHEME}standby/{index}"


IDENTITY_DOMAIN = "id.mobius.invalid"
"""The reserved DNS domain of identity names (docs/security.md "The identity rule"): ``.invalid``
never resolves (RFC 2606), and only ``certs init``/``renew``/``sign`` write a name under it,
each certificate exactly the one of its own ``mobius://`` identity."""


def node_name_of(identity: str) -> str:
    """The node name of an identity URI (``mobius://worker/3`` -> ``worker-3``)."""
    role, index = parse_identity(identity)
    return role if index is None else f"{role}-{index}"


def identity_name(identity: str) -> str:
    """The reserved DNS name of an identity (``mobius://worker/3`` ->
    ``worker-3.id.mobius.invalid``): what a dialler checks the server's certificate for."""
    return f"{node_name_of(identity)}.{IDENTITY_DOMAIN}"


def is_reserved_name(name: str) -> bool:
    """Whether a DNS name lies in the reserved identity domain (any case, trailing dot)."""
    n = name.lower().rstrip(".")
    return n == IDENTITY_DOMAIN or n.endswith("." + IDENTITY_DOMAIN)


def identity_of_node_name(name: str) -> str | None:
    """The identity of a node name (``coordinator``, ``operator``, ``worker-<i>``,
    ``standby-<n>``) or None."""
    if name in ("coordinator", "operator"):
        return f"{SCHEME}{name}"
    for role in INDEXED_ROLES:
        index = name.removeprefix(f"{role}-")
        if index != name and index.isdigit() and str(int(index)) == index:
            return f"{SCHEME}{role}/{int(index)}"
    return None


def tls_target_name(target_name: str) -> str:
    """The name a dialler checks the server's certificate for: a node name or an identity
    URI becomes that identity's reserved name (only that identity's certificate carries
    it); any other host name is checked as it is."""
    identity = target_name if target_name.startswith(SCHEME) else identity_of_node_name(target_name)
    return identity_name(identity) if identity else target_name


def parse_identity(uri: str) -> tuple[str, int | None]:
    """Split an identity URI into ``(role, worker index or None)``; ValueError if invalid."""
    if not uri.startswith(SCHEME):
        raise ValueError(f"not a mobius identity: {uri!r}")
    parts = uri[len(SCHEME) :].split("/")
    role = parts[0]
    if role in INDEXED_ROLES and len(parts) == 2 and parts[1].isdigit():
        return role, int(parts[1])
    if role in ("coordinator", "operator") and len(parts) == 1:
        return role, None
    raise ValueError(f"not a mobius identity: {uri!r}")


class TLSBytes(NamedTuple):
    """PEM bytes of a node's CA bundle, certificate chain and private key."""

    ca: bytes
    cert: bytes
    key: bytes


@dataclass(frozen=True)
class NodeTLS:
    """Paths of one node's TLS material (see :mod:`mobius_fed.transport.certs`)."""

    ca: Path
    cert: Path
    key: Path

    def load(self) -> TLSBytes:
        """Read all three files; FileNotFoundError names the missing one."""
        out = []
        for what, path in (
            ("CA certificate", self.ca),
            ("certificate", self.cert),
            ("private key", self.key),
        ):
            p = Path(path)
            if not p.is_file():
                raise FileNotFoundError(f"TLS {what} not found: {p} (make it: mobius-fed certs)")
            out.append(p.read_bytes())
        return TLSBytes(*out)


def server_credentials(tls: NodeTLS) -> grpc.ServerCredentials:
    """Server credentials that require a client certificate signed by our CA."""
    b = tls.load()
    return grpc.ssl_server_credentials(
        [(b.key, b.cert)], root_certificates=b.ca, require_client_auth=True
    )


def channel_credentials(tls: NodeTLS) -> grpc.ChannelCredentials:
    """Client credentials: trust only our CA and present this node's certificate."""
    b = tls.load()
    return grpc.ssl_channel_credentials(
        root_certificates=b.ca, private_key=b.key, certificate_chain=b.cert
    )


RECONNECT_BACKOFF_MS = (1_000, 1_000, 3_000)
"""Initial, minimum and maximum reconnect backoff of every channel. gRPC's default maximum
is 120 s: after a long network cut a worker would wait up to two minutes to reach the
coordinator again although the network was back."""


def channel_options(target_name: str | None = None) -> Options:
    """Channel options; ``target_name`` overrides the name checked against server SANs: a
    node name or identity URI is checked as its reserved identity name (:func:`tls_target_name`)."""
    initial, lowest, highest = RECONNECT_BACKOFF_MS
    opts = [
        *grpc_options(),
        ("grpc.initial_reconnect_backoff_ms", initial),
        ("grpc.min_reconnect_backoff_ms", lowest),
        ("grpc.max_reconnect_backoff_ms", highest),
    ]
    if target_name:
        opts.append(("grpc.ssl_target_name_override", tls_target_name(target_name)))
    return opts


def _refuse_or_warn_plaintext(insecure: bool, what: str) -> None:
    """Refuse plaintext unless ``insecure``; shout when it is used."""
    if not insecure:
        raise ValueError("no TLS material given; plaintext needs an explicit insecure=True")
    log.warning(
        "!!! INSECURE: %s WITHOUT TLS — no encryption, no authentication. "
        "Local debugging only; never on a real network. !!!",
        what,
    )


def add_port(
    server: grpc.Server, address: str, tls: NodeTLS | None, *, insecure: bool = False
) -> int:
    """Bind ``address`` with mTLS, or plaintext only if ``tls`` is None and ``insecure``."""
    if tls is not None:
        if not _HANDSHAKE_TLS13:
            log.warning(
                "gRPC was imported before GRPC_SSL_CIPHER_SUITES was set: TLS 1.2 handshakes "
                "to %s are possible, but every authorized RPC on them is refused",
                address,
            )
        return server.add_secure_port(address, server_credentials(tls))
    _refuse_or_warn_plaintext(insecure, f"serving on {address}")
    return server.add_insecure_port(address)


def open_channel(
    target: str, tls: NodeTLS | None, *, insecure: bool = False, target_name: str | None = None
) -> grpc.Channel:
    """Open an mTLS channel, or plaintext only if ``tls`` is None and ``insecure``."""
    if tls is not None:
        return grpc.secure_channel(target, channel_credentials(tls), channel_options(target_name))
    _refuse_or_warn_plaintext(insecure, f"connecting to {target}")
    return grpc.insecure_channel(target, channel_options(None))


def tls13_handshakes_enforced() -> bool:
    """Whether this process's gRPC refuses TLS 1.2 handshakes (see the module doc); either
    way RPCs over anything but TLS 1.3 get no identity from :func:`peer_identity`."""
    return _HANDSHAKE_TLS13


# --------------------------------------------------------------------------- identities
def identity_or_reason(uris: Sequence[str]) -> tuple[str | None, str]:
    """The identity among a certificate's URI SANs: exactly one ``mobius://`` URI, valid.

    Returns ``(identity, "")`` or ``(None, reason)``. Other schemes are ignored; the
    ``mobius`` scheme is matched case-insensitively so ``MOBIUS://…`` cannot hide a second.
    """
    ours = [u for u in uris if u[: len(SCHEME)].lower() == SCHEME]
    if not ours:
        return None, "certificate carries no mobius:// URI"
    if len(ours) > 1:
        return None, (
            f"certificate carries {len(ours)} mobius:// URIs ({', '.join(ours)}); "
            "exactly one is required"
        )
    try:
        parse_identity(ours[0])
    except ValueError:
        return None, f"certificate URI {ours[0]!r} is not a valid mobius identity"
    return ours[0], ""


@functools.lru_cache(maxsize=256)
def certificate_sans(pem: bytes) -> tuple[Any, ...]:
    """Every SAN (``x509.GeneralName``) of a PEM certificate (ValueError if it cannot be
    parsed)."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    try:
        return tuple(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        return ()


def certificate_uris(pem: bytes) -> tuple[str, ...]:
    """Every URI SAN of a PEM certificate (ValueError if it cannot be parsed)."""
    from cryptography import x509

    return tuple(
        n.value for n in certificate_sans(pem) if isinstance(n, x509.UniformResourceIdentifier)
    )


def certificate_dns_names(pem: bytes) -> tuple[str, ...]:
    """Every DNS SAN of a PEM certificate (ValueError if it cannot be parsed)."""
    from cryptography import x509

    return tuple(n.value for n in certificate_sans(pem) if isinstance(n, x509.DNSName))


def foreign_identity_names(identity: str, dns: Sequence[str]) -> list[str]:
    """Reserved identity names in ``dns`` that are not ``identity``'s own (a certificate
    carrying one is refused everywhere: it could pass as another node when dialled)."""
    own = identity_name(identity)
    return [d for d in dns if is_reserved_name(d) and d.lower().rstrip(".") != own]


def certificate_identity(pem: bytes) -> str:
    """The identity of a PEM certificate; ValueError saying why if it has none or if it
    carries another identity's reserved name."""
    who, why = identity_or_reason(certificate_uris(pem))
    if who is None:
        raise ValueError(why)
    foreign = foreign_identity_names(who, certificate_dns_names(pem))
    if foreign:
        raise ValueError(
            f"certificate of {who} carries the reserved identity name(s) {foreign!r} of "
            "another identity"
        )
    return who


def _text(raw: Any) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def peer_identity_or_reason(context: grpc.ServicerContext) -> tuple[str | None, str]:
    """``(identity, "")`` of the caller, or ``(None, why it has none)``.

    The caller needs a verified certificate (gRPC checked the chain) over TLS 1.3 that
    carries exactly one ``mobius://`` URI. URIs are read from the certificate itself;
    gRPC's ``peer_uri`` list (which may hold several entries) is the fallback.
    """
    auth = context.auth_context() or {}
    kind = [_text(v) for v in auth.get("transport_security_type", ())]
    if kind != ["ssl"]:
        return None, "connection is not TLS"
    version = [_text(v) for v in auth.get("ssl_tls_version", ())]
    if version != ["TLSv1.3"]:
        got = version[0] if version else "an unknown TLS version"
        return None, f"connection negotiated {got}; TLS 1.3 is required"
    pems = auth.get("x509_pem_cert", ())
    if len(pems) == 1:
        try:
            uris: Sequence[str] = certificate_uris(bytes(pems[0]))
            dns = certificate_dns_names(bytes(pems[0]))
        except ValueError:
            return None, "peer certificate cannot be parsed"
        who, why = identity_or_reason(uris)
        foreign = foreign_identity_names(who, dns) if who else []
        if foreign:
            return None, f"certificate of {who} carries another identity's name {foreign[0]!r}"
        if who is not None and revoked_serial(bytes(pems[0])) is not None:
            return None, f'certificate of {who} is revoked (docs/security.md "Revocation")'
        return who, why
    elif "peer_uri" in auth:
        uris = [_text(v) for v in auth["peer_uri"]]
    else:
        return None, "no verified peer certificate"
    return identity_or_reason(uris)


def revoked_peer(context: grpc.ServicerContext) -> str | None:
    """The identity in the caller's certificate when that certificate is revoked, else None
    (the coordinator counts such a worker lost at once: docs/security.md "Revocation")."""
    pems = (context.auth_context() or {}).get("x509_pem_cert", ())
    if len(pems) != 1 or revoked_serial(bytes(pems[0])) is None:
        return None
    return identity_or_reason(certificate_uris(bytes(pems[0])))[0]


def peer_certificate(context: grpc.ServicerContext) -> bytes | None:
    """The PEM certificate the caller presented (gRPC verified its chain), or None."""
    pems = (context.auth_context() or {}).get("x509_pem_cert", ())
    return bytes(pems[0]) if len(pems) == 1 else None


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """The caller's ``mobius://`` identity, or None (see :func:`peer_identity_or_reason`)."""
    return peer_identity_or_reason(context)[0]


def require_peer(context: grpc.ServicerContext, allowed: Collection[str] | Sequence[str]) -> str:
    """Return the caller's identity or abort the RPC with PERMISSION_DENIED, saying why."""
    who, why = peer_identity_or_reason(context)
    if who is None:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, f"peer refused: {why}")
    if who not in allowed:
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"peer {who} not allowed (expected one of {sorted(allowed)})",
        )
    assert who is not None  # context.abort raised otherwise
    return who


# --------------------------------------------------------------------------- revocation
_revoked: frozenset[int] = frozenset()
"""Serial numbers of revoked certificates this process refuses (docs/security.md
"Revocation"); replaced as a whole by :func:`set_revoked`."""


def set_revoked(serials: Collection[int]) -> None:
    """Refuse the certificates with these serial numbers from now on (every incoming call
    and every handshake: :func:`peer_identity_or_reason`)."""
    global _revoked
    new = frozenset(int(s) for s in serials)
    if new != _revoked:
        log.warning("revocation list: %d certificate(s) revoked", len(new))
    _revoked = new


def revoked_serials() -> frozenset[int]:
    """The serial numbers this process refuses now."""
    return _revoked


@functools.lru_cache(maxsize=256)
def certificate_serial(pem: bytes) -> int:
    """The serial number of a PEM certificate."""
    from cryptography import x509

    return int(x509.load_pem_x509_certificate(pem).serial_number)


def revoked_serial(pem: bytes) -> int | None:
    """The certificate's serial number if it is revoked, else None."""
    if not _revoked:
        return None
    serial = certificate_serial(pem)
    return serial if serial in _revoked else None


# --------------------------------------------------------------------------- secrets
COMPOSE_HINT = (
    "Docker Engine < 26 ignores volume.subpath, so every container sees the whole certs "
    "volume; use Engine >= 26"
)
MAX_SCANNED_BYTES = 1 << 20
"""Files larger than this are not read when looking for private keys (keys are small)."""


class SecretsError(ValueError):
    """A node's certificate directory holds secrets that are not the node's own."""


_PEM_PRIVATE_KEY = re.compile(rb"-----BEGIN ([A-Z0-9 ]*PRIVATE KEY)-----.*?-----END \1-----", re.S)


def _private_keys(data: bytes, path: Path) -> list[Any] | None:
    """The private keys in a file: PEM blocks, or one DER key in a ``*.key``/``*.der``.

    None when the file holds or claims to hold a private key that cannot be read
    (encrypted, OpenSSH, unknown format): then nobody can tell whose key it is.
    """
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    if b"PRIVATE KEY-----" in data:
        blocks = [m.group(0) for m in _PEM_PRIVATE_KEY.finditer(data)]
        if not blocks:  # claims a key, holds none readable
            return None
        load = serialization.load_pem_private_key
    elif path.suffix.lower() in (".key", ".der"):
        blocks, load = [data], serialization.load_der_private_key
    else:
        return []
    try:
        return [load(block, password=None) for block in blocks]
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None


def spki(holder: Any) -> bytes:
    """The DER SubjectPublicKeyInfo of a certificate's, a CSR's or a private key's public key."""
    from cryptography.hazmat.primitives import serialization

    return holder.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _certificates(pem: bytes, what: str, path: Path) -> list[Any]:
    """Every certificate in a PEM file (a CA file may hold several); SecretsError if none."""
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise SecretsError(f"{what} {path} is not a PEM certificate ({exc})") from None


EXPIRY_WARNING_DAYS = 14
"""A certificate that expires within this many days is logged as a warning at startup."""


def _check_validity(cert: Any, what: str, path: Path, now: dt.datetime) -> None:
    """Refuse a certificate outside its validity window; warn when it ends soon."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now > end:
        raise SecretsError(
            f"{what} {path} expired on {end:%Y-%m-%d %H:%M} UTC: the node needs a new one "
            "(at the site: mobius-fed certs request --key <its key>; the admin: certs sign)"
        )
    if now < start:
        raise SecretsError(
            f"{what} {path} is not valid before {start:%Y-%m-%d %H:%M} UTC and this "
            f"host's clock says {now:%Y-%m-%d %H:%M} UTC: check the clock"
        )
    if end - now < dt.timedelta(days=EXPIRY_WARNING_DAYS):
        log.warning("%s %s expires on %s UTC: renew it soon", what, path, f"{end:%Y-%m-%d}")


def _check_issuer(cert: Any, cas: list[Any], tls: NodeTLS) -> None:
    """Refuse a certificate that no certificate in the CA file signed."""
    from cryptography.exceptions import InvalidSignature

    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return
        except (ValueError, TypeError, InvalidSignature):
            continue
    held = "; ".join(c.subject.rfc4514_string() for c in cas)
    raise SecretsError(
        f"certificate {tls.cert} was not issued by the CA in {tls.ca} (its issuer is "
        f"{cert.issuer.rfc4514_string()!r}; {tls.ca} holds {held!r}): install the ca.crt "
        "that came with the certificate"
    )


def _check_role(identity: str, role: str | None, tls: NodeTLS) -> None:
    if role is None:
        return
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {ROLES}")
    if parse_identity(identity)[0] != role:
        raise SecretsError(
            f"certificate {tls.cert} is {identity}, not a {role}'s identity: this node "
            f"needs the certificate issued for its own name"
        )


ALLOW_READABLE_KEY_ENV = "MOBIUS_ALLOW_READABLE_KEY"
"""Set to 1 (or pass ``--allow-readable-key``) to only warn about a key others can read."""


def key_file_problem(path: Path) -> str | None:
    """Why the private key file ``path`` is readable by more than its owner, or None.

    Refused: any permission for others, and group permissions, except a read-only file
    owned by root read by a non-root process (a Kubernetes secret volume with ``fsGroup``
    and ``defaultMode: 0440``; the rule PostgreSQL applies to its key). The message names
    the file and the ``chmod`` that fixes it.
    """
    st = Path(path).stat()
    mode = stat.S_IMODE(st.st_mode)
    if not mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    root_secret = (
        st.st_uid == 0
        and os.geteuid() != 0
        and not mode & (stat.S_IRWXO | stat.S_IWGRP | stat.S_IXGRP)
    )
    if root_secret:
        return None
    who = "others" if mode & stat.S_IRWXO else "its group"
    return (
        f"private key {path} has mode {mode:04o}: {who} can read or change it; a node's key "
        f"is readable by its owner only (fix: chmod 600 {path})"
    )


def check_key_file(path: Path, *, warn_only: bool | None = None) -> None:
    """Refuse (SecretsError) or, with ``warn_only`` (default: ``$MOBIUS_ALLOW_READABLE_KEY``
    set to 1), log a key file others can read (:func:`key_file_problem`)."""
    problem = key_file_problem(path)
    if problem is None:
        return
    if warn_only is None:
        warn_only = os.environ.get(ALLOW_READABLE_KEY_ENV, "") in ("1", "true", "yes")
    if warn_only:
        log.warning("%s (allowed by --allow-readable-key / %s=1)", problem, ALLOW_READABLE_KEY_ENV)
        return
    raise SecretsError(
        f"{problem}; to only warn, pass --allow-readable-key or set {ALLOW_READABLE_KEY_ENV}=1"
    )


def _check_identity_name(identity: str, pem: bytes, tls: NodeTLS) -> None:
    """A node that is dialled (a worker, the coordinator) carries its reserved name."""
    if parse_identity(identity)[0] == "operator":
        return
    want = identity_name(identity)
    if want not in [d.lower().rstrip(".") for d in certificate_dns_names(pem)]:
        raise SecretsError(
            f"certificate {tls.cert} of {identity} lacks its identity name {want}, which "
            'every node dialling it checks (docs/security.md "The identity rule"): it was '
            "issued by an older mobius-fed; have it issued again (certs renew, or certs "
            "request + certs sign)"
        )


def check_node_secrets(
    tls: NodeTLS,
    *,
    role: str | None = None,
    now: dt.datetime | None = None,
    readable_key: bool | None = None,
) -> str:
    """Return the node's identity, or raise :class:`SecretsError` naming the file and why
    (the refusals: docs/keys.md "What a node refuses at startup"; with ``role``, also a
    certificate of another role). A key file is ``*.key`` or PEM ``PRIVATE KEY``. Only files
    directly in the directories of the certificate, key and CA certificate are looked at.
    ``readable_key``: only warn about a key others can read (:func:`check_key_file`).
    """
    b = tls.load()
    check_key_file(Path(tls.key), warn_only=readable_key)
    (cert, *_) = _certificates(b.cert, "certificate", Path(tls.cert))
    cas = _certificates(b.ca, "CA certificate", Path(tls.ca))
    own_pub, ca_pubs = spki(cert), {spki(c) for c in cas}
    _check_own_key(tls, b.key, own_pub, ca_pubs)
    try:
        identity = certificate_identity(b.cert)
    except ValueError as exc:
        raise SecretsError(f"certificate {tls.cert}: {exc}") from None
    _check_role(identity, role, tls)
    _check_identity_name(identity, b.cert, tls)
    now = now or dt.datetime.now(dt.UTC)
    for ca in cas:
        _check_validity(ca, "CA certificate", Path(tls.ca), now)
    _check_validity(cert, "certificate", Path(tls.cert), now)
    _check_issuer(cert, cas, tls)
    # each directory as mounted, and where its symlinks (Kubernetes secrets) lead
    dirs = dict.fromkeys(
        d
        for p in (tls.cert, tls.key, tls.ca)
        for d in (Path(p).absolute().parent, Path(p).resolve().parent)
    )
    for d in dirs:
        for f in sorted(d.iterdir()):
            _check_file(f, tls, own_pub, ca_pubs)
    return identity


def _check_own_key(tls: NodeTLS, pem: bytes, own_pub: bytes, ca_pubs: set[bytes]) -> None:
    own = _private_keys(pem, Path(tls.key))
    if not own:
        raise SecretsError(f"private key {tls.key} holds no readable unencrypted private key")
    for key in own:
        if spki(key) in ca_pubs:
            raise SecretsError(
                f"private key {tls.key} is the CA key: a node must never hold it. {COMPOSE_HINT}"
            )
        if spki(key) != own_pub:
            raise SecretsError(
                f"private key {tls.key} does not match certificate {tls.cert} "
                "(they are from different nodes or different issues of the certificates)"
            )


def _check_file(f: Path, tls: NodeTLS, own_pub: bytes, ca_pubs: set[bytes]) -> None:
    try:
        if not f.is_file():
            return
        if f.name.lower() == "ca.key":
            raise SecretsError(
                f"{f} is the CA key: a node must never hold it (anyone with it can mint any "
                f"identity). Give the node only its own bundle: ca.crt, tls.crt, tls.key. "
                f"{COMPOSE_HINT}"
            )
        if f.stat().st_size > MAX_SCANNED_BYTES:
            return
        data = f.read_bytes()
    except PermissionError:
        return  # this node cannot read it, so it does not hold it
    keys = _private_keys(data, f)
    if keys is None:
        raise SecretsError(
            f"{f} holds a private key this node cannot identify (encrypted or unknown "
            f"format); a node's certificate directory holds only its own key. {COMPOSE_HINT}"
        )
    for key in keys:
        pub = spki(key)
        if pub in ca_pubs:
            raise SecretsError(
                f"{f} holds the CA key: a node must never hold it (anyone with it can mint "
                f"any identity). {COMPOSE_HINT}"
            )
        if pub != own_pub:
            raise SecretsError(
                f"{f} holds another node's private key (its public key is not the one in "
                f"{tls.cert}); a node holds only its own key. {COMPOSE_HINT}"
            )
