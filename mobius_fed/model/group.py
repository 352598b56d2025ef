"""F_i: one block group, the unit of the model a worker owns (paper §2)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mobius_fed.model.config import ModelConfig
from mobius_fed.model.knobs import residual_epsilon
from mobius_fed.model.layers import Block
from mobius_fed.model.subspace import Bottleneck

# Group parameters that are not weight matrices of a layer (AdamW, never Muon).
LOOP_PARAMETERS = ("depth_embedding",)


class BlockGroup(nn.Module):
    """F_i: ``cfg.group_layers[i]`` consecutive blocks, owned by worker i.

    With the loop knobs on (``ModelConfig.depth_embedding`` / ``residual_scale``) the group
    also owns a ``[K, d]`` table of depth vectors and scales each visit's update; both are
    functions of the application index t alone, so any engine computes the same thing.
    With ``ModelConfig.subspace_rank`` k > 0 its blocks write through the basis U [d, k],
    unless ``subspace_writes`` is "full" (then only the hops are projected, by the engine).
    With ``subspace_bottleneck`` it also owns its learned wire :class:`Bottleneck` (encoder
    of what it sends, decoder of what it receives), which the engine applies around it.
    """

    def __init__(self, cfg: ModelConfig, basis: Tensor | None = None, index: int = 0) -> None:
        super().__init__()
        if cfg.subspace_rank and (basis is None or basis.shape != (cfg.d_model, cfg.subspace_rank)):
            raise ValueError(
                f"subspace rank {cfg.subspace_rank} needs a basis of shape "
                f"({cfg.d_model}, {cfg.subspace_rank}) (see model.subspace.subspace_basis)"
            )
        basis = basis if cfg.subspace_rank and cfg.subspace_writes == "basis" else None
        layers = cfg.group_layers[index]
        self.blocks = nn.ModuleList(Block(cfg, basis) for _ in range(layers))
        self.applications = cfg.applications
        self.epsilon = residual_epsilon(cfg.residual_scale, cfg.loops)
        self.depth_embedding = (
            nn.Parameter(torch.zeros(cfg.applications, cfg.d_model))
            if cfg.depth_embedding
            else None
        )
        self.bottleneck = (
            Bottleneck(cfg.d_model, cfg.subspace_rank) if cfg.subspace_bottleneck else None
        )

    def forward(self, x: Tensor, t: int = 0) -> Tensor:
        """Apply the group at application index t (0..K-1) of a stream's path."""
        h = x
        if self.depth_embedding is not None:
            if not 0 <= t < self.applications:
                raise ValueError(f"application index t={t} outside 0..{self.applications - 1}")
            h = h + self.depth_embedding[t]
        for block in self.blocks:
            h = block(h)
        if self.epsilon != 1.0:
            h = x + self.epsilon * (h - x)
        return h
