"""A trained model as the research tools hold it: the run's config, its P block groups and
its P (E, R) replicas, however it was read (a reference-engine checkpoint, or a coordinated
run's manifest: :mod:`mobius_fed.research.manifest_model`)."""

from __future__ import annotations

from dataclasses import dataclass

from mobius_fed.config import TrainConfig
from mobius_fed.model import BlockGroup, Replica
from mobius_fed.model.config import ModelConfig


@dataclass
class Model:
    """A trained model: its config, P groups and P (E, R) replicas."""

    cfg: TrainConfig
    groups: list[BlockGroup]
    replicas: list[Replica]
    name: str = ""


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The run's ModelConfig including L and the loop knobs (which size a group)."""
    return cfg.model().model_copy(
        update={
            "loops": cfg.loops,
            "depth_embedding": cfg.knobs.depth_embedding,
            "residual_scale": cfg.knobs.residual_scale,
        }
    )
