"""The deployment files agree with each other and with the code (pure parsing, no network).

Cross-checks docker/compose.yaml, docker/Dockerfile, deploy/k8s/*.yaml and deploy/systemd/
against the config models (defaults, MOBIUS_* names), the certificate bundle layout and the
real command-line parsers: service names, ports, container paths, environment variable
names, per-worker key and data isolation, and every command line they run.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from mobius_fed.cli import coordinator as coordinator_cli
from mobius_fed.cli import main as main_cli
from mobius_fed.cli import status as status_cli
from mobius_fed.cli import worker as worker_cli
from mobius_fed.config import read_toml
from mobius_fed.coordinator import config as coord_config
from mobius_fed.coordinator import rest_client
from mobius_fed.transport.certs import CertLayout
from mobius_fed.transport.tls import COORDINATOR_IDENTITY, identity_name
from mobius_fed.worker import config as worker_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
SYSTEMD = ROOT / "deploy" / "systemd"

WORKER_PORT = 7000
GRPC_PORT = 7300
REST_PORT = 7380
METRICS_PORT = 9464
CERTS, DATA, STATE = "/srv/mobius/certs", "/srv/mobius/data", "/srv/mobius/state"
KEY, REQUESTS = "/srv/mobius/key", "/srv/mobius/requests"
WORKER_RE = re.compile(r"^worker-(\d+)$")
ADMIN_JOBS = {"certs", "sign"}
"""The compose services that play the admin: the only ones that mount the CA's volume whole."""

BUNDLE = CertLayout(root=Path("/x"), ca_cert=Path("/x/ca.crt"), ca_key=Path("/x/ca.key"), workers=1)
BUNDLE_FILES = {
    "ca": BUNDLE.bundle("worker-0").ca.name,
    "cert": BUNDLE.bundle("worker-0").cert.name,
    "key": BUNDLE.bundle("worker-0").key.name,
}

WORKER_VARS = {f"MOBIUS_{k}" for k in worker_config.ENV_KEYS}
WORKER_TRAIN_VARS = {f"MOBIUS_{k}" for k in worker_config.TRAIN_ENV_KEYS}
COORD_VARS = {f"MOBIUS_{k}" for k in coord_config.ENV_KEYS}
COORD_TRAIN_VARS = {f"MOBIUS_{k}" for k in coord_config.TRAIN_ENV_KEYS}

PARSERS = {
    "mobius-fed": main_cli.build_parser,
    "mobius-worker": worker_cli.build_parser,
    "mobius-coordinator": coordinator_cli.build_parser,
}


# ----------------------------------------------------------------------------- loading
def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]


def _k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _k8s(kind: str, name: str | None = None) -> Any:
    found = {d["metadata"]["name"]: d for d in _k8s_docs() if d["kind"] == kind}
    if name is None:
        return found
    assert name in found, f"deploy/k8s has no {kind} {name!r} (has {sorted(found)})"
    return found[name]


def _env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an environment file; commented-out assignments count too."""
    found = (
        re.fullmatch(r"#?\s*(MOBIUS_[A-Z_]+)=(\S*)", ln.strip())
        for ln in path.read_text().splitlines()
    )
    return {m.group(1): m.group(2) for m in found if m}


def _env_file_active(path: Path) -> dict[str, str]:
    return {
        k: v
        for k, v in (
            line.split("=", 1)
            for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        )
    }


def _unit(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def _host(addr: str) -> str:
    return addr.rsplit(":", 1)[0]


def _parse(argv: list[str]):
    """Parse ``argv`` with the real parser of its console script; fail instead of exiting."""
    assert argv, "empty command"
    prog = argv[0]
    assert prog in PARSERS, f"{argv}: unknown program {prog!r} (expected one of {list(PARSERS)})"
    try:
        return PARSERS[prog]().parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"{shlex.join(argv)}: rejected by {prog}'s parser (exit {exc.code})")


def _health_test(svc: dict[str, Any]) -> list[str]:
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD", f"healthcheck should be exec form ['CMD', ...], got {test}"
    return test[1:]


def _compose_workers() -> dict[int, dict[str, Any]]:
    return {
        int(m.group(1)): svc for name, svc in _services().items() if (m := WORKER_RE.match(name))
    }


def _k8s_workers() -> dict[int, dict[str, Any]]:
    sets = _k8s("StatefulSet")
    out = {}
    for name, sts in sets.items():
        m = WORKER_RE.match(name)
        assert m, f"StatefulSet {name!r} is not named worker-<i>"
        out[int(m.group(1))] = sts
    return out


def _container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    by_name = {c["name"]: c for c in pod_spec["containers"]}
    assert name in by_name, f"no container {name!r} (has {sorted(by_name)})"
    return by_name[name]


def _pod_env(pod_spec: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """A container's environment: its ConfigMaps (envFrom), then env (later wins)."""
    maps = _k8s("ConfigMap")
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        name = ref["configMapRef"]["name"]
        assert name in maps, f"envFrom names ConfigMap {name!r}, not in deploy/k8s"
        env.update(maps[name]["data"])
    for item in container.get("env", []):
        assert "value" in item, f"env {item['name']} should be a literal value"
        env[item["name"]] = item["value"]
    return env


