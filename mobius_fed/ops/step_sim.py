"""One ring training step as a deterministic event simulation (pure Python).

Each worker runs the program of ``mobius_fed/worker/executor.py`` ``train_step`` in its
order: the home batch's M micro-batches enter slot 0; every (tick t, stream s, micro m)
application forward, micro-batches inner; the head at home for m = 0..M-1, each sending
its gradient back at once; the same applications in reverse (ticks down, micro-batches
M-1..0); then the home work (embedding backward, optimizer steps). Resources:

- one compute resource per worker, used in program order; an application starts when the
  worker is free and its input slot has arrived (``fwd_s``/``bwd_s`` per application and
  micro-batch, ``head_s`` per micro-batch, ``home_s`` once per step);
- every worker its own costs where a list of :class:`StepCosts` is given (a site's speed
  and link, a group of its own size: ``mobius-fed plan``); one for all otherwise;
- one egress link per worker (the site's access link, shared by both directions, as the
  testbed shapes it), used in send order: a frame of ``fwd_bytes``/``bwd_bytes`` leaves
  when the link is free and the sender has computed it, takes 8·bytes/rate, and arrives
  one one-way delay after its last byte left. A slot for the same worker needs no link.
  The link is a token bucket (``tc tbf``): ``burst_bytes`` of tokens, refilled at the rate
  while the link idles, pass at once (0 on an unshaped model of a WAN link).

The step time is when the last worker finishes. With M = 1 a cyclic ring is a chain and
the step is the serial bound compute + transfer + K·RTT; with M micro-batches the next
worker starts on micro-batch 0 while micro-batch 1 is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mobius_fed import schedule

FORWARD, BACKWARD = "fwd", "bwd"


@dataclass(frozen=True)
class StepCosts:
    """Per-step inputs of the simulation (seconds, bytes, bits/s)."""

    fwd_s: float  # one application forward, one micro-batch
    bwd_s: float  # one application backward, one micro-batch
    head_s: float  # R, the loss and their backward at home, one micro-batch
    home_s: float  # the rest of a step at home: embedding backward, optimizer steps
    fwd_bytes: float  # one forward hop of one micro-batch (hidden states)
    bwd_bytes: float  # one backward hop of one micro-batch (gradients)
    rate_bps: float  # each site's egress rate
    delay_s: float  # one-way delay of every hop
    burst_bytes: float = 0.0  # the egress token bucket's size (a shaped link's burst)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"StepCosts.{name} must be ≥ 0, got {value}")
        if self.rate_bps <= 0:
            raise ValueError(f"StepCosts.rate_bps must be > 0, got {self.rate_bps}")


Op = tuple[float, tuple | None, tuple | None, int | None, str]
"""(compute seconds, input key or None, output key or None, destination, direction)."""


def worker_program(order: str, i: int, P: int, L: int, M: int, c: StepCosts) -> list[Op]:
    """Worker i's work in one training step, in the executor's order."""
    if order != "cyclic":
        raise ValueError(
            f"order {order!r}: the simulation models the cyclic order only (the ordered "
            "order relays frames through workers in between, whose links it does not model)"
        )
    if M < 1:
        raise ValueError(f"micro-batches M must be ≥ 1, got {M}")
    K = schedule.num_applications(P, L)
    paths = [schedule.cyclic_path(s, P, L) for s in range(P)]
    consumer = lambda s, slot: schedule.consumer(paths[s], s, slot)  # noqa: E731
    producer = lambda s, slot: schedule.producer(paths[s], s, slot)  # noqa: E731
    ticks = schedule.worker_schedule("cyclic", i, P, L)
    apps = [(t, s, m) for t, s in ticks for m in range(M)]
    ops: list[Op] = [(0.0, None, (FORWARD, i, 0, m), consumer(i, 0), FORWARD) for m in range(M)]
    for t, s, m in apps:
        ops.append(
            (c.fwd_s, (FORWARD, s, t, m), (FORWARD, s, t + 1, m), consumer(s, t + 1), FORWARD)
        )
    for m in range(M):
        ops.append((c.head_s, (FORWARD, i, K, m), (BACKWARD, i, K, m), producer(i, K), BACKWARD))
    for t, s, m in reversed(apps):
        ops.append(
            (c.bwd_s, (BACKWARD, s, t + 1, m), (BACKWARD, s, t, m), producer(s, t), BACKWARD)
        )
    ops += [(0.0, (BACKWARD, i, 0, m), None, None, BACKWARD) for m in range(M)]
    ops.append((c.home_s, None, None, None, BACKWARD))
    return ops


@dataclass
class _Worker:
    ops: list[Op]
    pc: int = 0
    clock: float = 0.0
    link_free: float = 0.0
    tokens: float = 0.0  # the token bucket's bytes when the link last emptied
    sent_s: float = 0.0


def simulate_step(
    order: str, P: int, L: int, M: int, costs: StepCosts | Sequence[StepCosts]
) -> dict:
    """Step seconds (all workers start at 0 together) and each worker's finish time;
    ``costs``: one for every worker, or worker i's at index i (its compute, its egress)."""
    per = [costs] * P if isinstance(costs, StepCosts) else list(costs)
    if len(per) != P:
        raise ValueError(f"{len(per)} workers' costs for P={P} workers")
    programs = [worker_program(order, i, P, L, M, per[i]) for i in range(P)]
    workers = [_Worker(ops, tokens=c.burst_bytes) for ops, c in zip(programs, per)]
    arrived: dict[tuple, float] = {}
    while any(w.pc < len(w.ops) for w in workers):
        moved = False
        for i, w in enumerate(workers):
            while w.pc < len(w.ops):
                cost, need, out, dest, direction = w.ops[w.pc]
                if need is not None and need not in arrived:
                    break
                start = max(w.clock, arrived.pop(need) if need is not None else 0.0)
                w.clock = start + cost
                if out is not None:
                    arrived[out] = _send(w, i, dest, direction, per[i])
                w.pc += 1
                moved = True
        if not moved:
            raise RuntimeError("ring step simulation deadlocked (a slot nobody sends)")
    finish = [w.clock for w in workers]
    return {"step_s": max(finish), "finish_s": finish, "link_s": max(w.sent_s for w in workers)}


def _send(w: _Worker, i: int, dest: int | None, direction: str, c: StepCosts) -> float:
    """Arrival time of what worker i just computed (at ``w.clock``) at ``dest``."""
    if dest == i:
        return w.clock
    nbytes = c.fwd_bytes if direction == FORWARD else c.bwd_bytes
    byte_s = 8 / c.rate_bps
    start = max(w.clock, w.link_free)
    tokens = min(c.burst_bytes, w.tokens + (start - w.link_free) / byte_s)
    paced = max(0.0, nbytes - tokens)  # what waits for tokens at the rate
    w.tokens = tokens - (nbytes - paced)
    w.link_free = start + paced * byte_s
    w.sent_s += nbytes * byte_s
    return w.link_free + c.delay_s
