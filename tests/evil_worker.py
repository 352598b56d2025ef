"""A ``mobius-worker`` whose site lies, with a valid certificate and well-formed messages.
From step ``EVIL_FROM`` (default 3) on:

* ``EVIL_SCALE=s``: it scales every hidden state it sends on the ring by ``s``;
* ``EVIL_GRAD=s``: it scales every gradient it sends back on the ring by ``s`` (``-1``:
  flips its sign);
* ``EVIL_NOISE=s``: it adds Gaussian noise of ``s`` times the tensor's RMS to every hidden
  state and gradient it sends (after any scale);
* ``EVIL_FRACTION=f``: the three above lie on a fraction ``f`` of its frames only (drawn
  per frame from a hash of the frame's key, so a step trained again lies the same way);
* ``EVIL_ER=s``: at every barrier after step ``EVIL_ER_FROM`` (default 0: every one) it
  scales its E/R update (what it sends back minus what the round sent it) by ``s``;
* ``EVIL_LOSS=s``: it reports its training and validation losses ×``s``;
* ``EVIL_COMMIT``: how it lies in its commitments (docs/security.md "Commitments"):
  ``cover``: the frames it scales (``EVIL_SCALE``, ``EVIL_GRAD``) leave its ring link
  scaled, but it commits the digest of the frames it should have sent; ``forge@r``,
  ``omit@r``, ``late@r`` (comma-separated, r a round): its reply to round r carries a
  commitment signed by another key, none, or its previous round's.

Used by tests/test_bounds.py and benchmarks/poisoning.py as ``python -m tests.evil_worker``
with the worker's flags.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import Array, ArrayRecord
from torch import Tensor

import mobius_fed.worker.flower_client as flower_client
from mobius_fed.cli.worker import main
from mobius_fed.messages import COMMITMENT, Signed
from mobius_fed.transport.commitments import TRAIN, sign
from mobius_fed.worker.commitments import SENT
from mobius_fed.worker.executor import RingExecutor, WorkerStep
from mobius_fed.worker.frames import BACKWARD, FORWARD, FrameKey
from mobius_fed.worker.link import RingLinks

FROM = int(os.environ.get("EVIL_FROM", "3"))
SCALES: dict[int, float] = {
    FORWARD: float(os.environ.get("EVIL_SCALE", "1")),
    BACKWARD: float(os.environ.get("EVIL_GRAD", "1")),
}

NOISE = float(os.environ.get("EVIL_NOISE", "0"))
FRACTION = float(os.environ.get("EVIL_FRACTION", "1"))


def _draw(key: FrameKey) -> int:
    """64 bits drawn from the frame's key: the same for the same frame in every run."""
    name = f"{key.phase}:{key.step}:{key.direction}:{key.origin}:{key.tick}:{key.micro}"
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def chosen(key: FrameKey, fraction: float = FRACTION, start: int = FROM) -> bool:
    """Whether frame ``key`` carries the lie: from step ``start``, a ``fraction`` of frames."""
    return key.step >= start and (fraction >= 1 or _draw(key) < fraction * 2.0**64)


def lie(
    key: FrameKey,
    tensor: Tensor,
    scales: Mapping[Any, float] = SCALES,
    noise: float = NOISE,
    fraction: float = FRACTION,
    start: int = FROM,
) -> Tensor:
    """What the liar sends instead of ``tensor`` as frame ``key``."""
    if not chosen(key, fraction, start):
        return tensor
    out = tensor * scales.get(key.direction, 1.0)
    if noise:
        g = torch.Generator().manual_seed(_draw(key) >> 1)
        z = torch.randn(tensor.shape, generator=g, dtype=torch.float32).to(tensor.device)
        rms = tensor.detach().float().pow(2).mean().sqrt()
        out = out + (noise * rms * z).to(tensor.dtype)
    return out


