"""The private layers of each site: the home layer (``TrainConfig.privacy.home_layer``)
and its twin on the input side, the input layer (``privacy.home_input``).

Site s's replica carries a layer applied to the final hidden state before the shared
head R. It is drawn from a generator keyed by the site's secret (``noise_key_dir``; the
public seed without one, which any worker can recompute) and origin s, trained on s's own
loss, and neither averaged nor sent: the worker before the home receives the gradient
through a function it does not know.

The input layer is drawn the same way (its own label) and applied by the replica's
``embed`` to E(x) before the origin's first block group, so the first hidden state that
leaves home, and every later one, is a function of x through a layer no other worker holds.

Both engines build their replicas with :func:`build_site_replica` (the reference engine
reads every site's key, a ring worker only its own), so they hold identical layers. The
module sits below both engines: it builds replicas, never an engine.
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
