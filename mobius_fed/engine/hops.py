"""The hop stages of one engine (contract: :mod:`mobius_fed.hop`): the defences of
:mod:`mobius_fed.defences.stages`, then the wire codecs of
:mod:`mobius_fed.engine.wire_stages`. Both engines build theirs here, so they apply
the same stages in the same order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mobius_fed.defences.stages import build_stages as defence_stages
from mobius_fed.engine.wire_stages import build_stages as wire_stages
from mobius_fed.hop import Engine, Hops

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig


def build_hops(cfg: TrainConfig, engine: Engine, rank: int | None = None) -> Hops:
    """The hop stages of ``cfg`` for the reference engine or ring worker ``rank``."""
    return Hops([*defence_stages(cfg, engine, rank), *wire_stages(cfg, engine, rank)])