COMMIT = os.environ.get("EVIL_COMMIT", "")
if COMMIT == "cover":  # the lie goes on the wire, the honest digest into the commitment
    _send_tensor = RingLinks.send_tensor

    def _covered_send(self: RingLinks, key: FrameKey, tensor: Tensor) -> None:
        scale = SCALES.get(key.direction, 1.0)
        if key.step < FROM or scale == 1.0 or self.ledger is None:
            _send_tensor(self, key, tensor)
            return
        wire = self.rules.cfg.wire_dtype
        honest = hashlib.sha256(b"".join(self.frames(key, tensor, wire=wire))).hexdigest()
        self.ledger.record(key, SENT, self.peer(key.direction), honest)
        out = self._outgoing(key.direction)
        for data in self.frames(key, tensor * scale, wire=wire):
            out.put(data)

    RingLinks.send_tensor = _covered_send  # type: ignore[method-assign]
elif any(s != 1.0 for s in SCALES.values()) or NOISE:
    _send = RingExecutor._send

    def _lying_send(self: RingExecutor, key: FrameKey, tensor: Tensor) -> None:
        _send(self, key, lie(key, tensor))

    RingExecutor._send = _lying_send  # type: ignore[method-assign]

if "EVIL_LOSS" in os.environ:
    LOSS = float(os.environ["EVIL_LOSS"])
    _step, _evaluate = RingExecutor.train_step, RingExecutor.evaluate

    def _lying_step(self: RingExecutor) -> WorkerStep:
        r = _step(self)
        if r.step < FROM:
            return r
        return WorkerStep(r.step, r.loss * LOSS, r.compute_s, r.wait_s, r.seconds)

    def _lying_eval(self: RingExecutor) -> float:
        loss = _evaluate(self)
        return loss * LOSS if self.step >= FROM else loss

    RingExecutor.train_step = _lying_step  # type: ignore[method-assign]
    RingExecutor.evaluate = _lying_eval  # type: ignore[method-assign]

if "EVIL_ER" in os.environ:
    ER, ER_FROM = float(os.environ["EVIL_ER"]), int(os.environ.get("EVIL_ER_FROM", "0"))
    _load, _arrays = flower_client.load_replica, flower_client.replica_arrays
    _sent: dict[str, Any] = {}

    def _remember(executor: RingExecutor, arrays: ArrayRecord) -> None:
        _sent["arrays"] = {k: np.array(a.numpy()) for k, a in arrays.items()}
        _load(executor, arrays)

    def _poisoned(executor: RingExecutor) -> ArrayRecord:
        mine, base = _arrays(executor), _sent.get("arrays")
        if base is None or executor.step <= ER_FROM:
            return mine
        out = {}
        for k, a in mine.items():
            v = a.numpy()
            out[k] = Array(np.asarray(base[k] + ER * (v - base[k]), dtype=v.dtype))
        return ArrayRecord(out)

    flower_client.load_replica = _remember
    flower_client.replica_arrays = _poisoned

PLAN = {int(r): mode for mode, _, r in (x.partition("@") for x in COMMIT.split(",")) if r}
if PLAN:
    _commit = flower_client.WorkerHandlers._commit
    _last: list[Signed] = []
    _other = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )

    def _lying_commit(
        self: Any, reply: Any, rnd: int, phase: int, first: int, end: int
    ) -> Signed | None:
        mode = PLAN.get(rnd) if phase == TRAIN else None
        if mode == "omit":
            return None
        signed = _commit(self, reply, rnd, phase, first, end)
        if signed is None or phase != TRAIN:
            return signed
        if mode == "forge":
            reply[COMMITMENT] = Signed(signed.body, sign(_other, signed.body)).to_record()
        elif mode == "late" and _last:
            reply[COMMITMENT] = _last[-1].to_record()
        _last[:] = [signed]
        return Signed.of(reply[COMMITMENT])  # what the reply carries, as the honest one

    flower_client.WorkerHandlers._commit = _lying_commit  # type: ignore[method-assign]

if __name__ == "__main__":
    raise SystemExit(main())
