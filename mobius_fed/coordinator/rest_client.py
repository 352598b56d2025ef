"""GET the coordinator's REST API as the operator: mutual TLS 1.3, or local plain HTTP.

Used by ``mobius-fed status --rest``, the ``mobius-fed dashboard`` proxy and ``up``.
Torch-free.
"""

from __future__ import annotations

import ipaddress
import ssl
from typing import Any
from urllib.parse import urlsplit

from mobius_fed.transport.tls import COORDINATOR_IDENTITY, NodeTLS, identity_name, open_channel

COORDINATOR_NAME = identity_name(COORDINATOR_IDENTITY)
"""Name checked against the coordinator certificate's DNS SANs (gRPC and REST alike): its
reserved identity name, which only the coordinator's certificate carries (docs/security.md
"The identity rule")."""


class RestClientError(Exception):
    """The REST API could not be read; the message names the URL and the reason."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def operator_context(tls: NodeTLS) -> ssl.SSLContext:
    """Client SSL context: trusts ``tls.ca``, presents the operator cert, TLS 1.3 only."""
    try:
        ctx = ssl.create_default_context(cafile=str(tls.ca))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
    except (ssl.SSLError, OSError) as exc:
        raise RestClientError(f"cannot load operator TLS material ({tls.cert}): {exc}") from None
    return ctx


def base_url(url: str) -> tuple[str, str, str]:
    """``(scheme, host, base)`` of an http(s) URL (https assumed without a scheme)."""
    parts = urlsplit(url if "://" in url else f"https://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RestClientError(f"not an http(s) URL: {url!r}")
    return parts.scheme, parts.hostname, f"{parts.scheme}://{parts.netloc}"


def client_options(url: str, tls: NodeTLS | None) -> tuple[Any, dict[str, Any]]:
    """``(verify, extensions)`` for httpx: mTLS for https, plain only to loopback."""
    scheme, host, _ = base_url(url)
    if scheme == "http":
        if not is_loopback(host):
            raise RestClientError(
                f"{url}: plain http is only for a local-mode coordinator on "
                "127.0.0.1/localhost; use https:// (mutual TLS) for anything else"
            )
        return False, {}
    if tls is None:
        raise RestClientError(f"{url}: https needs the operator's certificate files")
    # Verify the server as the coordinator whatever name or IP we dialled (as gRPC does).
    return operator_context(tls), {"sni_hostname": COORDINATOR_NAME}


def rest_get(url: str, path: str, tls: NodeTLS | None, timeout: float = 5.0) -> Any:
    """GET ``path`` under ``url``: parsed JSON, or text for other content types."""
    import httpx

    verify, extensions = client_options(url, tls)
    target = base_url(url)[2] + path
    try:
        with httpx.Client(verify=verify, timeout=timeout) as client:
            resp = client.get(target, extensions=extensions)
    except httpx.TransportError as exc:
        raise RestClientError(f"{target}: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise RestClientError(f"{target}: HTTP {resp.status_code} {resp.text[:200]}")
    if resp.headers.get("content-type", "").startswith("application/json"):
        return resp.json()
    return resp.text


def get_status(addr: str, tls: NodeTLS, timeout: float) -> str:
    """The status document (JSON text) from ``GetStatus`` over mTLS gRPC; grpc.RpcError when
    the call fails."""
    from mobius_fed.proto import control_pb2, control_pb2_grpc

    channel = open_channel(addr, tls, target_name=COORDINATOR_NAME)
    try:
        stub = control_pb2_grpc.ControlStub(channel)
        return stub.GetStatus(control_pb2.StatusRequest(), timeout=timeout).json
    finally:
        channel.close()


def replace_worker(
    addr: str, tls: NodeTLS, worker: str, standby: str, force: bool, timeout: float
) -> str:
    """``Replace`` over mTLS gRPC as the operator: hand ``worker``'s rank to ``standby``;
    the coordinator's answer, or grpc.RpcError with its reason."""
    from mobius_fed.proto import control_pb2, control_pb2_grpc

    channel = open_channel(addr, tls, target_name=COORDINATOR_NAME)
    try:
        stub = control_pb2_grpc.ControlStub(channel)
        request = control_pb2.ReplaceRequest(worker=worker, standby=standby, force=force)
        return stub.Replace(request, timeout=timeout).message
    finally:
        channel.close()
