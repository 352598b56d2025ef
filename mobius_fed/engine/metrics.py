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
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
