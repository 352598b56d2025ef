"""Keep a ring link's large buffers on the malloc heap instead of fresh ``mmap`` pages (why,
gain and cost: docs/link.md "The allocator lever").

:func:`tune_allocator` raises glibc's mmap threshold (128 KiB at start, raised adaptively)
to its maximum (32 MiB on 64-bit) and the trim threshold to :data:`TRIM_BYTES`, so freed
buffers are reused: process-wide, cannot be undone, a no-op without ``mallopt`` (musl,
macOS). Measured with ``python benchmarks/link_throughput.py --levers`` (24.9 → 19.8 ms per
16 MiB, sender plus receiver).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger("mobius.link")

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks below this come from the heap (glibc's largest allowed value on 64-bit)."""
TRIM_BYTES = 256 << 20
"""Free memory at the top of the heap beyond this is returned to the system."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_lock = threading.Lock()
_state: dict[str, bool] = {}


def tune_allocator() -> bool:
    """Apply the thresholds once per process; True if glibc accepted them."""
    with _lock:
        if "done" in _state:
            return _state["done"]
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            ok = False
        else:
            ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            ok = ok and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES) == 1
        _state["done"] = ok
        if ok:
            log.info(
                "malloc: buffers below %d MiB stay on the heap (link.allocator = tuned)",
                MMAP_THRESHOLD_BYTES >> 20,
            )
        else:
            log.info("malloc thresholds not tunable here (no glibc mallopt); left as they are")
        return ok


def allocator_tuned() -> bool:
    """Whether :func:`tune_allocator` ran and took effect in this process."""
    return _state.get("done", False)