def _mounts(pod_spec: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume (or volumeClaimTemplate name) mounted there."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    out = {}
    for m in container.get("volumeMounts", []):
        out[m["mountPath"]] = {**volumes.get(m["name"], {"name": m["name"], "claim": True}), **m}
    return out


def _argv(container: dict[str, Any]) -> list[str]:
    return list(container.get("command", [])) + list(container.get("args", []))


def _num_workers() -> int:
    return len(_compose_workers())


# ----------------------------------------------------------------------------- code defaults
def test_code_defaults_are_the_deployment_ports() -> None:
    cfg = coord_config.CoordinatorConfig(ca=Path("ca"), cert=Path("c"), key=Path("k"))
    assert _port(cfg.listen) == GRPC_PORT
    assert _port(cfg.rest_listen) == REST_PORT
    worker = worker_config.WorkerConfig(
        coordinator="coordinator:7300",
        data_dir=Path("d"),
        ca=Path("ca"),
        cert=Path("c"),
        key=Path("k"),
    )
    assert worker.listen_address == f"0.0.0.0:{WORKER_PORT}"
    assert _port(status_cli.DEFAULT_COORDINATOR) == GRPC_PORT
    # The dialler checks the coordinator's reserved identity name, which `certs init` writes
    # into the coordinator's certificate beside its host name (docs/security.md).
    assert identity_name(COORDINATOR_IDENTITY) == rest_client.COORDINATOR_NAME
    assert rest_client.COORDINATOR_NAME == "coordinator.id.mobius.invalid"
    assert set(BUNDLE_FILES.values()) == {"ca.crt", "tls.crt", "tls.key"}
    assert BUNDLE.bundle("worker-3").cert.parent.relative_to(BUNDLE.root) == Path("nodes/worker-3")


def test_console_scripts_exist() -> None:
    scripts = read_toml(ROOT / "pyproject.toml")["project"]["scripts"]
    assert set(PARSERS) <= set(scripts), (
        f"pyproject [project.scripts] lacks {set(PARSERS) - set(scripts)}"
    )
    assert scripts["mobius-fed"] == "mobius_fed.cli.main:main"
    assert scripts["mobius-worker"] == "mobius_fed.cli.worker:main"
    assert scripts["mobius-coordinator"] == "mobius_fed.cli.coordinator:main"


# ----------------------------------------------------------------------------- Dockerfile
def test_dockerfile_paths_ports_and_user() -> None:
    text = DOCKERFILE.read_text()
    mkdir = [ln for ln in text.splitlines() if "mkdir" in ln and "/srv/mobius" in ln]
    assert mkdir, "Dockerfile should mkdir /srv/mobius/{certs,data,state}"
    for path in (CERTS, KEY, REQUESTS, DATA, STATE):
        assert path in mkdir[0].split(), f"Dockerfile mkdir line lacks {path}: {mkdir[0]!r}"
    assert re.search(r"chown -R mobius:mobius /srv/mobius\b", text)
    expose = re.search(r"^EXPOSE\s+(.+)$", text, re.M)
    assert expose and {int(p) for p in expose.group(1).split()} == {
        WORKER_PORT,
        GRPC_PORT,
        REST_PORT,
        METRICS_PORT,
    }
    user = re.findall(r"^USER\s+(\S+)$", text, re.M)
    assert user and user[-1].split(":")[0] == "10001", "the image must run as uid 10001"
    assert re.search(r"useradd --uid 10001\b", text)
    assert re.search(r"^ARG BASE=python:3\.\d+-slim$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    ci_pin = next(
        ln
        for ln in (ROOT / "requirements-ci.txt").read_text().splitlines()
        if ln.startswith("torch==")
    )
    assert re.search(rf"^ARG TORCH_SPEC={re.escape(ci_pin)}$", text, re.M), "CPU torch pin differs"
    cmd = re.search(r"^CMD\s+(\[.*\])$", text, re.M)
    assert cmd and yaml.safe_load(cmd.group(1))[0] in PARSERS


def test_compose_builds_the_image_once() -> None:
    """One service builds this Dockerfile; every other one runs the same image by name."""
    services = _services()
    builders = [name for name, svc in services.items() if "build" in svc]
    assert builders == ["certs"], f"build: on {builders} (one service only)"
    build = services["certs"]["build"]
    assert build["dockerfile"] == "docker/Dockerfile"
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).is_file()
    image = services["certs"]["image"]
    for name, svc in services.items():
        assert svc["image"] == image, f"{name} runs another image"
        if name != "certs":
            assert svc.get("pull_policy") == "never", f"{name} would try to pull {image}"


