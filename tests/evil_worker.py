"""A ``mobius-worker`` whose site lies: from step ``EVIL_FROM`` on it scales every hidden
state it sends by ``EVIL_SCALE`` (well-formed, finite frames from a valid certificate).

Used by tests/test_bounds.py as ``python -m tests.evil_worker`` with the worker's flags.
"""

from __future__ import annotations

import os

from torch import Tensor

from mobius_fed.cli.worker import main
from mobius_fed.worker.executor import RingExecutor
from mobius_fed.worker.frames import FORWARD, FrameKey

SCALE = float(os.environ.get("EVIL_SCALE", "1e6"))
FROM = int(os.environ.get("EVIL_FROM", "3"))
_send = RingExecutor._send


def _lying_send(self: RingExecutor, key: FrameKey, tensor: Tensor) -> None:
    if key.direction == FORWARD and key.step >= FROM:
        tensor = tensor * SCALE
    _send(self, key, tensor)


RingExecutor._send = _lying_send  # type: ignore[method-assign]

if __name__ == "__main__":
    raise SystemExit(main())
