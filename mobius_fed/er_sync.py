"""The E/R round's math at each site and its decoding at the coordinator (``TrainConfig.sync``;
docs/er-sync.md).

One :class:`ErSite` per site runs in the worker and, one per origin, in the reference
engine, so a ring and the reference compute every E/R value by the same code:

- **codec** (``sync.codec``): the site sends its pseudo-gradient δ = G − θ (G: the global
  E/R its round started from, θ: its replica) as the codec's ``uint8`` payload; the
  coordinator rebuilds θ̂ = G − decode(payload) (:func:`decode_er`) and the Flower strategy
  averages the θ̂ as it would the replicas (FedAvg; DiLoCo steps on G − mean θ̂).
- **error feedback** (``sync.error_feedback``): the site keeps e = (δ + e) − decode(payload)
  and adds it into its next δ; nothing rounded away is lost, only delayed.
- **delay** τ = 1 (``sync.delay``): a site does not load the global E/R when a round
  starts; it trains on from its own replica and, at the end of round r + 1, applies the
  change the round-r average made to what it sent: θ ← θ + (G(r) − θ_sent(r)). The merged
  θ is what it sends at that barrier (θ_sent(r + 1)). So G(r + 1) = G(r) + mean of the
  sites' round-(r + 1) progress under FedAvg, one round late.

Residuals and θ_sent are part of the site's checkpoint state (:meth:`ErSite.state_dict`), so
a rollback or a resume continues bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import Tensor

from mobius_fed.config import SyncConfig
from mobius_fed.transport.compress import Codec

State = dict[str, Tensor]


def _clone(state: Mapping[str, Tensor]) -> State:
    return {k: v.detach().clone() for k, v in state.items()}


class ErSite:
    """One site's end of the E/R round (see the module docstring).

    ``shared`` arguments are the replica's ``shared_state_dict()``: tensors that share
    storage with its parameters, so writing into them writes the replica."""

    def __init__(self, sync: SyncConfig) -> None:
        self.codec = None if sync.codec == "none" else Codec(sync.codec)
        self.delay = sync.delay
        self.error_feedback = sync.error_feedback and self.codec is not None
        self.base: State | None = None  # G: the global E/R this round's message carried
        self.sent: State | None = None  # τ = 1: θ_sent of the last barrier
        self.residual: State | None = None  # error feedback: what the last payload lost

    def start_round(self, shared: Mapping[str, Tensor], global_er: Mapping[str, Tensor]) -> None:
        """A round's train message carries ``global_er`` (G, already validated): with τ = 0
        the replica takes it; with τ = 1 only the very first round does (then θ_sent = G)."""
        with torch.no_grad():
            self.base = {k: global_er[k].to(p.dtype).to(p.device) for k, p in shared.items()}
            if self.delay == 0 or self.sent is None:
                for name, p in shared.items():
                    p.copy_(self.base[name])
                if self.delay:
                    self.sent = _clone(self.base)

    def end_round(self, shared: Mapping[str, Tensor]) -> ArrayRecord:
        """The barrier: merge the late global change (τ = 1), then what leaves the site: the
        replica's arrays, or with a codec its pseudo-gradient's payloads."""
        if self.base is None:
            raise RuntimeError("an E/R round ended that never started (no global E/R sent)")
        base = self.base
        if self.delay:
            assert self.sent is not None  # set by the first start_round
            with torch.no_grad():
                for name, p in shared.items():  # θ ← θ + (G(r) − θ_sent(r))
                    p.add_(base[name] - self.sent[name])
            self.sent = _clone(shared)
        if self.codec is None:
            return ArrayRecord(_clone(shared))
        out, residual = {}, {}
        for name, p in shared.items():
            delta = base[name].detach().cpu().float() - p.detach().cpu().float()
            if self.residual is not None:
                delta = delta + self.residual[name]
            payload = self.codec.encode(delta)
            if self.error_feedback:
                residual[name] = delta - self.codec.decode(payload, tuple(delta.shape))
            out[name] = Array(payload.numpy())
        self.residual = residual or None
        return ArrayRecord(out)

    @contextmanager
    def evaluating(
        self, shared: Mapping[str, Tensor], global_er: Mapping[str, Tensor]
    ) -> Iterator[None]:
        """Evaluate with the global E/R loaded; with τ = 1 the site's own E/R comes back
        afterwards (it trains on from it)."""
        keep = _clone(shared) if self.delay else None
        with torch.no_grad():
            for name, p in shared.items():
                p.copy_(global_er[name])
        try:
            yield
        finally:
            if keep is not None:
                with torch.no_grad():
                    for name, p in shared.items():
                        p.copy_(keep[name])

    def state_dict(self) -> dict[str, State]:
        """What a checkpoint keeps: θ_sent (τ = 1) and the error-feedback residual."""
        out = {}
        if self.sent is not None:
            out["sent"] = _clone(self.sent)
        if self.residual is not None:
            out["residual"] = _clone(self.residual)
        return out

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        self.sent = _clone(state["sent"]) if "sent" in state else None
        self.residual = _clone(state["residual"]) if "residual" in state else None
        self.base = None


def payload_spec(spec: Mapping[str, tuple], codec: str) -> dict[str, tuple]:
    """The E/R reply's expected arrays with ``codec``: per tensor the codec's exact
    ``uint8`` payload (``spec``: names → (shape, dtype) of the replica's shared state)."""
    c = Codec(codec)
    return {n: ((c.payload_bytes(tuple(shape)),), "uint8") for n, (shape, _) in spec.items()}


def decode_er(record: ArrayRecord, sent: ArrayRecord, codec: str) -> ArrayRecord:
    """θ̂ = G − decode(payload) per tensor (G: the arrays the round was sent)."""
    c = Codec(codec)
    out = {}
    for name, a in record.items():
        g = sent[name].numpy()
        delta = c.decode(torch.from_numpy(a.numpy()), tuple(g.shape)).numpy()
        out[name] = Array(np.asarray(g - delta.astype(g.dtype, copy=False)))
    return ArrayRecord(out)


def record_bytes(record: ArrayRecord) -> int:
    """The exact bytes of a record's arrays (what crosses the wire, without framing)."""
    return sum(a.numpy().nbytes for a in record.values())


# ----------------------------------------------------------------- the way down
# In a train or evaluate config: the broadcast a down-codec record stands for (the global
# round of the arrays it brings), and the broadcast its payload is taken against (-1: the
# record is the held arrays themselves, in fp32). One pair of keys per way down (E/R, F_i).
ER_DOWN = ("er-down-round", "er-down-from")
GROUP_DOWN = ("group-down-round", "group-down-from")
FULL = -1


def add_down(held: Mapping[str, Tensor], payload: ArrayRecord, codec: Codec) -> State:
    """held + decode(payload), per tensor in fp32: the one sum both ends of the way down
    compute (so the coordinator's copy and every site's stay equal, bit for bit)."""
    out = {}
    for name, h in held.items():
        a = payload[name].numpy()
        out[name] = h + codec.decode(torch.from_numpy(np.array(a)), tuple(h.shape))
    return out


def _floats(record: ArrayRecord) -> State:
    return {k: torch.from_numpy(np.array(a.numpy(), dtype=np.float32)) for k, a in record.items()}


class DownLink:
    """One end of a compressed way down (``sync.down_codec``, ``ring_down_codec``;
    docs/er-sync.md).

    The coordinator's end keeps ``held``: exactly what every site holds after the last
    broadcast. A broadcast of the new global arrays x sends the codec's payload of x − held,
    and both ends set held ← held + decode(payload) (:func:`add_down`): what a payload
    rounded away stays in x − held and goes with the next broadcast (error feedback on the
    server). The first broadcast of a strategy (a fresh run, a rollback) sends held itself
    in fp32. A site's end (:meth:`receive`) keeps its held with the broadcast's round, so
    the same record seen twice (an evaluate, then the train message that leaves it out) is
    applied once, and a payload taken against another held is refused."""

    def __init__(self, codec: str) -> None:
        self.codec = Codec(codec)
        self.held: State | None = None
        self.round: int | None = None  # the broadcast ``held`` stands for
        self.record: ArrayRecord | None = None  # what that broadcast sent (one object)
        self.base = FULL  # the broadcast that record is taken against

    # ------------------------------------------------------------ coordinator
    def send(self, arrays: ArrayRecord, rnd: int, full: bool) -> tuple[ArrayRecord, int]:
        """The record for the broadcast of ``arrays`` (global round ``rnd``) and the round
        it is taken against (:data:`FULL`: it is held itself). The same round again gives
        the same object; ``full`` sends held in fp32 (the first message of a strategy)."""
        if self.held is None:
            self.held, self.record = _floats(arrays), None
        elif self.round != rnd:
            x = _floats(arrays)
            payload = ArrayRecord(
                {n: Array(self.codec.encode(x[n] - h).numpy()) for n, h in self.held.items()}
            )
            self.held = add_down(self.held, payload, self.codec)
            self.record, self.base = payload, FULL if self.round is None else self.round
        self.round = rnd
        if self.record is None or (full and self.base != FULL):
            self.record, self.base = ArrayRecord(_clone(self.held)), FULL
        assert self.record is not None
        return self.record, self.base

    def resend(self) -> tuple[ArrayRecord, int]:
        """held itself in fp32 (the broadcast of its round again)."""
        if self.held is None:
            raise ValueError("nothing was ever broadcast on this way down")
        if self.base != FULL or self.record is None:
            self.record, self.base = ArrayRecord(_clone(self.held)), FULL
        return self.record, FULL

    # ------------------------------------------------------------------ site
    def receive(self, record: ArrayRecord, rnd: int, base: int) -> State:
        """The held arrays after the broadcast of round ``rnd`` (``record``: held itself
        when ``base`` is :data:`FULL`, else a payload taken against round ``base``)."""
        if base == FULL:
            self.held = _floats(record)
        elif rnd != self.round:
            if self.held is None or self.round != base:
                raise ValueError(
                    f"a way-down payload of round {rnd} is taken against round {base}, this "
                    f"site holds round {self.round}: it cannot be decoded here"
                )
            self.held = add_down(self.held, record, self.codec)
        assert self.held is not None
        self.round = rnd
        return _clone(self.held)

    def forget(self) -> None:
        """A rollback: the next broadcast brings held itself."""
        self.held, self.round, self.record, self.base = None, None, None, FULL

    def state(self) -> dict:
        """The coordinator's end, for a checkpoint: held and its round."""
        return {"held": None if self.held is None else _clone(self.held), "round": self.round}

    def load_state(self, state: Mapping) -> None:
        held = state.get("held")
        self.held = None if held is None else _clone(held)
        self.round, self.record, self.base = state.get("round"), None, FULL


def take_down(
    link: DownLink, record: ArrayRecord, config: Mapping, keys: tuple[str, str], names: set[str]
) -> State:
    """A site's end of a way down: the held arrays after the broadcast a message's
    ``record`` and ``config`` (``keys``: :data:`ER_DOWN` or :data:`GROUP_DOWN`) bring; a
    record without its broadcast's names, or with other tensors than ``names``, is refused."""
    if keys[0] not in config or keys[1] not in config:
        raise ValueError(
            f"a {link.codec.name} way down, but the message names no broadcast ({keys[0]})"
        )
    if set(record.keys()) != names:
        raise ValueError(f"a way-down record with tensors {sorted(set(record.keys()) ^ names)}")
    return link.receive(record, int(config[keys[0]]), int(config[keys[1]]))
