"""The private layers of each site: the home layer (``privacy.home_layer``, before the shared
head R) and the input layer (``privacy.home_input``, applied by the replica's ``embed`` to
E(x)); drawn from the site's key, trained on its own loss, never averaged or sent
(docs/privacy.md §3, §4b, §4f).

Both engines build replicas with :func:`build_site_replica` (the reference reads every site's
key, a worker only its own), so they hold identical layers. This module sits below both
engines: it builds replicas, never an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mobius_fed.defences.stages import NoiseKeys, keyed_digest
from mobius_fed.model import Replica, build_replica

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig
    from mobius_fed.hop import Engine


def _keyed_generator(cfg: TrainConfig, origin: int, engine: Engine, label: str) -> torch.Generator:
    """The generator of site ``origin``'s private layer ``label``, keyed by that site's secret."""
    keys = NoiseKeys(cfg, engine, origin if engine == "ring" else None)
    seed = keyed_digest(keys.key(origin), f"{cfg.seed}:{label}:{origin}") >> 1
    return torch.Generator().manual_seed(seed)


def build_site_replica(cfg: TrainConfig, origin: int, engine: Engine = "reference") -> Replica:
    """Origin ``origin``'s initial replica: the shared E/R and, when ``cfg`` asks for them,
    the site's private home and input layers, each drawn from its keyed generator (a
    frozen one takes no optimizer: it stays as drawn)."""
    pc = cfg.privacy
    replica = build_replica(cfg.model(), cfg.seed, pc.home_layer)
    if replica.home is not None:
        replica.reset_home(_keyed_generator(cfg, origin, engine, f"home-layer:{pc.home_layer}"))
        if not pc.home_layer_trained:
            replica.home.requires_grad_(False)
    if replica.home_input is not None:
        replica.reset_input(_keyed_generator(cfg, origin, engine, f"home-input:{pc.home_input}"))
        if not pc.home_input_trained:
            replica.home_input.requires_grad_(False)
    return replica
