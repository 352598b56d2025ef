"""A ``mobius-worker`` whose site lies, with a valid certificate and well-formed messages:

* ``EVIL_SCALE=s``: from step ``EVIL_FROM`` (default 3) on it scales every hidden state it
  sends on the ring by ``s``;
* ``EVIL_ER=s``: at every barrier it scales its E/R update (what it sends back minus what
  the round sent it) by ``s``.

Used by tests/test_bounds.py as ``python -m tests.evil_worker`` with the worker's flags.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from torch import Tensor

import mobius_fed.worker.flower_client as flower_client
from mobius_fed.cli.worker import main
from mobius_fed.worker.executor import RingExecutor
from mobius_fed.worker.frames import FORWARD, FrameKey

if "EVIL_SCALE" in os.environ:
    SCALE, FROM = float(os.environ["EVIL_SCALE"]), int(os.environ.get("EVIL_FROM", "3"))
    _send = RingExecutor._send

    def _lying_send(self: RingExecutor, key: FrameKey, tensor: Tensor) -> None:
        if key.direction == FORWARD and key.step >= FROM:
            tensor = tensor * SCALE
        _send(self, key, tensor)

    RingExecutor._send = _lying_send  # type: ignore[method-assign]

if "EVIL_ER" in os.environ:
    ER = float(os.environ["EVIL_ER"])
    _load, _arrays = flower_client.load_replica, flower_client.replica_arrays
    _sent: dict[str, Any] = {}

    def _remember(executor: RingExecutor, arrays: ArrayRecord) -> None:
        _sent["arrays"] = {k: np.array(a.numpy()) for k, a in arrays.items()}
        _load(executor, arrays)

    def _poisoned(executor: RingExecutor) -> ArrayRecord:
        mine, base = _arrays(executor), _sent.get("arrays")
        if base is None:
            return mine
        out = {}
        for k, a in mine.items():
            v = a.numpy()
            out[k] = Array(np.asarray(base[k] + ER * (v - base[k]), dtype=v.dtype))
        return ArrayRecord(out)

    flower_client.load_replica = _remember
    flower_client.replica_arrays = _poisoned

if __name__ == "__main__":
    raise SystemExit(main())
