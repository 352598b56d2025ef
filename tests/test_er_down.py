"""The compressed way down (``sync.down_codec``, ``ring_down_codec``; docs/ring-or-diloco.md
"E/R sync: rare, small and late"): what the coordinator keeps as held is what every site
decodes, bit for bit; a payload is the codec's exact size; held survives a checkpoint; and
the settings the path cannot take are refused (the ring against the reference:
tests/test_er_sync_ring.py, tests/test_rings_ring.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine import ReferenceEngine
from mobius_fed.er_sync import FULL, DownLink, record_bytes
from mobius_fed.strategies import (
    ErDownRounds,
    RoundPlan,
    make_strategy,
    restore_server_state,
    server_state,
    wrapper_of,
)
from mobius_fed.transport.compress import Codec

pytestmark = pytest.mark.usefixtures("one_torch_thread")
logging.getLogger("flwr").setLevel(logging.WARNING)
SHAPES = {"wte": (50, 16), "ln": (16,)}


def arrays(seed: int, scale: float = 1.0) -> ArrayRecord:
    gen = np.random.default_rng(seed)
    return ArrayRecord(
        {n: Array((gen.standard_normal(s) * scale).astype(np.float32)) for n, s in SHAPES.items()}
    )


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_every_site_decodes_the_coordinators_held_exactly(codec: str) -> None:
    """Broadcasts of a drifting model: the first is held itself in fp32, each later one the
    codec's payload of x − held (its exact size); a site's decoded held equals the
    coordinator's bit for bit, the same round again is the same object and is applied
    once, and what a payload rounded away goes with the next broadcast."""
    coordinator, site = DownLink(codec), DownLink(codec)
    x = arrays(0)
    for rnd in range(6):
        record, base = coordinator.send(x, rnd, full=rnd == 0)
        assert coordinator.send(x, rnd, full=False) == (record, base)  # cached: one object
        size = sum(Codec(codec).payload_bytes(s) for s in SHAPES.values())
        assert base == (FULL if rnd == 0 else rnd - 1)
        assert record_bytes(record) == (
            4 * sum(np.prod(s) for s in SHAPES.values()) if rnd == 0 else size
        )
        for _ in range(2):  # an evaluate, then the train message that brings it back
            held = site.receive(record, rnd, base)
        assert coordinator.held is not None
        assert all(torch.equal(held[n], coordinator.held[n]) for n in SHAPES)
        step = arrays(100 + rnd, 0.01).items()
        x = ArrayRecord({n: Array(x[n].numpy() + d.numpy()) for n, d in step})
    # x unchanged from here: the residual x − held shrinks broadcast after broadcast
    gaps = []
    for rnd in range(6, 10):
        site.receive(*coordinator.send(x, rnd, full=False)[:1], rnd, rnd - 1)
        assert coordinator.held is not None
        gaps.append(
            max(float((x[n].numpy() - coordinator.held[n].numpy()).__abs__().max()) for n in SHAPES)
        )
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < gaps[0] / 4, gaps


def test_a_payload_against_another_held_is_refused() -> None:
    coordinator, site = DownLink("int4"), DownLink("int4")
    coordinator.send(arrays(0), 0, True)
    record, base = coordinator.send(arrays(1), 1, False)
    with pytest.raises(ValueError, match="taken against round 0, this site holds round None"):
        site.receive(record, 1, base)


def test_held_is_server_state_and_a_restored_strategy_resends_it_whole() -> None:
    """The coordinator's held (and its round) is in the server state a checkpoint keeps: a
    strategy restored from it sends, first, held after the next broadcast in fp32, equal to
    what the uninterrupted strategy's sites hold after that broadcast."""
    cfg = TrainConfig(
        workers=2, steps=4, sync_every=1, sync={"codec": "int4", "down_codec": "int4"}
    )

    def build() -> ErDownRounds:
        strategy = make_strategy(
            "fedavg", 2, RoundPlan.of(cfg), er_codec="int4", er_down_codec="int4"
        )
        down = wrapper_of(strategy, ErDownRounds)
        assert down is not None
        return down

    straight = build()
    for rnd in range(3):
        straight.down.send(arrays(rnd), rnd, rnd == 0)
    saved = server_state(straight)
    restored_strategy = make_strategy(
        "fedavg", 2, RoundPlan.of(cfg), er_codec="int4", er_down_codec="int4"
    )
    restore_server_state(restored_strategy, saved)
    restored = wrapper_of(restored_strategy, ErDownRounds)
    assert restored is not None and restored.full
    site = DownLink("int4")
    record, base = restored.down.send(arrays(3), 3, True)
    assert base == FULL
    payload, _ = straight.down.send(arrays(3), 3, False)
    assert straight.down.held is not None
    got = site.receive(record, 3, base)
    assert all(torch.equal(got[n], straight.down.held[n]) for n in SHAPES)
    assert record_bytes(payload) < record_bytes(record)


def test_the_down_codec_changes_the_run(site_dirs) -> None:
    """int4 both ways trains on other E/R than int4 up alone (the down path is taken)."""
    base = dict(workers=2, preset="cpu-tiny", batch_size=4, optimizer="adamw", steps=4)
    losses = []
    for down in ("fp32", "int4"):
        cfg = TrainConfig(**base, sync_every=2, sync={"codec": "int4", "down_codec": down})
        engine = ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len) for d in site_dirs])
        losses.append([engine.train_step().loss for _ in range(cfg.steps)])
    assert losses[0][:2] == losses[1][:2] and losses[0] != losses[1]


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"sync": {"down_codec": "int4"}}, ["sync.down_codec=int4", "sync.codec ≠ none"]),
        ({"sync": {"down_codec": "int2"}}, ["down_codec", "'fp32', 'int8' or 'int4'"]),
        (
            {"sync": {"codec": "int4", "down_codec": "int8"}, "privacy": {"er_secagg": True}},
            ["sync.down_codec=int8", "er_secagg", "a down codec leaves the sites another"],
        ),
        (
            {"workers": 4, "rings": 2, "ring_down_codec": "int4"},
            ["ring_down_codec=int4", "ring_codec ≠ none"],
        ),
        ({"ring_down_codec": "bf16"}, ["ring_down_codec", "'fp32', 'int8' or 'int4'"]),
    ],
)
def test_a_way_down_the_path_cannot_take_is_refused(kw: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        TrainConfig(**kw)
    assert all(w in str(info.value) for w in words), str(info.value)
