"""What a worker's reply (or heartbeat) must hold before the strategy or status sees it."""

from __future__ import annotations

import json
import math
from typing import Any

from flwr.app import Message

from mobius_fed.coordinator.grid import RunFailed
from mobius_fed.defences.secagg import SecAggError, check_masked
from mobius_fed.machines import REPORTED_STATES, EdgeState
from mobius_fed.messages import GROUP, OPTIONAL_FIGURES
from mobius_fed.proto import control_pb2
from mobius_fed.relay.plan import DIRECT, PATHS
from mobius_fed.transport.safe_arrays import UnsafeArrayError, validate_array_record
from mobius_fed.transport.tls import worker_identity


def validate_reply(
    rank: int, reply: Message, replica_spec: Any, secagg: Any = None, group_spec: Any = None
) -> None:
    """E/R arrays exactly the replica's names, shapes and dtypes (with ``secagg``, a train
    reply carries only the masked update instead); a ring sync's F_i exactly its group's
    (``group_spec(rank)``, R > 1; a group from a run without rings is refused); losses
    finite; the records each message type needs. RunFailed names the worker."""
    who = f"worker-{rank} ({worker_identity(rank)})"
    content = reply.content
    if secagg is not None and reply.metadata.message_type == "train":
        n = sum(math.prod(shape) for shape, _ in replica_spec.values())
        try:
            check_masked(rank, content, n, secagg.q)
        except SecAggError as exc:
            raise RunFailed(f"{who} sent an unusable train reply: {exc}") from None
    if "arrays" in content:
        try:
            validate_array_record(content["arrays"], expected=replica_spec)
        except UnsafeArrayError as exc:
            raise RunFailed(f"{who} sent bad arrays: {exc}") from None
    if GROUP in content:
        if group_spec is None:
            raise RunFailed(f"{who} sent a block group, but this run has one ring")
        try:
            validate_array_record(content[GROUP], expected=group_spec(rank))
        except UnsafeArrayError as exc:
            raise RunFailed(f"{who} sent a bad block group: {exc}") from None
    problem = reply_problem(reply.metadata.message_type, content)
    if problem:
        raise RunFailed(f"{who} sent an unusable {reply.metadata.message_type} reply: {problem}")


def in_range(v: Any, top: float) -> bool:
    """A number (not a bool) in [0, top): NaN and ±inf fail the comparison."""
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < top


def reply_problem(kind: str, content: Any) -> str | None:
    """Why a worker's reply of message type ``kind`` is unusable (None: it is fine)."""
    try:
        if kind == "train":
            m = content["metrics"]
            losses = list(m["losses"])
            if not losses or not all(in_range(v, 1e4) for v in losses):
                return "losses must be a non-empty list of finite losses in [0, 1e4)"
            if not float(m["num-examples"]) > 0 or not float(m["train-seconds"]) >= 0:
                return "num-examples must be > 0 and train-seconds ≥ 0"
            for key in OPTIONAL_FIGURES:
                if key in m and not in_range(m[key], 1e18):
                    return f"{key} must be a finite number ≥ 0"
        elif kind == "evaluate":
            if not in_range(content["metrics"]["eval-loss"], 1e4):
                return "eval-loss must be a finite loss in [0, 1e4)"
        elif kind == "query.state":
            rounds = list(content["config"]["rounds"])
            if not all(isinstance(r, int) and r >= 0 for r in rounds):
                return "rounds must be non-negative integers"
        elif kind == "query.restore":
            if not isinstance(content["config"]["ok"], bool):
                return "ok must be a boolean"
            str(content["config"]["reason"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"missing or malformed field ({exc!r})"
    return None


_EDGE_NUMBERS = (
    ("reconnects", 1e9),
    ("down_s", 1e9),
    ("tunnel_bytes", 1e18),
    ("tunnel_bytes_per_s", 1e12),
)


def heartbeat_problem(request: control_pb2.HeartbeatRequest, steps: int) -> str | None:
    """Why a heartbeat cannot go into status or metrics (None: it can)."""
    if request.state and request.state not in REPORTED_STATES:
        return f"state {request.state[:40]!r} (expected one of {', '.join(REPORTED_STATES)})"
    if request.step > steps:
        return f"step {request.step} (the run has {steps} steps)"
    if request.step and not in_range(request.last_loss, 1e4):
        return f"last_loss {request.last_loss!r} (expected a finite loss in [0, 1e4))"
    if not in_range(request.tokens_per_s, 1e12):
        return f"tokens_per_s {request.tokens_per_s!r} (expected finite, in [0, 1e12))"
    if request.links_json:
        if len(request.links_json) > 4096:
            return "links_json longer than 4096 characters"
        try:
            links = json.loads(request.links_json)
        except ValueError:
            return "links_json is not JSON"
        if not isinstance(links, dict) or not set(links) <= {"in", "out"}:
            return "links_json must be an object with 'in' and/or 'out'"
        for side, edge in links.items():
            if not isinstance(edge, dict) or edge.get("state", "unknown") not in tuple(EdgeState):
                return f"links_json.{side}: unknown state"
            if edge.get("path", DIRECT) not in PATHS:  # reachability (relay/plan.py)
                return f"links_json.{side}.path: {str(edge.get('path'))[:20]!r}"
            for key, top in _EDGE_NUMBERS:
                v = edge.get(key, 0)
                if not in_range(v, top):
                    return f"links_json.{side}.{key}: {v!r}"
    return None
