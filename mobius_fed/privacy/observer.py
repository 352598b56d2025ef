"""What one worker legitimately sees on the ring, recorded as hop stages.

The reference engine hands on exactly the tensors a ring exchanges (the exactness
contract), so taps added to its :class:`~mobius_fed.hop.Hops` record what worker
``rank`` receives: both taps run after every other stage (a hop's stages run in the same
order in both directions), so they see the tensor and the gradient as they arrive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from mobius_fed.hop import HopContext, Hops

Key = tuple[str, int, int, int, int]  # phase, step, s, slot, m


@dataclass
class Observer:
    """Keeps the tensors ``rank`` receives at the chosen forward/backward slots.

    ``forward_slots``/``backward_slots`` map a stream s to the slot recorded for it;
    ``on_backward`` (if given) is called with each recorded gradient's context, so that an
    attack can run while the attacker's replica is as it was at that step. ``train_steps``
    (if given) limits the forward taps' training phase to those steps (evaluation is kept).
    """

    rank: int
    forward_slots: dict[int, int] = field(default_factory=dict)
    backward_slots: dict[int, int] = field(default_factory=dict)
    phases: tuple[str, ...] = ("train", "eval")
    on_backward: Callable[[HopContext, Tensor], None] | None = None
    sent_forward: dict[int, int] = field(default_factory=dict)
    train_steps: frozenset[int] | None = None
    received: dict[Key, Tensor] = field(default_factory=dict)
    sent: dict[Key, Tensor] = field(default_factory=dict)

    @staticmethod
    def key(ctx: HopContext) -> Key:
        return (ctx.phase, ctx.step, ctx.s, ctx.slot, ctx.m)

    def attach(self, hops: Hops) -> None:
        """Install the taps after every stage (defences and codecs run first)."""
        hops.stages.append(_BackwardTap(self))
        hops.stages.append(_ForwardTap(self))


class _ForwardTap:
    def __init__(self, obs: Observer) -> None:
        self.obs = obs

    def forward(self, h: Tensor, ctx: HopContext) -> Tensor:
        obs = self.obs
        skipped = ctx.phase == "train" and obs.train_steps is not None
        if skipped and ctx.step not in obs.train_steps:
            return h
        if ctx.phase in obs.phases and ctx.remote:
            if ctx.consumer == obs.rank and obs.forward_slots.get(ctx.s) == ctx.slot:
                obs.received[obs.key(ctx)] = h.detach().clone()
            if ctx.producer == obs.rank and obs.sent_forward.get(ctx.s) == ctx.slot:
                obs.sent[obs.key(ctx)] = h.detach().clone()
        return h

    def backward(self, g: Tensor, ctx: HopContext) -> Tensor:
        return g


class _BackwardTap:
    def __init__(self, obs: Observer) -> None:
        self.obs = obs

    def forward(self, h: Tensor, ctx: HopContext) -> Tensor:
        return h

    def backward(self, g: Tensor, ctx: HopContext) -> Tensor:
        obs = self.obs
        if ctx.remote and ctx.producer == obs.rank and obs.backward_slots.get(ctx.s) == ctx.slot:
            if obs.on_backward is not None:
                obs.on_backward(ctx, g.detach())
            else:
                obs.received[("grad", ctx.step, ctx.s, ctx.slot, ctx.m)] = g.detach().clone()
        return g
