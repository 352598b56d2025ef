"""What a worker accepts on its ring links: frame keys, routing and header rules.

Slot τ of stream s is the hidden state entering application τ (τ = K: entering the head
at home). A FORWARD frame (s, τ) carries slot τ to its consumer; a BACKWARD frame (s, τ)
carries the gradient of slot τ back to its producer (τ = 0: the embedding at home).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mobius_fed import schedule
from mobius_fed.config import TrainConfig
from mobius_fed.proto import ring_pb2
from mobius_fed.transport.codec import FrameError

FORWARD, BACKWARD, FIN = ring_pb2.FORWARD, ring_pb2.BACKWARD, ring_pb2.FIN
TRAIN, EVAL = ring_pb2.TRAIN, ring_pb2.EVAL


@dataclass(frozen=True)
class FrameKey:
    phase: int
    step: int
    direction: int
    origin: int
    tick: int
    micro: int

    @classmethod
    def of(cls, frame: ring_pb2.Frame) -> FrameKey:
        return cls(frame.phase, frame.step, frame.direction, frame.origin, frame.tick, frame.micro)

    def describe(self) -> str:
        d = ring_pb2.Direction.Name(self.direction)
        p = ring_pb2.Phase.Name(self.phase)
        return f"{p} {d} step {self.step} origin {self.origin} slot {self.tick} micro {self.micro}"


class FrameRules:
    """Header validation and routing for one run, as seen from worker ``rank``."""

    def __init__(self, cfg: TrainConfig, rank: int, run_id: str, current_step: Callable[[], int]):
        self.cfg, self.rank, self.run_id = cfg, rank, run_id
        self.P, self.K, self.M = cfg.P, cfg.K, cfg.micro_batches
        self.paths = [schedule.path(cfg.order, s, cfg.P, cfg.loops) for s in range(cfg.P)]
        mc = cfg.model()
        self.shape = (cfg.batch_size // cfg.micro_batches, mc.seq_len, mc.d_model)
        self.current_step = current_step

    def consumer(self, origin: int, slot: int) -> int:
        """The worker that reads slot τ forward: the group applied there, or home."""
        return self.paths[origin][slot] if slot < self.K else origin

    def producer(self, origin: int, slot: int) -> int:
        """The worker that wrote slot τ: the previous group, or home (the embedding)."""
        return self.paths[origin][slot - 1] if slot > 0 else origin

    def destination(self, frame: ring_pb2.Frame) -> int:
        if frame.direction == FORWARD:
            return self.consumer(frame.origin, frame.tick)
        return self.producer(frame.origin, frame.tick)

    def micro_count(self, phase: int) -> int:
        return self.M * (self.cfg.eval_batches if phase == EVAL else 1)

    def check_header(self, frame: ring_pb2.Frame, direction: int) -> None:
        """Raise :class:`FrameError` naming the first field that does not fit this run."""
        if frame.run_id != self.run_id:
            raise FrameError(f"frame rejected: run_id {frame.run_id!r} (expected {self.run_id!r})")
        if frame.direction == FIN:
            if direction != FORWARD or frame.origin >= self.P or frame.origin == self.rank:
                raise FrameError(f"frame rejected: FIN from origin {frame.origin}")
            return
        if frame.direction != direction:
            raise FrameError(
                f"frame rejected: direction {ring_pb2.Direction.Name(frame.direction)} "
                f"(expected {ring_pb2.Direction.Name(direction)} on this side of the link)"
            )
        if frame.phase not in (TRAIN, EVAL):
            raise FrameError(f"frame rejected: phase {frame.phase}")
        if frame.origin >= self.P:
            raise FrameError(f"frame rejected: origin {frame.origin} (expected < P={self.P})")
        if frame.tick > self.K:
            raise FrameError(f"frame rejected: tick {frame.tick} (expected ≤ K={self.K})")
        if frame.micro >= self.micro_count(frame.phase):
            raise FrameError(
                f"frame rejected: micro {frame.micro} (expected < {self.micro_count(frame.phase)})"
            )
        # Frames for this worker belong to its current step or the next one; a relay may
        # still carry the previous step while this worker has moved on.
        now = self.current_step()
        lo = now - 1 if self.destination(frame) != self.rank else now
        if not lo <= frame.step <= now + 1:
            raise FrameError(
                f"frame rejected: step {frame.step} (expected {max(lo, 0)}..{now + 1})"
            )
        if not frame.HasField("tensor"):
            raise FrameError("frame rejected: no tensor")
