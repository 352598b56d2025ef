"""Robust aggregation across rings (docs/rings.md "Robust aggregation across rings").

At a ring sync each group F_i comes back from the R rings, and :class:`RingAggregate`
combines the R records (F_i itself or, with a ring codec, its decoded pseudo-gradient)
before the outer step: ``mean`` is Flower's weighted average, as it always was; ``median``,
``trimmed`` and ``krum`` hand the records, as train replies, to the ``aggregate_train`` of
Flower's own FedMedian (the coordinate-wise median), FedTrimmedAvg (the coordinate-wise
mean after cutting int(beta·R) values off each end) or Krum (the one record with the least
summed squared distance to its R − f − 2 nearest others), so that one ring that sends a
poisoned F_i does not steer the synced group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Krum
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from mobius_fed.config import ConfigError, ring_aggregate_problem
from mobius_fed.messages import ARRAYS, METRICS
from mobius_fed.transport.flower_wire import COORDINATOR_NODE_ID, set_task_identity

WEIGHT = "num-examples"
ROBUST: dict[str, type[FedAvg]] = {"median": FedMedian, "trimmed": FedTrimmedAvg, "krum": Krum}


@dataclass(frozen=True)
class RingAggregate:
    """How a ring sync combines one group's R records, each a RecordDict of ``ARRAYS`` and
    a ``METRICS`` record with the ring's ``num-examples`` (the robust aggregates are
    unweighted, as Flower's are). Refuses what :func:`ring_aggregate_problem` refuses."""

    kind: str = "mean"
    rings: int = 1
    trim: float = 0.34  # trimmed: Flower's beta
    krum_f: int = 1  # krum: Flower's num_malicious_nodes

    def __post_init__(self) -> None:
        if self.kind != "mean" and self.kind not in ROBUST:
            raise ConfigError(
                f"ring_aggregate={self.kind!r}: expected mean or one of {', '.join(ROBUST)}"
            )
        if why := ring_aggregate_problem(self.kind, self.rings, self.trim, self.krum_f):
            raise ConfigError(why)

    def flower(self) -> FedAvg:
        """The Flower strategy whose ``aggregate_train`` combines the records."""
        nodes = ("min_train_nodes", "min_evaluate_nodes", "min_available_nodes")
        options: dict[str, Any] = dict.fromkeys(nodes, self.rings)
        if self.kind == "trimmed":
            options["beta"] = self.trim
        if self.kind == "krum":
            options["num_malicious_nodes"] = self.krum_f
        return ROBUST[self.kind](**options)

    def __call__(self, server_round: int, records: list[RecordDict]) -> ArrayRecord:
        """The records' aggregate (the records themselves are left as they came)."""
        if len(records) != self.rings:
            raise ValueError(f"a ring sync combines {self.rings} records, got {len(records)}")
        if self.kind == "mean":
            return aggregate_arrayrecords(records, WEIGHT)
        set_task_identity(COORDINATOR_NODE_ID)  # Flower's Message needs it; this is the server
        arrays, _ = self.flower().aggregate_train(server_round, [_reply(r) for r in records])
        if arrays is None:
            raise ValueError(f"round {server_round}: Flower's {self.kind} returned no arrays")
        return arrays


def _reply(record: RecordDict) -> Message:
    """``record`` as a train reply for Flower's ``aggregate_train``: its arrays in a record
    of their own (FedMedian pops them from the one it reads) and its weight alone."""
    arrays = ArrayRecord(array_dict=dict(record.array_records[ARRAYS].items()))
    weight = MetricRecord({WEIGHT: record.metric_records[METRICS][WEIGHT]})
    content = RecordDict({ARRAYS: arrays, METRICS: weight})
    return Message(content, COORDINATOR_NODE_ID, MessageType.TRAIN)
