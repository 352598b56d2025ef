"""Flower strategies driven as step barriers: one Flower round = ``sync_every`` steps.

Both the coordinator (over its mTLS Grid) and the reference engine (over an in-process
Grid) run ``Strategy.start`` with a strategy built here, so a server update such as
FedAvgM's momentum is computed by the same Flower code in both.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Strategy,
)

from mobius_fed.config import ConfigError, TrainConfig
from mobius_fed.defences.secagg import MASKED
from mobius_fed.messages import ARRAYS, STEP_END, STEP_START, TrainOrder  # noqa: F401 - engine reads STEP_START here
from mobius_fed.transport.flower_wire import rank_of_node

STRATEGIES: dict[str, type[FedAvg]] = {
    "fedavg": FedAvg,
    "fedavgm": FedAvgM,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad,
    "fedprox": FedProx,
    "fedmedian": FedMedian,
    "fedtrimmedavg": FedTrimmedAvg,
}
# Server-side state a strategy keeps between rounds (saved in checkpoints).
SERVER_STATE_ATTRS = ("current_arrays", "momentum_vector", "m_t", "v_t")


@dataclass(frozen=True)
class RoundPlan:
    """Which steps each round trains, and after which rounds to evaluate / checkpoint."""

    steps: int
    sync_every: int
    eval_every: int
    checkpoint_every: int = 0

    @classmethod
    def of(cls, cfg: TrainConfig, checkpoint_every: int = 0) -> RoundPlan:
        if cfg.sync_every < 1:
            raise ConfigError(
                "sync_every must be ≥ 1 with a coordinator: each Flower round is one barrier"
            )
        return cls(cfg.steps, cfg.sync_every, cfg.eval_every, checkpoint_every)

    @property
    def num_rounds(self) -> int:
        return -(-self.steps // self.sync_every)

    def steps_of(self, rnd: int) -> tuple[int, int]:
        """Round ``rnd`` (1-based) trains steps [start, end)."""
        start = (rnd - 1) * self.sync_every
        return start, min(start + self.sync_every, self.steps)

    def evaluates(self, rnd: int) -> bool:
        start, end = self.steps_of(rnd)
        crosses = bool(self.eval_every) and end // self.eval_every > start // self.eval_every
        return end == self.steps or crosses

    def checkpoints(self, rnd: int) -> bool:
        every = bool(self.checkpoint_every) and rnd % self.checkpoint_every == 0
        return rnd == self.num_rounds or every


class RoundHooks(Protocol):
    """What the owner of a run hears from its strategy (``before_train`` is optional)."""

    def after_train(self, rnd: int, replies: list[Message], arrays: ArrayRecord | None) -> None: ...

    def after_evaluate(self, rnd: int, replies: list[Message]) -> None: ...


BARRIER_SETTINGS = frozenset(
    {"hooks", "er_privacy", "secagg", "state_copy", "keep_checkpoints", "barrier_snapshots"}
)


class BarrierRounds:
    """Mixin over a Flower strategy: adds the step range to each round's train config and
    evaluates only on the plan's evaluation rounds. ``round_offset`` continues the round
    numbering of a resumed run."""

    plan: RoundPlan
    round_offset: int = 0
    state_copy: bool = False
    keep_checkpoints: int = 0  # checkpoint files a worker keeps (0: all)
    barrier_snapshots: bool = False
    hooks: RoundHooks | None = None
    er_privacy: Any = None  # ErPrivacy: DP-FedAvg of the E/R (clip replies, noise the mean)
    secagg: Any = None  # SecAgg: replies carry masked E/R updates; only their sum is unmasked
    _round_start: ArrayRecord | None = None  # the arrays this round's train messages carry

    def global_round(self, server_round: int) -> int:
        return server_round + self.round_offset

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        rnd = self.global_round(server_round)
        start, end = self.plan.steps_of(rnd)
        checkpoint = self.plan.checkpoints(rnd)
        TrainOrder(
            rnd,
            start,
            end,
            checkpoint,
            state_copy=self.state_copy and checkpoint,
            keep_checkpoints=self.keep_checkpoints,
            barrier_snapshot=self.barrier_snapshots,
        ).fill(config)
        if self.hooks is not None and hasattr(self.hooks, "before_train"):
            self.hooks.before_train(rnd)
        self._round_start = arrays
        if self.secagg is not None:
            self.secagg.fill(config, rnd)
        # Flower sees the run's round number, not start()'s count since the last (re)start:
        # FedAdam's bias correction depends on it.
        return list(super().configure_train(rnd, arrays, config, grid))  # type: ignore[misc]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        rnd = self.global_round(server_round)
        dp = self.er_privacy
        if self.secagg is not None and self._round_start is not None:
            self._unmask(replies, self._round_start)  # with DP, the sites clipped already
        elif dp is not None and self._round_start is not None:
            dp.clip_replies(replies, self._round_start)
        arrays, metrics = super().aggregate_train(rnd, replies)  # type: ignore[misc]
        if dp is not None and arrays is not None:
            arrays = dp.add_noise(arrays, rnd)
        if self.hooks is not None:
            self.hooks.after_train(rnd, replies, arrays)
        return arrays, metrics

    def _unmask(self, replies: list[Message], start: ArrayRecord) -> None:
        """Replace every masked reply by the unmasked mean of all of them (in place), so the
        strategy's own aggregation and server update act on the aggregate alone."""
        sites = [rank_of_node(r.metadata.src_node_id) for r in replies]
        mean = self.secagg.unmask(replies, start, sites)
        for reply in replies:
            del reply.content[MASKED]
            reply.content[ARRAYS] = mean

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        replies = list(replies)
        rnd = self.global_round(server_round)
        metrics = super().aggregate_evaluate(rnd, replies)  # type: ignore[misc]
        if self.hooks is not None and replies:
            self.hooks.after_evaluate(rnd, replies)
        return metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        rnd = self.global_round(server_round)
        if not self.plan.evaluates(rnd):
            return []
        config["round"] = rnd
        config[STEP_END] = self.plan.steps_of(rnd)[1]
        return list(super().configure_evaluate(rnd, arrays, config, grid))  # type: ignore[misc]


