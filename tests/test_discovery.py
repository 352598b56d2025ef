"""Health in milliseconds and endpoint discovery: no torch on the probe path; clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mobius_fed.coordinator.endpoints import EndpointsError, read_endpoints, write_endpoints

PROBE_MODULES = (
    "mobius_fed.cli.health",
    "mobius_fed.cli.status",
    "mobius_fed.cli.dashboard",
    "mobius_fed.cli.up",
    "mobius_fed.coordinator.endpoints",
)


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_health_path_loads_no_torch() -> None:
    mods = _loaded_after("\n".join(f"import {m}" for m in PROBE_MODULES))
    assert "torch" not in mods and "mobius_fed.config" not in mods
    # Building the up/status/health/dashboard parsers loads no torch either.
    code = (
        "import argparse\n"
        "from mobius_fed.cli import up, status, health, dashboard\n"
        "sub = argparse.ArgumentParser().add_subparsers()\n"
        "for m in (up, status, health, dashboard): m.register(sub)"
    )
    assert "torch" not in _loaded_after(code)


def test_health_probe_in_process_has_no_torch_in_importtime(tmp_path: Path) -> None:
    """``python -X importtime -m mobius_fed.cli.health`` against nothing: it fails fast,
    and nothing it imported was torch."""
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "mobius_fed.cli.health",
            "127.0.0.1:9",
            "--timeout",
            "0.5",
            "--ca",
            str(tmp_path / "ca"),
            "--cert",
            str(tmp_path / "c"),
            "--key",
            str(tmp_path / "k"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    imported = [ln.split("|")[-1].strip() for ln in proc.stderr.splitlines() if "|" in ln]
    assert "grpc" in imported and "torch" not in imported


def test_endpoints_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(EndpointsError, match=r"no endpoints\.json in"):
        read_endpoints(tmp_path)
    (tmp_path / "endpoints.json").write_text("{not json")
    with pytest.raises(EndpointsError, match="unreadable"):
        read_endpoints(tmp_path)
    (tmp_path / "endpoints.json").write_text(json.dumps({"schema": 1, "grpc": "x:1"}))
    with pytest.raises(EndpointsError, match=r"malformed.*certs"):
        read_endpoints(tmp_path)
    (tmp_path / "endpoints.json").write_text(json.dumps({"schema": 7}))
    with pytest.raises(EndpointsError, match="schema 7"):
        read_endpoints(tmp_path)
    certs = {k: str(tmp_path / k) for k in ("dir", "ca", "cert", "key")}
    write_endpoints(tmp_path, {"grpc": "127.0.0.1:5", "certs": certs, "pid": 2**22 + 7})
    ep = read_endpoints(tmp_path / "endpoints.json")
    assert ep.grpc == "127.0.0.1:5" and ep.alive() is False


def test_health_without_address_or_run_is_a_clear_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.health"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode != 0 and "no address given" in proc.stderr
