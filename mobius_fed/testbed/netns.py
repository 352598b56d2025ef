"""Run a Compose project without a container engine: one Linux network namespace per service.

Layout (everything lives in namespaces this module creates; the root namespace gets no
interface, address or route):

- ``<prefix>-switch`` holds one Linux bridge per compose network;
- ``<prefix>-<service>`` holds the service: ``lo`` plus one veth per attached network
  (``eth0``, ``eth1``, ... in the service's order), whose peer is a port of that network's
  bridge in the switch namespace. Network *k* is ``10.213.<k+1>.0/24``; no namespace has a
  default route, so every network is as closed as a compose ``internal: true`` one.
- ``/etc/netns/<prefix>-<service>/hosts`` maps every service name reachable on a shared
  network to its address there (``ip netns exec`` bind-mounts it over ``/etc/hosts``), and
  an empty ``resolv.conf`` keeps lookups of other names from waiting for a DNS server.
- each process runs as ``ip netns exec NS unshare --mount --propagation private -- sh -c
  SCRIPT sh ARGV...``: the script mounts a private tmpfs over each volume target's top-level
  directory (e.g. ``/srv``; the host's stays untouched), bind-mounts every volume onto its
  target (read-only ones remounted ``ro``), then ``exec``\\ s the command, so the service's
  main pid is the command's own pid.
- named volumes are directories ``<root>/volumes/<name>``; logs go to ``<root>/logs``.

:meth:`Testbed.down` (also run by ``__exit__``) kills every process in the namespaces and
removes namespaces, veths, bridges and ``/etc/netns`` entries. :func:`cleanup_stale` does
the same for the leftovers of a run that was killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mobius_fed.testbed.compose import ComposeProject, Healthcheck, Mount, Service, load_compose

if TYPE_CHECKING:  # wan is imported where used: `python -m mobius_fed.testbed.wan` runs it
    from mobius_fed.testbed.wan import WanShape

log = logging.getLogger("mobius_fed.testbed")

NETNS_ETC = Path("/etc/netns")
SUBNET = "10.213"  # network k gets 10.213.<k+1>.0/24
SWITCH = "switch"
# Top-level directories never covered by a private tmpfs (the system lives there).
_SYSTEM_TOPS = {
    "bin",
    "boot",
    "dev",
    "etc",
    "home",
    "lib",
    "lib32",
    "lib64",
    "libx32",
    "proc",
    "root",
    "run",
    "sbin",
    "sys",
    "tmp",
    "usr",
    "var",
}


def _in_wrapper(pid: int) -> bool:
    """Whether ``pid`` is still ip/unshare/the mount script rather than the command."""
    try:
        exe = os.path.basename(os.path.realpath(f"/proc/{pid}/exe"))
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if exe in ("ip", "unshare"):
        return True
    return len(cmd) > 2 and cmd[1] == b"-c" and cmd[2].endswith(_EXEC_LINE.encode())


_EXEC_LINE = 'exec "$@"'


class TestbedError(RuntimeError):
    """The testbed could not be built, or a service failed; the message names it."""

    __test__ = False  # not a pytest test class


def netns_available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "the namespace testbed needs root (ip netns, mount)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("mount", "mount")):
        if shutil.which(tool) is None:
            return (
                f"{tool} is not installed (apt-get install {package}, or "
                "scripts/install_system_tools.sh)"
            )
    name = f"mtbprobe{os.getpid()}"
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if r.returncode != 0:
            return f"`ip netns add` does not work here: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise TestbedError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _kill_netns_processes(namespaces: Sequence[str], grace: float = 5.0) -> None:
    """SIGTERM every process in ``namespaces``, then SIGKILL what is left after ``grace``."""
    deadline = time.monotonic() + grace
    sig = signal.SIGTERM
    while True:
        pids = [p for ns in namespaces for p in _netns_pids(ns)]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if sig == signal.SIGKILL and time.monotonic() > deadline + 5:
            log.warning("processes %s survive SIGKILL", pids)
            return
        time.sleep(0.2)
        if time.monotonic() > deadline:
            sig = signal.SIGKILL


def cleanup_stale(prefix: str) -> list[str]:
    """Remove every namespace ``<prefix>-*`` (killing its processes) and ``/etc/netns``
    entries left by a testbed that died; returns the namespaces removed."""
    if not prefix:
        raise ValueError("cleanup_stale needs a non-empty prefix")
    stale = [ns for ns in list_netns() if ns.startswith(prefix + "-")]
    _kill_netns_processes(stale, grace=2.0)
    for ns in stale:
        _ip("netns", "del", ns, check=False)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.glob(prefix + "-*"):
            shutil.rmtree(d, ignore_errors=True)
    return stale


@dataclass
class _Proc:
    """The live state of one service."""

    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    returncode: int | None = None
    restarts: int = 0
    healthy: bool = False
    final: bool = False  # exited and will not be restarted
    log_file: object = None
    history: list[int] = field(default_factory=list)


class Testbed:
    """A compose project running as hosts in network namespaces on this machine.

    ``env_overrides`` maps a service to environment variables that replace or extend its
    compose environment (e.g. ``{"coordinator": {"MOBIUS_STEPS": "8"}}``). ``wan`` maps a
    service to the shape of its access link (rate and one-way delay, see
    :mod:`mobius_fed.testbed.wan`); services not named are unshaped.
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        compose_file: str | os.PathLike[str],
        root_dir: str | os.PathLike[str],
        *,
        project: str | None = None,
        env_overrides: Mapping[str, Mapping[str, str]] | None = None,
        prefix: str | None = None,
        environ: Mapping[str, str] | None = None,
        wan: Mapping[str, WanShape] | None = None,
    ) -> None:
        self.compose_file = Path(compose_file)
        self.project: ComposeProject = load_compose(compose_file, environ=environ, project=project)
        self.root = Path(root_dir).resolve()
        for svc, env in (env_overrides or {}).items():
            if svc not in self.project.services:
                raise TestbedError(f"override for unknown service {svc!r}")
            self.project.services[svc].environment.update({k: str(v) for k, v in env.items()})
        self.wan = {svc: shape for svc, shape in (wan or {}).items() if shape.shaped}
        for svc in self.wan:
            self._service(svc)
        self.prefix = prefix or self._fresh_prefix()
        if len(self.prefix) > 12 or not self.prefix.replace("-", "").isalnum():
            raise TestbedError(f"bad prefix {self.prefix!r} (≤ 12 letters/digits)")
        self.logs_dir = self.root / "logs"
        self.volumes_dir = self.root / "volumes"
        self._procs: dict[str, _Proc] = {s: _Proc() for s in self.project.services}
        self._addresses: dict[str, dict[str, str]] = {}  # service -> network -> address
        self._created: list[str] = []  # namespaces, in creation order
        self._etc_dirs: list[Path] = []
        self._host_dirs: list[Path] = []  # mountpoints this testbed made on the host
        self._relays: list[subprocess.Popen[bytes]] = []  # delay lines (see wan.py)
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._built = False
        self._closed = False
        self._tb_log = None

    # ------------------------------------------------------------------ naming
    @staticmethod
    def _fresh_prefix() -> str:
        existing = list_netns()
        while True:
            p = "mtb" + secrets.token_hex(3)
            if not any(ns.startswith(p + "-") for ns in existing):
                return p

    def namespace(self, service: str) -> str:
        self._service(service)
        return f"{self.prefix}-{service}"

    @property
    def switch_namespace(self) -> str:
        return f"{self.prefix}-{SWITCH}"

    def namespaces(self) -> list[str]:
        """Every namespace this testbed creates (switch first)."""
        return [self.switch_namespace] + [self.namespace(s) for s in self.project.services]

    def address(self, service: str, network: str | None = None) -> str:
        """The service's IPv4 address on ``network`` (default: its first network)."""
        addrs = self._addresses[self._service(service).name]
        if not addrs:
            raise TestbedError(f"service {service} has no network (network_mode: none)")
        return addrs[network] if network else next(iter(addrs.values()))

    def volume_path(self, volume: str) -> Path:
        """The host directory backing named volume ``volume``."""
        if volume not in self.project.volumes:
            raise TestbedError(f"unknown volume {volume!r}")
        return self.volumes_dir / volume

    def log_path(self, service: str) -> Path:
        return self.logs_dir / f"{self._service(service).name}.log"

    def log_tail(self, service: str, lines: int = 20) -> str:
        try:
            text = self.log_path(service).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _service(self, name: str) -> Service:
        try:
            return self.project.services[name]
        except KeyError:
            raise TestbedError(f"unknown service {name!r}") from None

    def _say(self, msg: str) -> None:
        log.info("%s", msg)
        if self._tb_log is not None:
            self._tb_log.write(f"{time.strftime('%H:%M:%S')} {msg}\n")
            self._tb_log.flush()

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Testbed:
        try:
            self.build()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        """Create volume directories, namespaces, bridges, veths and hosts files."""
        if self._built:
            return
        if self._closed:
            raise TestbedError("this testbed was torn down; make a new one")
        reason = netns_available()
        if reason:
            raise TestbedError(reason)
        if self.wan:
            from mobius_fed.testbed.wan import wan_tools_missing

            reason = wan_tools_missing(self.wan.values())
            if reason:
                raise TestbedError(reason)
        self._built = True
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.volumes_dir.mkdir(parents=True, exist_ok=True)
        self._tb_log = open(self.logs_dir / "testbed.log", "a")  # noqa: SIM115
        self._say(
            f"testbed {self.prefix}: project {self.project.name} from {self.compose_file}, "
            f"root {self.root}"
        )
        for note in self.project.notes:
            self._say(f"note: {note}")
        for name in self.project.volumes:
            (self.volumes_dir / name).mkdir(parents=True, exist_ok=True)
        self._plan_addresses()
        self._check_mounts()
        self._make_namespace(self.switch_namespace)
        nets = list(self.project.networks)
        for k, _net in enumerate(nets):
            br = f"br{k}"
            _ip("-n", self.switch_namespace, "link", "add", br, "type", "bridge")
            _ip("-n", self.switch_namespace, "link", "set", br, "up")
        for j, svc in enumerate(self.project.services.values()):
            ns = self.namespace(svc.name)
            self._make_namespace(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            for i, net in enumerate(svc.networks):
                k = nets.index(net)
                port, eth = f"n{k}s{j}", f"eth{i}"
                _ip(
                    "-n", self.switch_namespace, "link", "add", port, "type", "veth",
                    "peer", "name", eth, "netns", ns,
                )  # fmt: skip
                _ip("-n", self.switch_namespace, "link", "set", port, "master", f"br{k}", "up")
                _ip("-n", ns, "addr", "add", f"{self._addresses[svc.name][net]}/24", "dev", eth)
                _ip("-n", ns, "link", "set", eth, "up")
                shape = self.wan.get(svc.name)
                if shape is not None and shape.rate is not None:
                    from mobius_fed.testbed.wan import shape_device

                    shape_device(ns, eth, shape.rate)  # upload
                    shape_device(self.switch_namespace, port, shape.rate)  # download
            self._write_etc(svc)
            addrs = ", ".join(f"{n} {a}" for n, a in self._addresses[svc.name].items())
            shaped = f"; WAN {self.wan[svc.name].describe()}" if svc.name in self.wan else ""
            self._say(f"host {svc.name}: namespace {ns}, {addrs or 'loopback only'}{shaped}")
        if any(shape.delay > 0 for shape in self.wan.values()):
            self._start_delay_lines()

    def _start_delay_lines(self) -> None:
        """One delay-line relay per networked service; its outgoing TCP goes through it."""
        from mobius_fed.testbed.wan import WanShape, redirect_rules, relay_argv

        none = WanShape()
        for svc in self.project.services.values():
            if not self._addresses[svc.name]:
                continue
            ns = self.namespace(svc.name)
            peers = {
                addr: self.wan.get(other, none)
                for other, addrs in self._addresses.items()
                if other != svc.name
                for addr in addrs.values()
            }
            argv = relay_argv(self.wan.get(svc.name, none), peers)
            log_path = self.logs_dir / f"delay-line-{svc.name}.log"
            with open(log_path, "ab") as err:
                p = subprocess.Popen(
                    ["ip", "netns", "exec", ns, *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    start_new_session=True,
                    cwd="/",
                    env={**self._env(svc), "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                )
            line = p.stdout.readline().decode(errors="replace").strip() if p.stdout else ""
            if line != "ready":
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise TestbedError(
                    f"delay line of {svc.name} did not start (exit {p.poll()}): {' | '.join(tail)}"
                )
            self._relays.append(p)
            redirect_rules(ns, f"{SUBNET}.0.0/16")

    def _make_namespace(self, ns: str) -> None:
        if ns in list_netns():
            raise TestbedError(f"namespace {ns} exists already (cleanup_stale({self.prefix!r}))")
        _ip("netns", "add", ns)
        self._created.append(ns)

    def _plan_addresses(self) -> None:
        nets = list(self.project.networks)
        if len(nets) > 254:
            raise TestbedError("at most 254 networks")
        count = dict.fromkeys(nets, 0)
        for svc in self.project.services.values():
            self._addresses[svc.name] = {}
            for net in svc.networks:
                count[net] += 1
                if count[net] > 253:
                    raise TestbedError(f"network {net}: more than 253 services")
                k = nets.index(net)
                self._addresses[svc.name][net] = f"{SUBNET}.{k + 1}.{count[net] + 1}"

    def hosts_file(self, service: str) -> str:
        """The /etc/hosts the service sees."""
        svc = self._service(service)
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        seen: set[str] = set()
        own = self._addresses[svc.name]
        if own:
            aliases = [a for n in svc.networks for a in svc.networks[n]]
            lines.append("\t".join([next(iter(own.values())), svc.name, *aliases]))
        else:
            lines[0] += f" {svc.name}"
        seen.add(svc.name)
        for net in svc.networks:
            for other in self.project.services.values():
                if other.name in seen or net not in other.networks:
                    continue
                seen.add(other.name)
                lines.append(
                    "\t".join([self._addresses[other.name][net], other.name, *other.networks[net]])
                )
        return "\n".join(lines) + "\n"

    def _write_etc(self, svc: Service) -> None:
        if not NETNS_ETC.exists():
            NETNS_ETC.mkdir(parents=True)
            self._host_dirs.append(NETNS_ETC)
        d = NETNS_ETC / self.namespace(svc.name)
        d.mkdir(parents=True, exist_ok=True)
        self._etc_dirs.append(d)
        (d / "hosts").write_text(self.hosts_file(svc.name))
        (d / "resolv.conf").write_text("# mobius-fed testbed: names come from /etc/hosts only\n")

    # ------------------------------------------------------------------ mounts
    def _source(self, svc: Service, m: Mount, idx: int) -> Path:
        if m.kind == "volume":
            if m.source is None:
                base = self.volumes_dir / "_anonymous" / f"{svc.name}-{idx}"
            else:
                base = self.volumes_dir / m.source
            src = base / m.subpath if m.subpath else base
        else:  # bind
            src = Path(os.path.expanduser(m.source or ""))
            if not src.is_absolute():
                src = self.project.base_dir / src
        return src.resolve()

    @staticmethod
    def _top(target: str) -> str | None:
        parts = Path(target).parts
        if len(parts) < 2 or not Path(target).is_absolute():
            raise TestbedError(f"volume target {target!r} must be an absolute path below /")
        return None if parts[1] in _SYSTEM_TOPS else "/" + parts[1]

    def _check_mounts(self) -> None:
        for svc in self.project.services.values():
            tops = {t for m in svc.mounts if (t := self._top(m.target))}
            for idx, m in enumerate(svc.mounts):
                if m.kind == "tmpfs":
                    continue
                src = self._source(svc, m, idx)
                for top in tops:
                    if src == Path(top) or Path(top) in src.parents:
                        raise TestbedError(
                            f"service {svc.name}: volume source {src} lies under {top}, which "
                            "the testbed covers with a private tmpfs; use a root directory "
                            f"outside {top}"
                        )

    def _mount_script(self, svc: Service) -> str:
        """Shell lines that build the service's filesystem view, then exec the command."""
        q = shlex.quote
        lines = ["set -e"]
        tops = sorted({t for m in svc.mounts if (t := self._top(m.target))})
        for top in tops:
            if not Path(top).exists():
                Path(top).mkdir()
                self._host_dirs.append(Path(top))
            lines.append(f"mount -t tmpfs -o mode=0755 testbed-{q(svc.name)} {q(top)}")
        ordered = sorted(enumerate(svc.mounts), key=lambda im: len(Path(im[1].target).parts))
        for idx, m in ordered:
            tgt = q(m.target)
            if m.kind == "tmpfs":
                lines += [f"mkdir -p {tgt}", f"mount -t tmpfs testbed {tgt}"]
                continue
            src = self._source(svc, m, idx)
            if not src.exists():
                src.mkdir(parents=True)
            if src.is_dir():
                lines.append(f"mkdir -p {tgt}")
            else:
                lines.append(f"mkdir -p {q(str(Path(m.target).parent))} && touch {tgt}")
            lines.append(f"mount --bind {q(str(src))} {tgt}")
            if m.read_only:
                lines.append(f"mount -o remount,bind,ro {tgt}")
        lines.append(_EXEC_LINE)
        return "\n".join(lines)

    def _env(self, svc: Service, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        bindir = os.path.dirname(sys.executable)
        path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        env = {
            "PATH": f"{bindir}:{path}" if bindir not in path.split(":") else path,
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }
        env.update(svc.environment)
        env.update(extra or {})
        return env

    def _wrap(self, svc: Service, argv: Sequence[str]) -> list[str]:
        unshare = shutil.which("unshare") or "unshare"
        return [
            shutil.which("ip") or "ip", "netns", "exec", self.namespace(svc.name),
            unshare, "--mount", "--propagation", "private", "--",
            "/bin/sh", "-c", self._mount_script(svc), "sh", *argv,
        ]  # fmt: skip

    # ------------------------------------------------------------------ running
    def up(self, timeout: float = 300.0, services: Sequence[str] | None = None) -> None:
        """Start services in dependency order, honouring ``depends_on`` conditions.

        Raises TestbedError naming the service when a dependency fails (exits non-zero,
        never becomes healthy) or ``timeout`` passes, and when any started service has
        failed for good by the time everything is started.
        """
        self.build()
        deadline = time.monotonic() + timeout
        order = self.project.start_order()
        if services is not None:
            wanted = self._with_deps(services)
            order = [s for s in order if s in wanted]
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, name="testbed", daemon=True)
            self._monitor.start()
        for name in order:
            svc = self.project.services[name]
            if self._procs[name].popen is not None:
                continue
            for dep, cond in svc.depends_on.items():
                self._await(dep, cond, name, deadline)
            self._start(svc)
        failed = {n: rc for n, rc in self.failed().items() if n in order}
        if failed:
            raise TestbedError(self.describe_failure(failed))

    def describe_failure(self, failed: Mapping[str, int]) -> str:
        """One message naming every failed service, with the first one's log tail."""
        first = next(iter(failed))
        names = ", ".join(
            f"{n} (exit {rc}"
            + (f", after {self.restarts(n)} restarts)" if self.restarts(n) else ")")
            for n, rc in failed.items()
        )
        return (
            f"service {names} failed; last lines of {first}'s log ({self.log_path(first)}):\n"
            + self.log_tail(first)
        )

    def _with_deps(self, services: Sequence[str]) -> set[str]:
        out: set[str] = set()
        todo = list(services)
        while todo:
            s = self._service(todo.pop()).name
            if s not in out:
                out.add(s)
                todo.extend(self.project.services[s].depends_on)
        return out

    def _start(self, svc: Service) -> None:
        with self._lock:
            if self._stopping.is_set():
                raise TestbedError("testbed is shutting down")
            st = self._procs[svc.name]
            if st.log_file is None:
                st.log_file = open(self.log_path(svc.name), "ab")  # noqa: SIM115
            st.log_file.write(  # type: ignore[attr-defined]
                f"--- testbed: starting {shlex.join(svc.argv)}\n".encode()
            )
            st.log_file.flush()  # type: ignore[attr-defined]
            st.popen = subprocess.Popen(
                self._wrap(svc, svc.argv),
                env=self._env(svc),
                stdin=subprocess.DEVNULL,
                stdout=st.log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd="/",
            )
            st.started_at = time.monotonic()
            st.returncode, st.final, st.healthy = None, False, False
            self._say(f"started {svc.name} (pid {st.popen.pid}): {shlex.join(svc.argv)}")

    def _will_restart(self, svc: Service, st: _Proc, rc: int) -> bool:
        if self._stopping.is_set():
            return False
        if svc.restart in ("always", "unless-stopped"):
            return True
        if svc.restart == "on-failure" and rc != 0:
            return svc.max_restarts is None or st.restarts < svc.max_restarts
        return False

    def _watch(self) -> None:
        """Record exits and apply restart policies until the testbed stops."""
        while not self._stopping.wait(0.25):
            with self._lock:
                for name, st in self._procs.items():
                    if st.popen is None or st.returncode is not None:
                        continue
                    rc = st.popen.poll()
                    if rc is None:
                        continue
                    st.returncode = rc
                    st.history.append(rc)
                    svc = self.project.services[name]
                    if self._will_restart(svc, st, rc):
                        st.restarts += 1
                        self._say(f"{name} exited with {rc}; restart #{st.restarts}")
                        with contextlib.suppress(TestbedError):
                            self._start(svc)
                    else:
                        st.final = True
                        self._say(f"{name} exited with {rc}")

    def _await(self, dep: str, cond: str, who: str, deadline: float) -> None:
        st = self._procs[dep]
        what = f"service {dep!r} (a dependency of {who!r})"
        if st.popen is None:
            raise TestbedError(f"{what} was not started")
        if cond == "service_started":
            return
        if cond == "service_completed_successfully":
            while not st.final:
                if time.monotonic() > deadline:
                    raise TestbedError(f"timed out waiting for {what} to complete")
                time.sleep(0.2)
            if st.returncode != 0:
                raise TestbedError(
                    f"{what} exited with status {st.returncode}; last lines of its log "
                    f"({self.log_path(dep)}):\n{self.log_tail(dep)}"
                )
            return
        self._await_healthy(dep, what, deadline)

    def _await_healthy(self, name: str, what: str, deadline: float) -> None:
        st = self._procs[name]
        hc: Healthcheck = self.project.services[name].healthcheck  # type: ignore[assignment]
        failures, last = 0, ""
        next_probe = st.started_at + (hc.start_interval if hc.start_period else hc.interval)
        while not st.healthy:
            if st.final:
                raise TestbedError(
                    f"{what} exited with status {st.returncode} before it became healthy; "
                    f"last lines of its log:\n{self.log_tail(name)}"
                )
            now = time.monotonic()
            if now > deadline:
                raise TestbedError(f"timed out waiting for {what} to become healthy: {last}")
            if now < next_probe:
                time.sleep(min(0.2, next_probe - now))
                continue
            in_start = now - st.started_at < hc.start_period
            ok, last = self.probe(name)
            if ok:
                st.healthy = True
                self._say(f"{name} is healthy")
                return
            if not in_start:
                failures += 1
                if failures >= hc.retries:
                    raise TestbedError(
                        f"{what} is unhealthy after {failures} failed checks: {last}\n"
                        f"last lines of its log:\n{self.log_tail(name)}"
                    )
            gap = hc.start_interval if in_start else hc.interval
            next_probe = time.monotonic() + gap

    def probe(self, service: str) -> tuple[bool, str]:
        """Run the service's healthcheck once: (passed, last output line)."""
        hc = self._service(service).healthcheck
        if hc is None:
            raise TestbedError(f"service {service} has no healthcheck")
        try:
            r = self.exec(service, hc.argv, timeout=hc.timeout)
        except subprocess.TimeoutExpired:
            return False, f"healthcheck timed out after {hc.timeout:g}s"
        out = (r.stdout + r.stderr).strip().splitlines()
        return r.returncode == 0, (out[-1] if out else f"exit {r.returncode}")

    def exec(
        self,
        service: str,
        argv: Sequence[str],
        *,
        timeout: float | None = 60.0,
        env: Mapping[str, str] | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on the service's host: its namespace, hosts file, volumes and
        environment (plus ``env``). Raises subprocess.TimeoutExpired after killing it."""
        svc = self._service(service)
        if not self._built or self._closed:
            raise TestbedError("the testbed is not up")
        p = subprocess.Popen(
            self._wrap(svc, list(argv)),
            env=self._env(svc, env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd="/",
        )
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
        r = subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        if check and r.returncode != 0:
            raise TestbedError(
                f"{service}: {shlex.join(argv)} exited with {r.returncode}: {err.strip()}"
            )
        return r

    # ------------------------------------------------------------------ inspection
    def processes(self, wait: float = 5.0) -> dict[str, int]:
        """``{service: pid}`` of every running service's main process: the command itself,
        once the namespace/mount wrapper has exec'd into it (waits up to ``wait`` s)."""
        with self._lock:
            running = {
                n: st.popen.pid
                for n, st in self._procs.items()
                if st.popen is not None and st.popen.poll() is None
            }
        out: dict[str, int] = {}
        deadline = time.monotonic() + wait
        for name, pid in running.items():
            while _in_wrapper(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if os.path.exists(f"/proc/{pid}"):
                out[name] = pid
        return out

    def returncode(self, service: str) -> int | None:
        """The exit status of the service's last run (None while running / never run)."""
        return self._procs[self._service(service).name].returncode

    def restarts(self, service: str) -> int:
        return self._procs[self._service(service).name].restarts

    def failed(self) -> dict[str, int]:
        """``{service: exit status}`` of services that exited non-zero and will not restart."""
        with self._lock:
            return {
                n: st.returncode
                for n, st in self._procs.items()
                if st.final and st.returncode not in (0, None)
            }

    def finished(self, service: str) -> bool:
        """Whether the service has exited and its restart policy will not restart it."""
        return self._procs[self._service(service).name].final

    def running(self, service: str) -> bool:
        st = self._procs[self._service(service).name]
        return st.popen is not None and st.popen.poll() is None

    # ------------------------------------------------------------------ teardown
    def down(self) -> None:
        """Stop everything and remove every namespace, veth, bridge and /etc/netns entry.
        Safe to call more than once, and after a partial build."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        saved = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # finish the cleanup
                saved[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            self._teardown()
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    def _teardown(self) -> None:
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5)
        with self._lock:
            popens = [st.popen for st in self._procs.values() if st.popen is not None]
        for p in popens:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        ours = [ns for ns in self._created if ns in set(list_netns())]
        _kill_netns_processes(ours, grace=5.0)
        for p in popens + self._relays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for ns in reversed(self._created):  # deleting a namespace removes its veths/bridges
            _ip("netns", "del", ns, check=False)
        for d in self._etc_dirs:
            shutil.rmtree(d, ignore_errors=True)
        for d in self._host_dirs:
            with contextlib.suppress(OSError):
                d.rmdir()
        for st in self._procs.values():
            if st.log_file is not None:
                st.log_file.close()  # type: ignore[attr-defined]
        leftover = [ns for ns in self._created if ns in set(list_netns())]
        if leftover:
            log.warning("namespaces not removed: %s", leftover)
        self._say(f"testbed {self.prefix} removed")
        if self._tb_log is not None:
            self._tb_log.close()
            self._tb_log = None
