"""What warm starts save: ``mobius-fed up`` with every daemon a fresh interpreter against
the same run with ``MOBIUS_WARM_START=1`` (daemons forked from a server that imported torch
once, mobius_fed/warmstart.py).

Each round runs both, in alternating order, as real ``mobius-fed up`` processes (a
coordinator and P workers, cpu-tiny, a few steps). Printed per mode: the wall seconds of the
whole ``up`` and the CPU seconds the machine spent meanwhile (``/proc/stat``: every process,
so run it on an otherwise idle machine); then the warm/cold ratios of the medians.

    python benchmarks/warm_start.py                  # P = 4, 3 steps, 3 rounds
    python benchmarks/warm_start.py --workers 2 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds this machine has spent outside idle and iowait since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / HZ


def one_up(warm: bool, workers: int, steps: int, root: Path) -> tuple[float, float]:
    """Wall and machine CPU seconds of one ``mobius-fed up`` run."""
    out = Path(tempfile.mkdtemp(dir=root)) / "run"
    env = {
        **os.environ,
        "MOBIUS_WARM_START": "1" if warm else "0",
        "MOBIUS_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-m", "mobius_fed.cli.main", "up", "--preset", "cpu-tiny",
            "--workers", str(workers), "--steps", str(steps), "--eval-every", "0",
            "--out", str(out)]  # fmt: skip
    cpu, t = busy_seconds(), time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t, busy_seconds() - cpu
    if done.returncode != 0:
        sys.exit(f"up ({'warm' if warm else 'cold'}) exited {done.returncode}:\n{done.stderr}")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for warm in (r % 2 == 0, r % 2 != 0):
                wall, cpu = one_up(warm, args.workers, args.steps, Path(tmp))
                runs[warm].append((wall, cpu))
                print(f"round {r} {'warm' if warm else 'cold'}: {wall:.1f} s wall, "
                      f"{cpu:.1f} s CPU", flush=True)  # fmt: skip
    med = {w: tuple(statistics.median(x[i] for x in runs[w]) for i in (0, 1)) for w in runs}
    print(f"\nmobius-fed up, cpu-tiny, P = {args.workers}, {args.steps} steps, "
          f"{args.rounds} rounds (medians)")  # fmt: skip
    print("| start | wall s | CPU s |\n|---|---|---|")
    for w in (False, True):
        print(f"| {'warm' if w else 'cold'} | {med[w][0]:.1f} | {med[w][1]:.1f} |")
    print(f"| warm / cold | {med[True][0] / med[False][0]:.2f} | "
          f"{med[True][1] / med[False][1]:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
