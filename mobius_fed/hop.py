"""What happens to a tensor on its way from one block group to the next (one *hop*).

Both engines route every hidden state they hand on and every gradient they hand back
through one :class:`Hops` object, at exactly the same points:

* forward: the embedding's output (slot 0), each application's output (slot t+1) and the
  final hidden state on its way home (slot K);
* backward: the gradient of slot K computed at home and the gradient of each
  application's input (slot t), on its way back to the slot's producer.

A stage sees the tensor and a :class:`HopContext` and returns the tensor the receiver
gets. Stages must be pure functions of (tensor, context, config) — noise is drawn from a
generator seeded by the context, never from the global RNG — or keep state keyed by
the context, so the reference engine and a ring of workers (which visit hops in other
orders) produce identical tensors. The transform is not differentiated through: the
gradient of the received tensor is handed back unchanged (straight-through), which is
what a ring does when the sender ships bytes.

Stages come from two places, each owned by its own module, and are put together by
:func:`mobius_fed.engine.hops.build_hops`:
:func:`mobius_fed.defences.stages.build_stages` (defences on hidden states and gradients)
and :func:`mobius_fed.transport.wire_stages.build_stages` (lossy wire codecs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor

Engine = Literal["reference", "ring"]
Direction = Literal["forward", "backward"]


@dataclass(frozen=True)
class HopContext:
    """One hop: ``direction`` of ``slot`` of stream ``s``, micro-batch ``m``, at ``step``.

    ``phase`` is "train" or "eval"; ``producer``/``consumer`` are the workers that wrote
    and read the slot (``remote`` is True when they differ, i.e. the tensor leaves a
    machine). Forward hops travel producer → consumer, backward hops the other way.
    """

    phase: Literal["train", "eval"]
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
