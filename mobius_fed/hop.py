"""What happens to a tensor on its way from one block group to the next (one *hop*).

Both engines route every hidden state and gradient through one :class:`Hops` object at the
same slots. A stage is a pure function of (tensor, context, config) (noise from a generator
seeded by the context, never the global RNG) or keeps state keyed by the context, and is
straight-through for gradients, so reference and ring produce identical tensors. Slots,
rules and the two stage owners (composed by :func:`mobius_fed.engine.hops.build_hops`):
docs/architecture.md §6.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor

Engine = Literal["reference", "ring"]
Direction = Literal["forward", "backward"]
HopPhase = Literal["train", "eval"]


@dataclass(frozen=True)
class HopContext:
    """One hop: ``direction`` of ``slot`` of stream ``s``, micro-batch ``m``, at ``step``.

    ``phase`` is "train" or "eval"; ``producer``/``consumer`` are the workers that wrote
    and read the slot (``remote`` is True when they differ, i.e. the tensor leaves a
    machine). Forward hops travel producer → consumer, backward hops the other way.
    """

    phase: HopPhase
    direction: Direction
    step: int
    s: int
    slot: int
    m: int
    producer: int
    consumer: int

    @property
    def remote(self) -> bool:
        return self.producer != self.consumer

    @property
    def sender(self) -> int:
        return self.producer if self.direction == "forward" else self.consumer


class HopStage(Protocol):
    def forward(self, h: Tensor, ctx: HopContext) -> Tensor: ...

    def backward(self, g: Tensor, ctx: HopContext) -> Tensor: ...


class Hops:
    """The ordered stages of one engine (identity when there are none)."""

    def __init__(self, stages: list[HopStage]) -> None:
        self.stages = stages

    def __bool__(self) -> bool:
        return bool(self.stages)

    def forward(self, h: Tensor, ctx: HopContext) -> Tensor:
        for stage in self.stages:
            h = stage.forward(h, ctx)
        return h

    def backward(self, g: Tensor, ctx: HopContext) -> Tensor:
        # The sender of a gradient applies its defences first, then encodes it: same order
        # as forward, since each direction's stages run at its own sender.
        for stage in self.stages:
            g = stage.backward(g, ctx)
        return g
