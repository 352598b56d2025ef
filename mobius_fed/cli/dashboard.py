"""``mobius-fed dashboard``: open a coordinator's dashboard through a local proxy.

Like ``kubectl proxy``: a plain-HTTP server on 127.0.0.1 forwards every GET to the
coordinator's REST API over mutual TLS with the operator certificate, so a browser needs
no client certificate. The coordinator comes from ``--run DIR`` (default ``./runs/up``)
or ``--url`` + ``--certs``. Torch-free.
"""

from __future__ import annotations

import argparse
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from mobius_fed.cli.common import (
    CliError,
    GracefulStop,
    Terminated,
    add_run_flag,
    console,
    run_endpoints,
)
from mobius_fed.cli.status import operator_tls
from mobius_fed.coordinator.rest_client import RestClientError, base_url, client_options, rest_get

LOCAL_NAMES = ("127.0.0.1", "localhost", "[::1]")
HOP_HEADERS = ("content-type", "cache-control", "etag", "last-modified")


class DashboardProxy:
    """Forward GET/HEAD from ``127.0.0.1:port`` to ``upstream`` (mTLS when https)."""

    def __init__(self, upstream: str, tls: Any, port: int = 0, timeout: float = 10.0) -> None:
        import httpx

        verify, self.extensions = client_options(upstream, tls)
        self.upstream = base_url(upstream)[2]
        self.client = httpx.Client(verify=verify, timeout=timeout)
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self.do_GET(body=False)

            def do_GET(self, body: bool = True) -> None:
                host = (self.headers.get("host") or "").rsplit(":", 1)[0].lower()
                if host not in LOCAL_NAMES:  # DNS rebinding: only loopback names
                    self._reply(403, b"only Host: 127.0.0.1 / localhost", "text/plain", body)
                    return
                try:
                    r = proxy.client.get(proxy.upstream + self.path, extensions=proxy.extensions)
                except Exception as exc:  # the coordinator is gone or refused us
                    msg = f"coordinator {proxy.upstream}: {type(exc).__name__}: {exc}"
                    self._reply(502, msg.encode(), "text/plain", body)
                    return
                headers = {k: v for k, v in r.headers.items() if k.lower() in HOP_HEADERS}
                self._reply(r.status_code, r.content, None, body, headers)

            def _reply(self, code, data, ctype, body, headers=None) -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if ctype:
                    self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _refuse(self) -> None:
                self._reply(405, b"read-only proxy: GET only", "text/plain", True)

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

        return Handler

    def start(self) -> DashboardProxy:
        threading.Thread(
            target=self.server.serve_forever, name="dashboard-proxy", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()

    def __enter__(self) -> DashboardProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def resolve_upstream(args: argparse.Namespace) -> tuple[str, Any]:
    """``(REST URL, operator NodeTLS | None)`` from --url/--certs, else from --run."""
    url, certs = args.url, args.certs
    ep = None
    if args.run is not None or url is None:
        ep = run_endpoints(args.run)
        if ep is None:
            raise CliError(
                "no --url and no ./runs/up/endpoints.json: pass --run DIR of a "
                "`mobius-fed up`, or --url https://HOST:PORT --certs DIR"
            )
        if ep.alive() is False:
            raise CliError(f"the `mobius-fed up` that wrote {ep.path} (pid {ep.pid}) has exited")
        url = url or ep.rest
        if not url:
            raise CliError(f"{ep.path}: the coordinator serves no REST API (rest_mode off)")
    if url.startswith("http://"):
        return url, None
    return url, operator_tls(Path(certs) if certs else (ep.certs_dir if ep else Path("certs")))


def dashboard_main(args: argparse.Namespace) -> int:
    url, tls = resolve_upstream(args)
    try:
        rest_get(url, "/healthz", tls, timeout=args.timeout)  # fail now, not in the browser
        proxy = DashboardProxy(url, tls, port=args.port)
    except RestClientError as exc:
        raise CliError(f"cannot reach the coordinator: {exc}") from None
    except OSError as exc:
        raise CliError(f"cannot listen on 127.0.0.1:{args.port}: {exc}") from None
    stop = GracefulStop("mobius-fed dashboard").install()
    with proxy:
        print(f"dashboard: {proxy.url}  (proxy to {url}; Ctrl-C to stop)", flush=True)
        if not args.no_open:
            try:
                webbrowser.open(proxy.url)
            except Exception as exc:  # no browser here: the URL is printed
                console.print(f"cannot open a browser: {exc}")
        try:
            threading.Event().wait()
        except (KeyboardInterrupt, Terminated):
            pass
        finally:
            stop.ignore()
            stop.settle()
    return 0


def register(sub) -> None:
    """Add ``dashboard`` to the ``mobius-fed`` subcommands."""
    p = sub.add_parser(
        "dashboard",
        help="open a coordinator's dashboard via a local mTLS proxy",
        description="Start a proxy on 127.0.0.1 that forwards to the coordinator's REST API "
        "with the operator certificate, print its URL and open it in a browser.",
    )
    add_run_flag(p)
    p.add_argument(
        "--url", default=None, help="coordinator REST URL, https://HOST:PORT (default: from --run)"
    )
    p.add_argument(
        "--certs",
        type=Path,
        default=None,
        metavar="DIR",
        help="operator certificate directory (ca.crt, operator.crt, operator.key; "
        "default: from --run, else certs)",
    )
    p.add_argument(
        "--port", type=int, default=0, help="local port of the proxy (default: a free one)"
    )
    p.add_argument("--no-open", action="store_true", help="print the URL, open no browser")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    p.set_defaults(func=dashboard_main)
