"""Ring-link transport: tensor codec, mutual TLS, certificates."""

from mobius_fed.transport.certs import CertLayout, identity_of, init_certs
from mobius_fed.transport.codec import (
    WIRE_DTYPES,
    FrameError,
    decode_tensor,
    encode_tensor,
    make_frame,
    validate_frame,
)
from mobius_fed.transport.tls import (
    COORDINATOR_IDENTITY,
    GRPC_OPTIONS,
    OPERATOR_IDENTITY,
    NodeTLS,
    add_port,
    channel_credentials,
    channel_options,
    open_channel,
    parse_identity,
    peer_identity,
    require_peer,
    server_credentials,
    worker_identity,
)

__all__ = [
    "COORDINATOR_IDENTITY",
    "GRPC_OPTIONS",
    "OPERATOR_IDENTITY",
    "WIRE_DTYPES",
    "CertLayout",
    "FrameError",
    "NodeTLS",
    "add_port",
    "channel_credentials",
    "channel_options",
    "decode_tensor",
    "encode_tensor",
    "identity_of",
    "init_certs",
    "make_frame",
    "open_channel",
    "parse_identity",
    "peer_identity",
    "require_peer",
    "server_credentials",
    "validate_frame",
    "worker_identity",
]
