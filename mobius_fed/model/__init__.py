"""Modded GPT-2 split into block groups F_i with an embedding/head replica (E, R).

The torch modules load on first use, so that code which only needs the configuration
(the coordinator, the CLI) does not import torch."""

from __future__ import annotations

import importlib

from mobius_fed.model.config import PRESETS, ModelConfig, make_model_config, pad_vocab

_FROM_GROUPS = frozenset(
    {
        "HOME_LAYERS",
        "BlockGroup",
        "HomeLayer",
        "Replica",
        "build_group",
        "build_replica",
        "count_parameters",
        "derive_seed",
        "is_private",
    }
)
__all__ = ["PRESETS", "ModelConfig", "make_model_config", "pad_vocab", *sorted(_FROM_GROUPS)]


def __getattr__(name: str):
    """The names of :mod:`mobius_fed.model.groups`, imported (with torch) on first use."""
    if name in _FROM_GROUPS:
        return getattr(importlib.import_module("mobius_fed.model.groups"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
