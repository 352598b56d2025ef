"""A worker's two ring links over one long-lived bidirectional gRPC stream per ring edge.

Worker i serves ``RingLink.Stream`` for its predecessor i-1 (FORWARD frames arrive on the
request side, BACKWARD frames leave on the response side) and calls ``Stream`` on its
successor i+1 (FORWARD frames leave, BACKWARD frames arrive). Frames for other workers are
relayed in the same direction; frames for this worker are validated, decoded and put in
the inbox the step executor reads.

Bytes on the wire: both sides of the stream carry pre-serialized ``Frame`` bytes (the
Stream method is registered with no (de)serializers on either end). A tensor is encoded
once, straight from its memory into the frame bytes (:func:`codec.encode_frames`), split
into frames of at most ``chunk_bytes``; a relay validates each frame and re-sends the
very bytes it received. What is counted in ``bytes_sent`` and written to the capture file
is exactly what was handed to gRPC.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mobius_fed.proto import ring_pb2, ring_pb2_grpc
from mobius_fed.transport.codec import (
    CHUNK_BYTES,
    FrameError,
    TensorAssembler,
    encode_frames,
    parse_frame,
)
from mobius_fed.transport.tls import NodeTLS, add_port, open_channel, peer_identity, worker_identity
from mobius_fed.worker.frames import BACKWARD, FIN, FORWARD, FrameKey, FrameRules

log = logging.getLogger("mobius.link")
_CLOSE = object()
_SERVICE = ring_pb2.DESCRIPTOR.services_by_name["RingLink"].full_name
STREAM_METHOD = f"/{_SERVICE}/Stream"


class PeerError(RuntimeError):
    """A ring peer is unreachable, went away, or sent something unusable."""


class Inbox:
    """Decoded tensors addressed to this worker, keyed by :class:`FrameKey`."""

    def __init__(self) -> None:
        self._items: dict[FrameKey, torch.Tensor] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.fins: set[int] = set()
        self.last_problem: str | None = None  # named in a timeout: why a frame never came

    def put(self, key: FrameKey, tensor: torch.Tensor) -> None:
        with self._cond:
            if key in self._items:
                raise FrameError(f"frame rejected: duplicate {key.describe()}")
            self._items[key] = tensor
            self._cond.notify_all()

    def add_fin(self, origin: int) -> None:
        with self._cond:
            self.fins.add(origin)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def get(self, key: FrameKey, timeout: float, waiting_for: str) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                if self._error is not None:
                    raise PeerError(str(self._error)) from self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    hint = f"; last refused frame: {self.last_problem}" if self.last_problem else ""
                    raise PeerError(
                        f"timed out after {timeout:.0f}s waiting for {waiting_for}{hint}"
                    )
                self._cond.wait(left)
            return self._items.pop(key)

    def wait_fins(self, expected: set[int], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: expected <= self.fins or self._error is not None, timeout
            )


class _Capture:
    """Audit file of every frame's bytes this worker sends, shared by its outboxes."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("ab", buffering=0)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._file.closed:  # a late frame while the link shuts down
                return
            view = memoryview(data)
            while view:  # unbuffered writes may be partial
                view = view[self._file.write(view) :]


class _Outbox:
    """A queue of serialized frames feeding one gRPC stream direction.

    Counts the bytes handed to gRPC and writes exactly those bytes to the capture file.
    """

    def __init__(self, capture: _Capture | None = None) -> None:
        self.q: queue.Queue = queue.Queue()
        self.bytes_sent = 0
        self.frames_sent = 0
        self._capture = capture

    def put(self, data: bytes) -> None:
        self.q.put(data)

    def close(self) -> None:
        self.q.put(_CLOSE)

    def __iter__(self) -> Iterator[bytes]:
        while True:
            item = self.q.get()
            if item is _CLOSE:
                return
            self.bytes_sent += len(item)
            self.frames_sent += 1
            if self._capture is not None:
                self._capture.write(item)
            yield item


