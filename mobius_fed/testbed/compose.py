"""Read a Compose file into the plain description the namespace testbed runs.

Only what a testbed without a container engine can honour is modelled: commands,
environment, volumes, networks, ``depends_on`` conditions, health checks and restart
policies. Keys that need an engine (``image``, ``build``, ``ports``, ...) are reported in
:attr:`ComposeProject.notes` and otherwise ignored.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
DEFAULT_NETWORK = "default"

# Keys that are accepted but have no effect here (each use is noted once per service).
_IGNORED_KEYS = {
    "image": "no container engine: the command runs with this machine's installed tools",
    "build": "no container engine: nothing is built",
    "ports": "nothing is published to the host; reach the service from inside the testbed",
    "expose": "every port is reachable from services on a shared network",
    "container_name": "the namespace is named <prefix>-<service>",
    "hostname": "the service is reachable by its service name",
    "labels": "ignored",
    "logging": "logs go to <root>/logs/<service>.log",
    "deploy": "ignored",
    "init": "ignored",
    "stop_grace_period": "ignored (processes get SIGTERM, then SIGKILL)",
    "user": "processes run as the invoking user",
    "working_dir": "ignored",
    "platform": "ignored",
    "pull_policy": "ignored",
    "profiles": "ignored",
    "tty": "ignored",
    "stdin_open": "ignored",
}
_SUPPORTED_KEYS = {
    "command",
    "entrypoint",
    "environment",
    "volumes",
    "networks",
    "network_mode",
    "depends_on",
    "healthcheck",
    "restart",
}


class ComposeError(ValueError):
    """The compose file uses something this testbed cannot run, or is malformed."""


@dataclass(frozen=True)
class Mount:
    """One volume of a service: ``source`` (a host directory or file) at ``target``."""

    kind: str  # "volume" | "bind" | "tmpfs"
    source: str | None  # volume name, or a host path for binds; None for tmpfs/anonymous
    target: str
    read_only: bool = False
    subpath: str | None = None


@dataclass(frozen=True)
class Healthcheck:
    """A service's health test as an argv, and its timing in seconds."""

    argv: list[str]
    interval: float = 30.0
    timeout: float = 30.0
    retries: int = 3
    start_period: float = 0.0
    start_interval: float = 5.0


@dataclass
class Service:
    name: str
    argv: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    networks: dict[str, list[str]] = field(default_factory=dict)  # network -> aliases
    depends_on: dict[str, str] = field(default_factory=dict)  # service -> condition
    healthcheck: Healthcheck | None = None
    restart: str = "no"  # "no" | "always" | "unless-stopped" | "on-failure"
    max_restarts: int | None = None  # on-failure:N

    @property
    def isolated(self) -> bool:
        """``network_mode: none``: only a loopback interface."""
        return not self.networks


@dataclass
class ComposeProject:
    name: str
    base_dir: Path
    services: dict[str, Service]
    networks: dict[str, dict[str, Any]]
    volumes: dict[str, dict[str, Any]]
    notes: list[str] = field(default_factory=list)

    def start_order(self) -> list[str]:
        """Services in dependency order (dependencies first; file order breaks ties)."""
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(name: str, chain: list[str]) -> None:
            if state.get(name) == 2:
                return
            if state.get(name) == 1:
                raise ComposeError(f"depends_on cycle: {' -> '.join([*chain, name])}")
            state[name] = 1
            for dep in self.services[name].depends_on:
                visit(dep, [*chain, name])
            state[name] = 2
            order.append(name)

        for name in self.services:
            visit(name, [])
        return order


# --------------------------------------------------------------------------- interpolation
_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?+])?(?P<arg>[^}]*)\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: str, environ: Mapping[str, str]) -> str:
    """Compose-style ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
    ``${VAR:?error}``, ``${VAR:+alt}`` and ``$$`` (a literal ``$``)."""

    def sub(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("named") or m.group("braced")
        op, arg = m.group("op"), m.group("arg") or ""
        val = environ.get(name)
        if op is None:
            if arg:
                raise ComposeError(f"invalid interpolation: {m.group(0)!r}")
            return val or ""
        unset_or_empty = val is None or (op.startswith(":") and val == "")
        kind = op[-1]
        if kind == "-":
            return interpolate(arg, environ) if unset_or_empty else val or ""
        if kind == "?":
            if unset_or_empty:
                raise ComposeError(f"required variable {name} is missing: {arg or 'unset'}")
            return val or ""
        return "" if unset_or_empty else interpolate(arg, environ)  # "+"

    return _VAR.sub(sub, value)


def _interpolate_tree(node: Any, environ: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, environ)
    if isinstance(node, list):
        return [_interpolate_tree(v, environ) for v in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, environ) for k, v in node.items()}
    return node


