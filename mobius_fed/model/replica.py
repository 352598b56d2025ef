"""(E, R): one origin's embedding and head replica, averaged across origins at barriers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobius_fed.model.config import ModelConfig
from mobius_fed.model.layers import rms_norm


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

    def shared_parameters(self) -> list[nn.Parameter]:
        """The parameters averaged across origins (all of them in the paper's model)."""
        return list(self.parameters())
