"""The mobius-fed side of the namespace testbed: read the coordinator's status from inside."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from mobius_fed.machines import ENDED_PHASES
from mobius_fed.testbed.netns import Testbed, TestbedError


def operator_certs(tb: Testbed, volume: str = "certs") -> Path:
    """``<root>/operator-certs``: the operator's bundle that the compose file's certificate
    job leaves under ``nodes/operator/`` in the ``certs`` volume, renamed to the ca.crt,
    operator.crt and operator.key (mode 0600) that ``mobius-fed status`` wants."""
    src = tb.volume_path(volume) / "nodes" / "operator"
    dst = tb.root / "operator-certs"
    dst.mkdir(parents=True, exist_ok=True)
    for a, b in (("ca.crt", "ca.crt"), ("tls.crt", "operator.crt"), ("tls.key", "operator.key")):
        if not (src / a).is_file():
            raise TestbedError(f"operator certificate {src / a} is missing (did certs run?)")
        shutil.copyfile(src / a, dst / b)
    os.chmod(dst / "operator.key", 0o600)
    return dst


def coordinator_status(
    tb: Testbed,
    *,
    service: str = "coordinator",
    url: str = "https://coordinator:7380",
    certs: Path | None = None,
    timeout: float = 20.0,
) -> dict[str, Any]:
    """The REST status document, read by ``mobius-fed status --rest URL --json`` run on
    the coordinator's host. Raises TestbedError when it cannot be read."""
    certs = certs or operator_certs(tb)
    argv = ["mobius-fed", "status", "--rest", url, "--certs", str(certs), "--json"]
    try:
        r = tb.exec(service, argv, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"mobius-fed status timed out after {timeout:g}s") from None
    if r.returncode != 0:
        raise TestbedError((r.stderr or r.stdout).strip() or f"status exited {r.returncode}")
    try:
        return json.loads(r.stdout)
    except ValueError as exc:
        raise TestbedError(f"unreadable status output: {exc}: {r.stdout[:200]!r}") from None


def wait_for_run(
    tb: Testbed,
    timeout: float,
    *,
    service: str = "coordinator",
    poll: float = 3.0,
    on_status=None,
) -> dict[str, Any]:
    """Poll the coordinator's status until its phase is final; the last document.

    Raises TestbedError on timeout or when the coordinator exits for good."""
    deadline = time.monotonic() + timeout
    certs = None
    last: dict[str, Any] | None = None
    err = ""
    while time.monotonic() < deadline:
        failed = tb.failed()
        if failed:
            raise TestbedError(tb.describe_failure(failed))
        if tb.finished(service):
            raise TestbedError(
                f"{service} exited with status {tb.returncode(service)}; last lines of its "
                f"log:\n{tb.log_tail(service)}"
            )
        try:
            certs = certs or operator_certs(tb)
            last = coordinator_status(tb, service=service, certs=certs)
        except TestbedError as exc:
            err = str(exc)
        else:
            if on_status is not None:
                on_status(last)
            if last.get("phase") in ENDED_PHASES:
                return last
        time.sleep(poll)
    raise TestbedError(
        f"run did not finish within {timeout:g}s; last status: {json.dumps(last) if last else err}"
    )
