"""Operator view of a real run: endpoints.json, status/health --run, the metrics listener,
metrics on disk, final worker states, and the dashboard in a real headless Chromium.

One federation (coordinator + 2 workers, real processes, mTLS on loopback) trains 4 steps
and keeps serving after the run, as ``mobius-fed up`` does; every test reads it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from mobius_fed.cli.dashboard import DashboardProxy
from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.endpoints import read_endpoints
from mobius_fed.ops.federation import LocalFederation

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"
STEPS = 4


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    train = TrainConfig(
        workers=2, preset="cpu-tiny", batch_size=2, steps=STEPS, eval_every=2, optimizer="adamw"
    )
    fed = LocalFederation(tmp_path_factory.mktemp("up"), train).prepare().start()
    try:
        fed.write_endpoints()
        final = fed.wait(timeout=240)
        assert final["phase"] == "done", fed.tail("coordinator")
        yield fed
    finally:
        fed.stop()


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


# --------------------------------------------------------------------------- findable
def test_status_and_health_find_the_run(fed: LocalFederation) -> None:
    ep = read_endpoints(fed.root)
    assert ep.grpc == f"127.0.0.1:{fed.coord_port}" and ep.cert.is_file()
    assert ep.alive() is True
    done = cli("status", "--run", str(fed.root), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["phase"] == "done" and doc["step"] == STEPS
    # Status tells the truth after the run: nobody is still "training".
    assert [w["state"] for w in doc["workers"]] == ["finished", "finished"]
    assert {e["state"] for e in doc["ring"]} == {"closed"}
    assert doc["config"]["train"]["steps"] == STEPS
    probe = subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.health", "--run", str(fed.root)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stderr
    wrong = cli("status", "--run", str(fed.root / "nowhere"))
    assert wrong.returncode != 0 and "endpoints.json" in wrong.stderr


# --------------------------------------------------------------------------- metrics
def test_metrics_listener_serves_prometheus_and_probes(fed: LocalFederation) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    assert fed.metrics_url, "the coordinator has the metrics_listen setting"
    base = fed.metrics_url.removesuffix("/metrics")
    r = httpx.get(fed.metrics_url, timeout=5)  # no client certificate
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    kinds = {name: f.type for name, f in fams.items()}
    assert kinds["mobius_rounds"] == "counter" and kinds["mobius_tokens"] == "counter"
    assert kinds["mobius_step_seconds"] == "histogram"
    assert kinds["mobius_round_seconds"] == "histogram"
    assert "process_cpu_seconds" in fams and "process_resident_memory_bytes" in fams
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for s in fams["mobius_rounds"].samples
    }
    assert samples[("mobius_rounds_total", (("run_id", "local-up"),))] == STEPS
    counts = [s for s in fams["mobius_step_seconds"].samples if s.name.endswith("_count")]
    assert sorted(s.labels["rank"] for s in counts) == ["0", "1"]
    assert all(s.value == STEPS for s in counts)
    assert httpx.get(base + "/healthz", timeout=5).json()["status"] == "ok"
    assert httpx.get(base + "/readyz", timeout=5).json() == {"ready": True, "phase": "done"}
    assert httpx.get(base + "/openapi.json", timeout=5).status_code == 404  # metrics only
    assert httpx.post(base + "/metrics", timeout=5).status_code == 405
    # The mTLS REST API serves the same registry.
    assert "mobius_rounds_total" in fed.rest("/metrics")


def test_metrics_and_history_on_disk(fed: LocalFederation) -> None:
    out = fed.coordinator_out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, STEPS + 1))
    hist = fed.rest("/v1/history")
    by_step = {s["step"]: s["loss"] for s in hist["steps"]}
    for r in rows:
        assert r["losses"] == [by_step[r["step"] - 1]]  # exactly what status reported
        assert set(r["workers"]) == {"0", "1"} and r["workers"]["0"]["train_s"] > 0
        for w in r["workers"].values():  # what each worker reported of its round
            assert w["bytes_sent"] > 0 and 0 <= w["wait_s"] <= w["train_s"]
    evals = {e["step"]: e["loss"] for e in hist["evals"]}
    assert {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r} == evals
    history = json.loads((out / "history.json").read_text())
    assert history["steps"] == hist["steps"] and history["status"]["phase"] == "done"
    # each site measured: its group's blocks, its compute per block, the slowest named
    status = fed.rest("/v1/status")
    assert all(w["layers"] == 6 and w["block_s"] > 0 for w in status["workers"])
    assert status["pace"]["slowest"] in ("worker-0", "worker-1")
    assert 0 < status["pace"]["share"] <= 1


# --------------------------------------------------------------------------- dashboard
def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


class _Attrs(HTMLParser):
    """Every element's attributes, by tag."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.found.append((tag, {k: v or "" for k, v in attrs}))

    def where(self, **want: str) -> list[dict[str, str]]:
        return [a for _, a in self.found if all(a.get(k) == v for k, v in want.items())]


