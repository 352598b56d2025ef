"""(E, R): one origin's embedding and head replica, averaged across origins at barriers.

A replica can also carry a private *home layer* (a deviation from the paper, off by
default): a small layer the home applies to the final hidden state before the head R.
It is trained on the home's own loss (or kept as drawn), never averaged and never sent, so the
gradient the home returns for the final hidden state is taken through a function the
worker before the home does not hold.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobius_fed.model.config import ModelConfig
from mobius_fed.model.layers import Block, rms_norm
from mobius_fed.model.memory import chunked_cross_entropy

HomeLayer = Literal["off", "mlp", "block"]
HOME_LAYERS: tuple[str, ...] = get_args(HomeLayer)
PRIVATE_PREFIX = "home."  # state-dict names of the private home layer


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


def home_layer_kind(kind: str | None) -> str:
    """A checked home layer name (None = "off")."""
    kind = kind or "off"
    if kind not in HOME_LAYERS:
        raise ValueError(f"home_layer {kind!r} is not one of {', '.join(HOME_LAYERS)}")
    return kind


def make_home_layer(cfg: ModelConfig, kind: str) -> nn.Module | None:
    """mlp: :class:`HomeMLP`; block: one transformer block (attention mixes tokens)."""
    if kind == "mlp":
        return HomeMLP(cfg)
    if kind == "block":
        return HomeBlock(cfg)
    return None


@torch.no_grad()
def reset_home_layer(home: nn.Module, generator: torch.Generator | None = None) -> None:
    """Draw every weight matrix of a home layer uniformly with std 0.5/sqrt(fan-in), output
    projections included (so the layer is not the identity at step 0); norms start at 1."""
    for module in home.modules():
        if isinstance(module, nn.Linear):
            bound = 3**0.5 * 0.5 * module.weight.size(1) ** -0.5
            module.weight.uniform_(-bound, bound, generator=generator)
        elif isinstance(module, nn.RMSNorm) and module.weight is not None:
            module.weight.fill_(1.0)


class Replica(nn.Module):
    """One origin's copy of the embedding E and the head R (tied weights by default), and
    optionally its private home layer (``home``, applied to h before R)."""

    def __init__(self, cfg: ModelConfig, home_layer: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.lm_head = None if cfg.tied else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        with torch.no_grad():
            self.wte.weight.normal_(0.0, 0.02)
            if self.lm_head is not None:
                self.lm_head.weight.normal_(0.0, 0.02)
        self.home_layer = home_layer_kind(home_layer)
        # Built last, so E and R draw the same initial values with or without it.
        self.home = make_home_layer(cfg, self.home_layer)
        if self.home is not None:
            reset_home_layer(self.home)

    def embed(self, idx: Tensor) -> Tensor:
        """E: token ids [B, T] → hidden states [B, T, d]."""
        return rms_norm(self.wte(idx))

    def logits(self, h: Tensor) -> Tensor:
        """The home layer (if any), then R: hidden states → soft-capped logits."""
        if self.home is not None:
            h = self.home(h)
        return self.head_logits(h)

    def head_logits(self, h: Tensor) -> Tensor:
        """R alone (the shared head), without the private home layer."""
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(rms_norm(h), weight).float()
        cap = self.cfg.logit_cap
        return cap * torch.tanh(logits / cap)

    def loss(self, h: Tensor, targets: Tensor) -> Tensor:
        """Mean token cross-entropy of R(home(h)) against targets (in chunks of
        ``ModelConfig.loss_chunk`` tokens when set: no B×T×V logits)."""
        if self.cfg.loss_chunk:
            if self.home is not None:
                h = self.home(h)
            weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
            hn = rms_norm(h).reshape(-1, h.size(-1))
            cap, chunk = self.cfg.logit_cap, self.cfg.loss_chunk
            return chunked_cross_entropy(hn, weight, targets.reshape(-1), cap, chunk)
        logits = self.logits(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def shared_parameters(self) -> list[nn.Parameter]:
        """The parameters averaged across origins: E and R, never the private home layer."""
        return [p for name, p in self.named_parameters() if not is_private(name)]

    def reset_home(self, generator: torch.Generator) -> None:
        """Redraw the home layer from ``generator`` (a site's secret: see
        :func:`mobius_fed.privacy.home.build_site_replica`)."""
        if self.home is not None:
            reset_home_layer(self.home, generator)

    def private_parameters(self) -> list[nn.Parameter]:
        """The home layer's parameters: they stay on the home's site."""
        return [] if self.home is None else list(self.home.parameters())

    def shared_state_dict(self) -> dict[str, Tensor]:
        """The state that leaves the site (Flower arrays, the coordinator's checkpoints)."""
        return {k: v for k, v in self.state_dict().items() if not is_private(k)}

    def load_shared_state_dict(self, state: dict[str, Tensor]) -> None:
        """Copy averaged E/R values in place (the private home layer is left as it is)."""
        own = self.shared_state_dict()
        missing = sorted(set(own) - set(state))
        extra = sorted(set(state) - set(own))
        if missing or extra:
            raise ValueError(f"replica arrays: missing {missing}, unexpected {extra}")
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(state[name])


def is_private(name: str) -> bool:
    """True for a state-dict or parameter name of the private home layer."""
    return name.startswith(PRIVATE_PREFIX)
