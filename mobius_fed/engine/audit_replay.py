"""Audits by recomputation: one site's block group replayed on the frames it received
(docs/audits.md).

A worker's sent frames are a deterministic function of its group's state at the start of a
step and the frames it received in it: :class:`GroupReplay` runs the applications of
worker ``rank`` in the executor's order (forward in schedule order, backward in reverse,
then the group's optimizer step; :class:`~mobius_fed.worker.executor.RingExecutor`), with
the same modules and the same functions, so on CPU kernels it produces the very tensors
an honest site sent. What depends on the site's private data (its embedding's slot 0 and
its head's gradient) is not replayed: the frames the group computes are.

Frames are named as in a commitment: (step, phase, direction, origin, slot, micro)
(:data:`~mobius_fed.transport.commitments.Frame`).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mobius_fed import schedule
from mobius_fed.config import TrainConfig
from mobius_fed.defences.nopeek import build_nopeek
from mobius_fed.engine.hops import build_hops
from mobius_fed.engine.stream import StreamMaps
from mobius_fed.engine.wire_stages import codecs
from mobius_fed.model import build_group
from mobius_fed.model.training import make_optimizers, scale_grads, step_optimizers
from mobius_fed.transport.codec import (
    FrameError,
    TensorAssembler,
    decode_tensor,
    encode_tensor,
    parse_frame,
)
from mobius_fed.transport.commitments import BACKWARD, FORWARD, TRAIN, Frame

__all__ = [
    "GroupReplay",
    "decode_frame",
    "initial_state",
    "load_state",
    "on_wire",
    "state_bytes",
    "state_digest",
    "unauditable",
]


def unauditable(cfg: TrainConfig, rank: int = 0) -> str | None:
    """Why a site of ``cfg`` cannot be audited by recomputation (None: it can)."""
    if cfg.device != "cpu":  # "auto" too: each site resolves it on its own machine
        return f"device {cfg.device!r}: GPU kernels need a tolerance (not calibrated yet)"
    if cfg.subspace.on:
        return "a subspace or bottleneck mode (its maps read the site's replica)"
    if build_nopeek(cfg) is not None:
        return "NoPeek (its penalty is computed from the site's own data)"
    if build_hops(cfg, "ring", rank):
        return "hop stages (a lossy wire codec, noise) keep state or draw noise per site"
    return None


# ----------------------------------------------------------------------- state


def state_digest(state: Any) -> str:
    """The sha256 of a (nested) state dict: keys in order, each tensor's dtype, shape and
    bytes, each other value's repr. Equal states, equal digests, in any process."""
    h = hashlib.sha256()
    _fold(h, state)
    return h.hexdigest()


