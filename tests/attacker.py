"""An attacker process holding one real worker key, aimed at a live worker's ring server.

Used by tests/test_trust.py (run as ``python -m tests.attacker``). It speaks the ring's
wire protocol by hand (raw ``Frame`` bytes, the session handshake in metadata) and
reports what each attack got back as one JSON line per phase on stdout:

* phase ``before`` runs while the victim's genuine predecessor is not connected yet, so
  the attacker can open a session with the predecessor's key;
* phase ``during`` runs (after a line on stdin) while the genuine ring trains.

Nothing here is clever: every attack is a plain, well-formed use of a stolen key.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

torch.set_num_threads(1)

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from mobius_fed.proto import ring_pb2  # noqa: E402
from mobius_fed.transport.codec import encode_frames  # noqa: E402
from mobius_fed.transport.tls import NodeTLS, open_channel  # noqa: E402

STREAM = "/mobius_fed.ring.v1.RingLink/Stream"
FORWARD, FIN, ACK = ring_pb2.FORWARD, ring_pb2.FIN, ring_pb2.ACK


def bundle(path: str) -> NodeTLS:
    d = Path(path)
    return NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key")


class Target:
    def __init__(self, port: int, tls: NodeTLS, run: str, name: str, shape) -> None:
        self.port, self.tls, self.run, self.name, self.shape = port, tls, run, name, shape

    def channel(self, tls: NodeTLS | None = None) -> grpc.Channel:
        return open_channel(f"127.0.0.1:{self.port}", tls or self.tls, target_name=self.name)

    def handshake(self, token: str = "", ack: int = 0):
        md = [("mobius-run", self.run), ("mobius-ack", str(ack))]
        return md + ([("mobius-session", token)] if token else [])

    def frames(self, step: int, origin: int, slot: int, value: float, chunks: int = 1):
        numel = 1
        for n in self.shape:
            numel *= n
        return list(
            encode_frames(
                run_id=self.run,
                step=step,
                origin=origin,
                tick=slot,
                micro=0,
                direction=FORWARD,
                tensor=torch.full(self.shape, value),
                chunk_bytes=-(-numel * 4 // chunks),
            )
        )

    def refused(self, frames: list[bytes], tls: NodeTLS | None = None, metadata=None) -> dict:
        """Send ``frames`` on a new stream; return how it ended and how fast."""
        t0 = time.monotonic()
        with self.channel(tls) as ch:
            call = ch.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
            try:
                for _ in call(
                    iter(frames),
                    timeout=15,
                    metadata=self.handshake() if metadata is None else metadata,
                ):
                    pass
                return {"code": "OK", "details": "", "seconds": time.monotonic() - t0}
            except grpc.RpcError as exc:
                return {
                    "code": exc.code().name,
                    "details": exc.details(),
                    "seconds": time.monotonic() - t0,
                }


class Session:
    """A session kept open by the attacker: frames go out, ACKs come back."""

    def __init__(self, target: Target, frames: list[bytes]) -> None:
        self.ch = target.channel()
        self.stop = threading.Event()
        self.acked = 0
        self.code = ""

        def requests() -> Iterator[bytes]:
            yield from frames
            self.stop.wait()  # never half-close: the session stays live

        call = self.ch.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
        self.call = call(requests(), metadata=target.handshake())
        self.token = dict(self.call.initial_metadata() or ()).get("mobius-session", "")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for data in self.call:
                f = ring_pb2.Frame.FromString(data)
                if f.direction == ACK:
                    self.acked = f.ack
        except grpc.RpcError as exc:
            self.code = exc.code().name

    def wait_acked(self, n: int, timeout: float = 15) -> bool:
        deadline = time.monotonic() + timeout
        while self.acked < n and time.monotonic() < deadline and not self.code:
            time.sleep(0.02)
        return self.acked >= n

    def kill(self) -> None:
        """Vanish without a goodbye: no half-close, the server sees the stream break."""
        self.call.cancel()
        self.ch.close()
        self.stop.set()


def health_ms(target: Target) -> float:
    t0 = time.monotonic()
    with target.channel() as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return (time.monotonic() - t0) * 1000


def before(t: Target, stranger: NodeTLS) -> dict:
    out: dict = {}
    # Rule: a frame is accepted only on its route. P=3 cyclic: worker 2 writes slot 2 of
    # stream 1 for worker 0; worker 1 writes slot 2 of stream 0 for worker 2. Neither may
    # arrive at worker 1 from worker 0 (nor be relayed by it).
    out["wrong_producer"] = [
        t.refused(t.frames(0, 1, 2, 1.0)),
        t.refused(t.frames(0, 0, 2, 1.0)),
    ]
    out["not_predecessor"] = t.refused(t.frames(0, 2, 2, 1.0), tls=stranger)
    # Rule: FIN frames are validated like any other.
    fin = ring_pb2.Frame(run_id=t.run, origin=0, direction=FIN)
    fin.tensor.CopyFrom(ring_pb2.Frame.FromString(t.frames(0, 2, 2, 1.0)[0]).tensor)
    out["fin_with_tensor"] = t.refused([fin.SerializeToString()])
    fin_step = ring_pb2.Frame(run_id=t.run, origin=0, direction=FIN, step=3, chunks=1)
    out["fin_with_fields"] = t.refused([fin_step.SerializeToString()])
    # Rule: one message is at most one piece plus headers.
    big = ring_pb2.Frame.FromString(t.frames(0, 2, 2, 1.0)[0])
    big.tensor.data = b"\0" * (3 << 20)
    out["oversized"] = t.refused([big.SerializeToString()])
    with t.channel() as ch:
        ping = ch.unary_unary(
            "/mobius_fed.ring.v1.RingLink/Ping",
            request_serializer=None,
            response_deserializer=None,
        )
        try:
            ping(b"\x0a\x80\x80\xc0\x01" + b"\0" * (3 << 20), timeout=10)
            out["oversized_ping"] = {"code": "OK"}
        except grpc.RpcError as exc:
            out["oversized_ping"] = {"code": exc.code().name, "details": exc.details()}
    # Rule: a key is accepted once per session window (a duplicate is refused).
    dup = t.frames(1, 2, 2, 2.0)
    out["duplicate"] = t.refused(dup + dup)
    # Rule: 8+ idle streams do not starve the health service. The first one takes the
    # edge's session (and stays idle); the rest are refused at once.
    idle = [Session(t, [])]
    refusals = [t.refused([]) for _ in range(9)]
    out["idle_streams"] = {
        "codes": [r["code"] for r in refusals],
        "slowest_refusal_s": max(r["seconds"] for r in refusals),
        "health_ms": [health_ms(t) for _ in range(5)],
    }
    for s in idle:
        s.kill()
    time.sleep(0.3)
    # Rule: leftovers of a dead session never block the genuine frames. Deliver a whole
    # step-0 frame the victim will need (in 8 pieces) and half of another one, see them
    # acknowledged, then vanish. Values 7.0 would wreck the loss if they were ever used.
    leftovers = t.frames(0, 2, 2, 7.0, chunks=8) + t.frames(0, 1, 3, 7.0, chunks=2)[:1]
    s = Session(t, leftovers)
    out["leftovers"] = {"acked": s.wait_acked(8), "frames": len(leftovers), "token": bool(s.token)}
    s.kill()
    return out


def during(t: Target, token_guess: str) -> dict:
    out: dict = {}
    out["second_stream"] = t.refused(t.frames(1, 2, 2, 1.0))
    out["bogus_resume"] = t.refused([], metadata=t.handshake(token=token_guess, ack=0))
    # 12 concurrent streams, each held open by the attacker: refused at once, and the
    # health service answers meanwhile.
    sessions, codes = [], []
    for _ in range(12):
        sessions.append(Session(t, []))  # refused by the server at once
    time.sleep(0.5)
    for s in sessions:
        codes.append(s.code or "OPEN")
    out["flood"] = {"codes": codes, "health_ms": [health_ms(t) for _ in range(5)]}
    for s in sessions:
        s.kill()
    return out


def replay(t: Target) -> None:
    """Deliver one frame, wait until the victim consumed it, then send it again."""
    frames = t.frames(0, 0, 1, 3.0, chunks=8)
    s = Session(t, frames)
    print(json.dumps({"acked": s.wait_acked(8)}), flush=True)
    sys.stdin.readline()  # the victim consumed it
    s.kill()
    print(json.dumps({"replay": t.refused(frames)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--bundle", required=True, help="the stolen key: the victim's predecessor")
    ap.add_argument("--stranger", required=True, help="another worker's bundle")
    ap.add_argument("--run", required=True)
    ap.add_argument("--name", default="worker-1")
    ap.add_argument("--shape", default="4,32,32")
    ap.add_argument("--replay", action="store_true", help="only the consumed-key replay")
    args = ap.parse_args()
    shape = tuple(int(n) for n in args.shape.split(","))
    t = Target(args.port, bundle(args.bundle), args.run, args.name, shape)
    if args.replay:
        replay(t)
        return
    print(json.dumps({"before": before(t, bundle(args.stranger))}), flush=True)
    if sys.stdin.readline().strip() != "during":
        return
    print(json.dumps({"during": during(t, "ab" * 16)}), flush=True)


if __name__ == "__main__":
    main()
