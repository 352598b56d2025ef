"""The private layers a site may hold around the shared model (deviations from the paper).

* the **home layer** (``privacy.home_layer``): applied to the final hidden state before the
  shared head R; ``mlp`` = :class:`HomeMLP`, ``block`` = :class:`HomeBlock`;
* the **input layer** (``privacy.home_input``): applied to E(x) before the origin's first
  block group, then rms-normalised, so the first hidden state that leaves home is not
  E(x); ``rotation`` = :class:`InputRotation` (a random orthogonal map), ``mlp`` and
  ``block`` as above.

Both are drawn from a generator keyed by the site's secret
(:mod:`mobius_fed.defences.site_layers`), never averaged and never sent.
"""

from __future__ import annotations

from typing import get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobius_fed.model.config import HomeInput, ModelConfig
from mobius_fed.model.layers import Block, rms_norm

HOME_LAYERS = ("off", "mlp", "block")
INPUT_LAYERS: tuple[str, ...] = get_args(HomeInput)


class HomeMLP(nn.Module):
    """W2 relu²(W1 rms_norm(h)), token by token, with no identity path: the head sees only
    the layer's output, so the gradient for h is taken through a function its producer
    does not know (a residual layer would hand most of the head's gradient straight back)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, h: Tensor) -> Tensor:
        return self.proj(F.relu(self.fc(rms_norm(h))).square())


class HomeBlock(nn.Module):
    """One transformer block on rms_norm(h) (its attention mixes the tokens of a sequence),
    then a :class:`HomeMLP`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.block = Block(cfg)
        self.mlp = HomeMLP(cfg)

    def forward(self, h: Tensor) -> Tensor:
        return self.mlp(self.block(rms_norm(h)))


def checked_kind(option: str, kind: str | None, kinds: tuple[str, ...]) -> str:
    """``kind`` (None = "off") if it is one of ``kinds``, else an error naming ``option``."""
    kind = kind or "off"
    if kind not in kinds:
        raise ValueError(f"{option} {kind!r} is not one of {', '.join(kinds)}")
    return kind


class InputRotation(nn.Module):
    """e ↦ e·Q with Q a d×d matrix drawn orthogonal (QR of a Gaussian): it keeps every
    distance between embedded tokens, so the shared groups see the same geometry."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, e: Tensor) -> Tensor:
        return self.proj(e)


def input_layer_kind(kind: str | None) -> str:
    """A checked input layer name (None = "off")."""
    return checked_kind("home_input", kind, INPUT_LAYERS)


def make_layer(cfg: ModelConfig, kind: str) -> nn.Module | None:
    """A freshly drawn private layer of a checked ``kind`` (None for "off"): rotation =
    :class:`InputRotation`, mlp = :class:`HomeMLP`, block = :class:`HomeBlock`."""
    cls = {"rotation": InputRotation, "mlp": HomeMLP, "block": HomeBlock}.get(kind)
    if cls is None:
        return None
    layer = cls(cfg)
    reset_layer(layer)
    return layer


@torch.no_grad()
def reset_layer(layer: nn.Module, generator: torch.Generator | None = None) -> None:
    """Redraw a private layer: a rotation's Q orthogonal (Haar); otherwise every weight
    matrix uniformly with std 0.5/sqrt(fan-in), output projections included (so the layer
    is not the identity at step 0), and norms at 1."""
    if isinstance(layer, InputRotation):
        d = layer.proj.weight.size(0)
        q, r = torch.linalg.qr(torch.randn(d, d, generator=generator))
        layer.proj.weight.copy_(q * torch.sign(torch.diagonal(r)))
        return
    for module in layer.modules():
        if isinstance(module, nn.Linear):
            bound = 3**0.5 * 0.5 * module.weight.size(1) ** -0.5
            module.weight.uniform_(-bound, bound, generator=generator)
        elif isinstance(module, nn.RMSNorm) and module.weight is not None:
            module.weight.fill_(1.0)