def make_strategy(
    name: str,
    P: int,
    plan: RoundPlan,
    options: dict[str, Any] | None = None,
    round_offset: int = 0,
    **barrier: Any,
) -> Strategy:
    """A Flower strategy by name (fedavg, fedavgm, …) that waits for and trains all P workers.

    ``barrier``: the :class:`BarrierRounds` settings it is built with (``hooks``,
    ``er_privacy``, ``secagg``, ``state_copy``, ``keep_checkpoints``, ``barrier_snapshots``).
    """
    key = name.lower()
    if key not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r} (expected one of {', '.join(STRATEGIES)})")
    unknown = set(barrier) - BARRIER_SETTINGS
    if unknown:
        raise TypeError(f"make_strategy: unknown barrier setting(s) {', '.join(sorted(unknown))}")
    base = STRATEGIES[key]
    cls = type(f"Barrier{base.__name__}", (BarrierRounds, base), {})
    kwargs: dict[str, Any] = {"fraction_train": 1.0, "fraction_evaluate": 1.0}
    kwargs |= dict.fromkeys(("min_train_nodes", "min_evaluate_nodes", "min_available_nodes"), P)
    if key == "fedprox":
        kwargs["proximal_mu"] = 0.0
    try:
        strategy = cls(**kwargs, **(options or {}))
    except TypeError as exc:
        raise ConfigError(f"strategy {name}: bad option ({exc})") from exc
    strategy.plan, strategy.round_offset = plan, round_offset
    for k, v in barrier.items():
        setattr(strategy, k, v)
    return strategy


def server_state(strategy: Strategy) -> dict[str, Any]:
    """A copy of the strategy's between-round state (momentum, moments, current arrays)."""
    return copy.deepcopy(
        {k: getattr(strategy, k) for k in SERVER_STATE_ATTRS if hasattr(strategy, k)}
    )


def restore_server_state(strategy: Strategy, state: dict[str, Any]) -> None:
    for k, v in copy.deepcopy(state).items():
        setattr(strategy, k, v)


_ARRAYS_TAG = "__array_record__"


def to_plain(value: Any) -> Any:
    """``value`` with every Flower ArrayRecord as a tagged dict of tensors (checkpointable)."""
    if isinstance(value, ArrayRecord):
        return {_ARRAYS_TAG: value.to_torch_state_dict()}
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value


def from_plain(value: Any) -> Any:
    """The inverse of :func:`to_plain`."""
    if isinstance(value, dict):
        if set(value) == {_ARRAYS_TAG}:
            return ArrayRecord(value[_ARRAYS_TAG])
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [from_plain(v) for v in value]
    return value
