"""REST status API over real mutual TLS, local mode, Prometheus text, and the status CLI."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mobius_fed.cli.common import CliError
from mobius_fed.cli.status import register, status_main
from mobius_fed.coordinator.rest import RestServer, identity_from_cert
from mobius_fed.coordinator.state import RunState
from mobius_fed.transport import CertLayout, NodeTLS, init_certs
from mobius_fed.transport.tls import revoked_serials, set_revoked
from tests.cert_util import sign_leaf

P = 2
ENROLLED = {"mobius://operator", "mobius://coordinator"} | {
    f"mobius://worker/{i}" for i in range(P)
}


def enrolled(identity: str | None) -> bool:
    return identity in ENROLLED


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertLayout:
    return init_certs(tmp_path_factory.mktemp("pki") / "certs", 3)  # worker-2 not enrolled


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> CertLayout:
    return init_certs(tmp_path_factory.mktemp("pki2") / "certs", 1)


@pytest.fixture(scope="module")
def stranger(certs: CertLayout, tmp_path_factory: pytest.TempPathFactory) -> NodeTLS:
    """A leaf signed by OUR CA whose identity is mobius://stranger."""
    ca_key = serialization.load_pem_private_key(certs.ca_key.read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stranger")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier("mobius://stranger")]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    d = tmp_path_factory.mktemp("stranger")
    (d / "s.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "s.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return NodeTLS(ca=certs.ca_cert, cert=d / "s.crt", key=d / "s.key")


def make_state() -> RunState:
    st = RunState(run_id='run-"7"', P=P, steps=20, strategy="fedavg", num_rounds=4)
    st.set(phase="training", round=2)
    for rank in range(P):  # a worker registers before it trains
        st.update_worker(rank, state="registered")
    st.update_worker(0, address="10.0.0.1:7400", state="training", last_heartbeat=time.time())
    st.update_worker(1, address="10.0.0.2:7400", state="training", last_heartbeat=time.time())
    st.update_worker(0, last_loss=3.25, tokens_per_s=1234.5, step=6)
    st.update_worker(1, last_loss=float("nan"), tokens_per_s=1000.0, step=6)
    st.record_losses(0, 0, [4.0, 3.5, 3.25])
    st.record_losses(1, 0, [4.1, 3.6])
    st.record_eval(1, 2, {0: 3.0, 1: 3.5})
    st.record_round(1, 1.5, 1.2)
    return st


@pytest.fixture(scope="module")
def state() -> RunState:
    return make_state()


@pytest.fixture(scope="module")
def tls_server(certs: CertLayout, state: RunState) -> Iterator[RestServer]:
    srv = RestServer(state, "127.0.0.1", 0, tls=certs.bundle("coordinator"), allowed=enrolled)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def local_server(state: RunState) -> Iterator[RestServer]:
    srv = RestServer(state, "127.0.0.1", 0, tls=None, allowed=None, local=True)
    srv.start()
    yield srv
    srv.stop()


def client_ctx(node: NodeTLS | None, ca: Path, tls12: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if node is not None:
        ctx.load_cert_chain(str(node.cert), str(node.key))
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def get(srv: RestServer, path: str, ctx: ssl.SSLContext) -> httpx.Response:
    with httpx.Client(verify=ctx, timeout=5) as c:
        return c.get(srv.url + path)


# --------------------------------------------------------------------------- TLS mode
def test_operator_reads_everything(tls_server: RestServer, certs: CertLayout) -> None:
    ctx = client_ctx(certs.bundle("operator"), certs.ca_cert)
    with httpx.Client(verify=ctx, timeout=5) as c:
        r = c.get(tls_server.url + "/v1/status")
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["run_id"] == 'run-"7"' and doc["phase"] == "training"
        assert (doc["round"], doc["num_rounds"], doc["step"], doc["steps"]) == (2, 4, 3, 20)
        assert doc["eval_loss"] == pytest.approx(3.25)
        w0, w1 = doc["workers"]
        assert w0["rank"] == 0 and w0["address"] == "10.0.0.1:7400"
        assert w0["state"] == "training" and w0["last_loss"] == 3.25
        assert w0["tokens_per_s"] == 1234.5 and 0 <= w0["heartbeat_age_s"] < 60
        assert w1["last_loss"] is None  # NaN → null: strict JSON

        r = c.get(tls_server.url + "/v1/history")
        assert r.status_code == 200
        hist = r.json()
        assert [s["step"] for s in hist["steps"]] == [0, 1, 2]
        assert hist["steps"][0]["origin_losses"] == [4.0, 4.1]
        assert hist["steps"][0]["loss"] == pytest.approx(4.05)
        assert hist["steps"][2] == {"step": 2, "loss": None, "origin_losses": [3.25, None]}
        assert hist["evals"][0]["origin_losses"] == [3.0, 3.5]
        assert hist["rounds"][0]["overhead_s"] == pytest.approx(0.3)

        r = c.get(tls_server.url + "/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert 'mobius_step{run_id="run-\\"7\\""} 3.0' in r.text

        r = c.get(tls_server.url + "/healthz")
        assert r.status_code == 200 and r.json() == {"status": "ok", "phase": "training"}

        r = c.get(tls_server.url + "/openapi.json")
        assert r.status_code == 200
        spec = r.json()
        assert "/v1/status" in spec["paths"] and "/v1/history" in spec["paths"]
        schemas = spec["components"]["schemas"]
        assert {"StatusModel", "WorkerModel", "HistoryModel"} <= set(schemas)
        assert "heartbeat_age_s" in schemas["WorkerModel"]["properties"]
        assert c.get(tls_server.url + "/docs").status_code == 200


def test_a_revoked_operator_is_refused(tls_server: RestServer, certs: CertLayout) -> None:
    """Every incoming REST call checks the revocation list (docs/security.md "Revocation")."""
    op = certs.bundle("operator")
    serial = x509.load_pem_x509_certificate(op.cert.read_bytes()).serial_number
    ctx = client_ctx(op, certs.ca_cert)
    before = revoked_serials()
    assert get(tls_server, "/v1/status", ctx).status_code == 200
    set_revoked({*before, serial})
    try:
        r = get(tls_server, "/v1/status", ctx)
        assert r.status_code == 403 and "revoked" in r.json()["detail"], r.text
        assert str(serial) in r.json()["detail"]
    finally:
        set_revoked(before)
    assert get(tls_server, "/v1/status", ctx).status_code == 200


def test_worker_and_coordinator_identities_allowed(
    tls_server: RestServer, certs: CertLayout
) -> None:
    for name in ("worker-0", "worker-1", "coordinator"):
        ctx = client_ctx(certs.bundle(name), certs.ca_cert)
        assert get(tls_server, "/v1/status", ctx).is_success


def test_unenrolled_identity_forbidden(
    tls_server: RestServer, certs: CertLayout, stranger: NodeTLS
) -> None:
    for node, who in (
        (stranger, "mobius://stranger"),
        (certs.bundle("worker-2"), "mobius://worker/2"),
    ):
        for path in ("/v1/status", "/v1/history", "/metrics", "/healthz", "/openapi.json"):
            r = get(tls_server, path, client_ctx(node, certs.ca_cert))
            assert r.status_code == 403, (path, r.text)
            assert who in r.json()["detail"]
            assert "run_id" not in r.text


@pytest.mark.parametrize("tls12", [False, True])
def test_other_ca_and_no_cert_rejected(
    tls_server: RestServer, certs: CertLayout, other_ca: CertLayout, tls12: bool
) -> None:
    # Trust our CA for the server, but present a foreign or no client certificate.
    for node in (other_ca.bundle("operator"), None):
        ctx = client_ctx(node, certs.ca_cert, tls12=tls12)
        # TLS 1.3: the client finishes first, so the rejection shows as a dropped
        # connection; TLS 1.2: as a failed handshake (ConnectError with an SSL alert).
        expected = httpx.ConnectError if tls12 else httpx.TransportError
        with pytest.raises(expected):
            get(tls_server, "/v1/status", ctx)


def test_client_must_trust_our_ca(tls_server: RestServer, certs: CertLayout, other_ca) -> None:
    with pytest.raises(httpx.ConnectError):
        get(tls_server, "/v1/status", client_ctx(certs.bundle("operator"), other_ca.ca_cert))


def test_forwarded_headers_do_not_matter(tls_server: RestServer, certs: CertLayout) -> None:
    ctx = client_ctx(certs.bundle("worker-2"), certs.ca_cert)
    with httpx.Client(verify=ctx, timeout=5) as c:
        r = c.get(tls_server.url + "/v1/status", headers={"X-Forwarded-For": "127.0.0.1"})
    assert r.status_code == 403


def test_live_update(certs: CertLayout) -> None:
    st = make_state()
    with RestServer(st, "127.0.0.1", 0, tls=certs.bundle("coordinator"), allowed=enrolled) as srv:
        ctx = client_ctx(certs.bundle("operator"), certs.ca_cert)
        with httpx.Client(verify=ctx, timeout=5) as c:
            assert c.get(srv.url + "/v1/status").json()["step"] == 3
            st.record_losses(0, 3, [3.0, 2.9])
            st.update_worker(1, state="lost")
            st.finish("failed", "worker 1 lost")
            doc = c.get(srv.url + "/v1/status").json()
            assert doc["step"] == 5 and doc["phase"] == "failed"
            assert doc["error"] == "worker 1 lost" and doc["workers"][1]["state"] == "lost"
            health = c.get(srv.url + "/healthz")
            assert health.status_code == 200 and health.json()["phase"] == "failed"
    assert not srv._thread  # stopped


def test_stop_is_prompt_and_frees_port(certs: CertLayout) -> None:
    srv = RestServer(make_state(), "127.0.0.1", 0, tls=certs.bundle("coordinator"), allowed=None)
    srv.start()
    port = srv.port
    assert port > 0
    # An idle keep-alive connection must not hold the shutdown up.
    c = httpx.Client(verify=client_ctx(certs.bundle("operator"), certs.ca_cert), timeout=5)
    assert c.get(srv.url + "/healthz").status_code == 200
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 1.5
    c.close()
    with socket.create_server(("127.0.0.1", port)):  # port free again
        pass


def test_constructor_checks(certs: CertLayout, state: RunState) -> None:
    RestServer(state, "127.0.0.1", 0, tls=None, allowed=None, local=True).stop()  # never started
    with pytest.raises(ValueError, match=r"127\.0\.0\.1"):
        RestServer(state, "0.0.0.0", 0, tls=None, allowed=None, local=True)
    with pytest.raises(ValueError, match=r"127\.0\.0\.1"):
        RestServer(state, "10.1.2.3", 0, tls=None, allowed=None, local=True)
    with pytest.raises(ValueError, match="local=True"):
        RestServer(state, "127.0.0.1", 0, tls=None, allowed=None)
    with pytest.raises(ValueError, match="plain HTTP"):
        RestServer(state, "127.0.0.1", 0, tls=certs.bundle("coordinator"), allowed=None, local=True)
    bad = NodeTLS(ca=certs.ca_cert, cert=certs.root / "nope.crt", key=certs.root / "nope.key")
    with pytest.raises(FileNotFoundError, match=r"nope\.crt"):
        RestServer(state, "127.0.0.1", 0, tls=bad, allowed=None).start()


def test_identity_from_cert() -> None:
    cert = {"subjectAltName": (("DNS", "localhost"), ("URI", "mobius://worker/3"))}
    assert identity_from_cert(cert) == "mobius://worker/3"
    assert identity_from_cert({"subjectAltName": (("URI", "spiffe://x"),)}) is None
    assert identity_from_cert(None) is None and identity_from_cert({}) is None
    two = {"subjectAltName": (("URI", "mobius://worker/3"), ("URI", "mobius://operator"))}
    assert identity_from_cert(two) is None


def test_tls12_client_is_refused(tls_server: RestServer, certs: CertLayout) -> None:
    """TLS 1.3 only: a TLS 1.2 client with a valid operator certificate fails the handshake."""
    with pytest.raises(httpx.ConnectError):
        get(tls_server, "/v1/status", client_ctx(certs.bundle("operator"), certs.ca_cert, True))
    ctx = client_ctx(certs.bundle("operator"), certs.ca_cert, tls12=True)
    with (
        socket.create_connection((tls_server.host, tls_server.port), timeout=5) as raw,
        pytest.raises((ssl.SSLError, ConnectionResetError)),
    ):
        ctx.wrap_socket(raw, server_hostname="coordinator")
    ctx = client_ctx(certs.bundle("operator"), certs.ca_cert)
    with (
        socket.create_connection((tls_server.host, tls_server.port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="coordinator") as tls,
    ):
        assert tls.version() == "TLSv1.3"
    assert get(tls_server, "/v1/status", ctx).status_code == 200


def test_certificate_with_two_identities_is_refused(
    tls_server: RestServer, certs: CertLayout, tmp_path: Path
) -> None:
    forged = sign_leaf(certs.root, tmp_path, ["mobius://operator", "mobius://worker/0"], "op")
    r = get(tls_server, "/v1/status", client_ctx(forged, certs.ca_cert))
    assert r.status_code == 403
    assert "certificate carries 2 mobius:// URIs" in r.json()["detail"]


# --------------------------------------------------------------------------- local mode
def test_local_mode(local_server: RestServer, caplog: pytest.LogCaptureFixture) -> None:
    assert local_server.url.startswith("http://127.0.0.1:")
    with httpx.Client(timeout=5) as c:
        r = c.get(local_server.url + "/v1/status")
        assert r.status_code == 200 and r.json()["run_id"] == 'run-"7"'
        assert c.get(local_server.url + "/metrics").status_code == 200
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            r = c.request(method, local_server.url + "/v1/status")
            assert r.status_code == 405, method
        assert c.post(local_server.url + "/nowhere").status_code == 405
        # DNS-rebinding guard: a foreign Host header is refused.
        r = c.get(local_server.url + "/v1/status", headers={"Host": "evil.example:80"})
        assert r.status_code == 403


def test_local_mode_warns(state: RunState, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="mobius_fed.coordinator.rest")
    with RestServer(state, "localhost", 0, tls=None, allowed=None, local=True) as srv:
        assert httpx.get(srv.url + "/healthz", timeout=5).status_code == 200
    assert any(
        r.levelname == "WARNING" and "NO authentication" in r.getMessage() for r in caplog.records
    )


# --------------------------------------------------------------------------- Prometheus
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(
    rf"^(?P<name>{_NAME})(?:\{{(?P<labels>{_LABEL}(?:,{_LABEL})*)?\}})? "
    r"(?P<value>[-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|NaN|Inf))$"
)


def strict_parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A strict Prometheus 0.0.4 text parser: HELP, TYPE, then contiguous samples."""
    assert text.endswith("\n")
    families: dict[str, list[tuple[dict[str, str], float]]] = {}
    current: str | None = None
    state = "help"  # expect: help → type → samples
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert re.fullmatch(_NAME, name), line
            assert name not in families, f"family {name} appears twice"
            families[name], current, state = [], name, "type"
            assert re.fullmatch(r"(?:[^\\\n]|\\[\\n])*", line.split(" ", 3)[3]), line
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert state == "type" and name == current, f"TYPE out of place: {line}"
            assert kind in ("gauge", "counter", "untyped", "summary", "histogram"), line
            state = "samples"
            suffixes = {"histogram": ("_bucket", "_sum", "_count", "_created")}.get(kind, ())
            if kind == "counter":
                suffixes = ("_created",)
        else:
            m = _SAMPLE.match(line)
            assert m, f"bad sample line: {line!r}"
            names = {current, *(f"{current}{x}" for x in suffixes)}
            if current and current.endswith("_total"):  # a counter's _created sample
                names.add(current.removesuffix("_total") + "_created")
            assert state == "samples" and m["name"] in names, f"sample out of family: {line}"
            labels = {}
            for lm in re.finditer(
                r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m["labels"] or ""
            ):
                raw = lm.group(2)
                labels[lm.group(1)] = re.sub(
                    r"\\(.)", lambda e: {"n": "\n"}.get(e.group(1), e.group(1)), raw
                )
            families[current].append((labels, float(m["value"])))
    return families


def test_prometheus_is_strictly_valid() -> None:
    st = make_state()
    st.set(run_id='we\\ird "id"\nx')
    st.update_worker(0, last_loss=float("inf"))
    fams = strict_parse(st.prometheus())
    assert fams["mobius_step"] == [({"run_id": 'we\\ird "id"\nx'}, 3.0)]
    assert len(fams["mobius_worker_up"]) == P
    assert {lbl["rank"] for lbl, _ in fams["mobius_worker_tokens_per_second"]} == {"0", "1"}
    phases = {lbl["phase"]: v for lbl, v in fams["mobius_phase"]}
    assert phases["training"] == 1 and sum(phases.values()) == 1
    losses = dict((lbl["rank"], v) for lbl, v in fams["mobius_worker_loss"])
    assert losses["0"] == math.inf and math.isnan(losses["1"])
    assert fams["mobius_eval_loss"][0][1] == pytest.approx(3.25)
    # The fresh state (no evals, no heartbeats) is valid too.
    strict_parse(RunState(run_id="r", P=3, steps=1, strategy="fedavg").prometheus())


def test_prometheus_client_parser_agrees() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    st = make_state()
    st.set(run_id='a"b\\c\nd')
    fams = {f.name: f for f in parser.text_string_to_metric_families(st.prometheus())}
    assert fams["mobius_step"].samples[0].labels["run_id"] == 'a"b\\c\nd'
    assert len(fams["mobius_worker_up"].samples) == P


# --------------------------------------------------------------------------- status CLI
def ns(**kw) -> argparse.Namespace:
    base = dict(coordinator="127.0.0.1:1", certs=Path("nowhere"), rest=None, json=False, timeout=2)
    return argparse.Namespace(**{**base, **kw})


def test_status_parser_registers() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["status", "--rest", "http://127.0.0.1:9", "--json"])
    assert args.func is status_main and args.json and args.rest == "http://127.0.0.1:9"
    # Unset: status_main takes them from --run's endpoints.json, else 127.0.0.1:7300, certs/.
    assert args.coordinator is None and args.certs is None and args.run is None


def test_status_cli_rest_local(
    local_server: RestServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert status_main(ns(rest=local_server.url)) == 0
    out = capsys.readouterr().out
    for text in ('run-"7"', "training", "2/4", "3/20", "3.2500", "10.0.0.1:7400", "1,234"):
        assert text in out, text
    assert status_main(ns(rest=local_server.url, json=True)) == 0
    assert json.loads(capsys.readouterr().out)["run_id"] == 'run-"7"'


def test_status_cli_rest_tls(
    tls_server: RestServer, certs: CertLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    # Dial "localhost" yet verify the server as "coordinator", like the gRPC path.
    url = f"https://localhost:{tls_server.port}"
    assert status_main(ns(rest=url, certs=certs.root, json=True)) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 20


def test_status_cli_rest_verifies_coordinator_name(
    certs: CertLayout, state: RunState, capsys: pytest.CaptureFixture[str]
) -> None:
    # 127.0.0.2 is in no certificate: only the "coordinator" name override makes it pass.
    try:
        srv = RestServer(state, "127.0.0.2", 0, tls=certs.bundle("coordinator"), allowed=enrolled)
        srv.start()
    except OSError:
        pytest.skip("127.0.0.2 not bindable here")
    try:
        with pytest.raises(httpx.ConnectError, match="not valid for"):
            get(srv, "/healthz", client_ctx(certs.bundle("operator"), certs.ca_cert))
        assert status_main(ns(rest=srv.url, certs=certs.root, json=True)) == 0
        assert json.loads(capsys.readouterr().out)["run_id"] == 'run-"7"'
    finally:
        srv.stop()


def test_status_cli_rest_refused(tls_server: RestServer, stranger: NodeTLS, tmp_path) -> None:
    d = tmp_path / "c"
    d.mkdir()
    (d / "ca.crt").write_bytes(stranger.ca.read_bytes())
    (d / "operator.crt").write_bytes(stranger.cert.read_bytes())
    (d / "operator.key").write_bytes(stranger.key.read_bytes())
    with pytest.raises(CliError, match=r"refused.*403.*mobius://stranger"):
        status_main(ns(rest=tls_server.url, certs=d))


def test_status_cli_errors(certs: CertLayout, tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        dead = s.getsockname()[1]  # closed right after: nothing listens there
    with pytest.raises(CliError, match="cannot reach"):
        status_main(ns(rest=f"http://127.0.0.1:{dead}"))
    with pytest.raises(CliError, match="cannot reach"):
        status_main(ns(rest=f"https://127.0.0.1:{dead}", certs=certs.root))
    with pytest.raises(CliError, match="only for a local-mode"):
        status_main(ns(rest="http://10.0.0.5:8080"))
    with pytest.raises(CliError, match="operator certificate files not found"):
        status_main(ns(rest="https://127.0.0.1:1", certs=tmp_path))
    with pytest.raises(CliError, match="operator certificate files not found"):
        status_main(ns(coordinator=f"127.0.0.1:{dead}", certs=tmp_path))
    with pytest.raises(CliError, match=f"cannot reach coordinator at 127.0.0.1:{dead}"):
        status_main(ns(coordinator=f"127.0.0.1:{dead}", certs=certs.root, timeout=2))


def test_status_cli_grpc(
    certs: CertLayout, state: RunState, capsys: pytest.CaptureFixture[str]
) -> None:
    from concurrent import futures

    import grpc

    from mobius_fed.proto import control_pb2, control_pb2_grpc
    from mobius_fed.transport import add_port, require_peer

    class Control(control_pb2_grpc.ControlServicer):
        def GetStatus(self, request, context):
            require_peer(context, ["mobius://operator"])
            return control_pb2.StatusReply(json=json.dumps(state.status_doc()))

    server = grpc.server(futures.ThreadPoolExecutor(2))
    control_pb2_grpc.add_ControlServicer_to_server(Control(), server)
    port = add_port(server, "127.0.0.1:0", certs.bundle("coordinator"))
    server.start()
    try:
        assert status_main(ns(coordinator=f"127.0.0.1:{port}", certs=certs.root)) == 0
        out = capsys.readouterr().out
        assert 'run-"7"' in out and "10.0.0.2:7400" in out and "nan" in out
        d = certs.root.parent / "as-worker"
        d.mkdir(exist_ok=True)
        for src, dst in (("ca.crt", "ca.crt"), ("worker-0.crt", "operator.crt")):
            (d / dst).write_bytes((certs.root / src).read_bytes())
        (d / "operator.key").write_bytes((certs.root / "worker-0.key").read_bytes())
        with pytest.raises(CliError, match="refused"):
            status_main(ns(coordinator=f"127.0.0.1:{port}", certs=d))
    finally:
        server.stop(0)


# --------------------------------------------------------------------------- dashboard, listener
def test_dashboard_and_docs_are_served_from_the_package(
    tls_server: RestServer, certs: CertLayout
) -> None:
    ctx = client_ctx(certs.bundle("operator"), certs.ca_cert)
    page = get(tls_server, "/", ctx)
    assert page.status_code == 200 and "/static/dashboard.js" in page.text
    for path in ("/static/dashboard.js", "/static/dashboard.css", "/favicon.ico"):
        assert get(tls_server, path, ctx).status_code == 200, path
    for path, asset in (
        ("/docs", "/static/vendor/swagger-ui/swagger-ui-bundle.js"),
        ("/redoc", "/static/vendor/redoc/redoc.standalone.js"),
    ):
        html = get(tls_server, path, ctx).text
        assert asset in html
        # Offline: no script, style or font from anywhere but this server.
        assert not re.findall(r'(?:src|href)="https?://', html), html
        assert get(tls_server, asset, ctx).status_code == 200


def test_metrics_listener_is_plain_read_only_and_limited() -> None:
    st = make_state()
    with RestServer(st, "127.0.0.1", 0, tls=None, allowed=None, metrics=True) as srv:
        assert srv.url.startswith("http://")
        with httpx.Client(timeout=5) as c:
            r = c.get(srv.url + "/metrics")
            assert r.status_code == 200 and "mobius_step" in r.text
            assert c.get(srv.url + "/healthz").json() == {"status": "ok", "phase": "training"}
            assert c.get(srv.url + "/readyz").json() == {"ready": True, "phase": "training"}
            assert c.get(srv.url + "/v1/status").json()["run_id"] == 'run-"7"'
            assert c.get(srv.url + "/").status_code == 200
            for path in ("/docs", "/redoc", "/openapi.json"):
                assert c.get(srv.url + path).status_code == 404, path
            assert c.post(srv.url + "/metrics").status_code == 405
            st.finish("failed", "boom")
            r = c.get(srv.url + "/readyz")
            assert r.status_code == 503 and r.json() == {"ready": False, "phase": "failed"}
            assert c.get(srv.url + "/healthz").status_code == 200
    assert [w["state"] for w in st.status_doc()["workers"]] == ["stopped", "stopped"]
    with pytest.raises(ValueError, match="plain HTTP"):
        RestServer(st, "127.0.0.1", 0, tls=NodeTLS(Path("a"), Path("b"), Path("c")),
                   allowed=None, metrics=True)  # fmt: skip


def test_status_carries_the_privacy_block() -> None:
    from mobius_fed.config import TrainConfig
    from mobius_fed.coordinator.server import privacy_source
    from mobius_fed.privacy_config import PrivacyConfig

    st = make_state()
    assert st.status_doc()["privacy"] is None
    train = TrainConfig(workers=P, preset="cpu-tiny", privacy=PrivacyConfig(label_noise=0.5))
    st.privacy = privacy_source(train)
    if st.privacy is None:
        pytest.skip("mobius_fed.defences.report is not part of this checkout")
    block = st.status_doc()["privacy"]
    assert block["steps"] == st.step and block["defences"][0]["name"] == "label_noise"
    st.privacy = lambda step: 1 / 0  # a failing report never breaks status
    assert "ZeroDivisionError" in st.status_doc()["privacy"]["error"]
