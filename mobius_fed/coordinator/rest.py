"""The coordinator's REST status API (FastAPI + uvicorn): JSON, OpenAPI, metrics, health.

Routes, the three modes (``tls``, ``local``, the opt-in plain ``metrics_listen``) and what
each serves: docs/operations.md §1 and §5; every asset ships in ``static/`` (no CDN).
In TLS mode uvicorn does not expose the peer certificate, so :class:`_PeerCertH11Protocol`
hands it to :class:`_AccessMiddleware`, which takes its one ``mobius://`` identity and
answers 403 unless ``allowed(identity)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, cast

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from uvicorn.protocols.http.h11_impl import H11Protocol

from mobius_fed.coordinator.metrics import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from mobius_fed.coordinator.rest_client import is_loopback
from mobius_fed.coordinator.state import RunState, json_safe
from mobius_fed.coordinator.status_model import (
    ErrorModel,
    HealthModel,
    HistoryModel,
    ReadyModel,
    StatusModel,
)
from mobius_fed.machines import ENDED_PHASES, Phase
from mobius_fed.transport.tls import NodeTLS, identity_or_reason, revoked_serials

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
PEER_CERT_KEY = "mobius_peer_cert"
"""Key of the verified client certificate (``SSLSocket.getpeercert()`` dict) in
``scope["state"]``; absent on plain connections."""

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
READ_METHODS = frozenset({"GET", "HEAD"})
SHUTDOWN_GRACE_S = 0.5
"""How long :meth:`RestServer.stop` lets open connections finish before aborting them."""

Allowed = Callable[[str | None], bool]


# --------------------------------------------------------------------------- app
Routes = Literal["full", "metrics"]


def make_app(state: RunState, routes: Routes = "full") -> FastAPI:
    """The FastAPI application serving ``state`` (no transport security of its own).

    ``routes="metrics"``: only what the plain metrics listener serves (see the module doc).
    """
    full = routes == "full"
    app = FastAPI(
        title="mobius-fed coordinator",
        version="1",
        description="Status of a Möbius Learning run: workers, rounds, losses, metrics.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if full else None,
    )
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    _status_routes(app, state)
    if full:
        _docs_routes(app)
    return app


_DENIED: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorModel, "description": "caller's identity not enrolled"}
}


def _status_routes(app: FastAPI, state: RunState) -> None:
    """The dashboard, status, history, metrics and health routes of ``state``."""

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> FileResponse:
        return FileResponse(STATIC_DIR / "favicon.svg", media_type="image/svg+xml")

    @app.get("/v1/status", response_model=StatusModel, responses=_DENIED, tags=["status"])
    def get_status() -> Any:
        """Run id, phase, round, step and every worker's state, heartbeat, loss, speed."""
        return json_safe(state.status_doc())

    @app.get("/v1/history", response_model=HistoryModel, responses=_DENIED, tags=["status"])
    def get_history() -> Any:
        """Loss per step and per origin, evaluation results, round timings."""
        return json_safe(state.history_doc())

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {PROMETHEUS_CONTENT_TYPE: {}}}, **_DENIED},
        tags=["status"],
    )
    def get_metrics() -> Response:
        """Prometheus text exposition format 0.0.4 (``prometheus_client``)."""
        return Response(state.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/healthz", response_model=HealthModel, responses=_DENIED, tags=["health"])
    def get_health() -> Any:
        """Liveness: 200 whenever the server answers, whatever the run's phase."""
        return {"status": "ok", "phase": state.phase}

    @app.get(
        "/readyz",
        response_model=ReadyModel,
        responses={503: {"model": ReadyModel, "description": "run failed or stopped"}, **_DENIED},
        tags=["health"],
    )
    def get_ready() -> Any:
        """Readiness: 200 while the run waits, trains, recovers or is done; 503 once it
        failed or was stopped."""
        phase = state.phase
        ready = phase not in ENDED_PHASES or phase == Phase.DONE
        return JSONResponse({"ready": ready, "phase": phase}, status_code=200 if ready else 503)


VENDOR = "/static/vendor"
"""Swagger UI and ReDoc assets, served from the package (no CDN: sites are often offline)."""


def _docs_routes(app: FastAPI) -> None:
    """Swagger UI and ReDoc, from the assets in ``static/vendor``."""

    title = "mobius-fed coordinator — {}"
    favicon = "/static/favicon.svg"

    @app.get("/docs", include_in_schema=False)
    def swagger() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=title.format("Swagger UI"),
            swagger_js_url=f"{VENDOR}/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url=f"{VENDOR}/swagger-ui/swagger-ui.css",
            swagger_favicon_url=favicon,
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url="/openapi.json",
            title=title.format("ReDoc"),
            redoc_js_url=f"{VENDOR}/redoc/redoc.standalone.js",
            redoc_favicon_url=favicon,
            with_google_fonts=False,
        )


