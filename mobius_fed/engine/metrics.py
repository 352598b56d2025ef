"""JSON-lines metrics: one object per training step or evaluation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append-only JSONL file; on resume, rows from ``start_step`` on are dropped first."""

    def __init__(self, path: Path, *, start_step: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) < start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``. A last line cut short (the process was killed
    while writing it) is dropped, so a killed run still resumes; a bad line before the
    last is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if n == len(lines):
                break  # a torn final record
            raise ValueError(f"{path}: line {n} is not a JSON record ({exc})") from exc
    return out
