"""Property tests of the ring's frame rules: a random header arriving from a random
neighbour is accepted iff the schedule allows it, and relayed iff the schedule relays it.

The oracle below is written independently of :class:`FrameRules`: it walks each slot's
hidden state around the physical ring one neighbour at a time, from the worker that
writes it to the worker that reads it, and checks that the walk of all slots is exactly
``schedule.ring_hops``.
"""

from __future__ import annotations

import contextlib
import itertools
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mobius_fed import schedule
from mobius_fed.config import TrainConfig
from mobius_fed.proto import ring_pb2
from mobius_fed.transport.codec import FrameError
from mobius_fed.worker.frames import (
    ACK,
    BACKWARD,
    CLOSE,
    DELIVER,
    EVAL,
    FIN,
    FORWARD,
    RELAY,
    TRAIN,
    FrameRules,
)

RUN = "rules"
NOW = 5  # the receiving worker's current step


@cache
def walks(order: str, P: int, L: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(origin, slot) → the ring edges (a, a+1) slot τ of that stream crosses, in order."""
    out = {}
    for s in range(P):
        stops = [s, *schedule.path(order, s, P, L), s]  # writer of slot τ = stops[τ]
        every = []
        for tau in range(len(stops) - 1):
            w, hops = stops[tau], []
            while w != stops[tau + 1]:
                hops.append((w, (w + 1) % P))
                w = (w + 1) % P
            out[s, tau] = hops
            every += hops
        assert every == schedule.ring_hops(order, s, P, L)  # the oracle agrees with §2
    return out


def oracle(order: str, P: int, L: int, M: int, E: int, rank: int, side: int, f) -> str | None:
    """DELIVER / RELAY if worker ``rank`` must accept frame ``f`` arriving on ``side``."""
    K = P * L
    if f.run_id != RUN or f.ack:
        return None
    if f.direction == FIN:
        extra = f.step or f.tick or f.micro or f.phase or f.chunk or f.chunks or f.has_tensor
        if side != FORWARD or f.origin >= P or f.origin == rank or extra:
            return None
        return DELIVER if (rank + 1) % P == f.origin else RELAY
    if f.direction != side or f.phase not in (TRAIN, EVAL) or f.origin >= P or f.tick > K:
        return None
    if f.phase == EVAL and f.direction != FORWARD:
        return None
    if f.micro >= M * (E if f.phase == EVAL else 1):
        return None
    hops = walks(order, P, L)[f.origin, f.tick]
    edge = ((rank - 1) % P, rank) if side == FORWARD else (rank, (rank + 1) % P)
    if edge not in hops:
        return None
    i = hops.index(edge)
    last = i == len(hops) - 1 if side == FORWARD else i == 0
    verdict = DELIVER if last else RELAY
    lo = NOW - 1 if verdict == RELAY else NOW
    if not lo <= f.step <= NOW + 1 or not f.has_tensor or f.chunks == 0:
        return None
    return verdict


class H:
    """A header as drawn (plus whether it carries a tensor)."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)

    def frame(self) -> ring_pb2.Frame:
        f = ring_pb2.Frame(
            run_id=self.run_id,
            step=self.step,
            origin=self.origin,
            tick=self.tick,
            micro=self.micro,
            direction=self.direction,
            phase=self.phase,
            chunk=self.chunk,
            chunks=self.chunks,
            ack=self.ack,
        )
        if self.has_tensor:
            f.tensor.SetInParent()
        return f


@cache
def rules(order: str, P: int, L: int, M: int, rank: int) -> FrameRules:
    cfg = TrainConfig(
        preset="cpu-tiny", workers=P, loops=L, order=order, micro_batches=M, batch_size=4
    )
    return FrameRules(cfg, rank, RUN, lambda: NOW)


MUTATIONS = [
    "none", "none", "none", "run_id", "step", "origin", "tick", "micro", "direction",
    "phase", "chunks", "ack", "tensor", "rank", "side",
]  # fmt: skip


@st.composite
def cases(draw, order: str):
    """A header that the schedule sends across some edge, received by one of that edge's
    ends (or a random worker), with one field possibly changed to a random value."""
    P = draw(st.sampled_from([2, 3, 4, 6]))  # 12 layers split evenly
    L = draw(st.integers(1, 3))
    M = draw(st.sampled_from([1, 2]))
    K = P * L
    kind = draw(st.sampled_from(["data", "data", "data", "fin"]))
    origin = draw(st.integers(0, P - 1))
    if kind == "fin":
        h = H(run_id=RUN, step=0, origin=origin, tick=0, micro=0, direction=FIN, phase=TRAIN)
        h.__dict__.update(chunk=0, chunks=0, ack=0, has_tensor=False)
        rank, side = (origin + draw(st.integers(1, P - 1))) % P, FORWARD
    else:
        phase = draw(st.sampled_from([TRAIN, EVAL]))
        direction = FORWARD if phase == EVAL else draw(st.sampled_from([FORWARD, BACKWARD]))
        # a slot that leaves its writer (cyclic: all; ordered: most)
        slots = [t for t in range(K + 1) if walks(order, P, L)[origin, t]]
        tick = draw(st.sampled_from(slots))
        a, b = draw(st.sampled_from(walks(order, P, L)[origin, tick]))
        rank, side = (b, FORWARD) if direction == FORWARD else (a, BACKWARD)
        micro = draw(st.integers(0, M * (2 if phase == EVAL else 1) - 1))
        h = H(run_id=RUN, step=draw(st.integers(NOW - 1, NOW + 1)), origin=origin, tick=tick)
        h.__dict__.update(micro=micro, direction=direction, phase=phase, chunk=0, chunks=1)
        h.__dict__.update(ack=0, has_tensor=True)
    what = draw(st.sampled_from(MUTATIONS))
    if what == "run_id":
        h.run_id = draw(st.sampled_from(["other", "", RUN + "x"]))
    elif what == "step":
        h.step = draw(st.integers(0, NOW + 3))
    elif what == "origin":
        h.origin = draw(st.integers(0, P))
    elif what == "tick":
        h.tick = draw(st.integers(0, K + 1))
    elif what == "micro":
        h.micro = draw(st.integers(0, 2 * M * 2))
    elif what == "direction":
        h.direction = draw(st.sampled_from([FORWARD, BACKWARD, FIN, 0, 7]))
    elif what == "phase":
        h.phase = draw(st.sampled_from([TRAIN, EVAL, 2, 9]))
    elif what == "chunks":
        h.chunks = draw(st.integers(0, 3))
    elif what == "ack":
        h.ack = draw(st.integers(1, 9))
    elif what == "tensor":
        h.has_tensor = not h.has_tensor
    elif what == "rank":
        rank = draw(st.integers(0, P - 1))
    elif what == "side":
        side = draw(st.sampled_from([FORWARD, BACKWARD]))
    return P, L, M, rank, side, h


def _check(order: str, case) -> None:
    P, L, M, rank, side, h = case
    r = rules(order, P, L, M, rank)
    want = oracle(order, P, L, M, r.cfg.eval_batches, rank, side, h)
    try:
        got = r.check_header(h.frame(), side)
    except FrameError as exc:
        assert want is None, f"refused a legal frame ({want}): {exc}; {vars(h)} at {rank}"
        assert str(exc).startswith("frame rejected: ")
        return
    assert got == want, f"{got} but the schedule says {want}: {vars(h)} at {rank} side {side}"


@settings(max_examples=400, deadline=None)
@given(cases("cyclic"))
def test_cyclic_headers_accepted_iff_the_schedule_allows(case) -> None:
    _check("cyclic", case)


@settings(max_examples=400, deadline=None)
@given(cases("ordered"))
def test_ordered_headers_accepted_iff_the_schedule_allows(case) -> None:
    _check("ordered", case)


@pytest.mark.parametrize("order", ["cyclic", "ordered"])
@pytest.mark.parametrize(("P", "L"), [(2, 1), (3, 2), (4, 1), (6, 3)])
def test_every_legal_frame_arrives_on_exactly_one_edge(order: str, P: int, L: int) -> None:
    """Exhaustively: each frame the schedule sends across the ring is accepted on the
    edges of its route and nowhere else; cyclic order never relays."""
    K = P * L
    for s, tau, direction in itertools.product(range(P), range(K + 1), (FORWARD, BACKWARD)):
        hops = walks(order, P, L)[s, tau]
        accepted = []
        for rank in range(P):
            r = rules(order, P, L, 1, rank)
            f = ring_pb2.Frame(
                run_id=RUN, step=NOW, origin=s, tick=tau, direction=direction, chunks=1
            )
            f.tensor.SetInParent()
            with contextlib.suppress(FrameError):
                accepted.append((rank, r.check_header(f, direction)))
        arrivals = [b for _, b in hops] if direction == FORWARD else [a for a, _ in hops]
        assert sorted(rank for rank, _ in accepted) == sorted(arrivals)
        relays = [rank for rank, v in accepted if v == RELAY]
        assert len(relays) == max(len(hops) - 1, 0)
        if order == "cyclic":
            assert not relays and len(hops) <= 1


def test_control_frames_carry_nothing_else() -> None:
    r = rules("cyclic", 3, 1, 1, 0)
    assert r.check_control(ring_pb2.Frame(run_id=RUN, direction=ACK, ack=9)) == 9
    assert r.check_control(ring_pb2.Frame(run_id=RUN, direction=CLOSE)) == 0
    with pytest.raises(FrameError, match="ACK with step"):
        r.check_control(ring_pb2.Frame(run_id=RUN, direction=ACK, ack=1, step=1))
    with pytest.raises(FrameError, match="CLOSE with ack"):
        r.check_control(ring_pb2.Frame(run_id=RUN, direction=CLOSE, ack=1))
    with pytest.raises(FrameError, match="run_id"):
        r.check_control(ring_pb2.Frame(run_id="x", direction=ACK, ack=1))