# --------------------------------------------------------------------------- identity
def identity_from_cert(cert: dict[str, Any] | None) -> str | None:
    """The one ``mobius://`` URI SAN of a ``getpeercert()`` dict, or None."""
    return identity_or_reason_from_cert(cert)[0]


def identity_or_reason_from_cert(cert: dict[str, Any] | None) -> tuple[str | None, str]:
    """``(identity, "")`` or ``(None, why)``: exactly one ``mobius://`` URI is required."""
    if not cert:
        return None, "no verified client certificate"
    uris = [str(v) for kind, v in cert.get("subjectAltName", ()) if kind == "URI"]
    return identity_or_reason(uris)


class _PeerCertH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that hands each request the connection's client certificate.

    uvicorn builds every request's scope with ``"state": self.app_state.copy()``; giving
    each connection its own ``app_state`` carrying the verified peer certificate binds the
    certificate to exactly that connection (no lookup by address, nothing to spoof).
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio.Protocol takes any BaseTransport; uvicorn's class narrows it to a Transport
        super().connection_made(cast(asyncio.Transport, transport))
        ssl_object = transport.get_extra_info("ssl_object")
        cert = ssl_object.getpeercert() if ssl_object is not None else None
        self.app_state = {**self.app_state, PEER_CERT_KEY: cert}


def _json(status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None):
    body = json.dumps({"detail": detail}).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return status, hdrs + (headers or []), body


class _AccessMiddleware:
    """Read-only guard, plus identity authorization (TLS) or a Host check (local)."""

    def __init__(
        self, app: Any, *, allowed: Allowed | None, local: bool, public: bool = False
    ) -> None:
        self.app, self.allowed, self.local, self.public = app, allowed, local, public

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        denial = self._check(scope) if scope["type"] == "http" else None
        if denial is None:
            await self.app(scope, receive, send)
            return
        status, headers, body = denial
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _check(self, scope: dict) -> tuple[int, list, bytes] | None:
        if scope["method"] not in READ_METHODS:
            return _json(405, "read-only API: only GET is allowed", [(b"allow", b"GET, HEAD")])
        if self.public:  # the metrics listener: read-only figures, for scrapers and probes
            return None
        if self.local:
            host = _host_header(scope)
            if host not in LOCAL_HOSTS:  # DNS-rebinding guard: only loopback names
                return _json(403, f"local mode answers only Host: localhost, not {host!r}")
            return None
        state = scope.get("state") or {}
        if PEER_CERT_KEY not in state:  # wrong protocol class or a plain connection
            return _json(403, "no verified client certificate on this connection")
        who, why = identity_or_reason_from_cert(state[PEER_CERT_KEY])
        if who is None:
            return _json(403, f"client refused: {why}")
        serial = int((state[PEER_CERT_KEY] or {}).get("serialNumber", "-1"), 16)
        if serial in revoked_serials():  # docs/security.md "Revocation"
            return _json(403, f"client refused: {who}'s certificate (serial {serial}) is revoked")
        if self.allowed is not None and not self.allowed(who):
            return _json(403, f"identity {who} is not enrolled in this run")
        return None


def _host_header(scope: dict) -> str:
    for k, v in scope.get("headers", ()):
        if k == b"host":
            host = v.decode("latin-1").strip().lower()
            if host.startswith("["):  # [::1]:port
                return host[1 : host.find("]")] if "]" in host else host
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return ""


# --------------------------------------------------------------------------- server
class _TLS13Config(uvicorn.Config):
    """uvicorn's Config whose server SSL context accepts TLS 1.3 only."""

    def load(self) -> None:
        super().load()
        if self.ssl is not None:
            self.ssl.minimum_version = ssl.TLSVersion.TLSv1_3
            self.ssl.maximum_version = ssl.TLSVersion.MAXIMUM_SUPPORTED


