"""What a worker accepts on its ring links: frame keys, routes and header rules.

Slot τ of stream s is the hidden state entering application τ (τ = 0: the embedding's
output; τ = K: entering the head at home; docs/architecture.md §2). A FORWARD frame (s, τ)
carries slot τ from producer to consumer; a BACKWARD frame (s, τ) carries its gradient
back. Routes and the deliver / relay / refuse decision: docs/architecture.md §6.4.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mobius_fed import schedule
from mobius_fed.config import BoundsConfig, TrainConfig
from mobius_fed.proto import ring_pb2
from mobius_fed.transport.codec import FrameError, NonFiniteError, direction_name

FORWARD, BACKWARD, FIN = ring_pb2.FORWARD, ring_pb2.BACKWARD, ring_pb2.FIN
ACK, CLOSE = ring_pb2.ACK, ring_pb2.CLOSE  # link control (see ring.proto)
TRAIN, EVAL = ring_pb2.TRAIN, ring_pb2.EVAL
DELIVER, RELAY = "deliver", "relay"
log = logging.getLogger("mobius.bounds")


def edge_name(a: int, b: int) -> str:
    """A ring edge as operators read it: ``worker-1 → worker-2``."""
    return f"worker-{a} → worker-{b}"


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
        d = direction_name(self.direction)
        known = self.phase in ring_pb2.Phase.values()
        p = ring_pb2.Phase.Name(self.phase) if known else str(self.phase)
        return f"{p} {d} step {self.step} origin {self.origin} slot {self.tick} micro {self.micro}"


class BoundError(FrameError):
    """A received hidden state or gradient above its sender's bound."""


def token_rms(tensor: torch.Tensor, channels: int | None = None) -> float:
    """The largest per-token RMS of a [..., width] tensor (its first ``channels`` channels:
    a forward tensor in subspace mode ``tokens`` carries the ids in its last one)."""
    x = tensor if channels is None else tensor[..., :channels]
    if x.numel() == 0:
        return 0.0
    norms = torch.linalg.vector_norm(x.float(), dim=-1)  # overflow: inf, refused
    return float(norms.max()) / math.sqrt(x.shape[-1])