def test_dashboard_renders_in_chromium(fed: LocalFederation) -> None:
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium: apt-get install -y chromium (.ci/run installs it)")
    status = fed.rest("/v1/status")
    hist = fed.rest("/v1/history")
    assert "Swagger UI" in fed.rest("/docs") and "/static/vendor/" in fed.rest("/redoc")
    with DashboardProxy(fed.rest_url, fed.operator_tls()) as proxy:
        assert httpx.get(proxy.url + "static/vendor/redoc/redoc.standalone.js").status_code == 200
        flags = [browser, "--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-dev-shm-usage", "--no-first-run", "--virtual-time-budget=10000",
                 "--window-size=1280,1700"]  # fmt: skip
        run = subprocess.run(
            [*flags, "--enable-logging=stderr", "--v=0", "--dump-dom", proxy.url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        subprocess.run(
            [*flags, f"--screenshot={shot}", proxy.url], capture_output=True, timeout=120
        )
    assert run.returncode == 0, run.stderr[-2000:]
    console = [ln for ln in run.stderr.splitlines() if "CONSOLE" in ln]
    assert not [ln for ln in console if re.search(r"error|uncaught|warn", ln, re.I)], console
    dom = _Attrs()
    dom.feed(run.stdout)
    body = dom.where(**{"data-ready": "1"})
    assert body, "the page never rendered a status"
    body = body[0]
    assert body["data-errors"] == "0"
    assert body["data-phase"] == status["phase"] and int(body["data-step"]) == status["step"]
    workers = dom.where(**{"class": "worker"})
    assert len(workers) == len(status["workers"]) == 2
    for w, node in zip(status["workers"], sorted(workers, key=lambda a: a["data-rank"])):
        assert node["data-state"] == w["state"] and int(node["data-step"]) == w["step"]
        assert float(node["data-last-loss"]) == w["last_loss"]
    assert len(dom.where(**{"class": "edge"})) == 2
    (ev,) = dom.where(**{"data-series": "eval"})
    assert (
        int(ev["data-points"]) == len(hist["evals"])
        and float(ev["data-last"]) == status["eval_loss"]
    )
    for s in range(2):
        (origin,) = dom.where(**{"data-series": f"val-origin-{s}"})
        assert float(origin["data-last"]) == status["eval_origin_losses"][s]
    (train,) = dom.where(**{"data-series": "train"})
    assert int(train["data-points"]) == STEPS and float(train["data-last"]) == status["train_loss"]
    (field,) = dom.where(**{"data-field": "eval_loss"})
    assert float(field["data-value"]) == status["eval_loss"]
    assert dom.where(**{"data-key": "train.steps"}), "the run's config is shown"
    sites = dom.where(**{"class": "site-row"})  # a clean run: every site, none suspect
    assert len(sites) == 2 and {a["data-suspect"] for a in sites} == {"0"}
    assert not dom.where(**{"class": "handover"})
    (pace,) = dom.where(id="pace")  # the slowest site, named
    assert pace["data-slowest"] == status["pace"]["slowest"]
    assert shot.is_file() and shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")


def test_proxy_refuses_foreign_hosts_and_writes(fed: LocalFederation) -> None:
    with DashboardProxy(fed.rest_url, fed.operator_tls()) as proxy:
        ok = httpx.get(proxy.url + "v1/status", timeout=5)
        assert ok.status_code == 200 and ok.json()["run_id"] == "local-up"
        evil = httpx.get(proxy.url, headers={"host": "evil.example:80"}, timeout=5)
        assert evil.status_code == 403
        assert httpx.post(proxy.url + "v1/status", timeout=5).status_code == 405


def test_dashboard_shows_each_ring_and_its_health(tmp_path: Path) -> None:
    """R = 2 rings of 2 with worker-3 lost: the page draws each ring apart (edge g from
    worker g to its successor in its own ring), a ring column in the workers table, and a
    rings table with ring 0 healthy and ring 1 stalled. The status is served as the
    coordinator serves it, from a RunState, by a plain local server."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mobius_fed.coordinator.state import RunState, json_safe

    browser = chromium()
    if browser is None:
        pytest.skip("no chromium: apt-get install -y chromium (.ci/run installs it)")
    st = RunState(run_id="rings", P=4, steps=4, strategy="fedavg", num_rounds=4, rings=2)
    st.set(phase="training")
    for g in range(4):
        st.update_worker(g, state="registered")
        st.update_worker(g, state="training", step=2, edges={"out": {"state": "up"}})
    incident = dict(kind="worker lost", what="w3", rank=3, edge=None, round=1, detected_at=0.0,
                    detection_s=0.1)  # fmt: skip
    st.lose_worker(3, incident)
    # worker-1 a suspect (3 frames refused); worker-3, clipped once, handed to standby-0
    for _ in range(3):
        st.record_refusal(1, "tensor rejected from mobius://worker/1 …", suspect_after=3)
    st.record_clip(3, "E/R update clipped", suspect_after=3)
    st.record_handover(3, "mobius://worker/3", "mobius://standby/0", "it did not rejoin")
    st.update_worker(3, identity="mobius://standby/0")
    docs = {
        "/v1/status": json.dumps(json_safe(st.status_doc()), default=str).encode(),
        "/v1/history": json.dumps(json_safe(st.history_doc()), default=str).encode(),
    }
    static = REPO / "mobius_fed" / "coordinator" / "static"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path in docs:
                body, kind = docs[path], "application/json"
            elif path == "/":
                body, kind = (static / "index.html").read_bytes(), "text/html"
            elif path.startswith("/static/") and (static / path[8:]).is_file():
                kind = "text/css" if path.endswith(".css") else "text/javascript"
                body = (static / path[8:]).read_bytes()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        flags = [browser, "--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-dev-shm-usage", "--no-first-run", "--virtual-time-budget=5000",
                 "--window-size=1280,1700", f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
        run = subprocess.run(
            [*flags, "--enable-logging=stderr", "--v=0", "--dump-dom", url],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr[-2000:]
    console = [ln for ln in run.stderr.splitlines() if "CONSOLE" in ln]
    assert not [ln for ln in console if re.search(r"error|uncaught|warn", ln, re.I)], console
    dom = _Attrs()
    dom.feed(run.stdout)
    (body,) = dom.where(**{"data-ready": "1"})
    assert body["data-errors"] == "0"
    rows = {a["data-ring"]: a for a in dom.where(**{"class": "ring-row"})}
    assert rows["0"]["data-state"] == "healthy" and rows["0"]["data-healthy"] == "1"
    assert rows["1"]["data-state"] == "stalled" and rows["1"]["data-healthy"] == "0"
    labels = {a["data-ring"]: a["data-state"] for a in dom.where(**{"class": "ring-label"})}
    assert labels == {"0": "healthy", "1": "stalled"}
    workers = {a["data-rank"]: a["data-ring"] for a in dom.where(**{"class": "worker"})}
    assert workers == {"0": "0", "1": "0", "2": "1", "3": "1"}
    rows = {a["data-rank"]: a["data-ring"] for a in dom.where(**{"class": "worker-row"})}
    assert rows == workers
    edges = {a["data-edge"]: a for a in dom.where(**{"class": "edge"})}
    assert edges["worker-1 → worker-0"]["data-ring"] == "0"
    assert edges["worker-3 → worker-2"]["data-state"] == "down"
    assert [a for a in dom.where(id="rings") if "hidden" not in a]
    sites = {a["data-site"]: a for a in dom.where(**{"class": "site-row"})}
    assert set(sites) == {"worker-0", "worker-1", "worker-2", "standby-0", "worker-3"}
    assert sites["worker-1"]["data-suspect"] == "1" and sites["worker-1"]["data-refused"] == "3"
    assert sites["worker-3"]["data-clipped"] == "1" and sites["worker-3"]["data-suspect"] == "0"
    assert sites["standby-0"]["data-clipped"] == "0"  # the standby starts clean
    (handover,) = dom.where(**{"class": "handover"})
    assert (handover["data-rank"], handover["data-standby"], handover["data-replaced"]) == (
        "3", "standby-0", "worker-3",
    )  # fmt: skip
