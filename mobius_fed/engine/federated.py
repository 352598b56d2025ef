"""The reference engine driven by a Flower strategy, exactly as the coordinator drives a ring.

``train_with_strategy`` runs ``Strategy.start`` over an in-process Grid whose P nodes are
the engine's P replicas: a train message loads the arrays it carries into that origin's
replica, the engine trains the round's steps (all origins together, as the ring does), and
each replica answers with its arrays. The strategy's server update (FedAvg, FedAvgM, …) is
therefore applied by the same Flower code as in a distributed run.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from typing import cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Strategy

from mobius_fed.config import TrainConfig
from mobius_fed.defences.secagg import MASKED, Round, SiteMasker
from mobius_fed.engine.reference import EvalResult, ReferenceEngine, StepResult
from mobius_fed.engine.rings import RingsEngine
from mobius_fed.er_sync import ER_DOWN, GROUP_DOWN, DownLink, take_down
from mobius_fed.messages import GROUP, GROUP_BASE, EvaluatedRecords
from mobius_fed.model import Replica
from mobius_fed.strategies import (
    STEP_END,
    STEP_START,
    DiLoCo,
    ErCodecRounds,
    ErDownRounds,
    TrainOrder,
    encode_delta,
    group_arrays,
    unwrapped,
    wrapper_of,
)
from mobius_fed.transport.flower_wire import (
    COORDINATOR_NODE_ID,
    RunGrid,
    rank_of_node,
    set_task_identity,
    worker_node_id,
)


def _arrays(replica: Replica) -> ArrayRecord:
    """What a worker sends for its replica: E/R, never its private home layer."""
    return ArrayRecord({k: v.detach().clone() for k, v in replica.shared_state_dict().items()})


class EngineGrid(RunGrid):
    """In-process nodes backed by one engine, one per site (replica averaging left to
    Flower); with R rings (a :class:`RingsEngine`) a node also sends and loads its F_i."""

    def __init__(self, engine: ReferenceEngine | RingsEngine) -> None:
        self.engine = engine
        self.steps: list[StepResult] = []
        self.evals: list[EvalResult] = []
        cfg = engine.cfg  # Secure Aggregation: each site masks its update as a worker does
        self.maskers = [SiteMasker(cfg, s) for s in range(cfg.P)] if cfg.privacy.er_secagg else None
        self.bases: dict[int, dict[str, torch.Tensor]] = {}  # R > 1, a ring codec: global F_i
        # what each node's last evaluate brought, for a train message that leaves it out
        self.evaluated = [EvaluatedRecords() for _ in range(cfg.workers)]
        # a down codec: what each site holds of the E/R (and F_i), as a worker keeps it
        er, group = cfg.sync.down_codec, cfg.ring_down_codec
        self.er_down = [DownLink(er) for _ in range(cfg.workers)] if er != "fp32" else None
        on = group != "fp32" and cfg.rings > 1
        self.group_down = [DownLink(group) for _ in range(cfg.workers)] if on else None

    def get_node_ids(self) -> Iterable[int]:
        return [worker_node_id(s) for s in range(self.engine.cfg.workers)]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("EngineGrid answers synchronously in send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("EngineGrid answers synchronously in send_and_receive")

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        # Node order (as the coordinator's grid replies), not Flower's sampling order.
        messages = sorted(messages, key=lambda m: m.metadata.dst_node_id)
        if not messages:
            return []
        ranks = [rank_of_node(msg.metadata.dst_node_id) for msg in messages]
        kind = messages[0].metadata.message_type
        conf = messages[0].content.config_records["config"]
        states = {}
        for msg, rank in zip(messages, ranks):
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            if kind == "train":  # the records its evaluate brought, as a worker takes them
                self.evaluated[rank].restore(msg)
            else:
                self.evaluated[rank].keep(msg)
            states[rank] = state = self._received(msg, rank, "arrays")
            self._load_er(kind, rank, state)
            if GROUP in msg.content and isinstance(self.engine, RingsEngine):
                group = self._received(msg, rank, GROUP)
                self.bases[rank] = load_group(self.engine, rank, ArrayRecord(group))
            if GROUP_BASE in msg.content:
                self.bases[rank] = self._received(msg, rank, GROUP_BASE)
        replies = []
        if kind == "train":
            start, end = int(cast(int, conf[STEP_START])), int(cast(int, conf[STEP_END]))
            assert self.engine.step == start, (self.engine.step, start)
            results = [self.engine.train_step() for _ in range(start, end)]
            self.steps.extend(results)
            for msg, rank in zip(messages, ranks):
                losses = [r.origin_losses[rank] for r in results]
                metrics = MetricRecord(
                    {
                        "num-examples": results[0].tokens // self.engine.cfg.workers * len(results),
                        "loss": losses[-1],
                        "losses": losses,
                    }
                )
                update = self._update(rank, msg.content.array_records["arrays"], conf)
                if TrainOrder.of(conf).ring_sync and isinstance(self.engine, RingsEngine):
                    group, codec = self.engine.group(rank), self.engine.cfg.ring_codec
                    update[GROUP] = (
                        group_arrays(group)
                        if codec == "none"
                        else encode_delta(group, self.bases[rank], codec)
                    )
                replies.append(self._reply(msg, RecordDict({**update, "metrics": metrics})))
        else:
            ev = self._evaluate(states)
            self.evals.append(ev)
            for msg, rank in zip(messages, ranks):
                metrics = MetricRecord({"num-examples": 1, "eval-loss": ev.origin_losses[rank]})
                replies.append(self._reply(msg, RecordDict({"metrics": metrics})))
        set_task_identity(COORDINATOR_NODE_ID)
        return replies

    def _received(self, msg: Message, rank: int, key: str) -> dict[str, torch.Tensor]:
        """The arrays record ``key`` of ``msg`` as site ``rank`` takes it (with a down
        codec, what it holds after the broadcast, decoded by its DownLink as a worker's)."""
        record = msg.content.array_records[key]
        links = self.er_down if key == "arrays" else self.group_down
        if links is None:
            return record.to_torch_state_dict()
        keys = ER_DOWN if key == "arrays" else GROUP_DOWN
        conf = msg.content.config_records["config"]
        if key == "arrays":  # the tensors this site holds, as a worker checks them
            own = set(self.engine.replicas[rank].shared_state_dict())
        else:  # a group sync: only rings of rings send one
            assert isinstance(self.engine, RingsEngine)
            own = set(dict(self.engine.group(rank).named_parameters()))
        return take_down(links[rank], record, conf, keys, own)

    def _load_er(self, kind: str, rank: int, state: Mapping[str, torch.Tensor]) -> None:
        """A message's E/R for site ``rank``, taken as a worker takes it: loaded, or under a
        sync codec or delay by the site's ErSite (train; evaluate: :meth:`_evaluate`)."""
        engine = self.engine
        if not engine.cfg.sync.on_sites:
            engine.replicas[rank].load_shared_state_dict(dict(state))
        elif kind == "train":
            engine.er_sites[rank].start_round(engine.replicas[rank].shared_state_dict(), state)

    def _evaluate(self, states: Mapping[int, Mapping[str, torch.Tensor]]) -> EvalResult:
        engine = self.engine
        if not engine.cfg.sync.on_sites:
            return engine.evaluate()
        with ExitStack() as stack:  # the global E/R; with τ = 1 each site's own comes back
            for rank, state in states.items():
                site, replica = engine.er_sites[rank], engine.replicas[rank]
                stack.enter_context(site.evaluating(replica.shared_state_dict(), state))
            return engine.evaluate()

    def _update(self, rank: int, start: ArrayRecord, conf: ConfigRecord) -> dict[str, ArrayRecord]:
        """What site ``rank`` sends: its E/R arrays (under a sync codec or delay, what its
        ErSite sends), or with SecAgg only its masked update."""
        engine = self.engine
        if engine.cfg.sync.on_sites:  # τ = 1 merges first; a codec sends payloads
            arrays = engine.er_sites[rank].end_round(engine.replicas[rank].shared_state_dict())
        else:
            arrays = _arrays(engine.replicas[rank])
        if self.maskers is None:
            return {"arrays": arrays}
        order = Round.of(conf, self.engine.cfg.P)
        return {MASKED: self.maskers[rank].masked(arrays, start, order)}

    @staticmethod
    def _reply(msg: Message, content: RecordDict) -> Message:
        set_task_identity(msg.metadata.dst_node_id)
        return Message(content, reply_to=msg)


def load_group(engine: RingsEngine, site: int, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """Load the synced F_i a ring sync sent site ``site`` (cast as a worker casts); return it."""
    state = arrays.to_torch_state_dict()
    own = dict(engine.group(site).named_parameters())
    if set(state) != set(own):
        raise ValueError(f"group arrays for site {site}: names differ from F_{site % engine.cfg.P}")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(state[name])
    return state


def check_sync_strategy(cfg: TrainConfig, strategy: Strategy) -> None:
    """The strategy must decode the E/R codec and take the outer step the config names, as
    the coordinator's does (else payload bytes would be averaged as numbers)."""
    codec = getattr(wrapper_of(strategy, ErCodecRounds), "codec", "none")
    if codec != cfg.sync.codec:
        raise ValueError(
            f"the config's sync codec is {cfg.sync.codec!r}, the strategy decodes {codec!r}: "
            "build it with make_strategy(..., er_codec=cfg.sync.codec), as the coordinator does"
        )
    down = wrapper_of(strategy, ErDownRounds)
    down_codec = "fp32" if down is None else down.down.codec.name
    if down_codec != cfg.sync.down_codec:
        raise ValueError(
            f"the config's sync down codec is {cfg.sync.down_codec!r}, the strategy sends "
            f"{down_codec!r}: build it with make_strategy(..., er_down_codec="
            "cfg.sync.down_codec), as the coordinator does"
        )
    if cfg.sync.outer == "diloco" and not isinstance(unwrapped(strategy), DiLoCo):
        raise ValueError(
            "the config's sync outer step is diloco, the strategy is "
            f"{type(unwrapped(strategy)).__name__}: build it from sync_strategy(name, options, "
            "cfg), as the coordinator does"
        )


def train_with_strategy(engine: ReferenceEngine | RingsEngine, strategy: Strategy) -> EngineGrid:
    """Train ``engine`` to ``cfg.steps`` with ``strategy`` doing every replica average."""
    engine.average_replicas = False  # averaging is the strategy's job here
    if engine.cfg.privacy.er_noise > 0 and getattr(strategy, "er_privacy", None) is None:
        raise ValueError(
            "the config adds E/R noise (privacy.er_noise) but the strategy has no er_privacy: "
            "build it with make_strategy(..., er_privacy=ErPrivacy.of(cfg)), as the "
            "coordinator does"
        )
    secagg = getattr(strategy, "secagg", None)
    if engine.cfg.privacy.er_secagg and secagg is None:
        raise ValueError(
            "the config turns on Secure Aggregation (privacy.er_secagg) but the strategy has "
            "no secagg: build it with make_strategy(..., secagg=SecAgg.of(cfg)), as the "
            "coordinator does"
        )
    check_sync_strategy(engine.cfg, strategy)
    set_task_identity(COORDINATOR_NODE_ID)
    grid = EngineGrid(engine)
    # The coordinator's relay; one attempt, no incidents here.
    if grid.maskers is not None and secagg is not None:
        secagg.relay([m.keys.public for m in grid.maskers], "reference")
    strategy.start(
        grid=grid,
        initial_arrays=_arrays(engine.replicas[0]),
        # Ignored: `plan` is set on the strategy make_strategy builds, not on Flower's class.
        num_rounds=strategy.plan.num_rounds - getattr(strategy, "round_offset", 0),  # type: ignore[attr-defined]
        train_config=ConfigRecord(),
        evaluate_config=ConfigRecord(),
    )
    return grid
