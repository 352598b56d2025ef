"""Where a running coordinator can be reached: ``<run dir>/endpoints.json``.

Written by ``mobius-fed up``; read by ``status``, ``health`` and ``dashboard`` from ``--run
DIR``. Schema (version 1, paths absolute): docs/operations.md §3. Torch-free: the health
probe imports it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENDPOINTS_FILE = "endpoints.json"
DEFAULT_RUN_DIR = Path("runs/up")
SCHEMA = 1


class EndpointsError(Exception):
    """endpoints.json is missing or unusable; the message says which and why."""


@dataclass(frozen=True)
class Endpoints:
    """A coordinator's addresses and the operator's TLS files, as ``up`` wrote them."""

    path: Path
    grpc: str
    rest: str | None
    rest_mode: str
    server_name: str
    metrics: str | None
    dashboard: str | None
    certs_dir: Path
    ca: Path
    cert: Path
    key: Path
    out_dir: Path | None
    run_id: str
    pid: int | None
    state: str | None = None  # starting | running | exited (None: written before states)

    @classmethod
    def from_doc(cls, path: Path, doc: dict[str, Any]) -> Endpoints:
        try:
            if int(doc.get("schema", 0)) != SCHEMA:
                raise EndpointsError(f"{path}: schema {doc.get('schema')!r}, expected {SCHEMA}")
            certs = doc["certs"]
            return cls(
                path=path,
                grpc=str(doc["grpc"]),
                rest=doc.get("rest"),
                rest_mode=str(doc.get("rest_mode", "tls")),
                server_name=str(doc.get("server_name", "coordinator")),
                metrics=doc.get("metrics"),
                dashboard=doc.get("dashboard"),
                certs_dir=Path(certs["dir"]),
                ca=Path(certs["ca"]),
                cert=Path(certs["cert"]),
                key=Path(certs["key"]),
                out_dir=Path(doc["out_dir"]) if doc.get("out_dir") else None,
                run_id=str(doc.get("run_id", "")),
                pid=doc.get("pid"),
                state=doc.get("state"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EndpointsError(f"{path}: malformed endpoints file ({exc!r})") from None

    def alive(self) -> bool | None:
        """Whether the process that wrote the file still runs (None: unknown)."""
        if not self.pid:
            return None
        try:
            os.kill(int(self.pid), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, OverflowError, ValueError):
            return None
        return True


def write_endpoints(run_dir: Path, doc: dict[str, Any]) -> Path:
    """Write ``run_dir/endpoints.json`` atomically (``schema`` and ``written_at`` added)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ENDPOINTS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"schema": SCHEMA, **doc, "written_at": time.time()}, indent=2))
    os.replace(tmp, path)
    return path


def read_endpoints(run_dir: Path) -> Endpoints:
    """The endpoints ``up`` wrote into ``run_dir`` (or the file itself if given)."""
    run_dir = Path(run_dir)
    path = run_dir if run_dir.suffix == ".json" else run_dir / ENDPOINTS_FILE
    if not path.is_file():
        raise EndpointsError(
            f"no {ENDPOINTS_FILE} in {path.parent}: is `mobius-fed up --out {path.parent}` "
            "running? (or pass the coordinator's address and --certs)"
        )
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EndpointsError(f"{path}: unreadable ({exc})") from None
    if not isinstance(doc, dict):
        raise EndpointsError(f"{path}: not a JSON object")
    return Endpoints.from_doc(path, doc)


def find_endpoints(run_dir: Path | None) -> Endpoints | None:
    """``--run DIR`` (an error if absent there), else ``./runs/up`` if it has a file."""
    if run_dir is not None:
        return read_endpoints(run_dir)
    if (DEFAULT_RUN_DIR / ENDPOINTS_FILE).is_file():
        return read_endpoints(DEFAULT_RUN_DIR)
    return None
