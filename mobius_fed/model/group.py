"""F_i: one block group, the unit of the model a worker owns (paper §2)."""

from __future__ import annotations

from torch import Tensor, nn

from mobius_fed.model.config import ModelConfig
from mobius_fed.model.layers import Block


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