class RingLinks(ring_pb2_grpc.RingLinkServicer):
    """Server for the predecessor's stream plus client stream to the successor."""

    def __init__(
        self,
        rules: FrameRules,
        *,
        listen: str,
        successor: str,
        tls: NodeTLS | None,
        insecure: bool = False,
        peer_timeout: float = 120.0,
        capture: Path | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        link_grace: float = 60.0,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.rules, self.rank, self.P = rules, rules.rank, rules.P
        self.chunk_bytes = chunk_bytes
        self.listen, self.successor_addr = listen, successor
        self.tls, self.insecure, self.peer_timeout = tls, insecure, peer_timeout
        self.link_grace = link_grace  # reconnects within this grace: not implemented yet
        self.inbox = Inbox()
        self._capture = _Capture(capture) if capture else None
        self.forward_out = _Outbox(self._capture)
        self._backward_out: _Outbox | None = None
        self._backward_ready = threading.Condition()
        self.rejected: list[str] = []
        self._server: grpc.Server | None = None
        self._channel: grpc.Channel | None = None
        self._client_thread: threading.Thread | None = None
        self._closing = threading.Event()
        self.predecessor_identity = worker_identity((self.rank - 1) % self.P)
        self.successor_identity = worker_identity((self.rank + 1) % self.P)

    # ---------------------------------------------------------------- server
    def start_server(self) -> int:
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8),
            options=[
                ("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        # Registered by hand so that Stream moves raw bytes both ways: requests are parsed
        # here (the relay needs the received bytes) and responses are sent pre-serialized.
        handlers = {
            "Stream": grpc.stream_stream_rpc_method_handler(self.Stream),
            "Ping": grpc.unary_unary_rpc_method_handler(
                self.Ping,
                request_deserializer=ring_pb2.PingRequest.FromString,
                response_serializer=ring_pb2.PingReply.SerializeToString,
            ),
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, handlers),)
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        port = add_port(self._server, self.listen, self.tls, insecure=self.insecure)
        if port == 0:
            raise PeerError(f"worker-{self.rank}: cannot listen on {self.listen}")
        self._server.start()
        for name in ("", "mobius_fed.ring.v1.RingLink"):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("worker-%d listening on %s", self.rank, self.listen)
        return port

    def Ping(self, request: ring_pb2.PingRequest, context: grpc.ServicerContext):
        return ring_pb2.PingReply(
            identity=worker_identity(self.rank), peer=peer_identity(context) or ""
        )

    def Stream(self, request_iterator, context: grpc.ServicerContext):
        who = peer_identity(context)
        if not self.insecure and who != self.predecessor_identity:
            msg = (
                f"worker-{self.rank} accepts ring frames only from its predecessor "
                f"{self.predecessor_identity}, not {who or '<no identity>'}"
            )
            log.error("refused stream: %s", msg)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, msg)
        out = _Outbox(self._capture)
        failure: list[str] = []

        def receive() -> None:
            # The first predecessor stream that delivers a valid frame carries the ring:
            # its response side takes the BACKWARD frames. Any later stream (a duplicate
            # connection, a misbehaving client) never takes that channel over.
            bound = False
            pieces = self._assembler()
            try:
                for data in request_iterator:
                    self._accept(data, FORWARD, pieces)
                    if not bound:
                        with self._backward_ready:
                            if self._backward_out is None:
                                self._backward_out = out
                                bound = True
                                self._backward_ready.notify_all()
            except FrameError as exc:
                self.rejected.append(str(exc))
                self.inbox.last_problem = f"{exc} (from {who})"
                log.error(
                    "worker-%d: %s (from %s); stream closed, still serving", self.rank, exc, who
                )
                failure.append(str(exc))
            except grpc.RpcError:
                pass
            except Exception as exc:  # a bug must not leave the executor waiting silently
                log.exception("worker-%d: receiving from %s failed", self.rank, who)
                failure.append(f"internal error: {exc!r}")
            finally:
                if pieces.pending and not failure:
                    log.warning(
                        "worker-%d: predecessor stream ended with %d tensor(s) half received",
                        self.rank,
                        pieces.pending,
                    )
                pred = f"worker-{(self.rank - 1) % self.P}"
                if not bound:
                    out.close()
                elif failure:  # free the backward channel for the next valid stream
                    out.close()
                    with self._backward_ready:
                        if self._backward_out is out:
                            self._backward_out = None
                elif not self._closing.is_set() and not self._all_finished():
                    self.inbox.fail(PeerError(f"lost the link to predecessor {pred}"))

        threading.Thread(target=receive, daemon=True, name="ring-recv-fwd").start()
        yield from out
        if failure:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, failure[0])

    # ---------------------------------------------------------------- client
    def connect(self) -> None:
        """Open the stream to the successor, retrying with backoff until peer_timeout."""
        target = f"worker-{(self.rank + 1) % self.P}"
        deadline = time.monotonic() + self.peer_timeout
        delay = 0.1
        while True:
            self._channel = open_channel(
                self.successor_addr, self.tls, insecure=self.insecure, target_name=target
            )
            try:
                grpc.channel_ready_future(self._channel).result(timeout=min(delay * 4, 5.0))
                reply = ring_pb2_grpc.RingLinkStub(self._channel).Ping(
                    ring_pb2.PingRequest(), timeout=10
                )
                if not self.insecure and reply.identity != self.successor_identity:
                    raise PeerError(
                        f"successor at {self.successor_addr} is {reply.identity}, "
                        f"expected {self.successor_identity}"
                    )
                break
            except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
                self._channel.close()
                if time.monotonic() > deadline:
                    raise PeerError(
                        f"worker-{self.rank}: successor {target} at {self.successor_addr} "
                        f"unreachable after {self.peer_timeout:.0f}s ({exc!r})"
                    ) from exc
                log.info(
                    "worker-%d waiting for successor %s at %s",
                    self.rank,
                    target,
                    self.successor_addr,
                )
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        stream = self._channel.stream_stream(
            STREAM_METHOD, request_serializer=None, response_deserializer=None
        )  # raw frame bytes both ways
        responses = stream(iter(self.forward_out))
        self._client_thread = threading.Thread(
            target=self._receive_backward, args=(responses,), daemon=True, name="ring-recv-bwd"
        )
        self._client_thread.start()
        log.info(
            "worker-%d connected to successor %s at %s", self.rank, target, self.successor_addr
        )

    def _receive_backward(self, responses) -> None:
        pieces = self._assembler()
        try:
            for data in responses:
                self._accept(data, BACKWARD, pieces)
        except FrameError as exc:
            self.rejected.append(str(exc))
            log.error("worker-%d: %s (from successor)", self.rank, exc)
            self.inbox.fail(exc)
        except grpc.RpcError as exc:
            if not self._closing.is_set():
                self.inbox.fail(
                    PeerError(
                        f"lost the link to successor worker-{(self.rank + 1) % self.P}: "
                        f"{exc.code().name} {exc.details()}"
                    )
                )
        except Exception as exc:  # a bug must not leave the executor waiting silently
            log.exception("worker-%d: receiving from the successor failed", self.rank)
            self.inbox.fail(exc)

    # --------------------------------------------------------------- routing
    def _assembler(self) -> TensorAssembler:
        """Piece validation/reassembly state for one incoming stream."""
        return TensorAssembler(self.rules.shape, self.rules.cfg.wire_dtype)

    def _accept(self, data: bytes, direction: int, pieces: TensorAssembler) -> None:
        """Validate one received frame (its serialized bytes) and deliver or relay it."""
        frame, payload = parse_frame(data)  # the tensor bytes stay in `data`, not copied
        self.rules.check_header(frame, direction)
        if frame.direction == FIN:
            self.inbox.add_fin(frame.origin)
            if (self.rank + 1) % self.P != frame.origin:
                self.forward_out.put(data)
            return
        # Every piece is validated in full (order, total, offset, size, dtype, full shape,
        # checksum, finiteness) before it is used or relayed; a relay forwards each piece
        # as received, without reassembly.
        key = FrameKey.of(frame)
        mine = self.rules.destination(frame) == self.rank
        tensor = pieces.add(key, frame, keep=mine, what=key.describe(), data=payload)
        if not mine:
            self._outbox(frame.direction).put(data)  # relay in the same direction
        elif tensor is not None:
            self.inbox.put(key, tensor)

    def send_tensor(self, key: FrameKey, tensor: torch.Tensor) -> None:
        """Encode ``tensor`` (in the run's wire dtype) as the frame(s) ``key`` and send them."""
        out = self._outbox(key.direction)
        for data in encode_frames(
            run_id=self.rules.run_id,
            step=key.step,
            origin=key.origin,
            tick=key.tick,
            micro=key.micro,
            direction=key.direction,
            phase=key.phase,
            tensor=tensor,
            wire=self.rules.cfg.wire_dtype,
            chunk_bytes=self.chunk_bytes,
        ):
            out.put(data)  # gRPC sends piece k while piece k+1 is built

    def send(self, frame: ring_pb2.Frame) -> None:
        """Send a ready-made frame message (serialized here) in its direction."""
        self._outbox(frame.direction).put(frame.SerializeToString())

    def _outbox(self, direction: int) -> _Outbox:
        return self._backward_outbox() if direction == BACKWARD else self.forward_out

    def _backward_outbox(self) -> _Outbox:
        with self._backward_ready:
            if not self._backward_ready.wait_for(
                lambda: self._backward_out is not None, self.peer_timeout
            ):
                raise PeerError(
                    f"worker-{self.rank}: predecessor worker-{(self.rank - 1) % self.P} "
                    "never opened its ring stream"
                )
            return self._backward_out  # type: ignore[return-value]

    def edge_states(self) -> dict:
        """State of both ring edges of this worker, for status reports."""
        pred, succ = (self.rank - 1) % self.P, (self.rank + 1) % self.P
        down = self.inbox._error is not None or self._closing.is_set()
        state = "down" if down else "up"
        return {
            "in": {"peer": f"worker-{pred}", "state": state, "reconnects": 0, "down_s": 0.0},
            "out": {"peer": f"worker-{succ}", "state": state, "reconnects": 0, "down_s": 0.0},
        }

    # -------------------------------------------------------------- shutdown
    @property
    def bytes_sent(self) -> int:
        back = self._backward_out.bytes_sent if self._backward_out else 0
        return self.forward_out.bytes_sent + back

    def _all_finished(self) -> bool:
        return set(range(self.P)) - {self.rank} <= self.inbox.fins

    def finish(self, timeout: float) -> None:
        """Announce FIN, wait until every other worker finished, then close both streams."""
        self.send(ring_pb2.Frame(run_id=self.rules.run_id, origin=self.rank, direction=FIN))
        others = set(range(self.P)) - {self.rank}
        if not self.inbox.wait_fins(others, timeout):
            log.warning("worker-%d: not every peer finished within %.0fs", self.rank, timeout)
        self.close()

    def close(self) -> None:
        self._closing.set()
        self.forward_out.close()
        if self._backward_out is not None:
            self._backward_out.close()
        if self._client_thread is not None:
            self._client_thread.join(timeout=10)
        if self._channel is not None:
            self._channel.close()
        if self._server is not None:
            self._server.stop(grace=2).wait()
        if self._capture is not None:
            self._capture.close()
