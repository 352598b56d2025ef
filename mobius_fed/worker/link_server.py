"""The predecessor side of a ring link: worker i serves ``RingLink.Stream`` for worker
i-1, admits one live stream per session, resumes a broken one within ``link_grace`` and
drops a session (and all it delivered but nobody consumed) when it ends for good."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from mobius_fed.machines import EdgeState
from mobius_fed.proto import ring_pb2
from mobius_fed.transport.codec import FrameError
from mobius_fed.transport.tls import (
    add_port,
    parse_identity,
    peer_identity,
    peer_identity_or_reason,
)
from mobius_fed.worker.frames import FORWARD, edge_name
from mobius_fed.worker.link_session import (
    IDLE_CONNECTION_MS,
    MAX_CONCURRENT_RPCS,
    MAX_STREAMS_PER_CONNECTION,
    MD_ACK,
    MD_RUN,
    MD_SESSION,
    RING_HANDLERS,
    RING_SERVICE,
    SERVER_THREADS,
    Endpoint,
    FrameRouter,
    LinkSettings,
    PeerError,
    Session,
    StreamCall,
    culprit,
    edge_report,
)

log = logging.getLogger("mobius.link")
Refusal = tuple[grpc.StatusCode, str]


class PredecessorServer:
    """The gRPC server the predecessor dials, and the in-edge's session it carries.

    Owns that session, the count of stream handlers and reconnects; hands every received
    frame to the ``router``. ``closing`` is set by the owner when the links shut down.
    """

    def __init__(self, cfg: LinkSettings, router: FrameRouter, closing: threading.Event) -> None:
        self.cfg, self.router, self.inbox, self._closing = cfg, router, router.inbox, closing
        self.rank, self.pred = cfg.rank, (cfg.rank - 1) % cfg.P
        self.edge_in = edge_name(self.pred, self.rank)
        self.peer_identity = cfg.neighbour_identity(self.pred, "predecessor")  # or its standby
        self._lock = threading.Lock()
        self._in_ready = threading.Condition(self._lock)
        self.session: Session | None = None
        self._handlers = 0
        self.reconnects = 0
        self._old_bytes = 0  # bytes sent by ended predecessor sessions
        self._server: grpc.Server | None = None

    def options(self) -> list[tuple[str, int | str]]:
        t = self.cfg.timers
        return [
            *self.cfg.grpc_options(t.server_keepalive_ms),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
            ("grpc.http2.min_ping_interval_without_data_ms", t.min_ping_interval_ms),
            ("grpc.so_reuseport", 0),  # a second process on this port fails loudly
        ]

    def start(self, listen: str) -> int:
        """Listen on ``listen``; return the port."""
        self._server, self.health = _ring_server(self.options(), self.Stream, self.Ping)
        try:
            port = add_port(self._server, listen, self.cfg.tls, insecure=self.cfg.insecure)
        except RuntimeError as exc:  # newer grpcio raises instead of returning 0
            raise PeerError(f"worker-{self.rank}: cannot listen on {listen}: {exc}") from exc
        if port == 0:
            raise PeerError(f"worker-{self.rank}: cannot listen on {listen}")
        self._server.start()
        for name in ("", "mobius_fed.ring.v1.RingLink"):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("worker-%d listening on %s", self.rank, listen)
        return port

    # ------------------------------------------------------------------- RPCs
    def Ping(self, request: ring_pb2.PingRequest, context: grpc.ServicerContext) -> Any:
        return ring_pb2.PingReply(
            identity=self.cfg.identity(self.rank), peer=peer_identity(context) or ""
        )

    def Stream(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        """Admit the predecessor's stream into its session, then send that session's frames."""
        label, token, ack = _caller(
            context,
            self.cfg.base + self.rank,
            self.peer_identity,
            self.cfg.insecure,
            self.router.rules.run_id,
            self.cfg.P,
        )
        st = StreamCall(label)
        refusal = self._admit(st, token, ack, label)
        if refusal is not None:
            code, msg = refusal
            log.warning("refused stream from %s on edge %s: %s", label, self.edge_in, msg)
            context.abort(code, msg)
        s = st.session
        assert s is not None
        try:
            if not context.add_callback(lambda: self._stream_ended(s, st, "broken")):
                return  # the call ended already (finally: the stream ends with it)
            context.send_initial_metadata(((MD_SESSION, s.token), (MD_ACK, str(st.rx_at_start))))
            threading.Thread(
                target=self._serve_receive,
                args=(s, st, request_iterator),
                daemon=True,
                name="ring-recv-fwd",
            ).start()
            yield from s.end.frames(st, self.router.ack_frame)
            if st.failure:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, st.failure)
        finally:
            if not st.ended:  # e.g. the call was cancelled while this handler started
                self._stream_ended(s, st, "broken")
            with self._lock:
                self._handlers -= 1

    # -------------------------------------------------------------- sessions
    def _admit(self, st: StreamCall, token: str, ack: int, label: str) -> Refusal | None:
        """Bind ``st`` to a session; return (status, reason) to refuse it instead."""
        with self._lock:
            if self._closing.is_set():
                return grpc.StatusCode.UNAVAILABLE, f"worker-{self.rank} is closing its links"
            if self._handlers >= RING_HANDLERS:
                return (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"worker-{self.rank} is busy with {self._handlers} ring streams",
                )
            admit = self._resume_session if token else self._open_session
            refusal = admit(st, token, ack, label)
            if refusal is None:
                self._handlers += 1
            return refusal

    def _resume_session(self, st: StreamCall, token: str, ack: int, label: str) -> Refusal | None:
        """``st`` carries on the session ``token`` names from the peer's count ``ack``."""
        s = self.session
        if s is None or not hmac.compare_digest(token.encode(), s.token.encode()):
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker-{self.rank} has no such ring session (it restarted, or "
                "dropped the session after the grace period)",
            )
        with s.rx_lock:  # a frame in progress on the old stream finishes first
            old = s.end.stream
            err = s.end.resume(ack, st)
            st.rx_at_start = s.end.rx
        if err is not None:
            return grpc.StatusCode.INVALID_ARGUMENT, f"cannot resume: {err}"
        if old is not None:
            log.warning(
                "worker-%d: %s resumed its session on edge %s; the old stream is dropped",
                self.rank,
                label,
                self.edge_in,
            )
        if s.down_since is not None:
            back, resend = time.monotonic() - s.down_since, s.end.sent_hi - ack
            log.warning(
                "ring edge %s back after %.1fs (%d frame(s) to resend)", self.edge_in, back, resend
            )
        self.reconnects += 1
        s.down_since = None
        if s.timer is not None:
            s.timer.cancel()
        st.session = s
        return None

    def _open_session(self, st: StreamCall, token: str, ack: int, label: str) -> Refusal | None:
        """``st`` starts a new session; one it replaces is dropped (its frames with it)."""
        s = self.session
        if s is not None and s.end.stream is not None:
            return (
                grpc.StatusCode.ALREADY_EXISTS,
                f"worker-{self.rank} already has a live ring stream from {s.who} on "
                f"edge {self.edge_in}; a second one is refused (is another process "
                "using this worker's key?)",
            )
        if ack != 0:
            return grpc.StatusCode.INVALID_ARGUMENT, f"a new session starts at {MD_ACK} 0"
        if s is not None:
            self._drop_session(s, f"replaced by a new session from {label}")
            if s.carrying and not s.finished:  # the ring's frames in flight are gone
                self.inbox.fail(
                    PeerError(
                        f"ring edge {self.edge_in}: a new session from {label} replaced "
                        f"the interrupted one (did worker-{self.pred} restart?)"
                    )
                )
        s = self.session = self.router.new_session(label, FORWARD)
        s.end.resume(0, st)
        st.rx_at_start = 0
        self._in_ready.notify_all()
        st.session = s
        return None

    def _serve_receive(self, s: Session, st: StreamCall, request_iterator: Iterator[bytes]) -> None:
        how = "broken"  # a stream that ends without CLOSE may be resumed
        try:
            for data in request_iterator:
                with s.rx_lock:
                    if st.dead:
                        return
                    if self.router.accept(data, FORWARD, s):
                        how = "closed"
                        return
        except FrameError as exc:
            msg = culprit(exc, st.who, self.edge_in)
            self.router.refused(msg)
            st.failure = msg
            how = "refused"
        except grpc.RpcError:
            pass
        except Exception as exc:  # a bug must not leave the executor waiting silently
            log.exception("worker-%d: receiving on edge %s failed", self.rank, self.edge_in)
            st.failure = f"internal error on edge {self.edge_in}: {exc!r}"
            how = "refused"
        finally:
            self._stream_ended(s, st, how)

    def _stream_ended(self, s: Session, st: StreamCall, how: str) -> None:
        """A predecessor stream ended: ``closed`` (CLOSE), ``refused`` or ``broken``."""
        fail: str | None = None
        with self._lock:
            if st.ended:
                return
            st.ended = True
            current = s.end.stream is st
            s.end.end_stream(st)
            if self.session is not s or not current or self._closing.is_set():
                return
            if how == "refused":
                self._drop_session(s, "it sent a frame that was refused")
                if s.carrying:
                    fail = st.failure
            elif how == "closed" and s.fin_seen:
                s.finished = True
            elif how == "closed":
                self._drop_session(s, "closed before finishing")
                if s.carrying:
                    fail = f"ring edge {self.edge_in}: {s.who} closed the link before finishing"
            elif s.fin_seen or self.inbox.all_finished():
                s.finished = True
            else:
                s.down_since = time.monotonic()
                log.warning(
                    "ring edge %s down (stream from %s broke); waiting up to %.0fs for it to "
                    "reconnect",
                    self.edge_in,
                    s.who,
                    self.cfg.link_grace,
                )
                s.timer = threading.Timer(self.cfg.link_grace, self._grace_over, args=(s,))
                s.timer.daemon = True
                s.timer.start()
        if fail:
            self.inbox.fail(PeerError(fail))

    def _grace_over(self, s: Session) -> None:
        grace = self.cfg.link_grace
        with self._lock:
            if self.session is not s or s.down_since is None or self._closing.is_set():
                return
            self._drop_session(s, f"down for {grace:.0f}s")
            carrying = s.carrying
        msg = f"ring edge {self.edge_in} down for {grace:.0f}s ({s.who} did not reconnect)"
        log.error("%s", msg)
        if carrying:
            self.inbox.fail(PeerError(msg))

    def _drop_session(self, s: Session, why: str) -> None:
        """Forget session ``s`` and everything it delivered but nobody consumed (lock held)."""
        if self.session is s:
            self.session = None
        self._old_bytes += s.end.bytes_sent
        s.stop()
        with s.rx_lock:  # a frame being processed lands first; later ones see st.dead
            dropped = self.inbox.drop(s)
            partial = s.pieces.pending + len(s.relay_hold)
            s.relay_hold.clear()
            s.pieces = self.router.assembler(FORWARD)
        unsent = s.end.queued - s.end.acked
        if dropped or partial or unsent or not s.finished:
            log.warning(
                "worker-%d: session of %s on edge %s ended (%s): dropped %d unconsumed "
                "frame(s), %d partial tensor(s), %d unacknowledged frame(s) to it",
                self.rank,
                s.who,
                self.edge_in,
                why,
                dropped,
                partial,
                unsent,
            )

    # ------------------------------------------------------ what the owner asks
    def sending_end(self, deadline: float) -> Endpoint:
        """The end that sends BACKWARD frames, once the predecessor opened its session."""
        with self._in_ready:
            ready = False
            while not ready and self.inbox.error is None and time.monotonic() < deadline:
                ready = self._in_ready.wait_for(lambda: self.session is not None, 0.5)
            if self.inbox.error is not None:
                raise PeerError(str(self.inbox.error)) from self.inbox.error
            s = self.session
            if not ready or s is None:
                raise PeerError(
                    f"worker-{self.rank}: predecessor worker-{self.pred} never opened its "
                    f"ring stream (edge {self.edge_in})"
                )
            s.carrying = True
            return s.end

    def reconnecting(self) -> bool:
        s = self.session
        return s is not None and s.down_since is not None

    def describe(self, now: float) -> dict[str, Any]:
        """The in-edge for status reports (see ``RingLinks.edge_states``)."""
        s = self.session
        if s is not None and s.down_since is not None:
            state, down = EdgeState.RECONNECTING, now - s.down_since
        elif s is not None and s.end.stream is not None:
            state, down = EdgeState.UP, 0.0
        else:
            state, down = EdgeState.DOWN, 0.0
        return edge_report(self.pred, self.edge_in, state, self.reconnects, down)

    @property
    def bytes_sent(self) -> int:
        s = self.session
        return self._old_bytes + (s.end.bytes_sent if s else 0)

    def close(self) -> None:
        """End the session's live stream and stop serving (the owner set ``closing``)."""
        with self._lock:
            if self.session is not None:
                self.session.stop()
        if self._server is not None:
            self._server.stop(grace=1.0).wait()


