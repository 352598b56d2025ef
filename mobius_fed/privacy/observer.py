"""What one worker legitimately sees on the ring, recorded as a hop stage.

The reference engine hands on exactly the tensors a ring exchanges (the exactness
contract), so an observer added to its :class:`~mobius_fed.hop.Hops` records what worker
``rank`` receives: it runs after every other stage (a hop's stages run in the same order
in both directions), so it sees the tensor and the gradient as they arrive.

What arrives is what crosses the edge: the hidden state, or with the subspace on the k-wide
coordinates (a learned bottleneck's code). ``rebuild`` (if given) also keeps what the
receiver computes from a received forward tensor *as it arrives*, with the weights it holds
at that moment (a bottleneck receiver's own decoder at that step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mobius_fed.hop import HopContext, Hops

Key = tuple[str, int, int, int, int]  # phase, step, s, slot, m


@dataclass
class Observer:
    """Keeps the tensors ``rank`` receives at the chosen forward/backward slots.

    ``forward_slots``/``backward_slots`` map a stream s to the slot recorded for it;
    ``on_backward`` (if given) is called with each recorded gradient's context, so that an
    attack can run while the attacker's replica is as it was at that step. ``train_steps``
    (if given) limits the forward records of the training phase to those steps (evaluation is kept).
    ``rebuild`` (if given) maps each recorded received tensor and its context to what the
    receiver rebuilds from it, evaluated on arrival; kept in ``rebuilt`` under the same key.
    """

    rank: int
    forward_slots: dict[int, int] = field(default_factory=dict)
    backward_slots: dict[int, int] = field(default_factory=dict)
    phases: tuple[str, ...] = ("train", "eval")
    on_backward: Callable[[HopContext, Tensor], None] | None = None
    sent_forward: dict[int, int] = field(default_factory=dict)
    train_steps: frozenset[int] | None = None
    rebuild: Callable[[Tensor, HopContext], Tensor] | None = None
    received: dict[Key, Tensor] = field(default_factory=dict)
    rebuilt: dict[Key, Tensor] = field(default_factory=dict)
    sent: dict[Key, Tensor] = field(default_factory=dict)

    @staticmethod
    def key(ctx: HopContext) -> Key:
        return (ctx.phase, ctx.step, ctx.s, ctx.slot, ctx.m)

    def attach(self, hops: Hops) -> None:
        """Install the observer as the last stage (defences and codecs run first)."""
        hops.stages.append(self)

    def forward(self, h: Tensor, ctx: HopContext) -> Tensor:
        skipped = ctx.phase == "train" and self.train_steps is not None
        if skipped and ctx.step not in (self.train_steps or ()):
            return h
        if ctx.phase in self.phases and ctx.remote:
            if ctx.consumer == self.rank and self.forward_slots.get(ctx.s) == ctx.slot:
                self.received[self.key(ctx)] = h.detach().clone()
                if self.rebuild is not None:
                    with torch.no_grad():
                        self.rebuilt[self.key(ctx)] = self.rebuild(h.detach(), ctx).clone()
            if ctx.producer == self.rank and self.sent_forward.get(ctx.s) == ctx.slot:
                self.sent[self.key(ctx)] = h.detach().clone()
        return h

    def backward(self, g: Tensor, ctx: HopContext) -> Tensor:
        if ctx.remote and ctx.producer == self.rank and self.backward_slots.get(ctx.s) == ctx.slot:
            if self.on_backward is not None:
                self.on_backward(ctx, g.detach())
            else:
                self.received[("grad", ctx.step, ctx.s, ctx.slot, ctx.m)] = g.detach().clone()
        return g