# --------------------------------------------------------------------------- helpers
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any, what: str = "duration") -> float:
    """``"1m30s"``, ``"5s"``, ``"500ms"`` or a number of seconds."""
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ComposeError(f"{what}: not a duration: {value!r}")
    return total


def _argv(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return [str(v) for v in value]
    raise ComposeError(f"{what}: expected a string or a list of strings, got {value!r}")


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


def _environment(value: Any, svc: str) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): _scalar(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        env: dict[str, str] = {}
        for item in value:
            key, sep, val = str(item).partition("=")
            if sep:
                env[key] = val
            elif key in os.environ:  # "- NAME" passes the host's value through
                env[key] = os.environ[key]
        return env
    raise ComposeError(f"service {svc}: environment must be a map or a list")


def _short_volume(spec: str, svc: str) -> Mount:
    parts = spec.split(":")
    if len(parts) == 1:
        return Mount("volume", None, parts[0])  # anonymous volume
    if len(parts) > 3:
        raise ComposeError(f"service {svc}: cannot parse volume {spec!r}")
    source, target = parts[0], parts[1]
    opts = parts[2].split(",") if len(parts) == 3 else []
    kind = "bind" if source.startswith((".", "/", "~")) else "volume"
    return Mount(kind, source, target, read_only="ro" in opts)


def _long_volume(spec: dict[str, Any], svc: str) -> Mount:
    kind = spec.get("type", "volume")
    target = spec.get("target")
    if not target:
        raise ComposeError(f"service {svc}: volume {spec!r} has no target")
    if kind not in ("volume", "bind", "tmpfs"):
        raise ComposeError(f"service {svc}: volume type {kind!r} is not supported")
    sub = (spec.get("volume") or {}).get("subpath") if kind == "volume" else None
    if kind == "bind" and not spec.get("source"):
        raise ComposeError(f"service {svc}: bind volume for {target} has no source")
    return Mount(kind, spec.get("source"), target, bool(spec.get("read_only", False)), sub)


def _networks(raw: dict[str, Any], svc: str) -> dict[str, list[str]]:
    mode = raw.get("network_mode")
    nets = raw.get("networks")
    if mode is not None:
        if mode != "none":
            raise ComposeError(
                f"service {svc}: network_mode {mode!r} is not supported (only 'none')"
            )
        if nets:
            raise ComposeError(f"service {svc}: network_mode none together with networks")
        return {}
    if nets is None:
        return {DEFAULT_NETWORK: []}
    if isinstance(nets, list):
        return {str(n): [] for n in nets}
    if isinstance(nets, dict):
        out = {}
        for n, opts in nets.items():
            opts = opts or {}
            if "ipv4_address" in opts or "ipv6_address" in opts:
                raise ComposeError(f"service {svc}: fixed addresses are not supported")
            out[str(n)] = [str(a) for a in opts.get("aliases", [])]
        return out
    raise ComposeError(f"service {svc}: networks must be a list or a map")


def _depends_on(value: Any, svc: str) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, list):
        return {str(d): "service_started" for d in value}
    if isinstance(value, dict):
        out = {}
        for dep, opts in value.items():
            cond = (opts or {}).get("condition", "service_started")
            if cond not in CONDITIONS:
                raise ComposeError(f"service {svc}: unknown depends_on condition {cond!r}")
            out[str(dep)] = cond
        return out
    raise ComposeError(f"service {svc}: depends_on must be a list or a map")


def _healthcheck(value: Any, svc: str) -> Healthcheck | None:
    if not value or value.get("disable"):
        return None
    test = value.get("test")
    if isinstance(test, str):
        argv = ["sh", "-c", test]
    elif isinstance(test, list) and test:
        head, rest = test[0], [str(t) for t in test[1:]]
        if head == "NONE":
            return None
        if head == "CMD":
            argv = rest
        elif head == "CMD-SHELL":
            argv = ["sh", "-c", " ".join(rest)]
        else:
            raise ComposeError(f"service {svc}: healthcheck test must start with CMD/CMD-SHELL")
    else:
        raise ComposeError(f"service {svc}: healthcheck has no test")
    if not argv:
        raise ComposeError(f"service {svc}: empty healthcheck test")
    timing = {
        key: parse_duration(value[key], f"service {svc}: healthcheck.{key}")
        for key in ("interval", "timeout", "start_period", "start_interval")
        if value.get(key) is not None
    }  # unset ones keep Healthcheck's defaults
    return Healthcheck(argv=argv, retries=int(value.get("retries", 3)), **timing)


