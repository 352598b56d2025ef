"""mobius-fed: Möbius Learning (cyclic depth folding) across machines."""

import os as _os
import sys as _sys

# gRPC Python has no minimum TLS version; its core reads this once, when it is first
# loaded, so it is set here, before any module of ours imports grpc. TLS 1.3 suites plus
# one pre-shared-key suite that never negotiates: a TLS 1.2 peer finds no shared cipher
# (mobius_fed.transport.tls.GRPC_TLS13_CIPHER_SUITES is the same value).
_TLS13_SUITES = (
    "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256:PSK-AES128-CBC-SHA"
)
_before = _os.environ.get("GRPC_SSL_CIPHER_SUITES")
_os.environ["GRPC_SSL_CIPHER_SUITES"] = _TLS13_SUITES
TLS13_HANDSHAKES = "grpc._cython.cygrpc" not in _sys.modules or _before == _TLS13_SUITES
"""Whether gRPC's handshakes in this process refuse TLS 1.2 (False when gRPC was loaded
before this package, with another cipher list)."""

__version__ = "0.1.0"
