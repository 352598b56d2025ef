"""The successor side of a ring link: worker i dials worker i+1's ``RingLink.Stream``,
receives BACKWARD frames on it, and re-dials with backoff within ``link_grace`` when the
stream breaks, resuming the session where the successor's count says."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from mobius_fed.machines import EDGE, EdgeState
from mobius_fed.proto import ring_pb2, ring_pb2_grpc
from mobius_fed.relay.edges import EdgeTunnels
from mobius_fed.relay.plan import DIRECT, REVERSED
from mobius_fed.transport.codec import FrameError
from mobius_fed.transport.tls import channel_credentials, tls_target_name
from mobius_fed.worker.frames import BACKWARD, CLOSE, edge_name
from mobius_fed.worker.link_session import (
    HANDSHAKE_TIMEOUT_S,
    MD_ACK,
    MD_RUN,
    MD_SESSION,
    STREAM_METHOD,
    FrameRouter,
    LinkSettings,
    PeerError,
    StreamCall,
    culprit,
    edge_report,
)

log = logging.getLogger("mobius.link")


class SuccessorClient:
    """The gRPC client that dials the successor, and the out-edge's session it carries.

    Owns that session, the channel and its calls, the out-edge's state and the receiving
    thread; hands every received frame to the ``router``. ``closing`` is set by the owner
    when the links shut down.
    """

    def __init__(
        self,
        cfg: LinkSettings,
        router: FrameRouter,
        closing: threading.Event,
        address: str,
        tunnels: EdgeTunnels | None = None,
    ) -> None:
        self.cfg, self.router, self.inbox, self._closing = cfg, router, router.inbox, closing
        self.rank, self.succ = cfg.rank, (cfg.rank + 1) % cfg.P
        self.edge_out = edge_name(self.rank, self.succ)
        self.address, self.tunnels = address, tunnels  # a tunnelled edge dials its forwarder
        self.peer_identity = cfg.neighbour_identity(self.succ, "successor")  # or its standby
        self.session = router.new_session(self.peer_identity, BACKWARD)
        self.session.token = ""  # the successor's server hands the token out
        self.state = EdgeState.DOWN
        self.reconnects = 0
        self._channel: grpc.Channel | None = None
        self._call: Any = None
        self._dialing: Any = None
        self._stream: StreamCall | None = None
        self._thread: threading.Thread | None = None

    def _move(self, new: EdgeState) -> None:
        self.state = EDGE.step(self.state, new, f"edge {self.edge_out}")

    def describe(self, now: float) -> dict[str, Any]:
        """The out-edge for status reports (see ``RingLinks.edge_states``)."""
        since = self.session.down_since
        down = now - since if since is not None else 0.0
        return edge_report(self.succ, self.edge_out, self.state, self.reconnects, down)

    def close(self) -> None:
        """Tell the successor with a CLOSE frame after everything already queued, so that it
        does not wait for a resume (it ends the stream in turn: a bounded wait), then hang up.
        The owner set ``closing``."""
        end = self.session.end
        if self.state == EdgeState.UP:
            bye = ring_pb2.Frame(run_id=self.router.rules.run_id, direction=CLOSE)
            end.close(bye.SerializeToString())
            with end.cond:
                end.cond.wait_for(lambda: end.done, 2.0)
        end.close()
        for call in (self._call, self._dialing):
            if call is not None:
                call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._channel is not None:
            self._channel.close()

    def options(self) -> list[tuple[str, int | str]]:
        t = self.cfg.timers
        opts = [
            *self.cfg.grpc_options(t.client_keepalive_ms),
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", int(t.first_backoff_s * 1000) or 1),
            ("grpc.max_reconnect_backoff_ms", int(t.max_backoff_s * 1000) or 1),
        ]
        if not self.cfg.insecure:
            # only the successor's own certificate carries this name (docs/security.md)
            opts.append(("grpc.ssl_target_name_override", tls_target_name(self.peer_identity)))
        return opts

    def _open_channel(self) -> grpc.Channel:
        if self.cfg.tls is not None:
            creds = channel_credentials(self.cfg.tls)
            return grpc.secure_channel(self.address, creds, self.options())
        if not self.cfg.insecure:
            raise ValueError("no TLS material given; plaintext needs an explicit insecure=True")
        log.warning(
            "!!! INSECURE: connecting to %s WITHOUT TLS — no encryption, no authentication. "
            "Local debugging only; never on a real network. !!!",
            self.address,
        )
        return grpc.insecure_channel(self.address, self.options())

    def connect(self) -> None:
        """Open the session with the successor, retrying with backoff until peer_timeout."""
        target = f"worker-{self.cfg.base + self.succ}"  # its global name (R rings)
        deadline = time.monotonic() + self.cfg.peer_timeout
        delay = self.cfg.timers.first_backoff_s
        while True:
            self._check_not_closed(target)
            self._channel = self._open_channel()
            try:
                grpc.channel_ready_future(self._channel).result(timeout=min(delay * 4, 5.0))
                reply = ring_pb2_grpc.RingLinkStub(self._channel).Ping(
                    ring_pb2.PingRequest(), timeout=10
                )
                if not self.cfg.insecure and reply.identity != self.peer_identity:
                    raise PeerError(
                        f"successor at {self.address} is {reply.identity}, "
                        f"expected {self.peer_identity}"
                    )
                err = self._open_stream()
                if err is None:
                    break
                code, details = err
                if code not in _RETRY:
                    raise PeerError(
                        f"worker-{self.rank}: successor {target} at {self.address} "
                        f"refused the ring stream: {code.name} {details}"
                    )
                raise _Retry(f"{code.name} {details}")
            except (grpc.FutureTimeoutError, grpc.RpcError, _Retry) as exc:
                self._channel.close()
                self._check_not_closed(target)
                if time.monotonic() > deadline:
                    why = str(exc) if isinstance(exc, _Retry) else repr(exc)
                    raise PeerError(
                        f"ring edge {self.edge_out}: successor {target} {self.route()} "
                        f"unreachable after {self.cfg.peer_timeout:.0f}s ({why})"
                    ) from exc
                log.info(
                    "worker-%d waiting for successor %s at %s",
                    self.rank,
                    target,
                    self.address,
                )
                self._closing.wait(delay)
                delay = min(delay * 2, self.cfg.timers.max_backoff_s)
        self._check_not_closed(target)  # close() raced the last dial: it cancelled the call
        self._move(EdgeState.UP)
        self._thread = threading.Thread(
            target=self._receive_loop, daemon=True, name="ring-recv-bwd"
        )
        self._thread.start()
        log.info("worker-%d connected to successor %s at %s", self.rank, target, self.address)

    def route(self) -> str:
        """How the out-edge reaches the successor, for error messages."""
        t = self.tunnels
        if t is None or t.out.path == DIRECT:
            return (
                f"at {self.address} (direct: worker-{self.succ} declared it accepts "
                "connections; if it can only dial out, start it with --reachable no)"
            )
        why = f"; last tunnel error: {t.out_error()}" if t.out_error() else ""
        if t.out.path == REVERSED:
            return (
                f"through tunnels it opens to this worker's rendezvous {t.out.meet} (reversed: "
                f"can worker-{self.succ} reach that address?{why})"
            )
        return f"through relay {t.out.meet} (relayed: do both workers reach the relay?{why})"

    def _check_not_closed(self, target: str) -> None:
        """An abort closes the links while connect() may still be dialling: give up then."""
        if self._closing.is_set():
            raise PeerError(f"worker-{self.rank}: link closed while dialling successor {target}")

    def _open_stream(
        self, handshake_s: float = HANDSHAKE_TIMEOUT_S
    ) -> tuple[grpc.StatusCode, str] | None:
        """Start one Stream call of the session and resume it; None on success."""
        s, st = self.session, StreamCall(self.peer_identity)
        assert self._channel is not None
        stream = self._channel.stream_stream(
            STREAM_METHOD, request_serializer=None, response_deserializer=None
        )  # raw frame bytes both ways
        end = s.end

        def requests() -> Iterator[bytes]:
            st.go.wait()
            yield from end.frames(st, self.router.ack_frame)

        md = ((MD_RUN, self.router.rules.run_id), (MD_SESSION, s.token), (MD_ACK, str(end.rx)))
        call = stream(requests(), metadata=md)
        self._dialing = call  # close() cancels it
        watchdog = threading.Timer(handshake_s, call.cancel)
        watchdog.daemon = True
        watchdog.start()
        try:
            got = dict(call.initial_metadata() or ())
        finally:
            watchdog.cancel()
        if MD_ACK not in got or MD_SESSION not in got:
            st.dead = True
            st.go.set()
            call.cancel()
            code = call.code() or grpc.StatusCode.UNKNOWN
            return code, call.details() or "no handshake from the successor"
        if s.token and got[MD_SESSION] != s.token:
            st.dead = True
            st.go.set()
            call.cancel()
            return grpc.StatusCode.FAILED_PRECONDITION, "the successor answered another session"
        try:
            n = int(got[MD_ACK])
        except ValueError:
            n = -1
        err = end.resume(n, st) if n >= 0 else "not a number"
        if err is not None:
            st.dead = True
            st.go.set()
            call.cancel()
            return grpc.StatusCode.FAILED_PRECONDITION, f"cannot resume: {err}"
        s.token = got[MD_SESSION]
        self._call, self._stream = call, st
        return None

    def _receive_loop(self) -> None:
        """Receive BACKWARD frames; re-dial within the grace when the stream breaks."""
        s = self.session
        try:
            while True:
                call, st = self._call, self._stream
                assert st is not None  # dialled before the loop, re-dialled within it
                err = self._receive_backward(call, st)
                s.end.end_stream(st)
                if err is None or self._closing.is_set():
                    self._move(EdgeState.DOWN)
                    return
                if not self._reconnect(err):
                    return
        finally:
            with s.end.cond:
                s.end.done = True
                s.end.cond.notify_all()

    def _receive_backward(self, call, st: StreamCall) -> str | None:
        """Serve one stream; None when it ended for good, else why it broke."""
        s = self.session
        try:
            for data in call:
                with s.rx_lock:
                    self.router.accept(data, BACKWARD, s)
            if not self._closing.is_set():
                log.info("ring edge %s: worker-%d closed the stream", self.edge_out, self.succ)
            return None
        except FrameError as exc:
            msg = culprit(exc, self.peer_identity, f"{self.edge_out} (BACKWARD side)")
            self.router.refused(msg)
            call.cancel()
            self.inbox.fail(PeerError(msg))
            return None
        except grpc.RpcError as exc:
            if self._closing.is_set():
                return None
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = exc.details() if hasattr(exc, "details") else str(exc)
            why = f"{code.name} {details}"
            if code in _RETRY:
                return why
            msg = f"ring edge {self.edge_out}: worker-{self.succ} ended the link: {why}"
            self.inbox.fail(PeerError(msg))
            return None
        except Exception as exc:  # a bug must not leave the executor waiting silently
            log.exception("worker-%d: receiving on edge %s failed", self.rank, self.edge_out)
            self.inbox.fail(exc)
            return None

    def _reconnect(self, err: str) -> bool:
        """Re-dial until the session resumes (True) or the grace is spent (False).

        Also after every peer finished, while the successor has not confirmed all this
        worker sent: its FIN, or one it relays, may be what the break lost."""
        s = self.session
        s.down_since, s.last_error = time.monotonic(), err
        unconfirmed = s.end.unacknowledged()
        if self.inbox.all_finished() and not unconfirmed:
            self._move(EdgeState.DOWN)
            return False
        self._move(EdgeState.RECONNECTING)
        log.warning(
            "ring edge %s down (%s); reconnecting for up to %.0fs (%d frame(s) unacknowledged)",
            self.edge_out,
            err,
            self.cfg.link_grace,
            unconfirmed,
        )
        delay = self.cfg.timers.first_backoff_s
        while not self._closing.is_set():
            waited = time.monotonic() - s.down_since
            if waited >= self.cfg.link_grace:
                break
            if self._closing.wait(min(delay, max(self.cfg.link_grace - waited, 0.0))):
                break
            delay = min(delay * 2, self.cfg.timers.max_backoff_s)
            old = self._channel
            self._channel = self._open_channel()
            if old is not None:
                old.close()
            try:
                left = self.cfg.link_grace - (time.monotonic() - s.down_since)
                result = self._open_stream(max(1.0, min(HANDSHAKE_TIMEOUT_S, left)))
            except grpc.RpcError as exc:  # pragma: no cover - raised by some grpcio versions
                result = (exc.code(), exc.details())
            if result is None:
                self.reconnects += 1
                self._move(EdgeState.UP)
                log.warning(
                    "ring edge %s back after %.1fs (%d frame(s) resent)",
                    self.edge_out,
                    time.monotonic() - s.down_since,
                    s.end.sent_hi - s.end.acked,
                )
                s.down_since = None
                return True
            code, details = result
            s.last_error = f"{code.name} {details}"
            if code not in _RETRY:
                self._move(EdgeState.DOWN)
                self.inbox.fail(
                    PeerError(f"ring edge {self.edge_out}: reconnect refused: {s.last_error}")
                )
                return False
        self._grace_spent()
        return False

    def _grace_spent(self) -> None:
        """The re-dial gave up: fail the ring's wait unless the links close or it is over."""
        self._move(EdgeState.DOWN)
        msg = (
            f"ring edge {self.edge_out} down for {self.cfg.link_grace:.0f}s "
            f"(last error: {self.session.last_error})"
        )
        if self._closing.is_set():
            return
        if self.inbox.all_finished():  # only finish() waits: it names the successor
            log.warning("%s", msg)
            return
        log.error("%s", msg)
        self.inbox.fail(PeerError(msg))


class _Retry(Exception):
    """A transient refusal while connecting: try again."""


_RETRY = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""Codes after which the client re-dials (within the grace) rather than giving up."""
