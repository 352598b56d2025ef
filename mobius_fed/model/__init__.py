"""Modded GPT-2 split into block groups F_i with an embedding/head replica (E, R)."""

from mobius_fed.model.config import PRESETS, ModelConfig, make_model_config, pad_vocab
from mobius_fed.model.groups import (
    HOME_LAYERS,
    BlockGroup,
    HomeLayer,
    Replica,
    build_group,
    build_replica,
    count_parameters,
    derive_seed,
    is_private,
)

__all__ = [
    "HOME_LAYERS",
    "PRESETS",
    "BlockGroup",
    "HomeLayer",
    "ModelConfig",
    "Replica",
    "build_group",
    "build_replica",
    "count_parameters",
    "derive_seed",
    "is_private",
    "make_model_config",
    "pad_vocab",
]
