"""The private home layer in an engine: which replicas carry it, and giving it to them.

``TrainConfig.privacy.home_layer`` asks for the layer; a replica gets it from
``build_replica(..., home_layer=...)`` or from its model configuration's ``home_layer``.
:func:`ensure_home_layers` gives a reference engine's replicas the layer when the engine
built them without it, before the first step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mobius_fed.model import build_replica
from mobius_fed.model.training import make_optimizers

if TYPE_CHECKING:
    from mobius_fed.engine.reference import ReferenceEngine


def has_home_layer(engine: ReferenceEngine) -> bool:
    return all(r.home_layer == engine.cfg.privacy.home_layer for r in engine.replicas)


def ensure_home_layers(engine: ReferenceEngine) -> None:
    """Rebuild the replicas (and their optimizers) of an engine that has not stepped yet
    with the home layer of its configuration; a no-op when they already have it."""
    cfg = engine.cfg
    if has_home_layer(engine):
        return
    if engine.step != 0:
        raise RuntimeError("the home layer can only be added before the first step")
    kind = cfg.privacy.home_layer
    engine.replicas = [
        build_replica(cfg.model(), cfg.seed, kind).to(engine.device) for _ in range(cfg.P)
    ]
    engine.replica_opts = [make_optimizers(r, cfg, blocks=False) for r in engine.replicas]


def home_layer_wired() -> bool:
    """True when ``TrainConfig.model()`` carries ``privacy.home_layer`` into the model
    configuration, so every engine (the ring workers too) builds the layer by itself."""
    from mobius_fed.config import TrainConfig

    cfg = TrainConfig(preset="cpu-tiny", workers=1, privacy={"home_layer": "mlp"})
    return getattr(cfg.model(), "home_layer", "off") == "mlp"