def _ring_server(
    options: list[tuple[str, int | str]], stream: Any, ping: Any
) -> tuple[grpc.Server, health.HealthServicer]:
    """A gRPC server with the RingLink methods ``stream`` and ``ping`` and health checks."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=SERVER_THREADS, thread_name_prefix="ring"),
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        options=options,
    )
    # Registered by hand so that Stream moves raw bytes both ways: requests are parsed
    # here (the relay needs the received bytes) and responses are sent pre-serialized.
    handlers = {
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
        "Ping": grpc.unary_unary_rpc_method_handler(
            ping,
            request_deserializer=ring_pb2.PingRequest.FromString,
            response_serializer=ring_pb2.PingReply.SerializeToString,
        ),
    }
    checks = health.HealthServicer()
    # Health answers Check only: Watch is a long-lived stream that nothing here uses.
    check = grpc.unary_unary_rpc_method_handler(
        checks.Check,
        request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(RING_SERVICE, handlers),
            grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": check}),
        )
    )
    return server, checks


def _rings_of(who: str | None, rank: int, P: int) -> str:
    """' (its certificate is ring 0's; this is ring 1's worker-3)' when the caller's rank
    belongs to another ring than this worker's; else ''."""
    try:
        role, other = parse_identity(who or "")
    except ValueError:
        return ""
    if role != "worker" or other is None or other // P == rank // P:
        return ""
    return f" (its certificate is ring {other // P}'s; this is ring {rank // P}'s worker-{rank})"


def _caller(
    context: grpc.ServicerContext, rank: int, pred: str, insecure: bool, run_id: str, P: int
) -> tuple[str, str, int]:
    """The caller's label, session token and count; aborts a caller that is not the
    predecessor or not of this run. ``rank`` is this worker's global rank g = r·P + i; with
    ``P`` (workers per ring) the refusal names both rings: a certificate's rank decides its
    ring, so a worker of another ring is refused here whatever it claims."""
    who, why = peer_identity_or_reason(context)
    label = who or "<plaintext peer>"
    if not insecure and who != pred:
        msg = (
            f"worker-{rank} accepts ring frames only from its predecessor "
            f"{pred}, not {who or f'<no identity: {why}>'}{_rings_of(who, rank, P)}"
        )
        log.error("refused stream: %s", msg)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, msg)
    md = dict(context.invocation_metadata())
    run = md.get(MD_RUN)
    if run is None:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"no {MD_RUN} metadata: not a ring link client (from {label})",
        )
    if run != run_id:
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"worker-{rank} serves run {run_id!r}, not {run!r}",
        )
    try:
        ack = int(md.get(MD_ACK, "0"))
    except ValueError:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad {MD_ACK} metadata")
    return label, md.get(MD_SESSION, ""), ack
