"""Flower Messages on our control wire: serialization and the process's task identity."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as MessageProto
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from mobius_fed.transport.safe_arrays import validate_message_arrays

# Flower reserves node id 1 for the server side (SUPERLINK_NODE_ID); workers never get it.
COORDINATOR_NODE_ID = 1
FLOWER_RUN_ID = 1

# Flower Error codes in a worker's replies: what the coordinator does about them.
ERROR_INTERNAL = 1  # an incident: roll back and retry (counts against --max-incidents)
ERROR_RING = 2  # a ring edge is down: an incident naming the edge
ERROR_FATAL = 3  # retrying cannot help (a full disk): the run fails naming it


def worker_node_id(rank: int) -> int:
    """Flower node id of worker ``rank`` (1000 + rank, never 1)."""
    return 1000 + rank


def rank_of_node(node_id: int) -> int:
    return node_id - 1000


def set_task_identity(node_id: int) -> None:
    """Flower's Message constructor needs the process's run/node/task identity."""
    TaskIdentity.run_id = FLOWER_RUN_ID
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = 1


def message_to_bytes(message: Message) -> bytes:
    return message_to_proto(message).SerializeToString()


def message_from_bytes(data: bytes) -> Message:
    """Parse a Flower Message; every array in it must be a plain numeric ``.npy`` whose
    header matches its declaration (UnsafeArrayError otherwise; nothing is decoded)."""
    message = message_from_proto(MessageProto.FromString(data))
    if not message.has_error():  # an Error reply has no content
        validate_message_arrays(message)
    return message


class RunGrid(Grid):
    """The Grid methods every grid here shares: one run, plain Messages, nodes by id."""

    _run: Run | None = None  # each grid's own, made on first use

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        if self._run is None:
            self._run = Run.create_empty(FLOWER_RUN_ID)
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_nodes(self) -> Iterable[NodeInfo]:
        return [NodeInfo(node_id=n) for n in self.get_node_ids()]
