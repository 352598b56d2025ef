"""Möbius Learning's schedule (paper §2) as pure functions.

Notation: P block groups F_0..F_{P-1}, one per worker; L complete passes; K = L·P
block-group applications per stream. A stream s is the batch that originates at worker s.

    cyclic  Φ_s(t) = (s + t) mod P        t = 0..K-1      (Φ_{s,K} = Ψ_s^L)
    ordered  Ω(t)  = t mod P              t = 0..K-1      (Ψ_0 repeated L times)
    source-relative depth of group i for origin s:  d(s, i) = (i - s) mod P

At tick t worker i applies F_i to stream s = (i - t) mod P in cyclic order, so every
worker is busy at every tick. On the physical ring (edges i → i+1 mod P only) the
ordered order needs relay hops: a stream first travels from its home to worker 0, and
after its last application back home.
"""

from __future__ import annotations

import itertools
from typing import Literal

Order = Literal["cyclic", "ordered"]
ORDERS: tuple[Order, ...] = ("cyclic", "ordered")


def num_applications(P: int, L: int) -> int:
    """K = L·P block-group applications per stream."""
    _check(P, L)
    return L * P


def depth(s: int, i: int, P: int) -> int:
    """Source-relative depth d(s, i) = (i - s) mod P of group i for origin s."""
    _check(P, 1)
    return (i - s) % P


def psi(s: int, P: int) -> list[int]:
    """Ψ_s: one cyclic pass starting at s: [s, s+1, …, s-1] (mod P)."""
    _check(P, 1)
    return [(s + t) % P for t in range(P)]


def cyclic_path(s: int, P: int, L: int) -> list[int]:
    """Φ_s = [(s + t) mod P for t in 0..K-1]."""
    return [(s + t) % P for t in range(num_applications(P, L))]


def ordered_path(s: int, P: int, L: int) -> list[int]:
    """Ordered-loop baseline: [t mod P for t in 0..K-1], the same for every origin s."""
    del s
    return [t % P for t in range(num_applications(P, L))]


def path(order: Order, s: int, P: int, L: int) -> list[int]:
    """The block-group sequence visited by stream s."""
    if order == "cyclic":
        return cyclic_path(s, P, L)
    if order == "ordered":
        return ordered_path(s, P, L)
    raise ValueError(f"unknown order {order!r} (expected one of {', '.join(ORDERS)})")


def producer(path: list[int], s: int, slot: int) -> int:
    """The worker that writes slot τ of stream s (``path`` = its path): the group applied
    before it, or home (the embedding) for slot 0."""
    return path[slot - 1] if slot > 0 else s


def consumer(path: list[int], s: int, slot: int) -> int:
    """The worker that reads slot τ of stream s forward: the group applied there, or home
    (the head) for slot K = len(path)."""
    return path[slot] if slot < len(path) else s


def tick_table(order: Order, P: int, L: int) -> list[dict[int, list[int]]]:
    """For each tick t, which streams each worker applies its group to.

    ``table[t][i]`` lists the streams worker i runs at tick t, ascending. In cyclic order
    it is exactly ``[(i - t) mod P]``; in ordered order worker ``t mod P`` runs all streams.
    """
    K = num_applications(P, L)
    table: list[dict[int, list[int]]] = [{i: [] for i in range(P)} for _ in range(K)]
    for s in range(P):
        for t, i in enumerate(path(order, s, P, L)):
            table[t][i].append(s)
    return table


def worker_schedule(order: Order, i: int, P: int, L: int) -> list[tuple[int, int]]:
    """The (tick, stream) applications worker i performs in forward order.

    Backward runs the same list reversed. Sorted by tick, then stream, which fixes the
    order in which parameter gradients are accumulated.
    """
    return [(t, s) for t, row in enumerate(tick_table(order, P, L)) for s in row[i]]


def ring_successor(site: int, P: int) -> int:
    """The site after ``site`` on its own ring: with R rings of P, site g = r·P + i is
    followed by r·P + (i + 1) mod P (one ring: (g + 1) mod P)."""
    return site - site % P + (site + 1) % P


def ring_predecessor(site: int, P: int) -> int:
    """The site before ``site`` on its own ring (see :func:`ring_successor`)."""
    return site - site % P + (site - 1) % P


def ring_route(src: int, dst: int, P: int) -> list[int]:
    """Workers visited moving forward on the ring from src to dst (both included)."""
    return [(src + k) % P for k in range((dst - src) % P + 1)]


def ring_hops(order: Order, s: int, P: int, L: int) -> list[tuple[int, int]]:
    """Every ring edge (a, a+1 mod P) stream s crosses, home → applications → home.

    Cyclic paths cross one edge per application and need no relay; ordered paths relay
    from home to worker 0 first and from worker P-1 back home at the end.
    """
    stops = [s, *path(order, s, P, L), s]
    hops: list[tuple[int, int]] = []
    for a, b in itertools.pairwise(stops):
        route = ring_route(a, b, P)
        hops.extend(itertools.pairwise(route))
    return hops


def _check(P: int, L: int) -> None:
    if P < 1:
        raise ValueError(f"P (workers / block groups) must be ≥ 1, got {P}")
    if L < 1:
        raise ValueError(f"L (passes) must be ≥ 1, got {L}")
