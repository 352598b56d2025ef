"""Ring-link transport: tensor codec, mutual TLS, certificates.

Names are imported on first use, so that a health probe that needs only TLS does not load
torch (the codec does).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "CertLayout": "certs",
    "identity_of": "certs",
    "init_certs": "certs",
    "WIRE_DTYPES": "codec",
    "FrameError": "codec",
    "decode_tensor": "codec",
    "encode_tensor": "codec",
    "make_frame": "codec",
    "validate_frame": "codec",
    "COORDINATOR_IDENTITY": "tls",
    "grpc_options": "tls",
    "OPERATOR_IDENTITY": "tls",
    "NodeTLS": "tls",
    "add_port": "tls",
    "channel_credentials": "tls",
    "channel_options": "tls",
    "open_channel": "tls",
    "parse_identity": "tls",
    "peer_identity": "tls",
    "require_peer": "tls",
    "server_credentials": "tls",
    "worker_identity": "tls",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
