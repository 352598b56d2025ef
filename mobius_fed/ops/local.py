"""What a federation on one machine needs before its processes start: the per-site data
directories and the torch threads of each process."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from mobius_fed.ops import OpsError


def default_threads(processes: int = 1) -> int:
    """Threads for one of ``processes`` training processes on this machine: the cores this
    process may run on (its affinity mask, else the machine's count) // processes, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, processes))


def site_dirs(root: Path, P: int) -> list[Path]:
    """The P directories ``root/site-<i>``; a clear error when any is missing."""
    root = Path(root)
    if not root.is_dir():
        raise OpsError(f"data directory not found: {root}")
    dirs = [root / f"site-{i}" for i in range(P)]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise OpsError(f"data directory {root} lacks {', '.join(missing)} (P={P})")
    return dirs


def prepared_dir(data: Sequence[Path] | None) -> Path | None:
    """``--data DIR``: the one directory of prepared site-<i>/ folders, else None."""
    return Path(data[0]) if data and len(data) == 1 and Path(data[0]).is_dir() else None


def split_sites(data: Sequence[Path] | None, root: Path, P: int, encoding: str) -> list[Path]:
    """Split the text files ``data`` (none: the embedded corpus) into ``root/site-<i>``."""
    from mobius_fed.data import embedded_corpus, prepare_sites

    missing = [str(f) for f in data or () if not Path(f).exists()]
    if missing:
        raise OpsError(f"data path not found: {', '.join(missing)}")
    text = None if data else embedded_corpus()
    return prepare_sites(data, root, P, encoding, text=text, overwrite=True)
