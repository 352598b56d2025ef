"""One sweep cell: a reference-engine run in its own process, resumable, with a result file.

``python -m mobius_fed.research.cell CELL_DIR`` reads ``CELL_DIR/cell.json`` (the run's
TrainConfig, its sites directory and options), trains with one torch thread, and writes
``CELL_DIR/result.json`` last, atomically: a cell with that file is finished.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

CELL = "cell.json"
RESULT = "result.json"


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a temporary file, then a rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_result(cell_dir: Path) -> dict[str, Any] | None:
    """The finished cell's result, or None when it has not finished."""
    path = Path(cell_dir) / RESULT
    return json.loads(path.read_text()) if path.is_file() else None


def load_sites(sites_dir: Path, P: int, seq_len: int, encoding: str, *, coupled: bool) -> list:
    """The P prepared sites of a cell; ``coupled`` restores the old shared batch offsets."""
    from mobius_fed.data import SiteData

    sites = [SiteData(Path(sites_dir) / f"site-{i}", seq_len, encoding) for i in range(P)]
    if coupled:
        for site in sites:
            site.site = None
    return sites


def run_cell(cell_dir: Path, *, threads: int = 1) -> dict[str, Any]:
    """Train the cell (resuming from its checkpoint when there is one) and write its result."""
    import torch

    from mobius_fed.config import TrainConfig
    from mobius_fed.engine.metrics import read_metrics
    from mobius_fed.engine.reference import ReferenceEngine
    from mobius_fed.engine.trainer import CHECKPOINT, METRICS, train

    torch.set_num_threads(threads)
    cell_dir = Path(cell_dir)
    spec = json.loads((cell_dir / CELL).read_text())
    cfg = TrainConfig.model_validate(spec["train"])
    coupled = bool(spec.get("coupled_batches"))
    seq_len = cfg.model().seq_len
    sites = load_sites(Path(spec["sites"]), cfg.P, seq_len, cfg.encoding, coupled=coupled)
    engine = ReferenceEngine(cfg, sites)
    start = time.perf_counter()
    evals = train(
        engine,
        cell_dir,
        checkpoint_every=spec.get("checkpoint_every", 100),
        resume=(cell_dir / CHECKPOINT).is_file(),
    )
    final = evals[-1] if evals else engine.evaluate()
    result = {
        "name": cell_dir.name,
        "train": spec["train"],
        "coupled_batches": coupled,
        "final": final.loss,
        "origin_losses": final.origin_losses,
        "curve": [
            [r["step"], r["eval_loss"]]
            for r in read_metrics(cell_dir / METRICS)
            if "eval_loss" in r
        ],
        "seconds": time.perf_counter() - start,
    }
    write_json(cell_dir / RESULT, result)
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mobius_fed.research.cell CELL_DIR", file=sys.stderr)
        return 2
    run_cell(Path(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