class _ThreadServer(uvicorn.Server):
    """uvicorn server that never touches signal handlers (it runs in a worker thread)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Ask every connection to close, give in-flight replies a moment, then abort the
        # rest: an idle TLS keep-alive client never answers close_notify and would hold
        # the shutdown for the whole graceful timeout.
        for server in getattr(self, "servers", []):
            server.close()
        for conn in list(self.server_state.connections):
            conn.shutdown()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while self.server_state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()
        await super().shutdown(sockets)


class RestServer:
    """Serve :func:`make_app` of ``state`` with uvicorn in a daemon thread, in one of the
    module doc's modes: TLS (``tls`` given; ``allowed(identity)`` decides who may read, None:
    any ``mobius://`` identity our CA signed), ``local=True`` or ``metrics=True``.
    ``port=0`` picks a free port; read it from :attr:`port` after :meth:`start`.
    """

    def __init__(
        self,
        state: RunState,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        tls: NodeTLS | None,
        allowed: Allowed | None,
        local: bool = False,
        metrics: bool = False,
    ) -> None:
        if metrics and (tls is not None or local):
            raise ValueError("the metrics listener is plain HTTP: pass tls=None, local=False")
        if local and tls is not None:
            raise ValueError("local mode is plain HTTP; pass tls=None with local=True")
        if not local and not metrics and tls is None:
            raise ValueError("REST status needs TLS material, or an explicit local=True")
        if local and not is_loopback(host):
            raise ValueError(
                f"local (unauthenticated) REST mode binds only to 127.0.0.1/localhost/::1, "
                f"not {host!r}"
            )
        self.state, self.host, self.port = state, host, port
        self.tls, self.allowed, self.local, self.metrics = tls, allowed, local, metrics
        self._server: _ThreadServer | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> RestServer:
        """Bind, start serving, and return once the server accepts connections."""
        if self._thread is not None:
            raise RuntimeError("RestServer already started")
        if self.tls is not None:
            self.tls.load()  # FileNotFoundError naming the missing file, in the caller
        config = self._config()
        # bind here: errors raise in the caller, port 0 resolved
        host = "127.0.0.1" if self.host == "localhost" else self.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = self._sock = socket.create_server((host, self.port), family=family, backlog=128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        server = self._server = _ThreadServer(config)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                server.run(sockets=[sock])
            except BaseException as exc:  # SystemExit from uvicorn included
                errors.append(exc)
                log.exception("REST status server stopped with an error")

        self._thread = threading.Thread(target=run, name=f"rest-status:{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if errors or not self._thread.is_alive():
                self._close_sock()
                raise RuntimeError(f"REST status server failed to start: {errors[:1]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"REST status server not up after {timeout} s")
            time.sleep(0.01)
        self._log_mode()
        return self

    def _config(self) -> uvicorn.Config:
        """uvicorn's settings: the app behind the access check, TLS 1.3 when not plain."""
        app = _AccessMiddleware(
            make_app(self.state, "metrics" if self.metrics else "full"),
            allowed=self.allowed,
            local=self.local,
            public=self.metrics,
        )
        kwargs: dict[str, Any] = {}
        if self.tls is not None:
            kwargs = dict(
                ssl_certfile=str(self.tls.cert),
                ssl_keyfile=str(self.tls.key),
                ssl_ca_certs=str(self.tls.ca),
                ssl_cert_reqs=ssl.CERT_REQUIRED,
            )
        return _TLS13Config(
            app,
            http=_PeerCertH11Protocol,
            ws="none",
            lifespan="off",
            proxy_headers=False,  # never take the client address from X-Forwarded-For
            server_header=False,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=2,
            **kwargs,
        )

    def _log_mode(self) -> None:
        if self.metrics:
            log.warning(
                "metrics listener on %s: plain HTTP, no authentication, read-only "
                "(/metrics /healthz /readyz and the dashboard)",
                self.url,
            )
        elif self.local:
            log.warning(
                "!!! REST status in LOCAL mode: plain HTTP, NO authentication, read-only, "
                "bound to %s only. Local debugging only. !!!",
                self.url,
            )
        else:
            log.info("REST status (mutual TLS) on %s", self.url)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving; returns once the thread has ended (or after ``timeout``)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(timeout)
        self._close_sock()
        self._thread = None

    def _close_sock(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def __enter__(self) -> RestServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
