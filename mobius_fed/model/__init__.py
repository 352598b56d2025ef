"""Modded GPT-2 split into block groups F_i with an embedding/head replica (E, R).

The torch modules load on first use, so that code which only needs the configuration
(the coordinator, the CLI) does not import torch."""

from __future__ import annotations

import importlib

from mobius_fed.model.config import PRESETS, ModelConfig, make_model_config

_NAMES = {  # module (importing torch) → the names it defines
    "group": ("BlockGroup",),
    "replica": ("Replica", "is_private"),
    "groups": ("build_group", "build_replica", "count_parameters"),
}
_LAZY = {name: module for module, names in _NAMES.items() for name in names}
__all__ = ["PRESETS", "ModelConfig", "make_model_config", *sorted(_LAZY)]


def __getattr__(name: str):
    """The torch-backed names of the package, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"mobius_fed.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
