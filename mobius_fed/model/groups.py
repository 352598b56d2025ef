"""Deterministic construction of block groups F_i and the shared initial replica (E, R)."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from mobius_fed.model.config import ModelConfig
from mobius_fed.model.group import BlockGroup
from mobius_fed.model.replica import Replica
from mobius_fed.model.subspace import subspace_basis


def derive_seed(seed: int, *tags: object) -> int:
    """A stable 63-bit seed from a base seed and tags (independent of Python's hash)."""
    text = ":".join(str(t) for t in (seed, *tags)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def build_basis(cfg: ModelConfig, seed: int) -> Tensor | None:
    """The run's shared subspace basis U [d, k] (None when ``subspace_rank`` is 0)."""
    if not cfg.subspace_rank:
        return None
    return subspace_basis(cfg.d_model, cfg.subspace_rank, derive_seed(seed, "subspace"))


def build_group(cfg: ModelConfig, index: int, seed: int) -> BlockGroup:
    """F_index initialised from (seed, index) alone, identically on every machine."""
    basis = build_basis(cfg, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "group", index))
        return BlockGroup(cfg, basis, index)


def build_replica(cfg: ModelConfig, seed: int, home_layer: str | None = None) -> Replica:
    """The shared initial E/R, the same for every origin. The private layers
    (``home_layer``: "off" by default, "mlp", "block"; ``cfg.home_input``) are drawn here from
    the public seed; :func:`mobius_fed.defences.site_layers.build_site_replica` redraws them
    from the site's secret key, which is what keeps them private."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "replica"))
        replica = Replica(cfg, home_layer)
    if replica.subspace is not None:  # a learned U starts from the fixed one
        basis = build_basis(cfg, seed)
        assert basis is not None
        with torch.no_grad():
            replica.subspace.weight.copy_(basis)
    return replica


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the full model: P groups plus one E/R replica (without the private
    home and input layers, which belong to the sites)."""
    with torch.device("meta"):
        basis = torch.empty(cfg.d_model, cfg.subspace_rank) if cfg.subspace_rank else None
        groups = sum(
            p.numel() for i in range(cfg.groups) for p in BlockGroup(cfg, basis, i).parameters()
        )
        return groups + sum(p.numel() for p in Replica(cfg).shared_parameters())
