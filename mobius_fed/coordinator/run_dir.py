"""What a ``mobius-fed up`` run directory says about its run when nobody answers for it.

``status`` of a run whose processes are gone reports the last known state from the files
the coordinator left (``history.json``'s status, else the last ``metrics.jsonl`` line, and
the newest complete checkpoint); ``up --out DIR`` refuses a directory that holds an earlier
run unless ``--resume`` or ``--force``. Torch-free. See docs/operations.md §3.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COORDINATOR_DIR = "coordinator"
HISTORY_FILE, METRICS_FILE = "history.json", "metrics.jsonl"  # the recorder's (no flwr here)
# What ``up --force`` deletes: the earlier run's outputs (and every ``worker-<i>/``).
# Certificates and sites are kept.
RUN_OUTPUTS = (COORDINATOR_DIR, "logs", "endpoints.json", "train.toml")


@dataclass(frozen=True)
class LastKnown:
    """A run's last recorded state: its status document as of ``written_at``."""

    status: dict[str, Any]
    source: Path  # the file it was read from
    written_at: float  # that file's modification time (seconds since the epoch)
    checkpoint: Path | None  # the newest complete manifest

    def summary(self) -> str:
        """``phase training, round 3/10, step 6/20, Eq. 8 5.1234``: one line."""
        doc = self.status
        words = [f"phase {doc.get('phase', '?')}"]
        if doc.get("num_rounds"):
            words.append(f"round {doc.get('round', 0)}/{doc['num_rounds']}")
        steps = f"/{doc['steps']}" if doc.get("steps") else ""
        words.append(f"step {doc.get('step', 0)}{steps}")
        if doc.get("eval_loss") is not None:
            words.append(f"Eq. 8 {doc['eval_loss']:.4f}")
        return ", ".join(words)

    def age(self, now: float | None = None) -> float:
        return max(0.0, (now or time.time()) - self.written_at)


def _last_metrics_line(path: Path) -> dict[str, Any] | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            doc = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if isinstance(doc, dict):
            return doc
    return None


def last_known(out_dir: Path) -> LastKnown | None:
    """The coordinator ``out_dir``'s last recorded state (None: it recorded nothing)."""
    from mobius_fed.coordinator.manifests import latest_manifest

    out_dir = Path(out_dir)
    status: dict[str, Any] | None = None
    source = out_dir / HISTORY_FILE
    try:
        doc = json.loads(source.read_text())
        status = doc.get("status") if isinstance(doc, dict) else None
    except (OSError, ValueError):
        pass
    if not isinstance(status, dict):
        source = out_dir / METRICS_FILE
        line = _last_metrics_line(source)
        if line is None:
            return None
        status = {"round": line.get("round"), "step": line.get("step"), "phase": "training"}
        if line.get("eval_loss") is not None:
            status["eval_loss"] = line["eval_loss"]
    try:
        written_at = source.stat().st_mtime
    except OSError:
        written_at = time.time()
    return LastKnown(status, source, written_at, latest_manifest(out_dir))


def earlier_run(root: Path) -> str | None:
    """What earlier run ``root`` (an ``up --out``) holds, in words; None when its coordinator
    never started there (only certificates, sites or nothing)."""
    coordinator = Path(root) / COORDINATOR_DIR
    if not coordinator.is_dir() or not any(coordinator.iterdir()):
        return None
    known = last_known(coordinator)
    if known is None:
        return f"a run whose coordinator wrote {coordinator} but recorded no round"
    checkpoint = f"; last complete checkpoint {known.checkpoint}" if known.checkpoint else ""
    return f"a run last seen at {known.summary()}{checkpoint}"


def clear_run(root: Path) -> list[Path]:
    """Delete the earlier run's outputs in ``root`` (:data:`RUN_OUTPUTS`; certificates and
    sites stay); returns what was deleted."""
    root = Path(root)
    gone = []
    for path in [*(root / name for name in RUN_OUTPUTS), *sorted(root.glob("worker-*"))]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        gone.append(path)
    return gone
