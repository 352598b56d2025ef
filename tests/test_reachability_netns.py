"""Outbound-only sites in the namespace testbed: iptables drops every inbound connection to
worker-1 and worker-2 (adjacent), a relay runs on the wan, and all four workers train.

docker/compose.yaml is extended here, in the test's own copy: a one-shot service makes the
relay key, a ``relay`` service runs ``mobius-fed relay`` on the wan, worker-0 opens a
rendezvous port, and workers 1 and 2 declare ``MOBIUS_REACHABLE=no`` with the relay. The
edge worker-0 → worker-1 is then reversed, worker-1 → worker-2 relayed, the others direct.
The relay's wan port is cut for 10 s mid-run: the relayed edge breaks (keepalive) and heals
(session resume, or an incident if it takes longer). The run must end ``done`` with the
reference engine's losses.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.manifests import latest_manifest
from mobius_fed.testbed import Testbed, TestbedError, netns_available, wait_for_run
from tests.test_netns_faults import (
    _ip,
    history,
    reach,
    reference_losses,
    status,
    wan_port,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker" / "compose.yaml"
WORKERS, STEPS, CUT_SECONDS = 4, 24, 10.0
OUTBOUND_ONLY = ("worker-1", "worker-2")
KEY_DIR = "/srv/mobius/relay"

_REASON = netns_available()
needs_netns = pytest.mark.skipif(
    _REASON is not None, reason=f"namespace testbed unavailable here: {_REASON}"
)


def _env(svc: dict, **values: str) -> None:
    env = svc.setdefault("environment", {})
    if isinstance(env, list):
        env = svc["environment"] = dict(e.split("=", 1) for e in env)
    env.update(values)


def reach_compose(dest: Path) -> Path:
    """docker/compose.yaml plus a relay, a relay key and the reachability settings."""
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    one_shot = {k: v for k, v in services["data-0"].items() if k not in ("command", "volumes")}
    key_mount = f"relay-key:{KEY_DIR}"
    services["relay-key"] = {
        **one_shot,
        "command": ["mobius-fed", "relay", "--init-key", f"{KEY_DIR}/relay.key"],
        "volumes": [key_mount],
    }
    relay = {k: v for k, v in services["worker-0"].items() if k in ("image", "init")}
    services["relay"] = {
        **relay,
        "command": [
            "mobius-fed",
            "relay",
            "--listen",
            "0.0.0.0:7100",
            "--key-file",
            f"{KEY_DIR}/relay.key",
        ],
        "volumes": [key_mount],
        "networks": ["wan"],
        "depends_on": {"relay-key": {"condition": "service_completed_successfully"}},
        "restart": "on-failure:10",
    }
    doc["volumes"]["relay-key"] = {}
    _env(
        services["coordinator"],
        MOBIUS_STEPS=str(STEPS),
        MOBIUS_CHECKPOINT_EVERY="4",
        MOBIUS_EVAL_EVERY="12",
    )
    _env(
        services["worker-0"],
        MOBIUS_TUNNEL_LISTEN="0.0.0.0:7001",
        MOBIUS_TUNNEL_ADVERTISE="worker-0:7001",
    )
    for name in OUTBOUND_ONLY:
        svc = services[name]
        _env(
            svc,
            MOBIUS_REACHABLE="no",
            MOBIUS_RELAY="relay:7100",
            MOBIUS_RELAY_KEY=f"{KEY_DIR}/relay.key",
        )
        svc["volumes"].append(f"{key_mount}:ro")
        svc["depends_on"]["relay"] = {"condition": "service_started"}
    for svc in services.values():  # this checkout's code, in every namespace
        _env(svc, PYTHONPATH=str(REPO))
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


def drop_inbound(tb: Testbed, service: str) -> None:
    """New inbound TCP connections to ``service`` are dropped (loopback and replies pass)."""
    ns = tb.namespace(service)
    for rule in (
        ["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
        ["-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ["-A", "INPUT", "-p", "tcp", "--syn", "-j", "DROP"],
    ):
        subprocess.run(["ip", "netns", "exec", ns, "iptables", *rule], check=True)


@needs_netns
@pytest.mark.slow(reason="a namespace testbed with a relay, trained, cut and healed in one run")
def test_outbound_only_sites_train_in_the_testbed_and_a_relay_cut_heals(tmp_path: Path):
    compose = reach_compose(tmp_path / "compose.yaml")
    seen: dict = {}
    with Testbed(compose, tmp_path / "testbed") as tb:
        tb.build()
        for name in OUTBOUND_ONLY:
            drop_inbound(tb, name)
        tb.up(timeout=300)
        w1 = tb.address("worker-1", "wan")
        seen["dial_in"] = reach(tb, "worker-0", w1, 7000, timeout=3.0)
        seen["dial_out"] = reach(tb, "worker-1", "relay", 7100, timeout=3.0)
        deadline = time.monotonic() + 240
        while (
            (doc := status(tb)) is None
            or doc["step"] < 6
            or not all(e.get("path") for e in doc["ring"])
        ):
            assert time.monotonic() < deadline, tb.log_tail("worker-1", 40)
            assert not tb.failed(), tb.describe_failure(tb.failed())
            time.sleep(1.0)
        seen["paths"] = [e["path"] for e in doc["ring"]]
        _, port = wan_port(tb, "relay")
        _ip("-n", tb.switch_namespace, "link", "set", port, "down")  # the relay is cut off
        cut_at = time.monotonic()
        try:
            time.sleep(1.0)
            seen["relay_during"] = reach(tb, "worker-1", "relay", 7100, timeout=2.0)
            time.sleep(max(0.0, cut_at + CUT_SECONDS - time.monotonic()))
        finally:
            _ip("-n", tb.switch_namespace, "link", "set", port, "up")
        seen["cut_s"] = round(time.monotonic() - cut_at, 1)
        try:
            final = wait_for_run(tb, 300, poll=1.0)
        except TestbedError as exc:
            pytest.fail(f"{exc}\n{tb.log_tail('worker-1', 40)}\n{tb.log_tail('relay', 20)}")
        hist = history(tb)
        manifest = latest_manifest(tb.volume_path("coordinator-state"))
        assert manifest is not None
        train = TrainConfig.model_validate(json.loads(manifest.read_text())["train"])
        site_dirs = [tb.volume_path(f"site-{i}-data") / f"site-{i}" for i in range(WORKERS)]
        relay_log = tb.log_path("relay").read_text(errors="replace")
        healed = [
            line
            for name in ("worker-1", "worker-2")
            for line in tb.log_path(name).read_text(errors="replace").splitlines()
            if "ring edge worker-1 → worker-2 back after" in line
        ]
    got = {(row["step"], s): v for row in hist["steps"] for s, v in enumerate(row["origin_losses"])}
    ref = reference_losses(train, site_dirs)
    print(seen, final.get("incidents"))
    assert not seen["dial_in"], "iptables must stop worker-0 from dialling worker-1"
    assert seen["dial_out"] and not seen["relay_during"], seen
    assert seen["paths"] == ["reversed", "relayed", "direct", "direct"], seen
    assert final["phase"] == "done", final.get("error")
    assert seen["cut_s"] >= CUT_SECONDS
    assert healed or final.get("incidents"), "the cut never broke the relayed edge"
    assert "worker-1 → worker-2" in relay_log
    assert set(got) == set(ref) and max(abs(got[k] - ref[k]) for k in ref) <= 1e-5
