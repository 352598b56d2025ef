"""Flower strategies driven as step barriers: one Flower round = ``sync_every`` steps.

Both the coordinator (over its mTLS Grid) and the reference engine (over an in-process
Grid) run ``Strategy.start`` with a strategy built here, so a server update such as
FedAvgM's momentum is computed by the same Flower code in both.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
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

from mobius_fed.checkpoint import ARRAYS_TAG
from mobius_fed.config import ConfigError, TrainConfig
from mobius_fed.defences.secagg import MASKED
from mobius_fed.er_sync import ER_DOWN, GROUP_DOWN, DownLink, decode_er
from mobius_fed.messages import (  # noqa: F401 - engine reads STEP_START here
    ARRAYS,
    CONFIG,
    FROM_EVALUATE,
    GROUP,
    GROUP_BASE,
    METRICS,
    STEP_END,
    STEP_START,
    TrainOrder,
)
from mobius_fed.robust_sync import RingAggregate
from mobius_fed.transport.compress import Codec
from mobius_fed.transport.flower_wire import rank_of_node

Arrays = list[np.ndarray]
log = logging.getLogger("mobius.strategy")


def nesterov_step(
    current: ArrayRecord, average: ArrayRecord, momentum: Arrays | None, lr: float, mu: float
) -> tuple[ArrayRecord, Arrays]:
    """DiLoCo's outer step (arXiv 2311.08105), torch's SGD with Nesterov momentum on the
    pseudo-gradient Δ = θ − mean(θ_k) of the round: b ← μ·b + Δ (b = Δ at the first
    step), θ ← θ − lr·(Δ + μ·b). Returns the new θ and b."""
    names = list(average.keys())
    delta = [current[n].numpy() - a.numpy() for n, a in zip(names, average.values(), strict=True)]
    return nesterov_delta(current, dict(zip(names, delta, strict=True)), momentum, lr, mu)


def nesterov_delta(
    current: ArrayRecord,
    delta: dict[str, np.ndarray],
    momentum: Arrays | None,
    lr: float,
    mu: float,
) -> tuple[ArrayRecord, Arrays]:
    """:func:`nesterov_step` from the pseudo-gradient ``delta`` itself (a ring codec's)."""
    names = list(delta)
    theta = [current[n].numpy() for n in names]
    delta_list = [delta[n] for n in names]
    if momentum is None:
        buf = [d.copy() for d in delta_list]
    else:
        buf = [mu * b + d for b, d in zip(momentum, delta_list, strict=True)]
    new = [t - lr * (d + mu * b) for t, d, b in zip(theta, delta_list, buf, strict=True)]
    return ArrayRecord({n: Array(np.asarray(v)) for n, v in zip(names, new)}), buf


class DiLoCo(FedAvgM):
    """Flower's FedAvgM with DiLoCo's outer step instead of heavy-ball momentum: the
    replies' FedAvg average, then :func:`nesterov_step` (defaults lr 0.7, μ 0.9). With the
    E/R under it and ``ring_outer = diloco``, P = 1 with R sites is DiLoCo of the whole
    model (docs/rings.md)."""

    def __init__(
        self, server_learning_rate: float = 0.7, server_momentum: float = 0.9, **kw: Any
    ) -> None:
        super().__init__(
            server_learning_rate=server_learning_rate, server_momentum=server_momentum, **kw
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        average, metrics = FedAvg.aggregate_train(self, server_round, replies)
        if average is None or self.current_arrays is None:
            return average, metrics
        arrays, self.momentum_vector = nesterov_step(
            self.current_arrays,
            average,
            self.momentum_vector,
            self.server_learning_rate,
            self.server_momentum,
        )
        self.current_arrays = arrays
        return arrays, metrics


STRATEGIES: dict[str, type[FedAvg]] = {
    "fedavg": FedAvg,
    "fedavgm": FedAvgM,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad,
    "fedprox": FedProx,
    "fedmedian": FedMedian,
    "fedtrimmedavg": FedTrimmedAvg,
    "diloco": DiLoCo,
}
# Server-side state a strategy keeps between rounds (saved in checkpoints).
SERVER_STATE_ATTRS = ("current_arrays", "momentum_vector", "m_t", "v_t")
RING_STATE = "ring_sync"  # RingSync's synced groups and outer state (R > 1)
DOWN_STATE = "er_down"  # ErDownRounds' held E/R (sync.down_codec)
W = TypeVar("W", bound="StrategyWrapper")


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


class StrategyWrapper(Strategy):
    """A strategy that wraps another, as Flower's ``DifferentialPrivacy…FixedClipping`` do:
    every call goes on to ``self.strategy``; a subclass adds its one concern around it.
    ``sent`` is the arrays the round in flight was sent (None before the first round)."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.sent: ArrayRecord | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.sent = arrays
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()


def unwrapped(strategy: Strategy) -> Strategy:
    """The Flower strategy inside every wrapper (it holds the server state)."""
    while isinstance(strategy, StrategyWrapper):
        strategy = strategy.strategy
    return strategy


def wrapper_of(strategy: Strategy, kind: type[W]) -> W | None:
    """The ``kind`` wrapper in ``strategy``'s chain, if any."""
    while isinstance(strategy, StrategyWrapper):
        if isinstance(strategy, kind):
            return strategy
        strategy = strategy.strategy
    return None


class ErAveraging(StrategyWrapper):
    """The barrier's average of the shared tensors: the Flower strategy inside averages
    every tensor the round sent (E/R: ``Replica.shared_state_dict``), and each reply must
    carry back exactly those (so a private home layer never reaches the average). One more
    shared tensor is averaged by sending it with the round's arrays: nothing here changes."""

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        sent = frozenset(self.sent.keys() if self.sent is not None else ())
        for reply in replies:
            got = frozenset(reply.content[ARRAYS].keys()) if ARRAYS in reply.content else None
            if got is not None and sent and got != sent:
                rank = rank_of_node(reply.metadata.src_node_id)
                odd = sorted(got ^ sent)
                raise ValueError(
                    f"round {server_round}: worker-{rank} sent back tensors other than the "
                    f"round's shared ones: {', '.join(odd)}"
                )
        return self.strategy.aggregate_train(server_round, replies)


def update_norm(record: ArrayRecord, base: ArrayRecord) -> float:
    """The L2 norm of ``record`` − ``base`` over all their arrays (in float64)."""
    total = 0.0
    for name, a in record.items():
        d = a.numpy().astype(np.float64) - base[name].numpy().astype(np.float64)
        total += float(np.dot(d.ravel(), d.ravel()))
    return float(np.sqrt(total))


@dataclass(frozen=True)
class UpdateClip:
    """The barrier's bound on each site's E/R update (``bounds.er_clip_factor`` /
    ``er_clip_max``): an update norm above ``factor`` × the round's lower median of the
    update norms, or above ``ceiling``, is scaled down to that bound. The lower median is
    an honest site's norm while fewer than half the sites lie (with P = 2, the smaller)."""

    factor: float = 0.0  # 0: no relative bound
    ceiling: float | None = None

    @classmethod
    def of(cls, cfg: TrainConfig) -> UpdateClip | None:
        b = cfg.bounds
        if not b.er_clip_factor and b.er_clip_max is None:
            return None
        return cls(b.er_clip_factor, b.er_clip_max)

    def bound(self, norms: list[float]) -> float:
        bound = float("inf")
        if self.factor and norms:
            bound = self.factor * sorted(norms)[(len(norms) - 1) // 2]
        if self.ceiling is not None:
            bound = min(bound, self.ceiling)
        return bound


class ErClip(StrategyWrapper):
    """Clips each reply's E/R update (:class:`UpdateClip`) before the strategy inside
    averages it. A reply within its bound is left as it came, bit for bit; one above it
    becomes ``sent + update · bound/norm`` and is counted against its site (``clipped``)."""

    def __init__(self, strategy: Strategy, clip: UpdateClip) -> None:
        super().__init__(strategy)
        self.clip = clip
        self.clipped: dict[int, int] = {}  # site → rounds its update was clipped
        self.last: dict[int, str] = {}
        self.round_clipped: dict[int, str] = {}  # the last round's clips: site → why

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        sent = self.sent
        self.round_clipped = {}
        ok = [r for r in replies if not r.has_error() and ARRAYS in r.content.array_records]
        if sent is None or not ok:
            return self.strategy.aggregate_train(server_round, replies)
        norms = [update_norm(r.content.array_records[ARRAYS], sent) for r in ok]
        bound = self.clip.bound(norms)
        for reply, norm in zip(ok, norms, strict=True):
            if norm <= bound:
                continue
            rank = rank_of_node(reply.metadata.src_node_id)
            scale = bound / norm
            record = reply.content.array_records[ARRAYS]
            reply.content[ARRAYS] = ArrayRecord(
                {
                    name: Array(
                        np.asarray(
                            sent[name].numpy() + (a.numpy() - sent[name].numpy()) * scale,
                            dtype=a.numpy().dtype,
                        )
                    )
                    for name, a in record.items()
                }
            )
            self.clipped[rank] = self.clipped.get(rank, 0) + 1
            why = (
                f"round {server_round}: worker-{rank}'s E/R update norm {norm:.3g} clipped "
                f"to {bound:.3g}"
            )
            self.last[rank] = self.round_clipped[rank] = why
            log.warning("%s", why)
        return self.strategy.aggregate_train(server_round, replies)


class ErDp(StrategyWrapper):
    """DP-FedAvg of the E/R (:class:`~mobius_fed.defences.er_dp.ErPrivacy`): each reply's
    update clipped to C (here, unless the sites clip, as under SecAgg), noise added to the
    aggregate."""

    def __init__(self, strategy: Strategy, er_privacy: Any, clip_here: bool = True) -> None:
        super().__init__(strategy)
        self.er_privacy, self.clip_here = er_privacy, clip_here

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        if self.clip_here and self.sent is not None:
            self.er_privacy.clip_replies(replies, self.sent)
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is not None:
            arrays = self.er_privacy.add_noise(arrays, server_round)
        return arrays, metrics


class SecAggRounds(StrategyWrapper):
    """Secure Aggregation of the E/R (:class:`~mobius_fed.defences.secagg.SecAgg`): the
    round's orders carry the mask settings; the masked replies are replaced by their
    unmasked mean, so the strategy inside acts on the aggregate alone."""

    def __init__(self, strategy: Strategy, secagg: Any) -> None:
        super().__init__(strategy)
        self.secagg = secagg

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.secagg.fill(config, server_round)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        if self.sent is not None:
            sites = [rank_of_node(r.metadata.src_node_id) for r in replies]
            mean = self.secagg.unmask(replies, self.sent, sites)
            for reply in replies:
                del reply.content[MASKED]
                reply.content[ARRAYS] = mean
        return self.strategy.aggregate_train(server_round, replies)


class ErCodecRounds(StrategyWrapper):
    """The E/R pseudo-gradients through a codec (``sync.codec``): each reply's payloads
    become θ̂ = G − decode(payload) (:func:`~mobius_fed.er_sync.decode_er`, G: the arrays
    the round was sent), so every wrapper and the strategy inside see E/R arrays as
    without a codec."""

    def __init__(self, strategy: Strategy, codec: str) -> None:
        super().__init__(strategy)
        self.codec = codec

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        if self.sent is None:
            raise ValueError(f"round {server_round}: E/R payloads, but no E/R was sent")
        for reply in replies:
            if not reply.has_error() and ARRAYS in reply.content.array_records:
                payload = reply.content.array_records[ARRAYS]
                reply.content[ARRAYS] = decode_er(payload, self.sent, self.codec)
        return self.strategy.aggregate_train(server_round, replies)


class ErDownRounds(StrategyWrapper):
    """The E/R's way down through a codec (``sync.down_codec``, :class:`DownLink`): every
    train and evaluate message carries, instead of the global E/R x, the codec's payload of
    x − held (or, first in a strategy, held itself in fp32), and its config names the
    broadcast (:data:`~mobius_fed.er_sync.ER_DOWN`). Inside it every wrapper still sees x:
    a site's pseudo-gradient, taken against its held, decodes against x (the server's
    error feedback), so FedAvg and DiLoCo step x by the sites' mean progress."""

    def __init__(self, strategy: Strategy, codec: str) -> None:
        super().__init__(strategy)
        self.down, self.full = DownLink(codec), True  # full: the strategy's first broadcast

    def _swap(self, messages: Iterable[Message], arrays: ArrayRecord, rnd: int) -> list[Message]:
        """``messages`` carrying the broadcast of ``arrays``, the global E/R after round
        ``rnd`` (server rounds here are global: BarrierRounds numbers them)."""
        messages = list(messages)
        if not messages:
            return messages
        record, base = self.down.send(arrays, rnd, self.full)
        for msg in messages:  # Flower's messages share one RecordDict: give each its own
            config = ConfigRecord(dict(msg.content.config_records[CONFIG]))
            config[ER_DOWN[0]], config[ER_DOWN[1]] = rnd, base
            msg.content = RecordDict({**dict(msg.content.items()), ARRAYS: record, CONFIG: config})
        return messages

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = super().configure_train(server_round, arrays, config, grid)
        messages = self._swap(messages, arrays, server_round - 1)
        self.full = False
        return messages

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = self.strategy.configure_evaluate(server_round, arrays, config, grid)
        return self._swap(messages, arrays, server_round)


def sync_strategy(
    name: str, options: dict[str, Any] | None, train: TrainConfig
) -> tuple[str, dict[str, Any]]:
    """The Flower strategy and options of a run whose E/R outer step is ``train.sync.outer``
    (unset: ``name`` decides): ``diloco`` is :class:`DiLoCo` with ``outer_lr`` and
    ``outer_momentum`` unless ``options`` set them. A ``name`` that contradicts the outer
    step is refused, naming both."""
    outer, key, options = train.sync.outer, name.lower(), dict(options or {})
    if outer == "diloco" and key not in ("fedavg", "diloco"):
        raise ConfigError(
            f"--sync-outer diloco conflicts with --strategy {name}: the E/R outer step is "
            "the strategy's (use --strategy diloco, or leave --strategy at fedavg)"
        )
    if outer == "fedavg" and key != "fedavg":
        raise ConfigError(
            f"--sync-outer fedavg conflicts with --strategy {name}: the E/R outer step is "
            "the strategy's (leave --sync-outer unset to use the strategy's own)"
        )
    if outer == "diloco" or key == "diloco":
        options.setdefault("server_learning_rate", train.outer_lr)
        options.setdefault("server_momentum", train.outer_momentum)
        return "diloco", options
    return name, options


class EvaluateSent:
    """The array records each node's evaluate message carried (round ``round``), so that
    the train message of the next round leaves out those it would send again: the same
    objects (the synced E/R and, R > 1, the synced F_i), named in its order's
    ``from_evaluate`` for the node to take from its evaluate. Only nodes that answered that
    evaluate without an error are spared; a new strategy (a rollback) starts knowing none."""

    def __init__(self) -> None:
        self.round: int | None = None
        self.sent: dict[int, dict[str, ArrayRecord]] = {}
        self.answered_by: set[int] = set()

    def sending(self, rnd: int, messages: list[Message]) -> None:
        self.round, self.answered_by = rnd, set()
        self.sent = {m.metadata.dst_node_id: dict(m.content.array_records) for m in messages}

    def answered(self, replies: list[Message]) -> None:
        self.answered_by = {r.metadata.src_node_id for r in replies if not r.has_error()}

    def leave_out(self, rnd: int, messages: list[Message]) -> list[Message]:
        """``messages`` (round ``rnd``'s train messages), each without what its node's
        evaluate of round ``rnd`` − 1 already brought (a copy of its RecordDict: Flower's
        messages share one)."""
        sent, answered = (self.sent, self.answered_by) if self.round == rnd - 1 else ({}, set())
        self.round, self.sent, self.answered_by = None, {}, set()
        for msg in messages:
            node = msg.metadata.dst_node_id
            brought = sent.get(node, {}) if node in answered else {}
            keys = [k for k, rec in msg.content.array_records.items() if brought.get(k) is rec]
            if not keys:
                continue
            content = {k: v for k, v in msg.content.items() if k not in keys}
            config = ConfigRecord(dict(msg.content.config_records[CONFIG]))
            config[FROM_EVALUATE] = ",".join(keys)
            msg.content = RecordDict({**content, CONFIG: config})
        return messages


class BarrierRounds(StrategyWrapper):
    """The outermost wrapper: one Flower round = one barrier of ``plan``. It numbers rounds
    on from ``round_offset`` (a resumed run; FedAdam's bias correction depends on it), puts
    the step range and checkpoint order into each round's train config, evaluates only on
    the plan's evaluation rounds, and tells ``hooks``."""

    def __init__(
        self,
        strategy: Strategy,
        plan: RoundPlan,
        round_offset: int = 0,
        *,
        hooks: RoundHooks | None = None,
        state_copy: bool = False,
        keep_checkpoints: int = 0,  # checkpoint files a worker keeps (0: all)
        barrier_snapshots: bool = False,
        checkpoints: Callable[[int], bool] | None = None,  # round → checkpoint? (the plan's)
    ) -> None:
        super().__init__(strategy)
        self.plan, self.round_offset, self.hooks = plan, round_offset, hooks
        self.checkpoints = checkpoints or plan.checkpoints
        self.state_copy, self.keep_checkpoints = state_copy, keep_checkpoints
        self.barrier_snapshots = barrier_snapshots
        self.evaluated = EvaluateSent()

    @property
    def er_privacy(self) -> Any:
        dp = wrapper_of(self, ErDp)
        return None if dp is None else dp.er_privacy

    @property
    def secagg(self) -> Any:
        sa = wrapper_of(self, SecAggRounds)
        return None if sa is None else sa.secagg

    def global_round(self, server_round: int) -> int:
        return server_round + self.round_offset

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        rnd = self.global_round(server_round)
        start, end = self.plan.steps_of(rnd)
        checkpoint = self.checkpoints(rnd)
        TrainOrder(
            rnd,
            start,
            end,
            checkpoint,
            state_copy=self.state_copy and checkpoint,
            keep_checkpoints=self.keep_checkpoints,
            barrier_snapshot=self.barrier_snapshots,
            audit_asks=self._audit_asks(),
        ).fill(config)
        if self.hooks is not None and hasattr(self.hooks, "before_train"):
            self.hooks.before_train(rnd)
        messages = list(self.strategy.configure_train(rnd, arrays, config, grid))
        return self.evaluated.leave_out(rnd, messages)

    def _audit_asks(self) -> str | None:
        """Audits (docs/audits.md): the past rounds the owner asks the sites to upload."""
        audits = getattr(self.hooks, "audits", None)
        return None if audits is None else audits.asks()

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        rnd = self.global_round(server_round)
        arrays, metrics = self.strategy.aggregate_train(rnd, replies)
        if self.hooks is not None:
            self.hooks.after_train(rnd, replies, arrays)
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        rnd = self.global_round(server_round)
        if not self.plan.evaluates(rnd):
            return []
        config["round"] = rnd
        config[STEP_END] = self.plan.steps_of(rnd)[1]
        messages = list(self.strategy.configure_evaluate(rnd, arrays, config, grid))
        self.evaluated.sending(rnd, messages)
        return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        replies = list(replies)
        rnd = self.global_round(server_round)
        self.evaluated.answered(replies)
        metrics = self.strategy.aggregate_evaluate(rnd, replies)
        if self.hooks is not None and replies:
            self.hooks.after_evaluate(rnd, replies)
        return metrics


@dataclass(frozen=True)
class RingPlan:
    """R rings of P groups (docs/rings.md): every H steps (and at the end) each group F_i is
    combined over the R rings (``aggregate``: the mean, or Flower's median, trimmed mean or
    Krum, :class:`~mobius_fed.robust_sync.RingAggregate`), then the outer step ``outer``
    (fedavg: the aggregate; diloco: :func:`nesterov_step` from the global F_i of the previous
    sync). ``initial(i)``: F_i's weights at step 0, the first global weights of a DiLoCo
    outer step."""

    P: int
    R: int
    H: int
    steps: int
    outer: str = "fedavg"
    lr: float = 0.7
    momentum: float = 0.9
    initial: Callable[[int], ArrayRecord] | None = None
    codec: str = "none"  # the pseudo-gradients' wire codec (none: F_i itself, fp32)
    aggregate: str = "mean"  # mean, median, trimmed or krum (docs/rings.md)
    trim: float = 0.34  # trimmed: the fraction cut off each end
    krum_f: int = 1  # krum: the rings that may lie
    down_codec: str = "fp32"  # the synced F_i's way down (fp32, or a codec: DownLink)

    @classmethod
    def of(cls, cfg: TrainConfig) -> RingPlan | None:
        """The plan of ``cfg`` (None with one ring); F_i's initial weights built from the seed."""
        if cfg.rings == 1:
            return None

        def initial(i: int) -> ArrayRecord:
            from mobius_fed.model import build_group  # torch model code: only when needed

            return group_arrays(build_group(cfg.model(), i, cfg.seed))

        return cls(
            cfg.P,
            cfg.rings,
            cfg.ring_sync_every,
            cfg.steps,
            cfg.ring_outer,
            cfg.outer_lr,
            cfg.outer_momentum,
            initial,
            cfg.ring_codec,
            cfg.ring_aggregate,
            cfg.ring_trim,
            cfg.ring_krum_f,
            cfg.ring_down_codec,
        )

    def syncs(self, step_end: int) -> bool:
        """Whether the round that ends at ``step_end`` ends with a ring sync."""
        return step_end % self.H == 0 or step_end == self.steps


def group_arrays(group: Any) -> ArrayRecord:
    """The arrays of block group ``group`` (a torch module) that a ring sync averages."""
    return ArrayRecord({k: v.detach().clone() for k, v in group.named_parameters()})


def encode_delta(group: Any, base: dict[str, torch.Tensor], codec: str) -> ArrayRecord:
    """What a worker sends on a ring sync with a codec: per tensor the pseudo-gradient
    δ = base − θ (base: the global F_i of the last sync) as the codec's uint8 payload."""
    c = Codec(codec)
    out = {}
    for name, p in group.named_parameters():
        delta = base[name].detach().cpu().float() - p.detach().cpu().float()
        out[name] = Array(c.encode(delta).numpy())
    return ArrayRecord(out)


def decode_delta(record: ArrayRecord, like: ArrayRecord, codec: str) -> ArrayRecord:
    """The fp32 pseudo-gradient a :func:`encode_delta` payload stands for (shapes of ``like``)."""
    c = Codec(codec)
    return ArrayRecord(
        {
            name: Array(c.decode(torch.from_numpy(a.numpy()), tuple(like[name].shape)).numpy())
            for name, a in record.items()
        }
    )


class RingSync(StrategyWrapper):
    """R rings of P groups: on a ring-sync round each worker sends its group F_i back
    (``GROUP``); this wrapper takes those out of the replies, combines F_i over the R
    workers r·P + i (Flower's weighted average, or its median, trimmed mean or Krum: the
    plan's ``aggregate``), applies the plan's outer step, and sends the synced F_i with the
    next evaluate and train messages. The E/R go on to the strategy inside, which averages
    them over all R·P sites."""

    def __init__(self, strategy: Strategy, plan: RingPlan) -> None:
        super().__init__(strategy)
        self.plan = plan
        self.combine = RingAggregate(plan.aggregate, plan.R, plan.trim, plan.krum_f)
        self.pending: dict[int, ArrayRecord] = {}  # synced groups not yet sent for training
        self.globals: dict[int, ArrayRecord] = {}  # diloco: global F_i of the last sync
        self.momentum: dict[int, Arrays] = {}  # diloco: F_i's outer momentum
        # with a codec, a worker's pseudo-gradient is taken against the global F_i: it gets
        # that with the first train message of this strategy (a fresh run, a rollback)
        self.send_base = plan.codec != "none"
        # a down codec: per group, what every worker of it holds (DownLink), and the round
        # of the sync whose F_i is pending
        on = plan.down_codec != "fp32"
        self.down = {i: DownLink(plan.down_codec) for i in range(plan.P)} if on else None
        self.pending_round = 0

    def _attach(self, messages: Iterable[Message], train: bool = False) -> list[Message]:
        messages = list(messages)
        for msg in messages:
            i = rank_of_node(msg.metadata.dst_node_id) % self.plan.P
            extra: dict[str, Any] = {}
            if i in self.pending:
                extra[GROUP] = self.pending[i]
            elif train and self.send_base:
                extra[GROUP_BASE] = self._global(i)
            if extra and self.down is not None:
                extra[CONFIG] = self._down(i, extra, msg.content.config_records[CONFIG])
            if extra:  # Flower's messages share one RecordDict: give each its own
                msg.content = RecordDict({**dict(msg.content.items()), **extra})
        return messages

    def _down(self, i: int, extra: dict[str, Any], config: ConfigRecord) -> ConfigRecord:
        """With a down codec, in ``extra``: the synced F_i as the payload of its change
        since the last sync (on the strategy's first train, held itself in fp32), or as
        ``GROUP_BASE`` the F_i the workers hold (the seed's before a sync), in fp32. Returns
        the message's config, which names the broadcast (``GROUP_DOWN``)."""
        assert self.down is not None
        link = self.down[i]
        if GROUP in extra:
            extra[GROUP], base = link.send(extra[GROUP], self.pending_round, self.send_base)
        else:
            if link.held is None:
                link.send(self._global(i), 0, True)
            extra[GROUP_BASE], base = link.resend()
        config = ConfigRecord(dict(config))
        config[GROUP_DOWN[0]], config[GROUP_DOWN[1]] = link.round or 0, base
        return config

    def _global(self, i: int) -> ArrayRecord:
        """F_i's global weights at the last sync (the seed's before the first)."""
        if i not in self.globals:
            if self.plan.initial is None:
                raise ValueError("this ring sync needs the groups' initial weights")
            self.globals[i] = self.plan.initial(i)
        return self.globals[i]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        order = TrainOrder.of(config)  # every round says it (Flower reuses the config record)
        dataclasses.replace(order, ring_sync=self.plan.syncs(order.step_end)).fill(config)
        messages = self._attach(super().configure_train(server_round, arrays, config, grid), True)
        self.pending.clear()  # a worker loads a synced group once, before training on
        self.send_base = False
        return messages

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self._attach(super().configure_evaluate(server_round, arrays, config, grid))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        groups: dict[int, list[RecordDict]] = {}
        for reply in sorted(replies, key=lambda m: m.metadata.src_node_id):
            if not reply.has_error() and GROUP in reply.content:
                rank = rank_of_node(reply.metadata.src_node_id)
                record = RecordDict({ARRAYS: reply.content[GROUP], METRICS: reply.content[METRICS]})
                groups.setdefault(rank % self.plan.P, []).append(record)
                del reply.content[GROUP]
        for i, records in sorted(groups.items()):
            if len(records) != self.plan.R:
                raise ValueError(
                    f"round {server_round}: group F_{i} came back from {len(records)} of "
                    f"{self.plan.R} rings"
                )
            self.pending_round = server_round
            if self.plan.codec == "none":
                self.pending[i] = self._outer(i, self.combine(server_round, records))
            else:
                self.pending[i] = self._outer_delta(i, records, server_round)
        return super().aggregate_train(server_round, replies)

    def _outer(self, i: int, average: ArrayRecord) -> ArrayRecord:
        plan = self.plan
        if plan.outer == "fedavg":
            return average
        new, self.momentum[i] = nesterov_step(
            self._global(i), average, self.momentum.get(i), plan.lr, plan.momentum
        )
        self.globals[i] = new
        return new

    def _outer_delta(self, i: int, records: list[RecordDict], server_round: int) -> ArrayRecord:
        """With a codec: decode each ring's pseudo-gradient, combine them into δ̄ (the plan's
        aggregate), then θ − δ̄ (fedavg) or the Nesterov step on δ̄ (diloco)."""
        plan, theta = self.plan, self._global(i)
        for record in records:
            record[ARRAYS] = decode_delta(record.array_records[ARRAYS], theta, plan.codec)
        combined = self.combine(server_round, records)
        delta = {name: a.numpy() for name, a in combined.items()}
        if plan.outer == "fedavg":
            new = ArrayRecord(
                {n: Array(np.asarray(theta[n].numpy() - d)) for n, d in delta.items()}
            )
        else:
            new, self.momentum[i] = nesterov_delta(
                theta, delta, self.momentum.get(i), plan.lr, plan.momentum
            )
        self.globals[i] = new
        return new

    def state(self) -> dict[str, Any]:
        out = {"pending": self.pending, "globals": self.globals, "momentum": self.momentum}
        if self.down is not None:  # what the workers hold, and the pending sync's round
            out["down"] = {i: link.state() for i, link in self.down.items()}
            out["pending_round"] = self.pending_round
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        self.pending, self.globals = dict(state["pending"]), dict(state["globals"])
        self.momentum = dict(state["momentum"])
        if self.down is not None and "down" in state:
            for i, saved in state["down"].items():
                self.down[int(i)].load_state(saved)
            self.pending_round = int(state["pending_round"])


def flower_strategy(name: str, P: int, options: dict[str, Any] | None = None) -> Strategy:
    """The Flower strategy ``name`` (fedavg, fedavgm, …) that waits for and trains all P."""
    key = name.lower()
    if key not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r} (expected one of {', '.join(STRATEGIES)})")
    kwargs: dict[str, Any] = {"fraction_train": 1.0, "fraction_evaluate": 1.0}
    kwargs |= dict.fromkeys(("min_train_nodes", "min_evaluate_nodes", "min_available_nodes"), P)
    if key == "fedprox":
        kwargs["proximal_mu"] = 0.0
    try:
        return STRATEGIES[key](**kwargs, **(options or {}))
    except TypeError as exc:
        raise ConfigError(f"strategy {name}: bad option ({exc})") from exc


def make_strategy(
    name: str,
    P: int,
    plan: RoundPlan,
    options: dict[str, Any] | None = None,
    round_offset: int = 0,
    *,
    er_privacy: Any = None,
    secagg: Any = None,
    rings: RingPlan | None = None,
    update_clip: UpdateClip | None = None,
    er_codec: str = "none",
    er_down_codec: str = "fp32",
    **barrier: Any,
) -> BarrierRounds:
    """The run's strategy: the Flower strategy ``name`` inside one wrapper per feature,
    ``BarrierRounds(RingSync(ErCodecRounds(ErDp(SecAggRounds(ErAveraging(ErClip(flower)))))))``
    (the ones turned on). ``P``: the number of workers (all R·P sites with several rings).

    ``er_privacy`` turns on :class:`ErDp`, ``secagg`` :class:`SecAggRounds`, ``rings``
    :class:`RingSync`, ``update_clip`` (``UpdateClip.of(cfg)``) :class:`ErClip`, except
    under SecAgg, where no single update is visible; ``er_codec`` (``sync.codec``)
    :class:`ErCodecRounds`; ``er_down_codec`` (``sync.down_codec``) :class:`ErDownRounds`
    (outside it); ``barrier``
    goes to :class:`BarrierRounds`: ``hooks``, ``state_copy``, ``keep_checkpoints``,
    ``barrier_snapshots``, ``checkpoints`` (another name is a TypeError there).
    """
    strategy: Strategy = flower_strategy(name, P, options)
    if update_clip is not None and secagg is None:
        strategy = ErClip(strategy, update_clip)
    strategy = ErAveraging(strategy)
    if secagg is not None:
        strategy = SecAggRounds(strategy, secagg)
    if er_privacy is not None:  # under SecAgg the sites clip their own updates
        strategy = ErDp(strategy, er_privacy, clip_here=secagg is None)
    if er_codec != "none":
        strategy = ErCodecRounds(strategy, er_codec)
    if er_down_codec != "fp32":
        strategy = ErDownRounds(strategy, er_down_codec)
    if rings is not None:
        strategy = RingSync(strategy, rings)
    return BarrierRounds(strategy, plan, round_offset, **barrier)


def server_state(strategy: Strategy) -> dict[str, Any]:
    """A copy of the strategy's between-round state (momentum, moments, current arrays)."""
    inner = unwrapped(strategy)
    state = {k: getattr(inner, k) for k in SERVER_STATE_ATTRS if hasattr(inner, k)}
    rings = wrapper_of(strategy, RingSync)
    if rings is not None:
        state[RING_STATE] = rings.state()
    down = wrapper_of(strategy, ErDownRounds)
    if down is not None:
        state[DOWN_STATE] = down.down.state()
    return copy.deepcopy(state)


def restore_server_state(strategy: Strategy, state: dict[str, Any]) -> None:
    inner, state = unwrapped(strategy), copy.deepcopy(state)
    rings, ring_state = wrapper_of(strategy, RingSync), state.pop(RING_STATE, None)
    if rings is not None and ring_state is not None:
        rings.load_state(ring_state)
    down, down_state = wrapper_of(strategy, ErDownRounds), state.pop(DOWN_STATE, None)
    if down is not None and down_state is not None:
        down.down.load_state(down_state)
    for k, v in state.items():
        setattr(inner, k, v)


def to_plain(value: Any) -> Any:
    """``value`` with every Flower ArrayRecord as a tagged dict of tensors (checkpointable)."""
    if isinstance(value, ArrayRecord):
        return {ARRAYS_TAG: value.to_torch_state_dict()}
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value


def from_plain(value: Any) -> Any:
    """The inverse of :func:`to_plain`."""
    if isinstance(value, dict):
        if set(value) == {ARRAYS_TAG}:
            return ArrayRecord(value[ARRAYS_TAG])
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [from_plain(v) for v in value]
    return value
