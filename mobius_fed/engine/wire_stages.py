"""Lossy wire codecs as hop stages (see :mod:`mobius_fed.hop`; docs/architecture.md §6.1,
docs/wan.md §2 "Exactness").

:class:`CodecStage` applies ``decode(encode(x))`` on every remote hop (``ctx.remote``); on a
ring worker it also keeps the encoded payload by hop, so the executor ships exactly those
bytes (:meth:`CodecStage.take_payload`).
"""

from __future__ import annotations

import threading
import zlib
from typing import TYPE_CHECKING

from torch import Tensor

from mobius_fed.transport.compress import Codec

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig
    from mobius_fed.hop import Engine, HopContext, HopStage


def codecs(cfg: TrainConfig) -> tuple[Codec, Codec]:
    """The (forward, backward) codecs of ``cfg``."""
    w = cfg.wire
    sr = w.rounding == "stochastic"
    ids = cfg.subspace.on and cfg.subspace.mode == "tokens"  # forward slots end in token ids
    return Codec(w.fwd, w.group, w.rank, sr, ids), Codec(w.bwd, w.group, w.rank, sr)


def hop_seed(seed: int, ctx: HopContext) -> int:
    """The stochastic-rounding seed of one hop: a pure function of run seed and hop."""
    key = f"{seed}|{ctx.phase}|{ctx.direction}|{ctx.step}|{ctx.s}|{ctx.slot}|{ctx.m}"
    return zlib.crc32(key.encode())


class CodecStage:
    """decode(encode(·)) of the direction's codec on remote hops."""

    def __init__(self, fwd: Codec, bwd: Codec, keep_payloads: bool, seed: int = 0) -> None:
        self.fwd, self.bwd, self.keep, self.seed = fwd, bwd, keep_payloads, seed
        self._payloads: dict[HopContext, tuple[Tensor, Tensor]] = {}
        self._lock = threading.Lock()

    def _apply(self, codec: Codec, x: Tensor, ctx: HopContext) -> Tensor:
        if codec.lossless or not ctx.remote:
            return x
        payload = self.encode(ctx, x)
        out = codec.decode(payload, tuple(x.shape)).to(device=x.device, dtype=x.dtype)
        if self.keep:
            with self._lock:
                self._payloads[ctx] = (out, payload)
        return out

    def encode(self, ctx: HopContext, x: Tensor) -> Tensor:
        """The payload of ``x`` at hop ``ctx`` (its direction's codec, its seed)."""
        codec = self.fwd if ctx.direction == "forward" else self.bwd
        return codec.encode(x, hop_seed(self.seed, ctx))

    def forward(self, h: Tensor, ctx: HopContext) -> Tensor:
        return self._apply(self.fwd, h, ctx)

    def backward(self, g: Tensor, ctx: HopContext) -> Tensor:
        return self._apply(self.bwd, g, ctx)

    def take_payload(self, ctx: HopContext, sent: Tensor) -> Tensor | None:
        """The payload encoded at hop ``ctx`` if ``sent`` is still the tensor it decoded
        to (no later stage changed it), else None; forgotten either way."""
        with self._lock:
            kept = self._payloads.pop(ctx, None)
        if kept is None or kept[0] is not sent:
            return None
        return kept[1]

    def forget(self) -> None:
        """Drop every kept payload (a step abandoned before they were sent)."""
        with self._lock:
            self._payloads.clear()


def build_stages(cfg: TrainConfig, engine: Engine, rank: int | None) -> list[HopStage]:
    """The codec stage ``cfg`` selects (none when both directions are ``none``)."""
    del rank
    fwd, bwd = codecs(cfg)
    if fwd.lossless and bwd.lossless:
        return []
    return [CodecStage(fwd, bwd, keep_payloads=engine == "ring", seed=cfg.seed)]
