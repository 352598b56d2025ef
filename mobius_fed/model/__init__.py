"""Modded GPT-2 split into block groups F_i with an embedding/head replica (E, R).

The torch modules load on first use, so that code which only needs the configuration
(the coordinator, the CLI) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mobius_fed.model.config import PRESETS, ModelConfig, make_model_config, pad_vocab

if TYPE_CHECKING:
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

_FROM_GROUPS = (
    "HOME_LAYERS",
    "BlockGroup",
    "HomeLayer",
    "Replica",
    "build_group",
    "build_replica",
    "count_parameters",
    "derive_seed",
    "is_private",
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


def __getattr__(name: str):
    if name in _FROM_GROUPS:
        return getattr(importlib.import_module("mobius_fed.model.groups"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
