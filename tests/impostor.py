"""An impostor's gRPC server: a genuinely signed certificate, any claim (tests/test_identity.py).

Run as ``python -m tests.impostor --bundle DIR --claim mobius://worker/1``. It serves every
method of every service over mTLS with the bundle's certificate, answers ``Ping`` with the
claimed identity, takes every ``Stream`` frame, refuses everything else, and prints one JSON
line per event on stdout: ``{"port": N}`` once listening, then ``{"call": METHOD}`` for each
call that reached it (only a completed TLS handshake gets that far) and ``{"frame": METHOD}``
for each message a stream delivered. With ``--relay``, it also parks ``accept`` tunnels for
``--edge`` at that relay (it holds the relay key, as every site using the relay does).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

from mobius_fed.proto import ring_pb2
from mobius_fed.transport.tls import NodeTLS, add_port, grpc_options

_print_lock = threading.Lock()


def say(**event: object) -> None:
    with _print_lock:
        print(json.dumps(event), flush=True)


class Everything(grpc.GenericRpcHandler):
    """Answers any method: the impostor wants every call it can get."""

    def __init__(self, claim: str) -> None:
        self.claim = claim

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        say(call=method)
        if method.endswith("/Ping"):
            reply = ring_pb2.PingReply(identity=self.claim).SerializeToString()
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: reply)
        if method.endswith("/Stream") or method.endswith("/Session"):

            def stream(requests: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
                for _ in requests:
                    say(frame=method)
                return iter(())

            return grpc.stream_stream_rpc_method_handler(stream)

        def refuse(req: bytes, ctx: grpc.ServicerContext) -> bytes:
            ctx.abort(grpc.StatusCode.PERMISSION_DENIED, "impostor: no")

        return grpc.unary_unary_rpc_method_handler(refuse)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True, help="ca.crt, tls.crt, tls.key")
    ap.add_argument("--claim", required=True, help="the identity Ping answers with")
    ap.add_argument("--relay", help="park accept tunnels at this relay")
    ap.add_argument("--relay-key", help="the relay's key (hex text)")
    ap.add_argument("--run", default="")
    ap.add_argument("--edge", default="")
    args = ap.parse_args()
    d = Path(args.bundle)
    server = grpc.server(futures.ThreadPoolExecutor(8), options=grpc_options())
    server.add_generic_rpc_handlers((Everything(args.claim),))
    port = add_port(server, "127.0.0.1:0", NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key"))
    server.start()
    if args.relay:
        from mobius_fed.relay.tunnels import TunnelKeeper

        TunnelKeeper(args.relay, args.relay_key.encode(), args.run, args.edge, f"127.0.0.1:{port}")
    say(port=port)
    sys.stdin.readline()  # the test closes stdin (or kills us) when done
    server.stop(grace=None)


if __name__ == "__main__":
    main()
