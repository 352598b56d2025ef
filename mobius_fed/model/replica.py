"""(E, R): one origin's embedding and head replica, averaged across origins at barriers.

It may also carry the site's private layers (:mod:`mobius_fed.model.private_layers`, off
by default), never averaged and never sent: the *home layer* before the head R, so the
gradient the home returns for the final hidden state is taken through a function the
worker before it does not hold, and the *input layer* on E(x), so what the stream carries
from its first block group on is a function of x the other workers do not hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobius_fed.model.config import ModelConfig
from mobius_fed.model.layers import rms_norm
from mobius_fed.model.memory import chunked_cross_entropy
from mobius_fed.model.private_layers import (
    HOME_LAYERS,
    checked_kind,
    input_layer_kind,
    make_layer,
    reset_layer,
)
from mobius_fed.model.subspace import SharedBasis

PRIVATE_PREFIXES = ("home.", "home_input.")  # state-dict names of the private layers


class Replica(nn.Module):
    """One origin's copy of the embedding E and the head R (tied weights by default), and
    optionally its private home layer (``home``, applied to h before R) and input layer
    (``home_input``, applied to E(x); its kind is ``cfg.home_input``). With a learned
    subspace it also holds the shared W of U (``subspace``, :class:`SharedBasis`)."""

    def __init__(self, cfg: ModelConfig, home_layer: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.lm_head = None if cfg.tied else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        with torch.no_grad():
            self.wte.weight.normal_(0.0, 0.02)
            if self.lm_head is not None:
                self.lm_head.weight.normal_(0.0, 0.02)
        self.home_layer = checked_kind("home_layer", home_layer, HOME_LAYERS)
        # Built last, so E and R draw the same initial values with or without it.
        self.home = make_layer(cfg, self.home_layer)
        # Last of all, so E, R and the home layer draw the same values with or without it.
        self.input_kind = input_layer_kind(cfg.home_input)
        self.home_input = make_layer(cfg, self.input_kind)
        # A learned subspace U (shared: averaged with E/R); no random draw
        self.subspace = (
            SharedBasis(cfg.d_model, cfg.subspace_rank)
            if cfg.subspace_rank and cfg.subspace_learn
            else None
        )

    def embed(self, idx: Tensor) -> Tensor:
        """E, then the private input layer if any: token ids [B, T] → hidden states
        [B, T, d] (rms-normalised)."""
        e = rms_norm(self.wte(idx))
        return e if self.home_input is None else rms_norm(self.home_input(e))

    def _head_input(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """What R multiplies: rms_norm(home(h)), and R's weight (E's when tied)."""
        if self.home is not None:
            h = self.home(h)
        return rms_norm(h), (self.wte.weight if self.lm_head is None else self.lm_head.weight)

    def logits(self, h: Tensor) -> Tensor:
        """The home layer (if any), then R: hidden states → soft-capped logits."""
        hn, weight = self._head_input(h)
        logits = F.linear(hn, weight).float()
        cap = self.cfg.logit_cap
        return cap * torch.tanh(logits / cap)

    def loss(self, h: Tensor, targets: Tensor) -> Tensor:
        """Mean token cross-entropy of R(home(h)) against targets (in chunks of
        ``ModelConfig.loss_chunk`` tokens when set: no B×T×V logits)."""
        if self.cfg.loss_chunk:
            hn, weight = self._head_input(h)
            cap, chunk = self.cfg.logit_cap, self.cfg.loss_chunk
            hn = hn.reshape(-1, hn.size(-1))
            return chunked_cross_entropy(hn, weight, targets.reshape(-1), cap, chunk)
        logits = self.logits(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def shared_parameters(self) -> list[nn.Parameter]:
        """The parameters averaged across origins: E and R, never a private layer."""
        return [p for name, p in self.named_parameters() if not is_private(name)]

    def reset_home(self, generator: torch.Generator) -> None:
        """Redraw the home layer from ``generator`` (a site's secret: see
        :func:`mobius_fed.defences.site_layers.build_site_replica`)."""
        if self.home is not None:
            reset_layer(self.home, generator)

    def reset_input(self, generator: torch.Generator) -> None:
        """Redraw the input layer from ``generator`` (a site's secret)."""
        if self.home_input is not None:
            reset_layer(self.home_input, generator)

    def input_parameters(self) -> list[nn.Parameter]:
        """The input layer's parameters."""
        return [] if self.home_input is None else list(self.home_input.parameters())

    def private_parameters(self) -> list[nn.Parameter]:
        """The private layers' parameters (home, then input): they stay on the site."""
        layers = [m for m in (self.home, self.home_input) if m is not None]
        return [p for m in layers for p in m.parameters()]

    def shared_state_dict(self) -> dict[str, Tensor]:
        """The state that leaves the site (Flower arrays, the coordinator's checkpoints)."""
        return {k: v for k, v in self.state_dict().items() if not is_private(k)}

    def load_shared_state_dict(self, state: dict[str, Tensor]) -> None:
        """Copy averaged E/R values in place (the private layers are left as they are)."""
        own = self.shared_state_dict()
        missing = sorted(set(own) - set(state))
        extra = sorted(set(state) - set(own))
        if missing or extra:
            raise ValueError(f"replica arrays: missing {missing}, unexpected {extra}")
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(state[name])


def is_private(name: str) -> bool:
    """True for a state-dict or parameter name of a private layer (home or input)."""
    return name.startswith(PRIVATE_PREFIXES)
