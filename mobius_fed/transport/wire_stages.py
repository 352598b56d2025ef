"""Lossy wire codecs as hop stages (see :mod:`mobius_fed.engine.hops`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig
    from mobius_fed.engine.hops import Engine, HopStage


def build_stages(cfg: TrainConfig, engine: Engine, rank: int | None) -> list[HopStage]:
    """The codec stages ``cfg`` selects (none yet: fp32/bf16/fp16 are cast in the link)."""
    del cfg, engine, rank
    return []
