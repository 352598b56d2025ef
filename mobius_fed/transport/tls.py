"""Mutual TLS for every gRPC link: node identities, credentials, channel/server options.

A node's identity is a URI SAN in its certificate: ``mobius://worker/<i>``,
``mobius://coordinator`` or ``mobius://operator``. TLS only proves "signed by our CA";
who is calling is read from the peer certificate with :func:`peer_identity` and
authorized with :func:`require_peer`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import grpc

log = logging.getLogger(__name__)

SCHEME = "mobius://"
COORDINATOR_IDENTITY = "mobius://coordinator"
OPERATOR_IDENTITY = "mobius://operator"
ROLES = ("worker", "coordinator", "operator")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Send/receive limit on both sides (gRPC's default receive limit is only 4 MiB)."""

KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_RECV_PING_INTERVAL_MS = 10_000
"""Server accepts pings this often; must be <= the client's KEEPALIVE_TIME_MS."""

Options = list[tuple[str, int | str]]

GRPC_OPTIONS: Options = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_RECV_PING_INTERVAL_MS),
]
"""Options shared by servers and channels (ring links are long-lived and large)."""

assert MIN_RECV_PING_INTERVAL_MS <= KEEPALIVE_TIME_MS  # else GOAWAY "too_many_pings"


def worker_identity(index: int) -> str:
    """The identity URI of worker ``index`` (0-based)."""
    if index < 0:
        raise ValueError(f"worker index must be >= 0, got {index}")
    return f"{SCHEME}worker/{index}"


def parse_identity(uri: str) -> tuple[str, int | None]:
    """Split an identity URI into ``(role, worker index or None)``; ValueError if invalid."""
    if not uri.startswith(SCHEME):
        raise ValueError(f"not a mobius identity: {uri!r}")
    parts = uri[len(SCHEME) :].split("/")
    role = parts[0]
    if role == "worker" and len(parts) == 2 and parts[1].isdigit():
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


def channel_options(target_name: str | None = None) -> Options:
    """Channel options; ``target_name`` overrides the name checked against server SANs."""
    opts = list(GRPC_OPTIONS)
    if target_name:
        opts.append(("grpc.ssl_target_name_override", target_name))
    return opts


def _warn_plaintext(what: str) -> None:
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
        return server.add_secure_port(address, server_credentials(tls))
    if not insecure:
        raise ValueError("no TLS material given; plaintext needs an explicit insecure=True")
    _warn_plaintext(f"serving on {address}")
    return server.add_insecure_port(address)


def open_channel(
    target: str, tls: NodeTLS | None, *, insecure: bool = False, target_name: str | None = None
) -> grpc.Channel:
    """Open an mTLS channel, or plaintext only if ``tls`` is None and ``insecure``."""
    if tls is not None:
        return grpc.secure_channel(target, channel_credentials(tls), channel_options(target_name))
    if not insecure:
        raise ValueError("no TLS material given; plaintext needs an explicit insecure=True")
    _warn_plaintext(f"connecting to {target}")
    return grpc.insecure_channel(target, channel_options(None))


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """The caller's ``mobius://`` identity from its verified certificate, or None."""
    auth = context.auth_context() or {}
    for key in ("peer_uri", "x509_subject_alternative_name"):
        for raw in auth.get(key, ()):
            value = raw.decode() if isinstance(raw, bytes) else str(raw)
            if value.startswith(SCHEME):
                return value
    return None


def require_peer(context: grpc.ServicerContext, allowed: Collection[str] | Sequence[str]) -> str:
    """Return the caller's identity or abort the RPC with PERMISSION_DENIED."""
    who = peer_identity(context)
    if who is None or who not in allowed:
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"peer {who or '<no identity>'} not allowed (expected one of {sorted(allowed)})",
        )
    return who  # type: ignore[return-value]
