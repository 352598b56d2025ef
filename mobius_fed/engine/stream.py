"""What a stream carries between applications: hidden states, or subspace coordinates.

Both engines build one :class:`StreamMaps` and call it at exactly the same points, so a
ring equals the reference engine with the subspace on or off. Off (the paper's model)
every method is the identity and a slot carries the hidden state h itself; on
(``TrainConfig.subspace``, see :mod:`mobius_fed.model.subspace`) a slot carries
c = Uᵀ(h − b), each application runs Uᵀ(F_i(U·c + b) − b) and the head reads U·c + b.

In mode ``tokens`` a forward slot is [c, x] (the micro-batch's token ids as one more
channel, sent exactly) and every application rebuilds b = E_i(x) from its own worker's
embedding E_i; gradients travel without the ids channel (:meth:`StreamMaps.grad_out`,
:meth:`StreamMaps.grad_in`). The math: docs/wan.md §7.
"""

from __future__ import annotations

from collections.abc import Callable
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
    tokens: bool = False  # mode tokens: slot 0 is [0, x]; the head reads b = ``embedded``

    def backward(self, grad: Tensor) -> None:
        """Back-propagate slot 0's gradient (and b's) into the replica's embedding."""
        if self.tokens:  # slot 0 does not depend on E; each use of b had its own graph
            return
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
        self.tokens = self.basis is not None and cfg.subspace.mode == "tokens"

    def enter(self, e: Tensor, grad: bool = True, ids: Tensor | None = None) -> Entry:
        """Slot 0 of a stream from its embedding ``e`` = E(ids) (with ``grad``: a training
        step). Mode ``tokens`` needs the token ids: slot 0 is [0, ids]."""
        if self.basis is None:
            return Entry(e, e)
        if self.tokens:
            if ids is None:
                raise ValueError("subspace mode 'tokens': the stream's entry needs its token ids")
            zeros = e.new_zeros(*e.shape[:-1], self.basis.U.size(1))
            return Entry(e, torch.cat([zeros, ids.to(e.dtype).unsqueeze(-1)], dim=-1), None, True)
        base = None
        if self.basis.mode == "home":
            base = e.detach().requires_grad_() if grad else e
        return Entry(e, self.basis.enter(e), base)

    def apply(
        self,
        group: nn.Module,
        x: Tensor,
        t: int,
        worker: int,
        origin: int,
        entry: Entry | None,
        embed: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """Group ``worker`` at application t on a slot of stream ``origin``; ``entry`` is
        that stream's own :class:`Entry` where the worker is its origin (else None);
        ``embed`` is the worker's own E (mode ``tokens``: b = E_worker(x)).

        With ``memory.recompute`` (in a training step) only the inputs are kept; the
        group's activations are recomputed in backward, bit for bit."""
        base = None
        if self.basis is not None and entry is not None and worker == origin:
            base = entry.base
        if self.tokens and embed is None:
            raise ValueError("subspace mode 'tokens': an application needs its worker's E")
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._apply, group, x, t, base, embed, use_reentrant=False)
        return self._apply(group, x, t, base, embed)

    def _apply(
        self,
        group: nn.Module,
        x: Tensor,
        t: int,
        base: Tensor | None,
        embed: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        if self.basis is None:
            return group(x, t)
        if self.tokens:
            assert embed is not None
            c, ids = self.split(x)
            out = self.basis.apply(group, c, t, embed(ids.squeeze(-1).long()))
            return torch.cat([out, ids.detach()], dim=-1)
        return self.basis.apply(group, x, t, base)

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Mode ``tokens``: a forward slot [c, x] → (c [B, T, k], ids [B, T, 1] as floats)."""
        assert self.basis is not None
        k = self.basis.U.size(1)
        return x[..., :k], x[..., k:]

    def head(self, x: Tensor, entry: Entry) -> Tensor:
        """The hidden state the head reads from slot K (at the origin)."""
        if self.basis is None:
            return x
        if self.tokens:
            return self.basis.expand(self.split(x)[0], entry.embedded)
        return self.basis.expand(x, entry.base)

    def grad_out(self, g: Tensor) -> Tensor:
        """What a backward hop carries for a slot's gradient ``g``: in mode ``tokens`` its
        coordinates' part [B, T, k] (the ids channel's gradient is 0 and is not sent)."""
        return g[..., :-1].contiguous() if self.tokens else g

    def grad_in(self, g: Tensor) -> Tensor:
        """The slot's gradient from what a backward hop carried (mode ``tokens``: a zero
        gradient for the ids channel appended)."""
        return nn.functional.pad(g, (0, 1)) if self.tokens else g
