"""Attacks of an honest-but-curious worker on what it receives.

* :func:`recover_targets` — at a stream's last hop the worker before the home holds the
  final hidden state h it produced, the gradient ∂L/∂h the home returns and its own head
  replica R. The gradient of token i's loss is linear in the one-hot target, so every
  candidate target predicts a gradient; the attack picks the most likely one (exact
  matching without a defence, the Bayes rule under the label defence's known clip and
  noise, with the model's own softmax as the prior).
* :class:`Inverter` / :func:`train_inverter` — input inversion at the first remote hop: a
  small network trained on text the attacker owns, through the parts of the model it holds
  (the shared embedding and its own block group as a stand-in for the origin's), then
  applied to the hidden states it received.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobius_fed.model.layers import rms_norm
from mobius_fed.model.replica import Replica
from mobius_fed.privacy.stages import clip_rows


def _head_weight(head: Replica) -> Tensor:
    return head.wte.weight if head.lm_head is None else head.lm_head.weight


@torch.no_grad()
def candidate_gradients(h: Tensor, head: Replica) -> tuple[Tensor, Tensor]:
    """Per token of h [N, d]: the model's softmax p [N, V] and the gradient of that token's
    own CE with respect to h for every candidate target, [N, V, d]."""
    h = h.float()
    W = _head_weight(head).float()  # [V, d]
    d = h.size(-1)
    eps = torch.finfo(h.dtype).eps
    r = (h.square().mean(-1, keepdim=True) + eps).sqrt()  # [N, 1]
    u = h / r
    z0 = u @ W.T
    cap = head.cfg.logit_cap
    z = cap * torch.tanh(z0 / cap)
    p = torch.softmax(z, -1)
    c = 1 - torch.tanh(z0 / cap).square()  # dz/dz0

    def jt(v: Tensor) -> Tensor:  # J_rms^T v for v [..., N?, d]
        return (v - u.unsqueeze(-2) * (u.unsqueeze(-2) * v).sum(-1, keepdim=True) / d) / r[
            ..., None
        ]

    base = ((c * p) @ W) / 1.0  # [N, d]: W^T (c ⊙ p)
    cols = c.unsqueeze(-1) * W.unsqueeze(0)  # [N, V, d]: c_y W[y]
    grads = jt(base.unsqueeze(-2) - cols)  # [N, V, d]
    return p, grads


@torch.no_grad()
def recover_targets(
    h: Tensor,
    g: Tensor,
    head: Replica,
    *,
    sigma: float = 0.0,
    clip: float | None = None,
    chunk: int = 256,
) -> tuple[Tensor, Tensor]:
    """Guess the targets of a micro-batch from (h, ∂L/∂h, head): returns (guess, model) ids.

    ``h``, ``g``: [B, T, d] as received/produced at the last hop; L is the mean loss over
    the B·T tokens. ``model`` is the head's own top-1 prediction (what h and R give without
    the gradient), reported as the attack's baseline.
    """
    d = h.size(-1)
    n = h.shape[:-1].numel()
    hs, gs = h.reshape(-1, d), g.reshape(-1, d).float() * n
    guesses, models = [], []
    for i in range(0, n, chunk):
        p, cand = candidate_gradients(hs[i : i + chunk], head)
        if clip is not None:
            cand = clip_rows(cand, clip)
        dist = (cand - gs[i : i + chunk].unsqueeze(1)).square().sum(-1)  # [N, V]
        if sigma > 0 and clip is not None:
            score = torch.log(p.clamp_min(1e-30)) - dist / (2 * (sigma * clip) ** 2)
        else:
            score = -dist
        guesses.append(score.argmax(-1))
        models.append(p.argmax(-1))
    return torch.cat(guesses), torch.cat(models)


class Inverter(nn.Module):
    """Token at position t from the received hidden states at t-1, t, t+1."""

    def __init__(self, d_model: int, vocab: int, width: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3 * d_model, width), nn.GELU(), nn.Linear(width, vocab))

    def forward(self, h: Tensor) -> Tensor:  # [B, T, d] → logits [B, T, V]
        u = rms_norm(h.float())
        prev = F.pad(u, (0, 0, 1, 0))[:, :-1]
        nxt = F.pad(u, (0, 0, 0, 1))[:, 1:]
        return self.net(torch.cat([prev, u, nxt], -1))


def train_inverter(
    features: Tensor,
    tokens: Tensor,
    vocab: int,
    *,
    steps: int = 400,
    batch: int = 32,
    lr: float = 3e-3,
    noise: float = 0.0,
    seed: int = 0,
) -> Inverter:
    """Fit an :class:`Inverter` on the attacker's own (hidden state [S, T, d], token [S, T])
    pairs; ``noise`` adds the defence's known noise to its inputs (a knowing attacker)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Inverter(features.size(-1), vocab)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, features.size(0), (batch,), generator=gen)
        x = features[idx]
        if noise > 0:
            rms = x.square().mean(-1, keepdim=True).sqrt()
            x = x + noise * rms * torch.randn(x.shape, generator=gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), tokens[idx].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@torch.no_grad()
def inversion_accuracy(model: Inverter, received: Tensor, tokens: Tensor) -> tuple[float, float]:
    """(exact-token, top-5) accuracy of ``model`` on received hidden states."""
    logits = model(received)
    top5 = logits.topk(5, -1).indices
    exact = (top5[..., 0] == tokens).float().mean().item()
    in5 = (top5 == tokens.unsqueeze(-1)).any(-1).float().mean().item()
    return exact, in5
