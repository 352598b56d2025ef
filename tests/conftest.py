"""Test-session setup: one torch thread everywhere, and a clean ``MOBIUS_*`` environment.

Tests run many small models and many processes at once; torch's default (one thread per
core, spinning OpenMP workers) slows a shared 2-core machine to a crawl. The variables set
here are inherited by every subprocess the tests start (daemons, ``mobius-fed``), whose
``--threads`` default reads ``MOBIUS_THREADS``. ``MOBIUS_*`` variables of the calling shell
are removed so that they cannot change what a test trains. The repository root goes first
on ``PYTHONPATH`` so that ``python -m mobius_fed...`` subprocesses import this checkout.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_THREADS = "1"

for _name in [n for n in os.environ if n.startswith("MOBIUS_")]:
    del os.environ[_name]
os.environ.update(
    OMP_NUM_THREADS=TEST_THREADS,
    MKL_NUM_THREADS=TEST_THREADS,
    MOBIUS_THREADS=TEST_THREADS,
    PYTHONPATH=os.pathsep.join(
        [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    ),
)


def pytest_configure(config) -> None:
    import torch

    torch.set_num_threads(int(TEST_THREADS))
    with contextlib.suppress(RuntimeError):  # already set, or inter-op work has started
        torch.set_num_interop_threads(int(TEST_THREADS))