def _restart(value: Any, svc: str) -> tuple[str, int | None]:
    text = "no" if value in (None, False) else str(value)
    policy, _, count = text.partition(":")
    if policy not in ("no", "always", "unless-stopped", "on-failure"):
        raise ComposeError(f"service {svc}: unknown restart policy {text!r}")
    if count and policy != "on-failure":
        raise ComposeError(f"service {svc}: restart {text!r}: only on-failure takes a count")
    try:
        return policy, int(count) if count else None
    except ValueError:
        raise ComposeError(f"service {svc}: restart {text!r}: bad retry count") from None


# --------------------------------------------------------------------------- loading
def load_compose(
    path: str | os.PathLike[str],
    *,
    environ: Mapping[str, str] | None = None,
    project: str | None = None,
) -> ComposeProject:
    """Parse ``path`` (``${VAR:-default}`` expanded from ``environ``, default os.environ)."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ComposeError(f"cannot read compose file {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        raise ComposeError(f"{path}: no services")
    doc = {k: v for k, v in doc.items() if not str(k).startswith("x-")}
    doc = _interpolate_tree(doc, os.environ if environ is None else environ)
    notes: list[str] = []
    services = {str(n): _service(str(n), raw or {}, notes) for n, raw in doc["services"].items()}
    networks = {str(k): dict(v or {}) for k, v in (doc.get("networks") or {}).items()}
    volumes = {str(k): dict(v or {}) for k, v in (doc.get("volumes") or {}).items()}
    _check_references(services, networks, volumes)
    for net, opts in networks.items():
        for key in opts:
            if key not in ("internal", "driver", "name", "labels", "attachable"):
                notes.append(f"network {net}: {key}: ignored")
    name = project or str(doc.get("name") or path.resolve().parent.name)
    proj = ComposeProject(name, path.resolve().parent, services, networks, volumes, notes)
    proj.start_order()  # reject cycles early
    return proj


def _service(name: str, raw: dict, notes: list[str]) -> Service:
    """One service of the compose file; keys the testbed ignores are noted."""
    for key in raw:
        if key in _SUPPORTED_KEYS:
            continue
        why = _IGNORED_KEYS.get(key, "not supported by the namespace testbed; ignored")
        notes.append(f"service {name}: {key}: {why}")
    argv = _argv(raw.get("entrypoint"), f"service {name}: entrypoint") + _argv(
        raw.get("command"), f"service {name}: command"
    )
    if not argv:
        raise ComposeError(f"service {name}: no command (there is no image to supply one)")
    mounts = []
    for spec in raw.get("volumes") or []:
        if isinstance(spec, str):
            mounts.append(_short_volume(spec, name))
        elif isinstance(spec, dict):
            mounts.append(_long_volume(spec, name))
        else:
            raise ComposeError(f"service {name}: cannot parse volume {spec!r}")
    policy, count = _restart(raw.get("restart"), name)
    return Service(
        name=name,
        argv=argv,
        environment=_environment(raw.get("environment"), name),
        mounts=mounts,
        networks=_networks(raw, name),
        depends_on=_depends_on(raw.get("depends_on"), name),
        healthcheck=_healthcheck(raw.get("healthcheck"), name),
        restart=policy,
        max_restarts=count,
    )


def _check_references(
    services: dict[str, Service], networks: dict[str, dict], volumes: dict[str, dict]
) -> None:
    """Every network, volume and dependency a service names is declared (the default network
    is added when used)."""
    for svc in services.values():
        for net in svc.networks:
            if net not in networks:
                if net != DEFAULT_NETWORK:
                    raise ComposeError(f"service {svc.name}: undeclared network {net!r}")
                networks[DEFAULT_NETWORK] = {}
        for m in svc.mounts:
            if m.kind == "volume" and m.source is not None and m.source not in volumes:
                raise ComposeError(f"service {svc.name}: undeclared volume {m.source!r}")
        for dep, cond in svc.depends_on.items():
            if dep not in services:
                raise ComposeError(f"service {svc.name}: depends on unknown service {dep!r}")
            if cond == "service_healthy" and services[dep].healthcheck is None:
                raise ComposeError(
                    f"service {svc.name}: depends on {dep} being healthy, but {dep} has no "
                    "healthcheck"
                )
