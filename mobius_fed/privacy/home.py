"""The private home layer of each site (``TrainConfig.privacy.home_layer``).

Site s's replica carries a layer applied to the final hidden state before the shared
head R. It is drawn from a generator keyed by the site's secret (``noise_key_dir``; the
public seed without one, which any worker can recompute) and origin s, trained on s's own
loss, and neither averaged nor sent: the worker before the home receives the gradient
through a function it does not know.

Both engines build their replicas with :func:`build_site_replica` (the reference engine
reads every site's key, a ring worker only its own), so they hold identical layers.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from mobius_fed.model import Replica, build_replica
from mobius_fed.model.training import make_optimizers
from mobius_fed.privacy.stages import NoiseKeys

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig
    from mobius_fed.engine.hops import Engine
    from mobius_fed.engine.reference import ReferenceEngine


def home_generator(cfg: TrainConfig, origin: int, engine: Engine = "reference") -> torch.Generator:
    """The generator of site ``origin``'s home layer, keyed by that site's secret."""
    keys = NoiseKeys(cfg, engine, origin if engine == "ring" else None)
    label = f"{cfg.seed}:home-layer:{cfg.privacy.home_layer}:{origin}".encode()
    digest = hashlib.blake2b(label, key=keys.key(origin)[:64], digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def build_site_replica(cfg: TrainConfig, origin: int, engine: Engine = "reference") -> Replica:
    """Origin ``origin``'s initial replica: the shared E/R and, when ``cfg`` asks for it,
    the site's private home layer drawn from its keyed generator."""
    replica = build_replica(cfg.model(), cfg.seed, cfg.privacy.home_layer)
    if replica.home is not None:
        replica.reset_home(home_generator(cfg, origin, engine))
        if not cfg.privacy.home_layer_trained:  # no optimizer takes it: it stays as drawn
            for p in replica.private_parameters():
                p.requires_grad_(False)
    return replica


def ensure_home_layers(engine: ReferenceEngine) -> None:
    """Give a reference engine that has not stepped yet, and whose replicas lack the home
    layer of its configuration, the site replicas (each origin's keyed layer) and fresh
    replica optimizers; a no-op for an engine that built them with
    :func:`build_site_replica` (the reference engine does)."""
    cfg = engine.cfg
    if all(r.home_layer == cfg.privacy.home_layer for r in engine.replicas):
        return  # built by build_site_replica already (or no layer asked for)
    if engine.step != 0:
        raise RuntimeError("the home layer can only be added before the first step")
    engine.replicas = [build_site_replica(cfg, s).to(engine.device) for s in range(cfg.P)]
    engine.replica_opts = [make_optimizers(r, cfg, blocks=False) for r in engine.replicas]


def home_layer_wired() -> bool:
    """True when the engines build their replicas with the configured home layer by
    themselves (ring workers included), not only through :func:`ensure_home_layers`."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.engine.reference import ReferenceEngine

    cfg = TrainConfig(preset="cpu-tiny", workers=2, privacy={"home_layer": "mlp"})
    engine = ReferenceEngine(cfg, [None, None])  # type: ignore[list-item]  # sites unused here
    want = build_site_replica(cfg, 1)
    got = engine.replicas[1]
    return got.home is not None and all(
        torch.equal(a, b) for a, b in zip(got.private_parameters(), want.private_parameters())
    )
