"""NoPeek (Vepakomma et al., 2020): a distance-correlation penalty at the origin.

Origin s adds ``decorrelation`` × DCor(one-hot tokens, hidden state of its first remote hop)
to its own loss (docs/privacy.md §3). The home adds the penalty's gradient to the gradient
that comes back for that slot before back-propagating: the same two lines in both engines, so
ring == reference. Reported losses (and Eq. 8) are the cross-entropy alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mobius_fed.defences.stages import first_remote_slot

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig


def _centred_distances(x: Tensor) -> Tensor:
    """Double-centred pairwise Euclidean distances of the rows of x [B, T, k] → [B, T, T].

    From explicit differences (memory B·T²·k): equal rows give exact zeros, so the floor
    under the square root keeps their gradient at exactly 0 (a matrix-product form leaves
    rounding noise there, which the floor's steep slope turns into huge gradients)."""
    d2 = (x.unsqueeze(-2) - x.unsqueeze(-3)).square().sum(-1)
    d = (d2 + 1e-12).sqrt()
    return d - d.mean(-1, keepdim=True) - d.mean(-2, keepdim=True) + d.mean((-1, -2), keepdim=True)


def distance_correlation(tokens: Tensor, h: Tensor) -> Tensor:
    """Mean over sequences of DCor(one-hot tokens [B, T], hidden states [B, T, d]), in [0, 1]."""
    # Distances between one-hot rows: sqrt(2) where the tokens differ, 0 where they agree.
    same = (tokens.unsqueeze(-1) == tokens.unsqueeze(-2)).float()
    a = (2.0**0.5) * (1.0 - same)
    a = a - a.mean(-1, keepdim=True) - a.mean(-2, keepdim=True) + a.mean((-1, -2), keepdim=True)
    b = _centred_distances(h.float())
    dcov = (a * b).mean((-1, -2))
    dvar = (a * a).mean((-1, -2)) * (b * b).mean((-1, -2))
    # clamp before the root: a sequence of one repeated token has dvar = 0 (no gradient)
    dcor2 = dcov.clamp_min(0) / dvar.clamp_min(1e-24).sqrt()
    return (dcor2 + 1e-12).sqrt().mean()


class NoPeek:
    """The penalty of one run: which slot each origin decorrelates, and its gradient."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.weight = cfg.privacy.decorrelation
        self.slots = [first_remote_slot(cfg, s) for s in range(cfg.P)]

    def slot(self, s: int) -> int | None:
        return self.slots[s]

    def gradient(self, tokens: Tensor, h: Tensor) -> Tensor:
        """weight × ∂DCor(tokens, h)/∂h, for the home to add to the returned gradient."""
        with torch.enable_grad():
            z = h.detach().requires_grad_()
            (grad,) = torch.autograd.grad(self.weight * distance_correlation(tokens, z), z)
        return grad.to(h.dtype)


def build_nopeek(cfg: TrainConfig) -> NoPeek | None:
    """The run's NoPeek penalty, None when ``privacy.decorrelation`` is 0 (the default)."""
    return NoPeek(cfg) if cfg.privacy.decorrelation > 0 else None