# ----------------------------------------------------------------------------- compose
def test_compose_runs_rings_of_its_workers_or_refuses_with_the_reason() -> None:
    """``MOBIUS_RINGS=2`` (or ``testbed up --rings 2``): the 4 compose workers form 2 rings
    of 2; a ring count that does not divide them is refused with the reason, by the
    coordinator's config and by ``testbed up --rings`` before anything starts."""
    from mobius_fed.cli.common import CliError
    from mobius_fed.cli.testbed import rings_override
    from mobius_fed.settings import ConfigError

    P = _num_workers()
    cfg = coord_config.load_coordinator_config(
        None, {}, {}, environ=_coordinator_env({"MOBIUS_RINGS": "2"})
    )
    assert (cfg.train.workers, cfg.train.rings, cfg.train.P) == (P, 2, P // 2)
    with pytest.raises(ConfigError, match=f"rings=3 does not divide workers={P}"):
        coord_config.load_coordinator_config(
            None, {}, {}, environ=_coordinator_env({"MOBIUS_RINGS": "3"})
        )
    assert rings_override(COMPOSE, 2) == {"MOBIUS_RINGS": "2"}
    with pytest.raises(CliError, match=f"--rings 3 does not divide the {P} workers of"):
        rings_override(COMPOSE, 3)


def test_compose_names_and_worker_count() -> None:
    services = _services()
    workers = _compose_workers()
    P = len(workers)
    assert P >= 2 and sorted(workers) == list(range(P)), (
        f"workers must be worker-0..P-1: {sorted(workers)}"
    )
    assert "coordinator" in services
    coordinator_env = services["coordinator"]["environment"]
    assert int(coordinator_env["MOBIUS_WORKERS"]) == P
    certs = _parse(services["certs"]["command"])
    assert certs.command == "certs" and certs.certs_command == "ca", "the admin makes a CA only"
    assert str(certs.out) == CERTS
    for i in range(P):
        prep = _parse(services[f"data-{i}"]["command"])
        assert prep.command == "prepare" and prep.sites == P and prep.site == i
        assert str(prep.out) == DATA


def test_compose_environment_names_exist_in_code() -> None:
    services = _services()
    bad = set(services["coordinator"]["environment"]) - COORD_VARS - COORD_TRAIN_VARS
    assert not bad, (
        f"compose coordinator sets variables mobius-coordinator does not read: {sorted(bad)}"
    )
    for i, svc in _compose_workers().items():
        env = set(svc["environment"])
        bad = env - WORKER_VARS - WORKER_TRAIN_VARS
        assert not bad, (
            f"compose worker-{i} sets variables mobius-worker does not read: {sorted(bad)} "
            "(missing from mobius_fed.worker.config.ENV_KEYS?)"
        )
        train = env & WORKER_TRAIN_VARS
        assert not train, (
            f"worker-{i} sets training variables {train}; it takes them from the coordinator"
        )


def _coordinator_env(environ: dict[str, str]) -> dict[str, str]:
    """The compose coordinator's environment, ``${VAR:-default}`` expanded from ``environ``."""
    from mobius_fed.testbed.compose import interpolate

    env = _services()["coordinator"]["environment"]
    return {k: interpolate(str(v), environ) for k, v in env.items()}


def test_compose_environment_loads_into_the_config_models() -> None:
    env = _coordinator_env({})
    cfg = coord_config.load_coordinator_config(None, {}, {}, environ=env)
    assert cfg.train.rings == 1  # MOBIUS_RINGS unset: one ring
    assert _port(cfg.listen) == GRPC_PORT and _port(cfg.rest_listen) == REST_PORT
    assert cfg.train.workers == _num_workers()
    for i, svc in _compose_workers().items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        wc = worker_config.load_worker_config(None, {}, {}, environ=env)
        assert wc.coordinator == f"coordinator:{GRPC_PORT}", (
            f"worker-{i}: MOBIUS_COORDINATOR not applied"
        )
        assert wc.advertise_address == f"worker-{i}:{WORKER_PORT}", (
            f"worker-{i}: MOBIUS_ADVERTISE not applied"
        )
        assert wc.listen_address == f"0.0.0.0:{WORKER_PORT}"
        assert wc.data_dir == Path(DATA) / f"site-{i}"
        assert not wc.verify_train


def test_compose_ports_paths_and_identities() -> None:
    services = _services()
    coord = services["coordinator"]
    env = coord["environment"]
    assert _port(env["MOBIUS_LISTEN"]) == GRPC_PORT
    assert _port(env["MOBIUS_REST_LISTEN"]) == REST_PORT
    assert _port(env["MOBIUS_METRICS_LISTEN"]) == METRICS_PORT
    assert {str(p).split("#")[0].strip() for p in coord["ports"]} == {
        f"{GRPC_PORT}:{GRPC_PORT}",
        f"{REST_PORT}:{REST_PORT}",
        f"{METRICS_PORT}:{METRICS_PORT}",
    }
    assert env["MOBIUS_OUT_DIR"] == STATE
    _check_tls_env(env, CERTS, "compose coordinator", key_dir=KEY)
    _check_compose_cert_mount(coord, "coordinator")
    assert _volume_targets(coord) == {CERTS, KEY, STATE}
    _check_health(_health_test(coord), GRPC_PORT, "coordinator", env)

    for i, svc in _compose_workers().items():
        env = svc["environment"]
        assert _host(env["MOBIUS_COORDINATOR"]) == "coordinator"
        assert _port(env["MOBIUS_COORDINATOR"]) == GRPC_PORT
        assert _port(env["MOBIUS_LISTEN"]) == WORKER_PORT
        assert env["MOBIUS_ADVERTISE"] == f"worker-{i}:{WORKER_PORT}"
        assert env["MOBIUS_DATA_DIR"] == f"{DATA}/site-{i}"
        assert env["MOBIUS_OUT_DIR"] == STATE
        _check_tls_env(env, CERTS, f"compose worker-{i}", key_dir=KEY)
        _check_compose_cert_mount(svc, f"worker-{i}")
        assert _volume_targets(svc) == {CERTS, KEY, DATA, STATE}
        _check_health(_health_test(svc), WORKER_PORT, f"worker-{i}", env)
        assert svc["command"] == ["mobius-worker"]
        _parse(svc["command"])
    assert coord["command"] == ["mobius-coordinator"]
    _parse(coord["command"])


def test_compose_each_worker_gets_only_its_own_key_and_site() -> None:
    services = _services()
    users: dict[str, set[str]] = {}
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            source = vol["source"] if isinstance(vol, dict) else vol.split(":")[0]
            users.setdefault(source, set()).add(name)
    for i, svc in _compose_workers().items():
        data = [v for v in svc["volumes"] if _target(v) == DATA]
        assert len(data) == 1 and _source(data[0]) == f"site-{i}-data"
        assert users[f"site-{i}-data"] == {f"data-{i}", f"worker-{i}"}, (
            "a site's data volume is shared"
        )
        assert users[f"worker-{i}-state"] == {f"worker-{i}"}
        networks = set(svc["networks"])
        assert networks == {f"site-{i}", "wan"}
    # Only the admin's jobs see the whole CA volume; every node mounts its public bundle.
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            if _source(vol) == "certs" and name not in ADMIN_JOBS:
                assert isinstance(vol, dict) and vol.get("volume", {}).get("subpath"), name
                assert vol.get("read_only") is True, f"{name} mounts its certificates writable"


def _nodes() -> list[str]:
    return ["coordinator"] + [f"worker-{i}" for i in sorted(_compose_workers())]


def _volume_users() -> dict[str, dict[str, Any]]:
    """volume name -> {service: its mount of that volume}."""
    users: dict[str, dict[str, Any]] = {}
    for name, svc in _services().items():
        for vol in svc.get("volumes", []):
            users.setdefault(_source(vol), {})[name] = vol
    return users


def test_compose_keys_are_made_at_each_site_and_signed_by_the_admin() -> None:
    """`certs request` per node writes its key where only that node looks; the admin's
    `certs sign` sees the requests and the CA, never a node's key."""
    services, users, nodes = _services(), _volume_users(), _nodes()
    for node in nodes:
        job = services[f"{node}-key"]
        req = _parse(job["command"])
        assert (req.certs_command, req.node, req.if_missing) == ("request", node, True)
        assert (str(req.out), str(req.csr_dir)) == (KEY, REQUESTS)
        assert job.get("network_mode") == "none"
        assert {_source(v): _target(v) for v in job["volumes"]} == {
            f"{node}-key": KEY,
            "requests": REQUESTS,
        }
        assert set(users[f"{node}-key"]) == {f"{node}-key", node}, "a key volume is shared"
        (own,) = [v for v in services[node]["volumes"] if _source(v) == f"{node}-key"]
        assert _target(own) == KEY and own.get("read_only") is True
        assert services[node]["depends_on"]["sign"]["condition"] == "service_completed_successfully"
    assert set(users["requests"]) == {f"{n}-key" for n in nodes} | {"sign"}
    for job in ADMIN_JOBS:
        assert not [v for v in services[job]["volumes"] if _source(v).endswith("-key")], job
    sign = services["sign"]
    args = _parse(sign["command"])
    assert args.certs_command == "sign" and str(args.ca) == CERTS
    assert args.csr == [f"{REQUESTS}/{n}.csr" for n in nodes] and args.node == nodes
    for node in nodes:  # it writes exactly the bundle directory each node mounts
        written = (Path(args.out) / node).relative_to(CERTS).as_posix()
        assert written == BUNDLE.bundle(node).cert.parent.relative_to(BUNDLE.root).as_posix()
    (req_mount,) = [v for v in sign["volumes"] if _source(v) == "requests"]
    assert req_mount.get("read_only") is True
    assert {_source(v) for v in sign["volumes"]} == {"certs", "requests"}
    waits = {k: v["condition"] for k, v in sign["depends_on"].items()}
    assert waits == {
        n: "service_completed_successfully" for n in ["certs", *(f"{m}-key" for m in nodes)]
    }


def _mounted(svc: dict[str, Any], volumes: Path) -> dict[str, Path]:
    """A service's mount targets -> where its volumes (and subpaths) live under ``volumes``."""
    out = {}
    for vol in svc.get("volumes", []):
        sub = vol.get("volume", {}).get("subpath", "") if isinstance(vol, dict) else ""
        out[_target(vol)] = volumes / _source(vol) / sub
    return out


def _on_disk(path: str, mounts: dict[str, Path]) -> str:
    for target, where in mounts.items():
        if path == target or path.startswith(target + "/"):
            return str(where / path[len(target) :].lstrip("/"))
    return path


def test_compose_key_jobs_run_and_every_node_passes_its_startup_check(tmp_path: Path) -> None:
    """The admin's and the sites' jobs, run for real in start order on directories standing
    in for their volumes: every daemon then finds its own sound bundle, as it checks at
    startup, and no key but its own in what it mounts."""
    from mobius_fed.transport.enroll import check_bundle
    from mobius_fed.transport.tls import NodeTLS

    services, volumes = _services(), tmp_path / "volumes"
    jobs = ["certs", *(f"{n}-key" for n in _nodes()), "sign"]
    for name in jobs:
        mounts = _mounted(services[name], volumes)
        for where in mounts.values():
            where.mkdir(parents=True, exist_ok=True)
        argv = [_on_disk(a, mounts) for a in services[name]["command"]]
        assert main_cli.main(argv[1:]) == 0, name
    for node in _nodes():
        svc = services[node]
        mounts = _mounted(svc, volumes)
        env = svc["environment"]
        tls = NodeTLS(*(Path(_on_disk(env[f"MOBIUS_{k}"], mounts)) for k in ("CA", "CERT", "KEY")))
        check_bundle(node, tls)
        held = [p for d in mounts.values() if d.is_dir() for p in d.iterdir() if p.is_file()]
        assert [p for p in held if b"PRIVATE KEY" in p.read_bytes()] == [tls.key], node
    # the admin's volume holds the CA's and the operator's keys, no node's
    # the operator's bundle where the namespace testbed's operator_certs() reads it
    operator = volumes / "certs" / "nodes" / "operator"
    assert sorted(p.name for p in operator.iterdir()) == sorted(BUNDLE_FILES.values())
    admin_keys = sorted(p.relative_to(volumes).as_posix() for p in volumes.rglob("*.key"))
    assert admin_keys == [
        "certs/ca.key",
        "certs/nodes/operator/tls.key",
        "certs/operator.key",
        *(f"{n}-key/tls.key" for n in _nodes()),
    ]


def test_compose_stops_cleanly_and_heals() -> None:
    """An init as PID 1 on every service (SIGTERM reaches the daemon, zombies are reaped), a
    grace period longer than the daemons' 2 s stop; workers restart on failure only, so a
    finished worker (exit 0) stays stopped; a restarted coordinator resumes if it can."""
    from mobius_fed.testbed.compose import parse_duration

    services = _services()
    for name, svc in services.items():
        assert svc.get("init") is True, f"{name}: init: true (SIGTERM must reach the daemon)"
        grace = parse_duration(svc.get("stop_grace_period", "10s"))
        assert 2 < grace <= 10, f"{name}: stop_grace_period {grace}s"
    for i, svc in _compose_workers().items():
        policy = str(svc["restart"])
        assert re.fullmatch(r"on-failure(:\d+)?", policy), (
            f"worker-{i}: restart {policy!r} would restart a worker whose run is done"
        )
    coord = services["coordinator"]
    # exit 0 (the run is done, after lingering) stays stopped, so that
    # `docker compose up --exit-code-from coordinator` returns; a crash comes back
    assert re.fullmatch(r"on-failure(:\d+)?", str(coord["restart"])), coord["restart"]
    assert float(coord["environment"]["MOBIUS_LINGER"]) >= 0, "the coordinator must exit"
    assert coord["environment"]["MOBIUS_RESUME"] == "auto"
    env = _coordinator_env({})
    assert coord_config.load_coordinator_config(None, {}, {}, environ=env).resume == "auto"


def _target(vol: Any) -> str:
    return vol["target"] if isinstance(vol, dict) else vol.split(":")[1]


def _source(vol: Any) -> str:
    return vol["source"] if isinstance(vol, dict) else vol.split(":")[0]


def _volume_targets(svc: dict[str, Any]) -> set[str]:
    return {_target(v) for v in svc.get("volumes", [])}


def _check_compose_cert_mount(svc: dict[str, Any], node: str) -> None:
    mounts = [v for v in svc["volumes"] if _target(v) == CERTS]
    assert len(mounts) == 1, f"{node}: one certificate mount expected"
    (vol,) = mounts
    subpath = vol["volume"]["subpath"]
    expected = BUNDLE.bundle(node).cert.parent.relative_to(BUNDLE.root).as_posix()
    assert subpath == expected, (
        f"{node} mounts certificate bundle {subpath!r}, not its own {expected!r}"
    )


def _check_tls_env(
    env: dict[str, str], certs_dir: str, where: str, key_dir: str | None = None
) -> None:
    for key, file in BUNDLE_FILES.items():
        value = env[f"MOBIUS_{key.upper()}"]
        folder = key_dir if key == "key" and key_dir else certs_dir
        assert value == f"{folder}/{file}", f"{where}: MOBIUS_{key.upper()}={value}"


def _check_health(argv: list[str], port: int, server_name: str, env: dict[str, str]) -> None:
    args = _parse(argv)
    assert argv[0] == "mobius-fed" and args.command == "health", argv
    assert args.func.__name__ == "health_main"
    assert args.address == f"127.0.0.1:{port}"
    assert args.server_name == server_name
    assert not getattr(args, "insecure", False)
    assert (str(args.ca), str(args.cert), str(args.key)) == (
        env["MOBIUS_CA"],
        env["MOBIUS_CERT"],
        env["MOBIUS_KEY"],
    )


# ----------------------------------------------------------------------------- Kubernetes
def test_k8s_manifests_parse_and_kustomization_lists_them() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == files, f"kustomization resources {sorted(listed)} != manifests {sorted(files)}"
    for doc in _k8s_docs():
        assert "namespace" not in doc["metadata"], "manifests must stay namespace-agnostic"


def test_k8s_workers_yaml_is_rendered_from_the_template() -> None:
    spec = importlib.util.spec_from_file_location("render_workers", K8S / "render-workers.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render(_num_workers()) == (K8S / "workers.yaml").read_text(), (
        "workers.yaml is stale: python3 deploy/k8s/render-workers.py --workers P "
        "> deploy/k8s/workers.yaml"
    )


def test_k8s_workers_render_rings_with_their_labels() -> None:
    """``render-workers.py --workers 6 --rings 2``: six StatefulSets, worker-g labelled ring
    g // 3 and slot g mod 3 (Service, StatefulSet and pod); the committed file is one ring
    (ring 0 everywhere, as configmap.yaml's MOBIUS_RINGS says); a ring count that does
    not divide the workers is refused with the reason."""
    spec = importlib.util.spec_from_file_location("render_workers", K8S / "render-workers.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    docs = list(yaml.safe_load_all(module.render(6, rings=2)))
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    assert sorted(sets) == [f"worker-{g}" for g in range(6)]
    for g in range(6):
        want = {"mobius-fed/ring": str(g // 3), "mobius-fed/slot": str(g % 3)}
        st = sets[f"worker-{g}"]
        (svc,) = [
            d
            for d in docs
            if d["kind"] == "Service" and d["metadata"]["name"] == st["metadata"]["name"]
        ]
        for labels in (st["metadata"]["labels"], st["spec"]["template"]["metadata"]["labels"],
                       svc["metadata"]["labels"]):  # fmt: skip
            assert want.items() <= labels.items(), (g, labels)
        assert "mobius-fed/ring" not in st["spec"]["selector"]["matchLabels"]  # immutable
    assert {
        d["metadata"]["labels"]["mobius-fed/ring"]
        for d in _k8s_docs()
        if d["kind"] == "StatefulSet"
    } == {"0"}
    assert int(_k8s("ConfigMap", "mobius-config")["data"]["MOBIUS_RINGS"]) == 1
    with pytest.raises(SystemExit, match="--rings 3 does not divide --workers 4"):
        module.render(4, rings=3)


def test_k8s_names_and_ports_match_compose() -> None:
    P = _num_workers()
    assert sorted(_k8s_workers()) == list(range(P)), "one worker StatefulSet per compose worker"
    svc = _k8s("Service", "coordinator")["spec"]
    assert {p["name"]: p["port"] for p in svc["ports"]} == {
        "grpc": GRPC_PORT,
        "rest": REST_PORT,
        "metrics": METRICS_PORT,
    }
    headless = _k8s("Service", "worker")["spec"]
    assert headless["clusterIP"] == "None"
    assert [p["port"] for p in headless["ports"]] == [WORKER_PORT]
    for i in range(P):
        own = _k8s("Service", f"worker-{i}")["spec"]
        assert own["clusterIP"] == "None" and own["publishNotReadyAddresses"] is True
        assert [p["port"] for p in own["ports"]] == [WORKER_PORT]
    coord_env = _k8s("ConfigMap", "mobius-config")["data"]
    assert int(coord_env["MOBIUS_WORKERS"]) == P


def test_k8s_coordinator() -> None:
    dep = _k8s("Deployment", "coordinator")
    assert dep["spec"]["replicas"] == 1
    pod = dep["spec"]["template"]["spec"]
    c = _container(pod, "coordinator")
    assert _argv(c) == _services()["coordinator"]["command"]
    _parse(_argv(c))
    env = _pod_env(pod, c)
    bad = {k for k in env if k.startswith("MOBIUS_")} - COORD_VARS - COORD_TRAIN_VARS
    assert not bad, (
        f"k8s coordinator sets variables mobius-coordinator does not read: {sorted(bad)}"
    )
    cfg = coord_config.load_coordinator_config(None, {}, {}, environ=env)
    assert _port(cfg.listen) == GRPC_PORT and _port(cfg.rest_listen) == REST_PORT
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "grpc": GRPC_PORT,
        "rest": REST_PORT,
        "metrics": METRICS_PORT,
    }
    assert _port(cfg.metrics_listen or "") == METRICS_PORT
    assert env["MOBIUS_OUT_DIR"] == STATE
    _check_tls_env(env, CERTS, "k8s coordinator")
    mounts = _mounts(pod, c)
    assert {CERTS, STATE} <= set(mounts)
    _check_secret(mounts[CERTS], "coordinator")
    # httpGet on the plain metrics listener: no client certificate, no process per probe
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    _check_pod_security(pod, c)
    # Compose and Kubernetes run the same run shape.
    compose_env = _services()["coordinator"]["environment"]
    for key in ("MOBIUS_LISTEN", "MOBIUS_REST_LISTEN", "MOBIUS_REST_MODE", "MOBIUS_WORKERS"):
        assert str(compose_env[key]) == env[key], key


def test_k8s_workers_isolation_and_settings() -> None:
    secrets_seen: dict[str, int] = {}
    for i, sts in _k8s_workers().items():
        spec = sts["spec"]
        assert spec["replicas"] == 1, "one pod per worker StatefulSet (its own Secret)"
        assert spec["serviceName"] == "worker"
        labels = spec["template"]["metadata"]["labels"]
        assert labels.items() >= spec["selector"]["matchLabels"].items()
        own_svc = _k8s("Service", f"worker-{i}")["spec"]["selector"]
        assert labels.items() >= own_svc.items()
        assert labels.items() >= _k8s("Service", "worker")["spec"]["selector"].items()
        for j in _k8s_workers():
            if j != i:
                assert (
                    not labels.items() >= _k8s("Service", f"worker-{j}")["spec"]["selector"].items()
                )
        pod = spec["template"]["spec"]
        c = _container(pod, "worker")
        assert _argv(c) == _compose_workers()[i]["command"]
        _parse(_argv(c))
        env = _pod_env(pod, c)
        names = {k for k in env if k.startswith("MOBIUS_")}
        assert not names - WORKER_VARS - WORKER_TRAIN_VARS, (
            f"k8s worker-{i} sets variables mobius-worker does not read: "
            f"{sorted(names - WORKER_VARS - WORKER_TRAIN_VARS)}"
        )
        assert not names & WORKER_TRAIN_VARS, (
            f"worker-{i} must take training config from the coordinator"
        )
        assert env["MOBIUS_COORDINATOR"] == f"coordinator:{GRPC_PORT}"
        assert env["MOBIUS_ADVERTISE"] == f"worker-{i}:{WORKER_PORT}"
        assert _port(env["MOBIUS_LISTEN"]) == WORKER_PORT
        assert env["MOBIUS_DATA_DIR"] == f"{DATA}/site-{i}"
        assert env["MOBIUS_OUT_DIR"] == STATE
        _check_tls_env(env, CERTS, f"k8s worker-{i}")
        assert [p["containerPort"] for p in c["ports"]] == [WORKER_PORT]
        _check_health(c["readinessProbe"]["exec"]["command"], WORKER_PORT, f"worker-{i}", env)
        mounts = _mounts(pod, c)
        assert set(mounts) >= {CERTS, DATA, STATE}
        _check_secret(mounts[CERTS], f"worker-{i}")
        assert mounts[DATA].get("readOnly") is True
        claims = {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
        assert {mounts[DATA]["name"], mounts[STATE]["name"]} <= claims
        # Every Secret any of this pod's volumes names is its own.
        for vol in pod.get("volumes", []):
            if "secret" in vol:
                name = vol["secret"]["secretName"]
                assert name == f"mobius-worker-{i}-tls", f"worker-{i} mounts Secret {name}"
                secrets_seen[name] = secrets_seen.get(name, 0) + 1
            assert "projected" not in vol, "projected volumes could mix other nodes' keys in"
        (init,) = pod["initContainers"]
        prep = _parse(_argv(init))
        assert prep.command == "prepare" and prep.site == i and prep.sites == _num_workers()
        assert str(prep.out) == DATA
        assert _mounts(pod, init)[DATA]["name"] == mounts[DATA]["name"]
        _check_pod_security(pod, c)
    assert all(n == 1 for n in secrets_seen.values())


def test_k8s_resume_auto_and_termination_grace() -> None:
    env = _k8s("ConfigMap", "mobius-config")["data"]
    assert env["MOBIUS_RESUME"] == "auto", "a restarted coordinator pod must resume by itself"
    pods = [_k8s("Deployment", "coordinator")["spec"]["template"]["spec"]]
    pods += [sts["spec"]["template"]["spec"] for sts in _k8s_workers().values()]
    for pod in pods:
        assert 2 < pod["terminationGracePeriodSeconds"] <= 30


def _check_secret(mount: dict[str, Any], node: str) -> None:
    assert mount.get("readOnly") is True
    secret = mount["secret"]
    assert secret["secretName"] == f"mobius-{node}-tls"
    assert {it["key"] for it in secret["items"]} == set(BUNDLE_FILES.values())
    assert all(it["key"] == it["path"] for it in secret["items"])


def _check_pod_security(pod: dict[str, Any], container: dict[str, Any]) -> None:
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001 and sc["fsGroup"] == 10001
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["image"] == "mobius-fed:latest"


def test_make_secrets_script_uses_the_bundle_layout() -> None:
    one = (K8S / "make-secret.sh").read_text()
    assert "mobius-$node-tls" in one
    for f in BUNDLE_FILES.values():
        assert f'--from-file={f}="$dir/{f}"' in one
    assert 'certs check --node "$node" --dir "$dir"' in one
    lab = (K8S / "make-secrets.sh").read_text()
    assert "dir=$certs/nodes/$node" in lab
    assert '"$(dirname "$0")/make-secret.sh" "$node" "$dir" "$@"' in lab
    assert "nodes=coordinator" in lab and 'nodes="$nodes worker-$i"' in lab


def test_make_secret_checks_the_sites_bundle_before_kubectl(tmp_path: Path) -> None:
    """make-secret.sh with a bundle from the real request/sign flow, and a stand-in kubectl
    that records what it was asked: the right Secret, or a refusal naming the problem."""
    import os
    import shutil
    import subprocess
    import sys

    from mobius_fed.transport.enroll import make_ca, request_node, sign_request

    ca = make_ca(tmp_path / "admin")
    site = tmp_path / "site"
    req = request_node("worker-2", site)
    signed = sign_request(req.csr, "worker-2", ca)
    shutil.copy(signed.cert, site / "tls.crt")
    shutil.copy(signed.ca, site / "ca.crt")
    log = tmp_path / "kubectl.log"
    fake = tmp_path / "kubectl"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\necho "kind: Secret"\n')
    mobius = tmp_path / "mobius-fed"
    mobius.write_text(f'#!/bin/sh\nexec {sys.executable} -m mobius_fed.cli.main "$@"\n')
    for f in (fake, mobius):
        f.chmod(0o755)
    env = {**os.environ, "KUBECTL": str(fake), "MOBIUSFED": str(mobius), "DRY_RUN": "1"}

    def run(node: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["sh", str(K8S / "make-secret.sh"), node, str(site), "-n", "site-2"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = run("worker-2")
    assert done.returncode == 0, done.stderr
    assert "kind: Secret" in done.stdout and "ok:" in done.stderr
    (call,) = log.read_text().splitlines()
    assert call.startswith("create secret generic mobius-worker-2-tls -n site-2 ")
    for f in BUNDLE_FILES.values():
        assert f"--from-file={f}={site}/{f}" in call
    wrong = run("worker-1")
    assert wrong.returncode != 0 and "not worker-1's mobius://worker/1" in wrong.stderr
    assert len(log.read_text().splitlines()) == 1, "kubectl must not run for a refused bundle"


# ----------------------------------------------------------------------------- systemd
UNITS = {"coordinator": "mobius-coordinator", "worker": "mobius-worker"}


@pytest.mark.parametrize("role", sorted(UNITS))
def test_systemd_units_and_env_files(role: str) -> None:
    unit = _unit(SYSTEMD / f"{UNITS[role]}.service")
    (env_path,) = unit["EnvironmentFile"]
    example = SYSTEMD / f"{Path(env_path).name}.example"
    assert example.is_file(), f"{env_path} has no example {example.name}"
    assert env_path == f"/etc/mobius/{role}.env"
    (exec_start,) = unit["ExecStart"]
    argv = shlex.split(exec_start)
    assert Path(argv[0]).name == UNITS[role]
    _parse([Path(argv[0]).name, *argv[1:]])
    assert unit["User"] == ["mobius"] and unit["NoNewPrivileges"] == ["yes"]
    assert unit["ProtectSystem"] == ["strict"]
    assert unit["Restart"] == ["on-failure"]
    # systemctl stop: SIGTERM, which the daemon answers with 0 or 143 within 2 s.
    assert unit.get("KillSignal", ["SIGTERM"]) == ["SIGTERM"]
    assert "143" in " ".join(unit.get("SuccessExitStatus", [])).split()
    writable = unit["ReadWritePaths"][0].split()

    env = _env_file(example)
    allowed = (
        (WORKER_VARS | WORKER_TRAIN_VARS) if role == "worker" else (COORD_VARS | COORD_TRAIN_VARS)
    )
    assert not set(env) - allowed, f"{example.name}: unknown variables {sorted(set(env) - allowed)}"
    _check_tls_env(env, "/etc/mobius/certs", example.name)
    assert any(env["MOBIUS_OUT_DIR"].startswith(w + "/") for w in writable)
    _check_unit_key_commands(SYSTEMD / f"{UNITS[role]}.service", role)
    active = _env_file_active(example)
    if role == "coordinator":
        assert _port(active["MOBIUS_LISTEN"]) == GRPC_PORT
        assert _port(active["MOBIUS_REST_LISTEN"]) == REST_PORT
        cfg = coord_config.load_coordinator_config(None, {}, {}, environ=active)
        assert cfg.train.workers == int(active["MOBIUS_WORKERS"])
        assert cfg.resume == "auto"
        assert cfg.train.rings == int(active["MOBIUS_RINGS"]) == 1
        rings = coord_config.load_coordinator_config(
            None, {}, {}, environ={**active, "MOBIUS_RINGS": "2"}
        )
        assert (rings.train.rings, rings.train.P) == (2, cfg.train.workers // 2)
    else:
        assert _port(active["MOBIUS_LISTEN"]) == WORKER_PORT
        assert _port(active["MOBIUS_ADVERTISE"]) == WORKER_PORT
        assert _port(active["MOBIUS_COORDINATOR"]) == GRPC_PORT
        assert not set(env) & WORKER_TRAIN_VARS
        assert re.fullmatch(r"/var/lib/mobius/data/site-\d+", active["MOBIUS_DATA_DIR"])
        wc = worker_config.load_worker_config(None, {}, {}, environ=active)
        assert wc.coordinator == active["MOBIUS_COORDINATOR"]


# ----------------------------------------------------------------------------- packaging
# import name → distribution name, where they differ
DISTRIBUTION = {
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "google": "protobuf",
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
    "mlflow": "mlflow-skinny",  # the tracking client without the server's dependencies
}


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ @]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def _third_party_imports() -> set[str]:
    import ast
    import sys

    found: set[str] = set()
    for path in (ROOT / "mobius_fed").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in (n.split(".")[0] for n in names):
                if name not in sys.stdlib_module_names and name not in ("mobius_fed", "__future__"):
                    found.add(name)
    return found


def test_dependencies_are_declared_exactly_as_imported() -> None:
    project = read_toml(ROOT / "pyproject.toml")["project"]
    required = {_requirement_name(r) for r in project["dependencies"]}
    extras = {
        _requirement_name(r)
        for name, reqs in project["optional-dependencies"].items()
        if name != "dev"
        for r in reqs
        if not r.startswith("mobius-fed")
    }
    imported = {DISTRIBUTION.get(n, n).lower().replace("_", "-") for n in _third_party_imports()}
    assert imported - required - extras == set(), "imported but not declared"
    assert required - imported == set(), "declared but never imported"
    assert "typer" not in required
    assert {"pyarrow"} <= {
        _requirement_name(r) for r in project["optional-dependencies"]["parquet"]
    }
    assert not any(r.startswith("tomli") for r in project["dependencies"])  # tomllib (3.11)
    assert "urls" in project


def test_ci_pins_fall_in_the_declared_ranges() -> None:
    from packaging.requirements import Requirement

    project = read_toml(ROOT / "pyproject.toml")["project"]
    declared = {
        Requirement(r).name.lower(): Requirement(r)
        for reqs in (project["dependencies"], *project["optional-dependencies"].values())
        for r in reqs
        if not r.startswith("mobius-fed")
    }
    pins = [
        Requirement(ln.split("#")[0].strip())
        for ln in (ROOT / "requirements-ci.txt").read_text().splitlines()
        if ln.split("#")[0].strip()
    ]
    for pin in pins:
        version = str(next(iter(pin.specifier)).version)
        assert pin.name.lower() in declared, f"requirements-ci.txt pins undeclared {pin.name}"
        assert declared[pin.name.lower()].specifier.contains(version), (pin, declared[pin.name])
    for capped in ("flwr", "grpcio", "protobuf"):
        assert any(s.operator == "<" for s in declared[capped].specifier), capped
    assert not any(s.operator == "==" for s in declared["torch"].specifier)


def test_dashboard_assets_are_package_data() -> None:
    static = ROOT / "mobius_fed" / "coordinator" / "static"
    patterns = read_toml(ROOT / "pyproject.toml")["tool"]["setuptools"]["package-data"]
    globs = patterns["mobius_fed.coordinator"]
    for path in static.rglob("*"):
        if path.is_file():
            rel = path.relative_to(static.parent)
            assert any(rel.match(g) or (g.endswith("**/*") and str(rel).startswith(g[:-4]))
                       for g in globs), rel  # fmt: skip


def _check_unit_key_commands(unit: Path, role: str) -> None:
    """The unit's install notes make the key on the host (certs request) and check the
    bundle (certs check) into the paths the env file names; the commands parse."""
    lines = [ln.lstrip("#").strip() for ln in unit.read_text().splitlines()]
    commands, current = [], ""
    for line in lines:
        if line.startswith("sudo -u mobius") or current:
            current += " " + line.split("#")[0].rstrip("\\ ").strip()
            if not line.split("#")[0].rstrip().endswith("\\"):
                commands.append(current.strip())
                current = ""
    node = "coordinator" if role == "coordinator" else "worker-<i>"
    actions = {}
    for cmd in commands:
        argv = shlex.split(cmd.replace("<i>", "0").replace("<host>", "h.example.org"))
        argv = argv[argv.index("sudo") + 3 :] if argv[0] == "sudo" else argv
        args = _parse(["mobius-fed", *argv[1:]])
        assert args.node == node.replace("<i>", "0")
        actions[args.certs_command] = args
    assert set(actions) == {"request", "check"}, commands
    assert str(actions["request"].out) == "/etc/mobius/certs"
    assert str(actions["check"].dir) == "/etc/mobius/certs"