def _fold(h: Any, value: Any) -> None:
    if isinstance(value, Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        h.update(f"D{len(value)}".encode())
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _fold(h, value[k])
    elif isinstance(value, list | tuple):
        h.update(f"L{len(value)}".encode())
        for v in value:
            _fold(h, v)
    else:
        h.update(f"V{value!r}".encode())


def initial_state(cfg: TrainConfig, rank: int) -> dict[str, Any]:
    """Worker ``rank``'s group state before step 0, rebuilt from the run's seed."""
    group = build_group(cfg.model(), rank, cfg.seed)
    opts = make_optimizers(group, cfg, blocks=True)
    return {"group": group.state_dict(), "group_opts": [o.state_dict() for o in opts]}


def state_bytes(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def load_state(data: bytes) -> dict[str, Any]:
    """A state uploaded by a site: tensors and plain values only (never code)."""
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError("an uploaded state must be a dict")
    return state


# ---------------------------------------------------------------------- frames


def _shape(cfg: TrainConfig) -> tuple[int, ...]:
    mc = cfg.model()
    return (cfg.batch_size // cfg.micro_batches, mc.seq_len, mc.subspace_rank or mc.d_model)


def decode_frame(cfg: TrainConfig, frame: Frame, pieces: list[bytes]) -> Tensor:
    """The tensor of frame ``frame`` from its pieces as they went on the wire; raises
    :class:`FrameError` when they are not one whole, valid frame of that key."""
    codec = codecs(cfg)[0 if frame[2] == FORWARD else 1]
    asm = TensorAssembler(_shape(cfg), cfg.wire_dtype, codec=codec)
    out = None
    for k, data in enumerate(pieces):
        msg, payload = parse_frame(data)
        head = (msg.step, msg.phase, msg.direction, msg.origin, msg.tick, msg.micro)
        if head != frame:
            raise FrameError(f"piece {k} is of frame {head}, not {frame}")
        if out is not None:
            raise FrameError(f"piece {k} comes after the frame was whole")
        out = asm.add(frame, msg, data=payload)
    if out is None:
        raise FrameError("the pieces do not make a whole frame")
    return out


def on_wire(cfg: TrainConfig, t: Tensor) -> Tensor:
    """``t`` as its receiver decodes it (the run's wire dtype, lossless codecs)."""
    wire = cfg.wire_dtype
    return decode_tensor(encode_tensor(t, wire), expected_shape=tuple(t.shape), expected_dtype=wire)


# ---------------------------------------------------------------------- replay


class GroupReplay:
    """Worker ``rank``'s block group and its optimizers, from ``state`` (``{"group":
    …, "group_opts": […]}``, what :meth:`RingExecutor.group_state` returns)."""

    def __init__(self, cfg: TrainConfig, rank: int, state: dict[str, Any]) -> None:
        why = unauditable(cfg, rank)
        if why is not None:
            raise ValueError(f"worker {rank} cannot be replayed: {why}")
        self.cfg, self.rank = cfg, rank
        self.group = build_group(cfg.model(), rank, cfg.seed)
        self.opts = make_optimizers(self.group, cfg, blocks=True)
        self.group.load_state_dict(state["group"])
        if len(state["group_opts"]) != len(self.opts):
            raise ValueError("the state's optimizers are not the group's")
        for opt, sd in zip(self.opts, state["group_opts"]):
            opt.load_state_dict(sd)
        self.maps = StreamMaps(cfg, torch.device("cpu"))
        self.paths = [schedule.path(cfg.order, s, cfg.P, cfg.loops) for s in range(cfg.P)]
        ticks = schedule.worker_schedule(cfg.order, rank, cfg.P, cfg.loops)
        self.applications = [(t, s, m) for t, s in ticks for m in range(cfg.micro_batches)]

    def state(self) -> dict[str, Any]:
        return {
            "group": self.group.state_dict(),
            "group_opts": [o.state_dict() for o in self.opts],
        }

    def from_home(self, frame: Frame) -> bool:
        """Whether ``frame`` passes from this worker's home to its own group without a
        hop (its embedding's slot 0, or its head's gradient): what an upload may give
        as it is; every other frame it takes in must have come off the wire."""
        _, phase, direction, s, slot, _ = frame
        if phase != TRAIN or s != self.rank:
            return False
        if direction == FORWARD:
            return slot == 0 and self._dest(FORWARD, s, 0) == self.rank
        return slot == self.cfg.K and self._dest(BACKWARD, s, slot) == self.rank

    def _dest(self, direction: int, s: int, slot: int) -> int:
        path = self.paths[s]
        if direction == FORWARD:
            return schedule.consumer(path, s, slot)
        return schedule.producer(path, s, slot)

    def step(self, n: int, received: Callable[[Frame], Tensor]) -> dict[Frame, Tensor]:
        """Replay train step ``n``: ``received(frame)`` gives each frame this worker took
        in (from its ring links, or its own embedding's slot 0); the frames its group
        computed that left the worker, each as its receiver decoded it."""
        cfg, rank, M = self.cfg, self.rank, self.cfg.micro_batches
        local: dict[Frame, Tensor] = {}
        sent: dict[Frame, Tensor] = {}

        def emit(direction: int, s: int, slot: int, m: int, tensor: Tensor) -> None:
            frame = (n, TRAIN, direction, s, slot, m)
            if self._dest(direction, s, slot) == rank:
                local[frame] = tensor
            else:
                sent[frame] = on_wire(cfg, tensor)

        def take(frame: Frame) -> Tensor:
            return local.pop(frame) if frame in local else received(frame)

        saved: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}
        self.group.train()
        for t, s, m in self.applications:
            inp = take((n, TRAIN, FORWARD, s, t, m)).detach().clone().requires_grad_()
            out = self.maps.apply(self.group, inp, t, rank, s, None)
            saved[t, s, m] = (inp, out)
            emit(FORWARD, s, t + 1, m, out.detach())
        for t, s, m in reversed(self.applications):
            inp, out = saved.pop((t, s, m))
            out.backward(self.maps.grad_in(take((n, TRAIN, BACKWARD, s, t + 1, m))))
            assert inp.grad is not None
            emit(BACKWARD, s, t, m, self.maps.grad_out(inp.grad))
        scale_grads(self.group.parameters(), 1.0 / (cfg.P * M))
        step_optimizers(self.opts, cfg, n)
        return sent