class FrameBounds:
    """Bounds on the hidden states and gradients worker ``rank`` receives (settings:
    :class:`~mobius_fed.config.BoundsConfig`; docs/security.md, "Bounds on what a site
    sends").

    A tensor's figure is its largest per-token RMS. It is refused above the kind's ceiling,
    or, once its sender (the frame's producer) has ``warmup`` accepted frames of that kind,
    above ``factor`` × the median of the last ``window`` of them. Refusals, non-finite ones
    included (:meth:`count`), are counted per sender; a sender with ``suspect_after`` or
    more is suspect. Accepted frames change nothing but the running medians: a run whose
    frames all pass is the run without bounds. One object lives as long as its worker,
    across ring incarnations; both link threads call it.
    """

    def __init__(self, cfg: BoundsConfig, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self._seen: dict[tuple[int, int, int], deque[float]] = {}  # (sender, direction, slot)
        self.refused: dict[int, int] = {}  # sender → refused frames
        self.last: dict[int, str] = {}  # sender → why its last frame was refused
        # direction → the largest figure / running median seen (the margin a run had)
        self.peak: dict[int, float] = {}
        self._lock = threading.Lock()

    def limit(self, sender: int, direction: int, slot: int) -> tuple[float, str]:
        """The bound on ``sender``'s next tensor of slot ``slot`` travelling ``direction``,
        and how it was set (for the refusal's message)."""
        c = self.cfg
        ceiling = c.state_ceiling if direction == FORWARD else c.grad_ceiling
        factor = c.state_factor if direction == FORWARD else c.grad_factor
        seen = self._seen.get((sender, direction, slot))
        if seen is None or len(seen) < c.warmup:
            return ceiling, f"the ceiling {ceiling:.3g}"
        median = statistics.median(seen)
        if median <= 0 or factor * median >= ceiling:  # all-zero tensors bound nothing
            return ceiling, f"the ceiling {ceiling:.3g}"
        return factor * median, f"{factor:g} × its running median {median:.3g}"

    def check(
        self,
        key: FrameKey,
        tensor: torch.Tensor,
        sender: int,
        relayed_by: int | None = None,
        ids: bool = False,
    ) -> None:
        """Accept ``tensor`` (frame ``key`` from ``sender``, the worker that computed it)
        or raise :class:`BoundError` naming the sender and the figure. ``ids``: its last
        channel holds token ids and is left out."""
        if not self.cfg.frames:
            return
        channels = tensor.shape[-1] - 1 if ids else None
        figure = token_rms(tensor, channels)
        with self._lock:
            bound, how = self.limit(sender, key.direction, key.tick)
            seen = self._seen.get((sender, key.direction, key.tick))
            if seen is not None and len(seen) >= self.cfg.warmup:
                ratio = figure / max(statistics.median(seen), 1e-30)
                self.peak[key.direction] = max(self.peak.get(key.direction, 0.0), ratio)
            if figure <= bound:
                seen = self._seen.setdefault(
                    (sender, key.direction, key.tick), deque(maxlen=self.cfg.window)
                )
                seen.append(figure)
                return
        what = "hidden state" if key.direction == FORWARD else "gradient"
        via = f" (relayed by worker-{relayed_by})" if relayed_by is not None else ""
        msg = (
            f"tensor rejected: {what} from worker-{sender}{via} ({key.describe()}) has a "
            f"per-token RMS of {figure:.3g}, above its bound {bound:.3g} ({how})"
        )
        self.count(sender, msg)
        raise BoundError(msg)

    def count(self, sender: int, why: str) -> None:
        """Count one refused frame against ``sender``; log it suspect at the threshold."""
        with self._lock:
            n = self.refused[sender] = self.refused.get(sender, 0) + 1
            self.last[sender] = why
        if n == self.cfg.suspect_after:
            log.error(
                "worker-%d: worker-%d is suspect: %d of its frames refused (last: %s)",
                self.rank,
                sender,
                n,
                why,
            )

    def margin(self) -> str:
        """The largest ratio to a sender's running median seen so far, per kind."""
        return ", ".join(
            f"{'states' if d == FORWARD else 'gradients'} ×{r:.3g}"
            for d, r in sorted(self.peak.items())
        )

    @property
    def suspects(self) -> list[int]:
        """Senders with ``suspect_after`` or more refused frames."""
        with self._lock:
            return sorted(w for w, n in self.refused.items() if n >= self.cfg.suspect_after)

    def report(self) -> dict[str, object]:
        """Refusals per sender and the suspects, as metrics lines carry them ({} if none)."""
        with self._lock:
            if not self.refused:
                return {}
            refused = {f"worker-{w}": n for w, n in sorted(self.refused.items())}
        return {"refused_frames": refused, "suspects": [f"worker-{w}" for w in self.suspects]}


class FrameRules:
    """Header validation and routing for one run, as seen from worker ``rank``."""

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        run_id: str,
        current_step: Callable[[], int],
        bounds: FrameBounds | None = None,
    ):
        self.cfg, self.rank, self.run_id = cfg, rank, run_id
        self.bounds = bounds if bounds is not None else FrameBounds(cfg.bounds, rank)
        self.P, self.K, self.M = cfg.P, cfg.K, cfg.micro_batches
        self.paths = [schedule.path(cfg.order, s, cfg.P, cfg.loops) for s in range(cfg.P)]
        mc = cfg.model()
        # A slot carries [b, T, d] hidden states, or [b, T, k] subspace coordinates
        # (TrainConfig.subspace), forward with one more channel of token ids in mode
        # ``tokens``: the assembler refuses a tensor of any other shape.
        width = mc.subspace_rank or mc.d_model
        self.shape = (cfg.batch_size // cfg.micro_batches, mc.seq_len, width)
        self.ids = cfg.subspace.on and cfg.subspace.mode == "tokens"
        self.current_step = current_step

    def shape_of(self, direction: int) -> tuple[int, ...]:
        """The shape of a tensor travelling ``direction`` (FORWARD or BACKWARD): ``shape``,
        forward with the ids channel in mode ``tokens``."""
        if self.ids and direction == FORWARD:
            return (*self.shape[:-1], self.shape[-1] + 1)
        return tuple(self.shape)

    # ----------------------------------------------------------------- routes
    def consumer(self, origin: int, slot: int) -> int:
        """The worker that reads slot τ forward: the group applied there, or home."""
        return schedule.consumer(self.paths[origin], origin, slot)

    def producer(self, origin: int, slot: int) -> int:
        """The worker that wrote slot τ: the previous group, or home (the embedding)."""
        return schedule.producer(self.paths[origin], origin, slot)

    def route(self, direction: int, origin: int, slot: int = 0) -> list[int]:
        """The workers a frame visits, in travel order, from its producer to its consumer.

        One element means the frame never leaves its producer (it is passed locally).
        """
        if direction == FIN:
            return schedule.ring_route(origin, (origin - 1) % self.P, self.P)
        a, b = self.producer(origin, slot), self.consumer(origin, slot)
        path = schedule.ring_route(a, b, self.P)
        return path if direction == FORWARD else path[::-1]

    def arrival(self, frame: ring_pb2.Frame, side: int) -> str:
        """:data:`DELIVER` or :data:`RELAY` for a frame that arrived on ``side``.

        ``side`` FORWARD: on the stream from the predecessor (edge rank-1 → rank);
        BACKWARD: on the response side of the stream to the successor (edge rank → rank+1,
        travelled backwards). Raises :class:`FrameError` when that hop is not on the frame's
        route: the sender is not the frame's producer nor a relay of it.
        """
        route = self.route(frame.direction, frame.origin, frame.tick)
        sender = (self.rank - 1) % self.P if side == FORWARD else (self.rank + 1) % self.P
        for k in range(1, len(route)):
            if route[k] == self.rank and route[k - 1] == sender:
                return DELIVER if k == len(route) - 1 else RELAY
        shown = " → ".join(f"worker-{w}" for w in route)
        what = (
            f"FIN of worker-{frame.origin}"
            if frame.direction == FIN
            else FrameKey.of(frame).describe()
        )
        why = f"its route is {shown}" if len(route) > 1 else f"it never leaves worker-{route[0]}"
        raise FrameError(
            f"frame rejected: {what} cannot arrive from worker-{sender} ({why}; "
            f"producer worker-{route[0]})"
        )

    def sender(self, key: FrameKey) -> int:
        """The worker that computed frame ``key``'s tensor: slot τ's producer (FORWARD), or
        its consumer, which sends the slot's gradient back (BACKWARD)."""
        if key.direction == FORWARD:
            return self.producer(key.origin, key.tick)
        return self.consumer(key.origin, key.tick)

    def check_tensor(self, key: FrameKey, tensor: torch.Tensor, side: int) -> None:
        """The bounds on a tensor delivered to this worker on ``side`` (FORWARD: from the
        predecessor; BACKWARD: from the successor): :meth:`FrameBounds.check`."""
        sender = self.sender(key)
        neighbour = (self.rank - 1) % self.P if side == FORWARD else (self.rank + 1) % self.P
        relayed_by = None if neighbour == sender else neighbour
        ids = self.ids and key.direction == FORWARD
        self.bounds.check(key, tensor, sender, relayed_by, ids)

    def non_finite(self, key: FrameKey, exc: FrameError) -> FrameError:
        """A tensor refused for non-finite values, counted against its sender; the error
        names the sender and the frame."""
        sender = self.sender(key)
        msg = f"{exc} in {key.describe()}, computed by worker-{sender}"
        self.bounds.count(sender, msg)
        return NonFiniteError(msg)

    def micro_count(self, phase: int) -> int:
        return self.M * (self.cfg.eval_batches if phase == EVAL else 1)

    # ----------------------------------------------------------------- checks
    def check_header(self, frame: ring_pb2.Frame, direction: int) -> str:
        """Check a frame that arrived on side ``direction``; return DELIVER or RELAY.

        Raise :class:`FrameError` naming the first field that does not fit this run, or
        the hop when the frame may not arrive from this neighbour.
        """
        if frame.run_id != self.run_id:
            raise FrameError(f"frame rejected: run_id {frame.run_id!r} (expected {self.run_id!r})")
        if frame.ack:
            raise FrameError(f"frame rejected: ack {frame.ack} on a non-ACK frame")
        if frame.direction == FIN:
            return self._check_fin(frame, direction)
        if frame.direction != direction:
            raise FrameError(
                f"frame rejected: direction {direction_name(frame.direction)} "
                f"(expected {direction_name(direction)} on this side of the link)"
            )
        if frame.phase not in (TRAIN, EVAL):
            raise FrameError(f"frame rejected: phase {frame.phase}")
        if frame.phase == EVAL and frame.direction != FORWARD:
            raise FrameError("frame rejected: EVAL frames only travel FORWARD")
        if frame.origin >= self.P:
            raise FrameError(f"frame rejected: origin {frame.origin} (expected < P={self.P})")
        if frame.tick > self.K:
            raise FrameError(f"frame rejected: tick {frame.tick} (expected ≤ K={self.K})")
        micros = self.micro_count(frame.phase)
        if frame.micro >= micros:
            raise FrameError(f"frame rejected: micro {frame.micro} (expected < {micros})")
        verdict = self.arrival(frame, direction)
        # Frames for this worker belong to its current step or the next one; a relay may
        # still carry the previous step while this worker has moved on.
        now = self.current_step()
        lo = now - 1 if verdict == RELAY else now
        if not lo <= frame.step <= now + 1:
            raise FrameError(
                f"frame rejected: step {frame.step} (expected {max(lo, 0)}..{now + 1})"
            )
        if not frame.HasField("tensor"):
            raise FrameError("frame rejected: no tensor")
        if frame.chunks == 0:
            raise FrameError("frame rejected: chunks 0 on a tensor frame (expected ≥ 1)")
        return verdict

    def _check_fin(self, frame: ring_pb2.Frame, direction: int) -> str:
        if direction != FORWARD:
            raise FrameError("frame rejected: FIN on the BACKWARD side (FIN travels forward)")
        if frame.origin >= self.P:
            raise FrameError(f"frame rejected: FIN from origin {frame.origin} (expected < P)")
        extra = [
            f"{name} {getattr(frame, name)}"
            for name in ("step", "tick", "micro", "phase", "chunk", "chunks")
            if getattr(frame, name)
        ]
        if frame.HasField("tensor"):
            extra.insert(0, "a tensor")
        if extra:
            raise FrameError(
                f"frame rejected: FIN from origin {frame.origin} carries {', '.join(extra)} "
                "(a FIN has none)"
            )
        return self.arrival(frame, FORWARD)

    def check_control(self, frame: ring_pb2.Frame) -> int:
        """Check a link-control frame (ACK, CLOSE); return an ACK's count (CLOSE: 0)."""
        what = direction_name(frame.direction)
        if frame.run_id != self.run_id:
            raise FrameError(f"frame rejected: run_id {frame.run_id!r} (expected {self.run_id!r})")
        names = ("step", "origin", "tick", "micro", "phase", "chunk", "chunks")
        extra = [name for name in names if getattr(frame, name)]
        if frame.direction != ACK and frame.ack:
            extra.append("ack")
        if frame.HasField("tensor"):
            extra.insert(0, "tensor")
        if extra:
            raise FrameError(
                f"frame rejected: {what} with {', '.join(extra)} set (a {what} has none)"
            )
        return frame.ack
