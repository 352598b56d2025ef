"""mobius-fed: Möbius Learning (cyclic depth folding) across machines."""

import os as _os

# gRPC Python has no minimum TLS version; its core reads this once, at the first
# `import grpc`, so it is set here, before any module of ours imports grpc. TLS 1.3 suites
# plus one pre-shared-key suite that never negotiates: a TLS 1.2 peer finds no shared
# cipher (the same value as mobius_fed.transport.tls.GRPC_TLS13_CIPHER_SUITES).
_os.environ["GRPC_SSL_CIPHER_SUITES"] = (
    "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256:"
    "PSK-AES128-CBC-SHA"
)

__version__ = "0.1.0"
