"""DP-FedAvg for the shared E/R (McMahan et al., ICLR 2018; Andrew et al., arXiv 1710.06963),
with Flower's clipping and noise-scale primitives; what it does: docs/privacy.md §3, §4c.

Noise is keyed by the coordinator's secret (or the public seed) and the round, never the global
RNG, so both engines draw the same noise and a redone round draws it again. Accounting: a
site's replacement moves the mean by at most 2C/P, so the effective multiplier is z/2
(replace-one adjacency of a whole site), rounds composed with q = 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, Message
from flwr.supercore.differential_privacy import compute_clip_model_update, compute_stdv

from mobius_fed.defences.stages import COORDINATOR_KEY, keyed_digest, public_seed_key, read_key

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig


def coordinator_key(directory: str | Path | None, seed: int) -> bytes:
    """The coordinator's noise secret, or the public seed when no key directory is set."""
    if directory is None:
        return public_seed_key(seed)
    return read_key(Path(directory) / COORDINATOR_KEY, " (the E/R noise key)")


class ErPrivacy:
    """Clip each reply's E/R update to C; add N(0, (z·C/P)²) to the aggregate."""

    def __init__(self, noise: float, clip: float, P: int, seed: int, key: bytes) -> None:
        self.noise, self.clip, self.P, self.seed, self.key = noise, clip, P, seed, key

    @classmethod
    def of(cls, cfg: TrainConfig) -> ErPrivacy | None:
        pc = cfg.privacy
        if pc.er_noise <= 0:
            return None
        key = coordinator_key(pc.noise_key_dir, cfg.seed)
        return cls(pc.er_noise, pc.er_clip, cfg.workers, cfg.seed, key)  # every site

    def clip_replies(self, replies: list[Message], start: ArrayRecord) -> None:
        """Replace every reply's arrays by ``start`` + its update clipped to C (in place)."""
        base = start.to_numpy_ndarrays()
        for reply in replies:
            for name, record in reply.content.array_records.items():
                arrays = record.to_numpy_ndarrays()
                compute_clip_model_update(arrays, base, self.clip)
                reply.content[name] = ArrayRecord(
                    {k: Array(np.asarray(v)) for k, v in zip(record.keys(), arrays, strict=True)}
                )

    def add_noise(self, arrays: ArrayRecord, rnd: int) -> ArrayRecord:
        """``arrays`` plus round ``rnd``'s noise, std z·C/P, in each array's own dtype."""
        std = compute_stdv(self.noise, self.clip, self.P)
        seed = keyed_digest(self.key, f"{self.seed}:er-dp:{rnd}")
        gen = np.random.Generator(np.random.PCG64(seed))
        out = {}
        for name, a in zip(arrays.keys(), arrays.to_numpy_ndarrays(), strict=True):
            z = gen.standard_normal(a.shape, dtype=np.float32) * np.float32(std)
            out[name] = Array(np.asarray(a + z.astype(a.dtype)))
        return ArrayRecord(out)
