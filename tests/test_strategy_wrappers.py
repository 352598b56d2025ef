"""The coordinator's features as Flower-style wrapper strategies (mobius_fed/strategies.py),
each alone around a real Flower FedAvg: E/R averaging refuses a tensor the round did not
send, DP clips before the average and noises after it, SecAgg hands the strategy inside
only the unmasked mean, the barrier numbers rounds and tells its hooks."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedAvgM

from mobius_fed.config import TrainConfig
from mobius_fed.defences.er_dp import ErPrivacy
from mobius_fed.defences.secagg import MASKED
from mobius_fed.messages import ARRAYS, STEP_END, STEP_START
from mobius_fed.strategies import (
    BarrierRounds,
    ErAveraging,
    ErDp,
    RoundPlan,
    SecAggRounds,
    flower_strategy,
    make_strategy,
    restore_server_state,
    server_state,
    unwrapped,
)
from mobius_fed.transport.flower_wire import COORDINATOR_NODE_ID, set_task_identity, worker_node_id

P = 2
START = {"wte.weight": torch.zeros(3, 2)}


class _Grid:
    """The node ids a Flower strategy samples from (no messages pass here)."""

    def get_node_ids(self) -> Iterable[int]:
        return [worker_node_id(r) for r in range(P)]


def _orders(strategy: Any, rnd: int = 1, arrays: dict | None = None) -> list[Message]:
    set_task_identity(COORDINATOR_NODE_ID)
    arrays = ArrayRecord({k: v.clone() for k, v in (arrays or START).items()})
    orders = list(strategy.configure_train(rnd, arrays, ConfigRecord(), _Grid()))
    for m in orders:
        m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    return sorted(orders, key=lambda m: m.metadata.dst_node_id)


def _replies(orders: list[Message], values: list[dict[str, torch.Tensor]]) -> list[Message]:
    out = []
    for msg, state in zip(orders, values, strict=True):
        set_task_identity(msg.metadata.dst_node_id)
        metrics = MetricRecord({"num-examples": 1})
        out.append(
            Message(RecordDict({ARRAYS: ArrayRecord(state), "metrics": metrics}), reply_to=msg)
        )
    set_task_identity(COORDINATOR_NODE_ID)
    return out


def _fedavg() -> FedAvg:
    return flower_strategy("fedavg", P)


def test_er_averaging_averages_what_the_round_sent_and_refuses_anything_else() -> None:
    strategy = ErAveraging(_fedavg())
    orders = _orders(strategy)
    a, b = torch.ones(3, 2), 3 * torch.ones(3, 2)
    arrays, _ = strategy.aggregate_train(
        1, _replies(orders, [{"wte.weight": a}, {"wte.weight": b}])
    )
    assert torch.equal(arrays.to_torch_state_dict()["wte.weight"], 2 * torch.ones(3, 2))
    home = {"wte.weight": b, "home.fc.weight": torch.ones(2, 2)}  # a private layer
    with pytest.raises(ValueError, match=r"round 1: worker-1 sent back .*: home\.fc\.weight"):
        strategy.aggregate_train(1, _replies(orders, [{"wte.weight": a}, home]))


@pytest.mark.parametrize("clip_here", [True, False])
def test_er_dp_clips_each_update_before_the_average_only_when_it_clips(clip_here: bool) -> None:
    C = 0.5
    dp = ErPrivacy(noise=0.0, clip=C, P=P, seed=0, key=b"k" * 32)
    strategy = ErDp(ErAveraging(_fedavg()), dp, clip_here=clip_here)
    orders = _orders(strategy)
    big = [{"wte.weight": torch.full((3, 2), 4.0)}, {"wte.weight": torch.full((3, 2), 2.0)}]
    arrays, _ = strategy.aggregate_train(1, _replies(orders, big))
    norm = float(arrays.to_torch_state_dict()["wte.weight"].norm())
    if clip_here:  # each update clipped to C, so their mean is within C of the start
        assert norm == pytest.approx(C, rel=1e-6)
    else:  # the sites clipped (SecAgg): the plain mean
        assert norm == pytest.approx(float(torch.full((3, 2), 3.0).norm()), rel=1e-6)


def test_er_dp_noises_the_aggregate_by_round() -> None:
    dp = ErPrivacy(noise=1.0, clip=1.0, P=P, seed=0, key=b"k" * 32)
    strategy = ErDp(ErAveraging(_fedavg()), dp)
    values = [{"wte.weight": torch.ones(3, 2)}, {"wte.weight": -torch.ones(3, 2)}]  # mean 0
    got = []
    for rnd in (1, 1, 2):
        arrays, _ = strategy.aggregate_train(rnd, _replies(_orders(strategy, rnd), values))
        got.append(arrays.to_torch_state_dict()["wte.weight"])
    assert torch.equal(got[0], got[1]) and not torch.equal(got[0], got[2])  # keyed by round
    assert float(got[0].abs().sum()) > 0


class _SpySecAgg:
    """Records what the wrapper asks of Secure Aggregation; unmasks to a known mean."""

    def __init__(self) -> None:
        self.filled: list[int] = []
        self.unmasked: list[list[int]] = []

    def fill(self, config: ConfigRecord, rnd: int) -> None:
        config["secagg-round"] = rnd
        self.filled.append(rnd)

    def unmask(self, replies: list[Message], start: ArrayRecord, sites: list[int]) -> ArrayRecord:
        assert all(MASKED in r.content for r in replies)
        self.unmasked.append(sites)
        return ArrayRecord({"wte.weight": torch.full((3, 2), 7.0)})


def test_secagg_gives_the_strategy_inside_only_the_unmasked_mean() -> None:
    spy = _SpySecAgg()
    strategy = SecAggRounds(ErAveraging(_fedavg()), spy)
    orders = _orders(strategy, rnd=5)
    assert spy.filled == [5] and all(int(m.content["config"]["secagg-round"]) == 5 for m in orders)
    replies = []
    for msg in orders:
        set_task_identity(msg.metadata.dst_node_id)
        masked = ArrayRecord({"m": torch.zeros(4, dtype=torch.int64)})
        content = RecordDict({MASKED: masked, "metrics": MetricRecord({"num-examples": 1})})
        replies.append(Message(content, reply_to=msg))
    set_task_identity(COORDINATOR_NODE_ID)
    arrays, _ = strategy.aggregate_train(5, replies)
    assert spy.unmasked == [[0, 1]]
    assert torch.equal(arrays.to_torch_state_dict()["wte.weight"], torch.full((3, 2), 7.0))
    assert all(MASKED not in r.content for r in replies)


class _Hooks:
    def __init__(self) -> None:
        self.heard: list[tuple[str, int]] = []

    def before_train(self, rnd: int) -> None:
        self.heard.append(("before", rnd))

    def after_train(self, rnd: int, replies: list[Message], arrays: ArrayRecord | None) -> None:
        self.heard.append(("train", rnd))

    def after_evaluate(self, rnd: int, replies: list[Message]) -> None:
        self.heard.append(("evaluate", rnd))


def test_barrier_numbers_rounds_from_its_offset_and_evaluates_on_the_plan() -> None:
    cfg = TrainConfig(preset="cpu-tiny", workers=P, steps=8, sync_every=2, eval_every=4)
    hooks = _Hooks()
    strategy = BarrierRounds(ErAveraging(_fedavg()), RoundPlan.of(cfg), round_offset=2, hooks=hooks)
    orders = _orders(strategy, rnd=1)  # Flower's round 1 of a run resumed after round 2
    conf = orders[0].content["config"]
    assert (int(conf[STEP_START]), int(conf[STEP_END])) == (4, 6)
    strategy.aggregate_train(1, _replies(orders, [START, START]))
    assert hooks.heard == [("before", 3), ("train", 3)]
    start = ArrayRecord(START)
    assert strategy.configure_evaluate(1, start, ConfigRecord(), _Grid()) == []  # step 6
    assert len(strategy.configure_evaluate(2, start, ConfigRecord(), _Grid())) == P  # step 8


def test_make_strategy_wraps_one_feature_each_and_keeps_the_server_state_inside() -> None:
    cfg = TrainConfig(preset="cpu-tiny", workers=P, steps=4, sync_every=1)
    dp = ErPrivacy(noise=1.0, clip=1.0, P=P, seed=0, key=b"k" * 32)
    spy = _SpySecAgg()
    chain = make_strategy("fedavgm", P, RoundPlan.of(cfg), er_privacy=dp, secagg=spy)
    kinds = []
    s: Any = chain
    while hasattr(s, "strategy"):
        kinds.append(type(s).__name__)
        s = s.strategy
    assert kinds == ["BarrierRounds", "ErDp", "SecAggRounds", "ErAveraging"]
    assert isinstance(s, FedAvgM) and unwrapped(chain) is s
    assert chain.er_privacy is dp and chain.secagg is spy
    assert chain.strategy.clip_here is False  # under SecAgg the sites clip
    plain = make_strategy("fedavg", P, RoundPlan.of(cfg))
    assert (plain.er_privacy, plain.secagg) == (None, None)
    s.momentum_vector = [np.ones(2)]
    saved = server_state(chain)
    other = make_strategy("fedavgm", P, RoundPlan.of(cfg))
    restore_server_state(other, saved)
    assert np.array_equal(unwrapped(other).momentum_vector[0], np.ones(2))
