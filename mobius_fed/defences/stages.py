"""Privacy defences applied at ring hops (see :mod:`mobius_fed.hop`): :class:`LabelNoise` on
the gradient the home returns for slot K, :class:`InputNoise` on the origin's first remote hop
(docs/privacy.md §3). Both run at the sending site, with noise seeded by (site key, seed, phase,
step, s, slot, m, direction), never the global RNG, so both engines draw the same noise;
without ``<noise_key_dir>/site-<s>.key`` the key is the public seed and any worker can
regenerate (and strip) the noise.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mobius_fed import schedule

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig
    from mobius_fed.hop import Engine, HopContext, HopStage

KEY_BYTES = 32
COORDINATOR_KEY = "coordinator.key"  # the coordinator's secret for the E/R noise (er_dp.py)


def key_path(directory: str | Path, s: int) -> Path:
    return Path(directory) / f"site-{s}.key"


def write_site_keys(directory: str | Path, sites: int) -> list[Path]:
    """Make one random secret per site (each file belongs on its own site only) and the
    coordinator's (``coordinator.key``, for the E/R noise; it belongs on the coordinator)."""
    import secrets

    Path(directory).mkdir(parents=True, exist_ok=True)
    paths = [key_path(directory, s) for s in range(sites)] + [Path(directory) / COORDINATOR_KEY]
    for path in paths:
        path.write_bytes(secrets.token_bytes(KEY_BYTES))
        path.chmod(0o600)
    return paths


def public_seed_key(seed: int) -> bytes:
    """The key used without a key directory: public, so anyone can regenerate the noise."""
    return f"public-seed:{seed}".encode()


def read_key(path: Path, what: str = "") -> bytes:
    """A secret key file (at least 16 bytes); errors name the file and the setting."""
    if not path.is_file():
        raise FileNotFoundError(f"privacy.noise_key_dir: {path} not found{what}")
    data = path.read_bytes()
    if len(data) < 16:
        raise ValueError(f"privacy.noise_key_dir: {path} holds {len(data)} bytes (< 16)")
    return data


def keyed_digest(key: bytes, label: str) -> int:
    """A 64-bit integer from ``label`` under the secret ``key`` (keyed BLAKE2b)."""
    digest = hashlib.blake2b(label.encode(), key=key[:64], digest_size=8).digest()
    return int.from_bytes(digest, "little")


class NoiseKeys:
    """The secret each sending site keys its noise with (a ring worker holds only its own)."""

    def __init__(self, cfg: TrainConfig, engine: Engine, rank: int | None) -> None:
        self.seed = cfg.seed
        self.directory = cfg.privacy.noise_key_dir
        self.engine, self.rank = engine, rank
        self._keys: dict[int, bytes] = {}

    def key(self, s: int) -> bytes:
        if self.directory is None:
            return public_seed_key(self.seed)
        if s not in self._keys:
            if self.engine == "ring" and s != self.rank:
                raise ValueError(f"worker {self.rank} has no noise key of site {s}")
            self._keys[s] = read_key(key_path(self.directory, s))
        return self._keys[s]

    def generator(self, ctx: HopContext) -> torch.Generator:
        """The generator of hop ``ctx``, keyed by the sender's (= origin's) secret."""
        label = f"{self.seed}:{ctx.phase}:{ctx.step}:{ctx.s}:{ctx.slot}:{ctx.m}:{ctx.direction}"
        return torch.Generator().manual_seed(keyed_digest(self.key(ctx.s), label) >> 1)


def gaussian(like: Tensor, gen: torch.Generator) -> Tensor:
    """Standard normal noise shaped like ``like`` (drawn in fp32 on the CPU)."""
    z = torch.randn(like.shape, generator=gen, dtype=torch.float32)
    return z.to(device=like.device, dtype=like.dtype)


def clip_rows(rows: Tensor, bound: float) -> Tensor:
    """Scale each row to L2 norm at most ``bound``."""
    norms = rows.norm(dim=-1, keepdim=True)
    return rows * torch.clamp(bound / norms.clamp_min(1e-12), max=1.0)


def label_release(g: Tensor, sigma: float, clip: float, noise: Tensor | None) -> Tensor:
    """The home's released gradient: per-token clip of N·g to ``clip``, plus σ·clip·noise, /N.

    ``g`` is the gradient of the micro-batch's mean loss over N = B·T tokens, so N·g holds
    each token's gradient of its own loss. ``noise`` None clips only.
    """
    n = g.shape[:-1].numel()
    rows = clip_rows(g.reshape(-1, g.shape[-1]) * n, clip)
    if noise is not None:
        rows = rows + (sigma * clip) * noise.reshape(rows.shape)
    return (rows / n).reshape(g.shape)


def first_remote_slot(cfg: TrainConfig, s: int) -> int | None:
    """The first forward slot of stream s that leaves its home (None when P = 1)."""
    path = schedule.path(cfg.order, s, cfg.P, cfg.loops)
    for slot in range(cfg.K + 1):
        if schedule.producer(path, s, slot) != schedule.consumer(path, s, slot):
            return slot
    return None


class LabelNoise:
    """Clip + Gaussian noise on the gradient of slot K that the home sends back."""

    def __init__(self, cfg: TrainConfig, keys: NoiseKeys) -> None:
        self.K, self.keys = cfg.K, keys
        self.sigma, self.clip = cfg.privacy.label_noise, cfg.privacy.label_clip

    def forward(self, h: Tensor, ctx: HopContext) -> Tensor:
        return h

    def backward(self, g: Tensor, ctx: HopContext) -> Tensor:
        if ctx.slot != self.K or not ctx.remote:
            return g
        return label_release(g, self.sigma, self.clip, gaussian(g, self.keys.generator(ctx)))


class InputNoise:
    """Gaussian noise on a stream's first remote hop: std σ × each token's RMS, or with
    ``input_clip`` C each position clipped to C and std σ·C (``accounting``'s mechanism)."""

    def __init__(self, cfg: TrainConfig, keys: NoiseKeys) -> None:
        self.keys, self.sigma = keys, cfg.privacy.input_noise
        self.clip = cfg.privacy.input_clip
        self.slots = [first_remote_slot(cfg, s) for s in range(cfg.P)]

    def forward(self, h: Tensor, ctx: HopContext) -> Tensor:
        if ctx.slot != self.slots[ctx.s]:
            return h
        noise = gaussian(h, self.keys.generator(ctx))
        if self.clip is not None:
            return clip_rows(h, self.clip) + (self.sigma * self.clip) * noise
        rms = h.float().square().mean(-1, keepdim=True).sqrt().to(h.dtype)
        return h + (self.sigma * rms) * noise

    def backward(self, g: Tensor, ctx: HopContext) -> Tensor:
        return g


def build_stages(cfg: TrainConfig, engine: Engine, rank: int | None) -> list[HopStage]:
    """The defence stages ``cfg`` turns on, in hop order (none by default)."""
    pc = cfg.privacy
    if pc.input_epsilon_target is not None:  # refuse a target the run cannot meet, at start
        from mobius_fed.defences.accounting import check_input_target

        check_input_target(pc, cfg.steps, cfg.model().seq_len)
    keys = NoiseKeys(cfg, engine, rank)
    if pc.any_on() and engine == "ring" and rank is not None:
        keys.key(rank)  # a missing or short key file fails at start, not mid-step
    stages: list[HopStage] = []
    if pc.input_noise > 0:
        stages.append(InputNoise(cfg, keys))
    if pc.label_noise > 0:
        stages.append(LabelNoise(cfg, keys))
    return stages
