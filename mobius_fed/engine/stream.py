"""What a stream carries between applications: hidden states, or subspace coordinates.

Both engines build one :class:`StreamMaps` and call it at exactly the same points, so a
ring equals the reference engine with the subspace on or off. Off (the paper's model)
every method is the identity and a slot carries the hidden state h itself; on
(``TrainConfig.subspace``, see :mod:`mobius_fed.model.subspace`) a slot carries
c = Uᵀ(h − b), each application runs Uᵀ(F_i(U·c + b) − b) and the head reads U·c + b.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mobius_fed.model.groups import build_basis
from mobius_fed.model.subspace import StreamBasis

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig


@dataclass
class Entry:
    """One micro-batch of a stream at its origin: E(x_s), what slot 0 carries, and b.

    ``base`` (home mode only) is a leaf copy of E(x_s): every use of b at the origin
    (its own group's applications and the head) accumulates its gradient there, and
    :meth:`backward` hands the sum to the embedding at the end of the step.
    """

    embedded: Tensor
    slot0: Tensor
    base: Tensor | None = None

    def backward(self, grad: Tensor) -> None:
        """Back-propagate slot 0's gradient (and b's) into the replica's embedding."""
        if self.base is None:
            self.slot0.backward(grad)
        elif self.base.grad is not None:  # home: slot 0 carries 0; E reached the loss via b
            self.embedded.backward(self.base.grad)


class StreamMaps:
    """The run's maps between hidden states and what travels (identity when off)."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        basis = build_basis(cfg.model(), cfg.seed)
        self.basis = None if basis is None else StreamBasis(basis.to(device), cfg.subspace.mode)
        self.recompute = cfg.memory.recompute

    def enter(self, e: Tensor, grad: bool = True) -> Entry:
        """Slot 0 of a stream from its embedding ``e`` (with ``grad``: a training step)."""
        if self.basis is None:
            return Entry(e, e)
        base = None
        if self.basis.mode == "home":
            base = e.detach().requires_grad_() if grad else e
        return Entry(e, self.basis.enter(e), base)

    def apply(
        self, group: nn.Module, x: Tensor, t: int, worker: int, origin: int, entry: Entry | None
    ) -> Tensor:
        """Group ``worker`` at application t on a slot of stream ``origin``; ``entry`` is
        that stream's own :class:`Entry` where the worker is its origin (else None).

        With ``memory.recompute`` (in a training step) only the inputs are kept; the
        group's activations are recomputed in backward, bit for bit."""
        base = None
        if self.basis is not None and entry is not None and worker == origin:
            base = entry.base
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._apply, group, x, t, base, use_reentrant=False)
        return self._apply(group, x, t, base)

    def _apply(self, group: nn.Module, x: Tensor, t: int, base: Tensor | None) -> Tensor:
        if self.basis is None:
            return group(x, t)
        return self.basis.apply(group, x, t, base)

    def head(self, x: Tensor, entry: Entry) -> Tensor:
        """The hidden state the head reads from slot K (at the origin)."""
        if self.basis is None:
            return x
        return self.basis.expand(x, entry.base)
