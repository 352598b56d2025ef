"""Privacy defences applied at ring hops (see :mod:`mobius_fed.engine.hops`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig
    from mobius_fed.engine.hops import Engine, HopStage


def build_stages(cfg: TrainConfig, engine: Engine, rank: int | None) -> list[HopStage]:
    """The defence stages ``cfg`` turns on (none yet)."""
    del cfg, engine, rank
    return []
