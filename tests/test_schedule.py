"""Property tests for mobius_fed.schedule: the paper's paths as pure functions."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mobius_fed import schedule
from mobius_fed.schedule import (
    cyclic_path,
    depth,
    num_applications,
    ordered_path,
    path,
    psi,
    ring_hops,
    tick_table,
    worker_schedule,
)

Ps = st.integers(min_value=1, max_value=8)
Ls = st.integers(min_value=1, max_value=4)
ORDERS = st.sampled_from(schedule.ORDERS)


@st.composite
def p_l_s(draw):
    P, L = draw(Ps), draw(Ls)
    return P, L, draw(st.integers(min_value=0, max_value=P - 1))


def _is_ring_edge(hop: tuple[int, int], P: int) -> bool:
    a, b = hop
    return 0 <= a < P and b == (a + 1) % P


@settings(max_examples=60, deadline=None)
@given(Ps, Ls)
def test_every_group_sits_at_every_depth_exactly_once(P: int, L: int) -> None:
    for pass_ in range(L):
        for i in range(P):
            positions = []
            for s in range(P):
                chunk = cyclic_path(s, P, L)[pass_ * P : (pass_ + 1) * P]
                assert chunk.count(i) == 1
                pos = chunk.index(i)
                assert depth(s, i, P) == pos
                positions.append(pos)
            assert Counter(positions) == Counter(range(P))


@settings(max_examples=60, deadline=None)
@given(p_l_s())
def test_phi_is_psi_repeated_and_ordered_is_origin_independent(pls) -> None:
    P, L, s = pls
    assert num_applications(P, L) == L * P
    assert cyclic_path(s, P, L) == psi(s, P) * L
    assert path("cyclic", s, P, L) == cyclic_path(s, P, L)
    assert psi(0, P) == ordered_path(0, P, 1)
    assert ordered_path(s, P, L) == ordered_path(0, P, L) == psi(0, P) * L
    assert path("ordered", s, P, L) == ordered_path(s, P, L)
    assert len(cyclic_path(s, P, L)) == len(ordered_path(s, P, L)) == L * P


@settings(max_examples=60, deadline=None)
@given(p_l_s())
def test_cyclic_paths_use_only_ring_edges(pls) -> None:
    P, L, s = pls
    p = cyclic_path(s, P, L)
    assert p[0] == s
    assert all(b == (a + 1) % P for a, b in itertools.pairwise(p))
    hops = ring_hops("cyclic", s, P, L)
    assert all(_is_ring_edge(h, P) for h in hops)
    assert len(hops) == (num_applications(P, L) if P > 1 else 0)
    if P > 1:  # the stream comes home after its last application
        assert hops[-1] == ((s - 1) % P, s)


@settings(max_examples=60, deadline=None)
@given(Ps, Ls)
def test_cyclic_tick_table_has_no_bubble(P: int, L: int) -> None:
    table = tick_table("cyclic", P, L)
    assert len(table) == L * P
    for t, row in enumerate(table):
        assert sorted(row) == list(range(P))
        for i, streams in row.items():
            assert streams == [(i - t) % P]  # exactly one stream per worker: no bubble


@settings(max_examples=60, deadline=None)
@given(Ps, Ls)
def test_ordered_tick_table_runs_everything_on_one_worker(P: int, L: int) -> None:
    table = tick_table("ordered", P, L)
    assert len(table) == L * P
    for t, row in enumerate(table):
        busy = {i: streams for i, streams in row.items() if streams}
        assert busy == {t % P: list(range(P))}


@settings(max_examples=60, deadline=None)
@given(p_l_s())
def test_ordered_ring_hops_include_relays(pls) -> None:
    P, L, s = pls
    hops = ring_hops("ordered", s, P, L)
    assert all(_is_ring_edge(h, P) for h in hops)
    K = num_applications(P, L)
    between = K - 1 if P > 1 else 0
    relay_in = (0 - s) % P
    relay_out = (s - (P - 1)) % P
    assert len(hops) == between + relay_in + relay_out
    if relay_in:
        assert hops[0] == (s, (s + 1) % P)
    if relay_out:
        assert hops[-1] == ((s - 1) % P, s)


@settings(max_examples=60, deadline=None)
@given(Ps, Ls, ORDERS, st.data())
def test_worker_schedule_covers_its_applications(P: int, L: int, order, data) -> None:
    i = data.draw(st.integers(min_value=0, max_value=P - 1))
    expected = sorted(
        (t, s) for s in range(P) for t, g in enumerate(path(order, s, P, L)) if g == i
    )
    got = worker_schedule(order, i, P, L)
    assert got == expected
    assert got == sorted(got)
    if order == "cyclic":
        assert len(got) == L * P  # one application per tick
    total = sum(len(worker_schedule(order, w, P, L)) for w in range(P))
    assert total == P * L * P  # P streams × K applications


@pytest.mark.parametrize(
    ("P", "L"),
    [(0, 1), (-1, 1), (1, 0), (4, 0), (4, -2)],
)
def test_invalid_p_or_l_raises(P: int, L: int) -> None:
    with pytest.raises(ValueError):
        num_applications(P, L)
    with pytest.raises(ValueError):
        cyclic_path(0, P, L)
    with pytest.raises(ValueError):
        ordered_path(0, P, L)
    with pytest.raises(ValueError):
        tick_table("cyclic", P, L)
    with pytest.raises(ValueError):
        ring_hops("ordered", 0, P, L)


def test_unknown_order_raises() -> None:
    with pytest.raises(ValueError, match="unknown order"):
        path("zigzag", 0, 4, 1)  # type: ignore[arg-type]


def test_small_example_matches_the_paper() -> None:
    assert cyclic_path(2, 4, 2) == [2, 3, 0, 1, 2, 3, 0, 1]
    assert ordered_path(2, 4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [depth(2, i, 4) for i in range(4)] == [2, 3, 0, 1]
    assert ring_hops("ordered", 2, 4, 1) == [
        (2, 3),
        (3, 0),
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 0),
        (0, 1),
        (1, 2),
    ]


def test_slot_producer_and_consumer_are_the_groups_either_side_or_home() -> None:
    path = schedule.cyclic_path(2, 4, 2)  # [2, 3, 0, 1, 2, 3, 0, 1]
    assert schedule.producer(path, 2, 0) == 2  # slot 0: the embedding, at home
    assert schedule.consumer(path, 2, 0) == 2  # ... read by the home's own group first
    assert [schedule.producer(path, 2, t) for t in (1, 3, 8)] == [2, 0, 1]
    assert [schedule.consumer(path, 2, t) for t in (1, 3, 7)] == [3, 1, 1]
    assert schedule.consumer(path, 2, 8) == 2  # slot K: the head, at home
    ordered = schedule.ordered_path(1, 4, 1)  # [0, 1, 2, 3]: origin 1's embedding goes to 0
    assert schedule.producer(ordered, 1, 0) == 1 and schedule.consumer(ordered, 1, 0) == 0
