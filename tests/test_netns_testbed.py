"""The namespace testbed: docker/compose.yaml run without Docker, one network namespace per
service, through the compose file's own commands."""

from __future__ import annotations

import math
import os
import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from mobius_fed.cli.testbed import parse_sets
from mobius_fed.testbed import (
    ComposeError,
    Testbed,
    TestbedError,
    list_netns,
    load_compose,
    netns_available,
    wait_for_run,
)
from mobius_fed.testbed.compose import interpolate, parse_duration

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker" / "compose.yaml"
WORKERS = 4
STEPS = 8
OVERRIDES = {
    "coordinator": {
        "MOBIUS_STEPS": str(STEPS),
        "MOBIUS_EVAL_EVERY": "4",
        "MOBIUS_CHECKPOINT_EVERY": "4",
    }
}

_REASON = netns_available()
needs_netns = pytest.mark.skipif(
    _REASON is not None, reason=f"namespace testbed unavailable here: {_REASON}"
)


def _root_ns_links() -> tuple[set[str], str]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}, addrs


def _proc(pid: int) -> dict:
    """What a running process was given: environment, argv and its view of /srv/mobius."""
    root = Path(f"/proc/{pid}/root/srv/mobius")
    env = dict(
        kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv
    )
    data = root / "data"
    return {
        "environ": env,
        "cmdline": Path(f"/proc/{pid}/cmdline").read_text().split("\0"),
        "srv": sorted(os.listdir(root)),
        "data": sorted(os.listdir(data)) if data.exists() else None,
        "key": (root / "key" / "tls.key").read_bytes(),  # its own key volume
        "ca": (root / "certs" / "ca.crt").is_file(),
    }


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------- the demo run
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One 4-worker run of docker/compose.yaml; what was seen during and after it."""
    if _REASON is not None:
        pytest.skip(f"namespace testbed unavailable here: {_REASON}")
    root = tmp_path_factory.mktemp("testbed")
    links_before, _ = _root_ns_links()
    seen: dict = {"pids": {}, "procs": {}, "write_errors": {}, "resolve": {}, "reach": {}}
    t0 = time.monotonic()
    with Testbed(COMPOSE, root, env_overrides=OVERRIDES) as tb:
        seen["prefix"], seen["namespaces"] = tb.prefix, tb.namespaces()
        tb.up(timeout=240)
        pids = tb.processes()
        seen["pids"] = pids
        for name, pid in pids.items():
            seen["procs"][name] = _proc(pid)
        for i in range(WORKERS):  # a worker's data is mounted read-only
            target = Path(f"/proc/{pids[f'worker-{i}']}/root/srv/mobius/data/site-{i}/x")
            try:
                target.write_text("x")
                seen["write_errors"][i] = None
            except OSError as exc:
                seen["write_errors"][i] = exc.errno
        seen["resolve"] = tb.exec("worker-0", ["getent", "hosts", "coordinator", "worker-1"])
        seen["root_ns"] = _root_ns_links()
        # worker-0 reaches the coordinator and worker-1 over wan, but has no route into
        # worker-1's own site network.
        probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 3)"
        targets = {
            "coordinator": ("coordinator", "7300"),
            "wan": (tb.address("worker-1", "wan"), "7000"),
            "site-1": (tb.address("worker-1", "site-1"), "7000"),
        }
        for key, (host, port) in targets.items():
            r = tb.exec("worker-0", ["python3", "-c", probe, host, port], timeout=30)
            seen["reach"][key] = (r.returncode, r.stderr.strip().splitlines()[-1:])
        seen["final"] = wait_for_run(tb, 240)
        seen["coordinator_running"] = tb.running("coordinator")
        seen["certs_dir"] = tb.volume_path("certs")
        seen["keys"] = {  # each node's key, made in its own volume (certs request)
            node: (tb.volume_path(f"{node}-key") / "tls.key").read_bytes()
            for node in ["coordinator", *(f"worker-{i}" for i in range(WORKERS))]
        }
        seen["all_pids"] = set(pids.values())
    seen["seconds"] = time.monotonic() - t0
    seen["netns_after"] = list_netns()
    seen["etc_after"] = sorted(p.name for p in Path("/etc/netns").glob(seen["prefix"] + "-*"))
    seen["alive_after"] = [p for p in seen["all_pids"] if _alive(p)]
    seen["links_before"] = links_before
    return seen


@needs_netns
@pytest.mark.slow(reason="the first of the two builds the demo: a 4-worker compose run, cold")
def test_compose_demo_trains_and_cleans_up(demo):
    final = demo["final"]
    assert final["phase"] == "done", final
    assert final["step"] == STEPS and final["steps"] == STEPS
    assert final["run_id"] == "compose-demo"
    assert len(final["workers"]) == WORKERS
    assert sorted(w["rank"] for w in final["workers"]) == list(range(WORKERS))
    assert {w["address"] for w in final["workers"]} == {f"worker-{i}:7000" for i in range(4)}
    assert final["eval_loss"] is not None and math.isfinite(final["eval_loss"])
    assert demo["coordinator_running"]  # MOBIUS_LINGER=-1: it serves the final status
    # names resolve to testbed addresses; sites only meet on wan
    resolved = demo["resolve"]
    assert resolved.returncode == 0, resolved.stderr
    assert all(line.startswith("10.213.") for line in resolved.stdout.splitlines())
    reach = demo["reach"]
    assert reach["coordinator"][0] == 0, reach
    assert reach["wan"][0] == 0 or "Connection refused" in str(reach["wan"]), reach
    assert "Network is unreachable" in str(reach["site-1"]), reach
    # nothing was added to the root namespace, and everything is gone afterwards
    links_during, addrs_during = demo["root_ns"]
    assert links_during == demo["links_before"]
    assert "10.213." not in addrs_during
    ours = set(demo["namespaces"])
    assert len(ours) == 1 + 16  # switch + every compose service
    assert not ours & set(demo["netns_after"]), demo["netns_after"]
    assert not [ns for ns in demo["netns_after"] if ns.startswith(demo["prefix"] + "-")]
    assert demo["etc_after"] == []
    assert demo["alive_after"] == []


@needs_netns
@pytest.mark.slow(reason="the first of the two builds the demo: a 4-worker compose run, cold")
def test_workers_hold_only_their_own_site_and_key(demo):
    procs = demo["procs"]
    keys = {i: demo["keys"][f"worker-{i}"] for i in range(WORKERS)}
    assert len(set(keys.values())) == WORKERS
    nodes = demo["certs_dir"] / "nodes"  # the admin's volume holds no node's key
    assert not [k for k in nodes.glob("*/tls.key") if k.parent.name != "operator"]
    for i in range(WORKERS):
        p = procs[f"worker-{i}"]
        assert any(a.endswith("mobius-worker") for a in p["cmdline"][:2]), p["cmdline"]
        env = p["environ"]
        assert env["MOBIUS_DATA_DIR"] == f"/srv/mobius/data/site-{i}"
        assert env["MOBIUS_KEY"] == "/srv/mobius/key/tls.key"
        assert env["MOBIUS_ADVERTISE"] == f"worker-{i}:7000"
        assert p["key"] == keys[i]  # the key visible in its own mount namespace
        assert p["ca"]
        assert p["data"] == [f"site-{i}"]  # no other site's data is even visible
        assert p["srv"] == ["certs", "data", "key", "state"]
        assert demo["write_errors"][i] is not None  # read-only data volume
    coord = procs["coordinator"]
    assert any(a.endswith("mobius-coordinator") for a in coord["cmdline"][:2])
    assert "MOBIUS_DATA_DIR" not in coord["environ"]
    assert coord["data"] is None and coord["srv"] == ["certs", "key", "state"]
    assert coord["key"] == demo["keys"]["coordinator"]
    assert coord["key"] not in keys.values()


@needs_netns
@pytest.mark.slow(reason="two rings of two in namespaces: five cold daemons")
def test_compose_runs_two_rings_of_two(tmp_path):
    """``testbed up --rings 2`` on docker/compose.yaml: the same four worker services form
    two rings of two (worker-g is ring g // 2, its edges within its own ring: a worker's
    certificate names its ring through its rank), the run ends done and status shows each
    ring."""
    from mobius_fed.cli.testbed import rings_override

    env = {**OVERRIDES["coordinator"], "MOBIUS_STEPS": "4", "MOBIUS_EVAL_EVERY": "2"}
    env.update(rings_override(COMPOSE, 2))
    env["MOBIUS_CHECKPOINT_EVERY"] = "2"
    with Testbed(COMPOSE, tmp_path, env_overrides={"coordinator": env}) as tb:
        tb.up(timeout=240)
        final = wait_for_run(tb, 240)
    assert final["phase"] == "done", final.get("error")
    assert final["rings"] == 2 and final["step"] == 4
    assert [(w["rank"], w["ring"]) for w in final["workers"]] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [e["edge"] for e in final["ring"]] == [
        "worker-0 → worker-1",
        "worker-1 → worker-0",
        "worker-2 → worker-3",
        "worker-3 → worker-2",
    ]
    assert [(h["workers"], h["state"]) for h in final["ring_health"]] == [
        ([0, 1], "ended"),
        ([2, 3], "ended"),
    ]
    assert final["eval_loss"] is not None and len(final["eval_origin_losses"]) == 4


# --------------------------------------------------------------------------- small files
def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "compose.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@needs_netns
def test_failed_dependency_names_service_and_cleans_up(tmp_path):
    compose = _write(
        tmp_path,
        """
        name: tbfail
        services:
          side:
            command: ["sleep", "300"]
          setup:
            command: ["sh", "-c", "echo setup-went-wrong >&2; exit 3"]
            network_mode: none
          app:
            command: sleep 300
            depends_on:
              setup:
                condition: service_completed_successfully
        """,
    )
    tb = Testbed(compose, tmp_path / "root")
    with pytest.raises(TestbedError) as err, tb:
        tb.up(timeout=60)
    msg = str(err.value)
    assert "'setup'" in msg and "status 3" in msg and "setup-went-wrong" in msg, msg
    assert "'app'" in msg
    assert not [ns for ns in list_netns() if ns.startswith(tb.prefix + "-")]
    assert not list(Path("/etc/netns").glob(tb.prefix + "-*"))
    started = re.findall(r"started (\w+) \(pid (\d+)\)", (tb.logs_dir / "testbed.log").read_text())
    assert {name for name, _ in started} == {"side", "setup"}
    assert not [pid for _, pid in started if _alive(int(pid))]


@needs_netns
def test_networks_hosts_health_and_restarts(tmp_path):
    compose = _write(
        tmp_path,
        """
        services:
          web:
            command: ["python3", "-m", "http.server", "8080", "--bind", "0.0.0.0"]
            networks: [front, back]
            healthcheck:
              test: ["CMD", "python3", "-c",
                     "import socket; socket.create_connection(('127.0.0.1', 8080), 1)"]
              interval: 200ms
              retries: 50
          client:
            command: ["sleep", "300"]
            networks:
              front:
                aliases: [browser]
            depends_on:
              web:
                condition: service_healthy
          db:
            command: ["sleep", "300"]
            networks: [back]
            volumes:
              - ./conf:/srv/conf:ro
          flaky:
            command: ["sh", "-c", "echo run >> /srv/count/runs; exit 1"]
            network_mode: none
            restart: on-failure:2
            volumes:
              - count:/srv/count
        networks:
          front: {}
          back: {internal: true}
        volumes:
          count: {}
        """,
    )
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "app.ini").write_text("x=1\n")
    with Testbed(compose, tmp_path / "root") as tb:
        tb.up(timeout=60)
        hosts = tb.exec("client", ["cat", "/etc/hosts"]).stdout
        assert f"{tb.address('web', 'front')}\tweb" in hosts
        assert "db" not in hosts  # no shared network
        r = tb.exec(
            "client",
            ["python3", "-c", "import urllib.request as u; print(u.urlopen('http://web:8080/').status)"],
        )  # fmt: skip
        assert r.stdout.strip() == "200", r.stderr
        assert tb.exec("db", ["cat", "/srv/conf/app.ini"]).stdout == "x=1\n"
        assert tb.exec("db", ["sh", "-c", "echo y > /srv/conf/app.ini"]).returncode != 0
        assert tb.exec("db", ["getent", "hosts", "client"]).returncode != 0
        deadline = time.monotonic() + 20
        while not tb.finished("flaky") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tb.finished("flaky") and tb.restarts("flaky") == 2 and tb.returncode("flaky") == 1
        assert (tb.volume_path("count") / "runs").read_text() == "run\n" * 3
        pids = tb.processes()
        assert set(pids) == {"web", "client", "db"}
        assert "http.server" in Path(f"/proc/{pids['web']}/cmdline").read_text()
    assert not [ns for ns in list_netns() if ns.startswith(tb.prefix + "-")]
    assert all(not _alive(p) for p in pids.values())


@needs_netns
def test_unhealthy_dependency_fails_up(tmp_path):
    compose = _write(
        tmp_path,
        """
        services:
          sick:
            command: ["sleep", "300"]
            healthcheck:
              test: ["CMD-SHELL", "echo not-ready; exit 1"]
              interval: 100ms
              retries: 2
          app:
            command: ["sleep", "300"]
            depends_on: {sick: {condition: service_healthy}}
        """,
    )
    tb = Testbed(compose, tmp_path / "root")
    with pytest.raises(TestbedError, match=r"'sick'.*unhealthy.*not-ready"), tb:
        tb.up(timeout=30)
    assert not [ns for ns in list_netns() if ns.startswith(tb.prefix + "-")]


# --------------------------------------------------------------------------- parsing (no root)
def test_parse_real_compose_file():
    proj = load_compose(COMPOSE, environ={})
    assert proj.name == "mobius-fed"
    order = proj.start_order()
    assert order.index("certs") < order.index("coordinator") < order.index("worker-0")
    w = proj.services["worker-2"]
    assert w.argv == ["mobius-worker"] and w.networks == {"site-2": [], "wan": []}
    assert w.environment["MOBIUS_DATA_DIR"] == "/srv/mobius/data/site-2"
    assert w.environment["MOBIUS_COORDINATOR"] == "coordinator:7300"  # from the anchor
    certs, key, data, state = w.mounts
    assert (certs.source, certs.subpath, certs.read_only) == ("certs", "nodes/worker-2", True)
    assert (key.source, key.read_only) == ("worker-2-key", True)
    assert (data.source, data.read_only, state.read_only) == ("site-2-data", True, False)
    assert w.depends_on["coordinator"] == "service_healthy"
    assert (w.restart, w.max_restarts) == ("on-failure", 10)
    assert w.healthcheck and w.healthcheck.interval == 30 and w.healthcheck.start_period == 180
    assert w.healthcheck.start_interval == 5
    assert proj.services["certs"].isolated and not proj.services["coordinator"].isolated
    assert any("ports" in n and "published" in n for n in proj.notes)


def test_interpolation_and_short_forms(tmp_path):
    env = {"A": "1", "EMPTY": ""}
    assert interpolate("${A:-x} ${B:-y} ${EMPTY:-z} ${EMPTY-z} $A $$A ${A:+set}", env) == (
        "1 y z  1 $A set"
    )
    with pytest.raises(ComposeError, match="B"):
        interpolate("${B:?needed}", env)
    assert parse_duration("1m30s") == 90 and parse_duration("250ms") == 0.25
    compose = _write(
        tmp_path,
        """
        services:
          a:
            image: ${IMG:-img:latest}
            entrypoint: ["python3"]
            command: -c "print(1)"
            environment: ["X=${A}", "Y=2"]
            volumes: ["v:/srv/v", "./b:/opt/b:ro", "/srv/anon"]
            depends_on: [b]
          b:
            command: ["true"]
            restart: always
        volumes: {v: {}}
        """,
    )
    proj = load_compose(compose, environ={"A": "7"})
    a = proj.services["a"]
    assert a.argv == ["python3", "-c", "print(1)"]
    assert a.environment == {"X": "7", "Y": "2"}
    assert [m.kind for m in a.mounts] == ["volume", "bind", "volume"]
    assert a.mounts[1].read_only and a.mounts[2].source is None
    assert a.depends_on == {"b": "service_started"} and a.networks == {"default": []}
    assert proj.start_order() == ["b", "a"]
    bad = _write(
        tmp_path,
        "services:\n  a: {command: x, depends_on: [b]}\n  b: {command: y, depends_on: [a]}\n",
    )
    with pytest.raises(ComposeError, match="cycle"):
        load_compose(bad)


def test_set_overrides():
    assert parse_sets(["coordinator:MOBIUS_STEPS=10", "worker-0:A=b=c"]) == {
        "coordinator": {"MOBIUS_STEPS": "10"},
        "worker-0": {"A": "b=c"},
    }
    with pytest.raises(Exception, match="SERVICE:KEY=VALUE"):
        parse_sets(["nocolon"])
