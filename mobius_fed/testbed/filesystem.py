"""Each service's filesystem view: named volume directories, bind/volume/tmpfs mounts, and
the shell script that builds the view in a private mount namespace and execs the command."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path

from mobius_fed.testbed.compose import ComposeProject, Mount, Service
from mobius_fed.testbed.namespaces import TestbedError

EXEC_LINE = 'exec "$@"'  # the mount script's last line
# Top-level directories never covered by a private tmpfs (the system lives there).
# fmt: skip below keeps the names a table, not one a line.
_SYSTEM_TOPS = frozenset({
    "bin", "boot", "dev", "etc", "home", "lib", "lib32", "lib64", "libx32", "proc", "root",
    "run", "sbin", "sys", "tmp", "usr", "var",
})  # fmt: skip


def _top(target: str) -> str | None:
    """The top-level directory a private tmpfs covers for ``target`` (None: a system one)."""
    parts = Path(target).parts
    if len(parts) < 2 or not Path(target).is_absolute():
        raise TestbedError(f"volume target {target!r} must be an absolute path below /")
    return None if parts[1] in _SYSTEM_TOPS else "/" + parts[1]


class ServiceFilesystem:
    """Volumes under ``volumes_dir`` and the mounts every service's processes see."""

    def __init__(self, project: ComposeProject, volumes_dir: Path) -> None:
        self.project, self.volumes_dir = project, volumes_dir
        self._host_dirs: list[Path] = []  # mountpoints this testbed made on the host

    def volume_path(self, volume: str) -> Path:
        """The host directory backing named volume ``volume``."""
        if volume not in self.project.volumes:
            raise TestbedError(f"unknown volume {volume!r}")
        return self.volumes_dir / volume

    def make_volumes(self) -> None:
        """Create the volumes directory and one directory per named volume."""
        self.volumes_dir.mkdir(parents=True, exist_ok=True)
        for name in self.project.volumes:
            (self.volumes_dir / name).mkdir(parents=True, exist_ok=True)

    def _source(self, svc: Service, m: Mount, idx: int) -> Path:
        if m.kind == "volume":
            anonymous = f"_anonymous/{svc.name}-{idx}"
            base = self.volumes_dir / (anonymous if m.source is None else m.source)
            src = base / m.subpath if m.subpath else base
        else:  # bind
            src = Path(os.path.expanduser(m.source or ""))
            if not src.is_absolute():
                src = self.project.base_dir / src
        return src.resolve()

    def check_mounts(self) -> None:
        """Refuse a volume source that a service's private tmpfs would hide."""
        for svc in self.project.services.values():
            tops = {t for m in svc.mounts if (t := _top(m.target))}
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

    def mount_script(self, svc: Service) -> str:
        """Shell lines that build the service's filesystem view, then exec the command."""
        q = shlex.quote
        lines = ["set -e"]
        tops = sorted({t for m in svc.mounts if (t := _top(m.target))})
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
        lines.append(EXEC_LINE)
        return "\n".join(lines)

    def host_argv(self, namespace: str, svc: Service, argv: Sequence[str]) -> list[str]:
        """``argv`` run in ``namespace`` inside a private mount namespace with svc's view."""
        unshare = shutil.which("unshare") or "unshare"
        # fmt: skip below keeps one command a line: ip netns exec, unshare, the mount script.
        return [
            shutil.which("ip") or "ip", "netns", "exec", namespace,
            unshare, "--mount", "--propagation", "private", "--",
            "/bin/sh", "-c", self.mount_script(svc), "sh", *argv,
        ]  # fmt: skip

    def remove_host_dirs(self) -> None:
        """Remove the (empty) mountpoints this testbed made on the host."""
        for d in self._host_dirs:
            with contextlib.suppress(OSError):
                d.rmdir()
