"""A grid of reference-engine runs over P, L, order and seed, run as parallel processes.

Each cell is one process with one torch thread (``python -m mobius_fed.research.cell``);
as many run at once as the thread budget allows. A cell with a ``result.json`` is skipped,
so an interrupted sweep continues where it stopped (a cell in progress resumes from its
checkpoint).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mobius_fed.config import TrainConfig
from mobius_fed.research.cell import CELL, RESULT, read_result, write_json
from mobius_fed.schedule import ORDERS
from mobius_fed.warmstart import ChildProcess, spawn


@dataclass(frozen=True)
class Cell:
    """One run of the grid: its configuration and its directory."""

    cfg: TrainConfig
    directory: Path

    @property
    def name(self) -> str:
        return self.directory.name


def grid(
    base: TrainConfig,
    workers: Sequence[int],
    loops: Sequence[int],
    orders: Sequence[str],
    seeds: Sequence[int],
    out: Path,
) -> list[Cell]:
    """Every (P, L, order, seed) cell; a bad value raises ValueError naming it."""
    for name, values in (("workers", workers), ("loops", loops), ("seeds", seeds)):
        if not values:
            raise ValueError(f"sweep: no {name} given")
    for order in orders:
        if order not in ORDERS:
            raise ValueError(
                f"sweep: unknown order {order!r} (expected one of {', '.join(ORDERS)})"
            )
    for L in loops:
        if L < 1:
            raise ValueError(f"sweep: L must be ≥ 1, got {L}")
    n_layer = base.model().n_layer
    for P in workers:
        if P < 1 or n_layer % P:
            divisors = ", ".join(str(d) for d in range(1, n_layer + 1) if n_layer % d == 0)
            raise ValueError(
                f"sweep: P={P} does not divide the {n_layer} layers (divisors: {divisors})"
            )
    cells = []
    for P, L, seed, order in itertools.product(workers, loops, seeds, orders):
        update = {"workers": P, "loops": L, "order": order, "seed": seed}
        cfg = TrainConfig.model_validate({**base.model_dump(), **update})
        name = f"P{cfg.P}-L{cfg.loops}-{cfg.order}-s{cfg.seed}"
        cells.append(Cell(cfg, Path(out) / "cells" / name))
    return cells


def _normalised(spec: dict) -> dict | None:
    """A stored cell spec with the train config re-read through today's model.

    A setting added since the cell was written takes its default, so a sweep resumes
    across an upgrade that adds fields; None when the stored config no longer validates.
    """
    try:
        train = TrainConfig.model_validate(spec.get("train", {}))
    except ValueError:
        return None
    return {**spec, "train": train.model_dump(mode="json")}


def prepare_cell(cell: Cell, sites: Path, *, coupled: bool, checkpoint_every: int) -> bool:
    """Write the cell's spec; False when it has finished already (same config)."""
    cell.directory.mkdir(parents=True, exist_ok=True)
    spec = {
        "train": cell.cfg.model_dump(mode="json"),
        "sites": str(sites),
        "coupled_batches": coupled,
        "checkpoint_every": checkpoint_every,
    }
    path = cell.directory / CELL
    if path.is_file():
        if _normalised(json.loads(path.read_text())) != spec:
            raise ValueError(
                f"sweep: {cell.directory} holds a cell with another configuration; "
                "use a new --out (or delete that directory)"
            )
        if read_result(cell.directory) is not None:
            return False
    write_json(path, spec)
    return True


@contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """While cells run, SIGTERM raises SystemExit, so that the cells' processes end too.

    (Python's default SIGTERM ends the sweep at once and leaves its cells running; a sweep
    started in the background ignores SIGINT, so SIGTERM is how it is usually stopped.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run_cells(
    dirs: Sequence[Path],
    *,
    parallel: int,
    on_done: Callable[[Path, dict[str, Any] | None, float], None] | None = None,
) -> list[Path]:
    """Run ``python -m mobius_fed.research.cell`` for each directory, ``parallel`` at a time.

    Returns the directories whose process failed (their log is ``cell.log``).
    """
    if parallel < 1:
        raise ValueError(f"sweep: thread budget must be ≥ 1, got {parallel}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    pending = list(dirs)
    running: dict[ChildProcess, tuple[Path, float]] = {}
    failed: list[Path] = []
    with _stop_on_sigterm():
        try:
            while pending or running:
                while pending and len(running) < parallel:
                    d = pending.pop(0)
                    if read_result(d) is not None:  # finished meanwhile (by another sweep)
                        continue
                    cell = [sys.executable, "-m", "mobius_fed.research.cell", str(d)]
                    proc = spawn(cell, d / "cell.log", env)  # warm with MOBIUS_WARM_START=1
                    running[proc] = (d, time.perf_counter())
                time.sleep(0.2)
                for proc in [p for p in running if p.poll() is not None]:
                    d, t0 = running.pop(proc)
                    if proc.returncode != 0:
                        failed.append(d)
                    if on_done:
                        on_done(d, read_result(d), time.perf_counter() - t0)
        finally:
            for proc in running:
                proc.terminate()
            for proc in running:
                proc.wait()
    return failed


def load_results(out: Path) -> list[dict[str, Any]]:
    """Every finished cell's result under ``out/cells``."""
    return [json.loads(p.read_text()) for p in sorted((Path(out) / "cells").glob(f"*/{RESULT}"))]


def by_cost(cells: Sequence[Cell]) -> list[Cell]:
    """The cells with the most work (steps × passes) first, so that long cells start early."""
    return sorted(cells, key=lambda c: -c.cfg.steps * c.cfg.loops)
