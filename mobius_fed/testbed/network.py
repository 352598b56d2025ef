"""The testbed's network: one namespace per service plus a switch namespace with a bridge
per compose network, veths, the address plan, per-namespace hosts files, and the WAN shape
(tc rate limits on the veths, delay-line relays; see :mod:`mobius_fed.testbed.wan`)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from mobius_fed.testbed.compose import ComposeProject, Service
from mobius_fed.testbed.namespaces import (
    NETNS_ETC,
    TestbedError,
    ip,
    kill_netns_processes,
    kill_process_groups,
    list_netns,
    log,
    lookup_service,
)

if TYPE_CHECKING:  # wan is imported where used: `python -m mobius_fed.testbed.wan` runs it
    from mobius_fed.testbed.wan import WanShape

SUBNET = "10.213"  # network k gets 10.213.<k+1>.0/24
SWITCH = "switch"


class TestbedNetwork:
    """Namespaces, bridges, veths, addresses and /etc/netns files of one testbed."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        project: ComposeProject,
        prefix: str,
        wan: Mapping[str, WanShape],
        say: Callable[[str], None],
    ) -> None:
        self.project, self.prefix, self.wan, self._say = project, prefix, wan, say
        self.addresses: dict[str, dict[str, str]] = {}  # service -> network -> address
        self.created: list[str] = []  # namespaces, in creation order
        self._etc_dirs: list[Path] = []
        self._made_netns_etc = False
        self._relays: list[subprocess.Popen[bytes]] = []  # delay lines (see wan.py)

    # ------------------------------------------------------------------ naming
    def namespace(self, service: str) -> str:
        return f"{self.prefix}-{lookup_service(self.project, service).name}"

    @property
    def switch_namespace(self) -> str:
        return f"{self.prefix}-{SWITCH}"

    def namespaces(self) -> list[str]:
        """Every namespace this testbed creates (switch first)."""
        return [self.switch_namespace] + [self.namespace(s) for s in self.project.services]

    def address(self, service: str, network: str | None = None) -> str:
        """The service's IPv4 address on ``network`` (default: its first network)."""
        addrs = self.addresses[lookup_service(self.project, service).name]
        if not addrs:
            raise TestbedError(f"service {service} has no network (network_mode: none)")
        return addrs[network] if network else next(iter(addrs.values()))

    def plan_addresses(self) -> None:
        """Give the i-th service on network k the address ``10.213.<k+1>.<i+2>``."""
        nets = list(self.project.networks)
        if len(nets) > 254:
            raise TestbedError("at most 254 networks")
        count = dict.fromkeys(nets, 0)
        for svc in self.project.services.values():
            self.addresses[svc.name] = {}
            for net in svc.networks:
                count[net] += 1
                if count[net] > 253:
                    raise TestbedError(f"network {net}: more than 253 services")
                k = nets.index(net)
                self.addresses[svc.name][net] = f"{SUBNET}.{k + 1}.{count[net] + 1}"

    def hosts_file(self, service: str) -> str:
        """The /etc/hosts the service sees."""
        svc = lookup_service(self.project, service)
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        seen = {svc.name}
        own = self.addresses[svc.name]
        if own:
            aliases = [a for n in svc.networks for a in svc.networks[n]]
            lines.append("\t".join([next(iter(own.values())), svc.name, *aliases]))
        else:
            lines[0] += f" {svc.name}"
        for net in svc.networks:
            for other in self.project.services.values():
                if other.name in seen or net not in other.networks:
                    continue
                seen.add(other.name)
                lines.append(
                    "\t".join([self.addresses[other.name][net], other.name, *other.networks[net]])
                )
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        """Create the switch with its bridges, then each service's namespace and links."""
        self._make_namespace(self.switch_namespace)
        for k in range(len(self.project.networks)):
            ip("-n", self.switch_namespace, "link", "add", f"br{k}", "type", "bridge")
            ip("-n", self.switch_namespace, "link", "set", f"br{k}", "up")
        for j, svc in enumerate(self.project.services.values()):
            self._add_host(j, svc)

    def _add_host(self, j: int, svc: Service) -> None:
        """Namespace, one veth per network (shaped per ``wan``) and /etc files of ``svc``."""
        nets = list(self.project.networks)
        ns, switch = self.namespace(svc.name), self.switch_namespace
        self._make_namespace(ns)
        ip("-n", ns, "link", "set", "lo", "up")
        if self.wan:
            from mobius_fed.testbed.wan import limit_send_buffer, send_buffer_bytes

            cap = send_buffer_bytes(self.wan.values())
            if cap is not None:  # every host's queues hold no more time than a real one's
                limit_send_buffer(ns, cap)
        for i, net in enumerate(svc.networks):
            k = nets.index(net)
            port, eth = f"n{k}s{j}", f"eth{i}"
            ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", eth, "netns", ns)
            ip("-n", switch, "link", "set", port, "master", f"br{k}", "up")
            ip("-n", ns, "addr", "add", f"{self.addresses[svc.name][net]}/24", "dev", eth)
            ip("-n", ns, "link", "set", eth, "up")
            shape = self.wan.get(svc.name)
            if shape is not None and shape.rate is not None:
                from mobius_fed.testbed.wan import shape_device

                shape_device(ns, eth, shape.rate)  # upload
                shape_device(switch, port, shape.rate)  # download
        self._write_etc(svc)
        addrs = ", ".join(f"{n} {a}" for n, a in self.addresses[svc.name].items())
        shaped = f"; WAN {self.wan[svc.name].describe()}" if svc.name in self.wan else ""
        self._say(f"host {svc.name}: namespace {ns}, {addrs or 'loopback only'}{shaped}")

    def _make_namespace(self, ns: str) -> None:
        if ns in list_netns():
            raise TestbedError(f"namespace {ns} exists already (cleanup_stale({self.prefix!r}))")
        ip("netns", "add", ns)
        self.created.append(ns)

    def _write_etc(self, svc: Service) -> None:
        if not NETNS_ETC.exists():
            NETNS_ETC.mkdir(parents=True)
            self._made_netns_etc = True
        d = NETNS_ETC / self.namespace(svc.name)
        d.mkdir(parents=True, exist_ok=True)
        self._etc_dirs.append(d)
        (d / "hosts").write_text(self.hosts_file(svc.name))
        (d / "resolv.conf").write_text("# mobius-fed testbed: names come from /etc/hosts only\n")

    def start_delay_lines(
        self, logs_dir: Path, env_of: Callable[[Service], dict[str, str]]
    ) -> None:
        """One delay-line relay per networked service; its outgoing TCP goes through it."""
        from mobius_fed.testbed.wan import WanShape, redirect_rules, relay_argv

        none = WanShape()
        for svc in self.project.services.values():
            if not self.addresses[svc.name]:
                continue
            ns = self.namespace(svc.name)
            peers = {
                addr: self.wan.get(other, none)
                for other, addrs in self.addresses.items()
                if other != svc.name
                for addr in addrs.values()
            }
            argv = relay_argv(self.wan.get(svc.name, none), peers)
            log_path = logs_dir / f"delay-line-{svc.name}.log"
            with open(log_path, "ab") as err:
                p = subprocess.Popen(
                    ["ip", "netns", "exec", ns, *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    start_new_session=True,
                    cwd="/",
                    env={**env_of(svc), "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                )
            line = p.stdout.readline().decode(errors="replace").strip() if p.stdout else ""
            if line != "ready":
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise TestbedError(
                    f"delay line of {svc.name} did not start (exit {p.poll()}): {' | '.join(tail)}"
                )
            self._relays.append(p)
            redirect_rules(ns, f"{SUBNET}.0.0/16")

    # ------------------------------------------------------------------ teardown
    def kill_processes(self) -> None:
        """SIGTERM, then SIGKILL, every process left in this testbed's namespaces."""
        kill_netns_processes([ns for ns in self.created if ns in set(list_netns())], grace=5.0)

    def remove(self) -> None:
        """Stop the delay lines; delete namespaces (with veths and bridges) and /etc/netns."""
        kill_process_groups(self._relays)
        for ns in reversed(self.created):
            ip("netns", "del", ns, check=False)
        for d in self._etc_dirs:
            shutil.rmtree(d, ignore_errors=True)
        if self._made_netns_etc:
            with contextlib.suppress(OSError):
                NETNS_ETC.rmdir()
        leftover = [ns for ns in self.created if ns in set(list_netns())]
        if leftover:
            log.warning("namespaces not removed: %s", leftover)
