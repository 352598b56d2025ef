"""Block group F_i and the embedding/head replica (E, R); deterministic initialisation."""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobius_fed.model.config import ModelConfig
from mobius_fed.model.layers import Block, rms_norm


def derive_seed(seed: int, *tags: object) -> int:
    """A stable 63-bit seed from a base seed and tags (independent of Python's hash)."""
    text = ":".join(str(t) for t in (seed, *tags)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class BlockGroup(nn.Module):
    """F_i: ``layers_per_group`` consecutive blocks, owned by worker i."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers_per_group))

    def forward(self, x: Tensor, t: int = 0) -> Tensor:
        """Apply the group at application index t (0..K-1) of a stream's path."""
        del t  # the paper's groups do not depend on where in the path they run
        for block in self.blocks:
            x = block(x)
        return x


class Replica(nn.Module):
    """One origin's copy of the embedding E and the head R (tied weights by default)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.lm_head = None if cfg.tied else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        with torch.no_grad():
            self.wte.weight.normal_(0.0, 0.02)
            if self.lm_head is not None:
                self.lm_head.weight.normal_(0.0, 0.02)

    def embed(self, idx: Tensor) -> Tensor:
        """E: token ids [B, T] → hidden states [B, T, d]."""
        return rms_norm(self.wte(idx))

    def logits(self, h: Tensor) -> Tensor:
        """R: hidden states → soft-capped logits."""
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(rms_norm(h), weight).float()
        cap = self.cfg.logit_cap
        return cap * torch.tanh(logits / cap)

    def loss(self, h: Tensor, targets: Tensor) -> Tensor:
        """Mean token cross-entropy of R(h) against targets."""
        logits = self.logits(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build_group(cfg: ModelConfig, index: int, seed: int) -> BlockGroup:
    """F_index initialised from (seed, index) alone, identically on every machine."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "group", index))
        return BlockGroup(cfg)


def build_replica(cfg: ModelConfig, seed: int) -> Replica:
    """The shared initial E/R; every origin starts from the same replica."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "replica"))
        return Replica(cfg)


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the full model: P groups plus one E/R replica."""
    with torch.device("meta"):
        groups = sum(p.numel() for p in BlockGroup(cfg).parameters()) * cfg.groups
        return groups + sum(p.numel() for p in Replica(cfg).parameters())
