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

from mobius_fed.defences.stages import clip_rows
from mobius_fed.model.layers import rms_norm
from mobius_fed.model.replica import Replica


@torch.no_grad()
def candidate_gradients(h: Tensor, head: Replica) -> tuple[Tensor, Tensor]:
    """Per token of h [N, d]: the model's softmax p [N, V] and the gradient of that token's
    own CE with respect to h for every candidate target, [N, V, d]."""
    h = h.float()
    W = (head.wte.weight if head.lm_head is None else head.lm_head.weight).float()  # [V, d]
    d = h.size(-1)
    eps = torch.finfo(h.dtype).eps
    r = (h.square().mean(-1, keepdim=True) + eps).sqrt()  # [N, 1]
    u = h / r
    z0 = u @ W.T
    cap = head.cfg.logit_cap
    z = cap * torch.tanh(z0 / cap)
    p = torch.softmax(z, -1)
    c = 1 - torch.tanh(z0 / cap).square()  # dz/dz0
    base = (c * p) @ W  # [N, d]: W^T (c ⊙ p)
    cols = c.unsqueeze(-1) * W.unsqueeze(0)  # [N, V, d]: c_y W[y]
    v = base.unsqueeze(-2) - cols  # [N, V, d]
    u1 = u.unsqueeze(-2)
    grads = (v - u1 * (u1 * v).sum(-1, keepdim=True) / d) / r[..., None]  # J_rms^T v
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
def recover_targets_through(
    h: Tensor, g: Tensor, head: Replica, home: nn.Module, *, chunk: int = 256
) -> Tensor:
    """Exact matching through a token-wise home layer the attacker assumes (a surrogate:
    the layer it can know): candidates are J_home(h)^T × the head's candidate gradients at
    home(h). Returns the guessed ids."""
    from torch.func import jacrev, vmap

    d = h.size(-1)
    n = h.shape[:-1].numel()
    hs, gs = h.reshape(-1, d).float(), g.reshape(-1, d).float() * n

    def one(x: Tensor) -> Tensor:
        return home(x.view(1, 1, d)).view(d)

    guesses = []
    for i in range(0, n, chunk):
        x = hs[i : i + chunk]
        with torch.enable_grad():
            jac = vmap(jacrev(one))(x)  # [N, d_out, d_in]
        _, cand = candidate_gradients(home(x.view(1, -1, d)).view(-1, d), head)
        cand = torch.einsum("nvo,noi->nvi", cand, jac)
        dist = (cand - gs[i : i + chunk].unsqueeze(1)).square().sum(-1)
        guesses.append(dist.argmin(-1))
    return torch.cat(guesses)


@torch.no_grad()
def recover_targets_linear(
    h: Tensor,
    g: Tensor,
    head: Replica,
    first_guess: Tensor,
    *,
    rounds: int = 3,
    ridge: float = 1e-3,
    chunk: int = 256,
) -> Tensor:
    """An attacker that does not know the home layer and models it as an unknown linear map
    B on the head's candidate gradients (g ≈ B^T c_y): starting from ``first_guess`` it
    fits B by ridge least squares on the guessed candidates, re-matches, and repeats."""
    d = h.size(-1)
    n = h.shape[:-1].numel()
    hs, gs = h.reshape(-1, d).float(), g.reshape(-1, d).float() * n
    guess = first_guess.reshape(-1)
    eye = torch.eye(d)
    for _ in range(rounds):
        picked = []
        for i in range(0, n, chunk):
            _, cand = candidate_gradients(hs[i : i + chunk], head)
            picked.append(cand[torch.arange(cand.size(0)), guess[i : i + chunk]])
        c = torch.cat(picked)
        lam = ridge * c.square().sum() / n
        b = torch.linalg.solve(c.T @ c + lam * eye, c.T @ gs + lam * eye)
        out = []
        for i in range(0, n, chunk):
            _, cand = candidate_gradients(hs[i : i + chunk], head)
            dist = (cand @ b - gs[i : i + chunk].unsqueeze(1)).square().sum(-1)
            out.append(dist.argmin(-1))
        guess = torch.cat(out)
    return guess


@torch.no_grad()
def cluster_targets(
    g: Tensor, prior: Tensor, *, per_group: int = 16, rounds: int = 15, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """An attacker that knows nothing of the home layer groups the tokens by the direction
    of their gradient (spherical k-means, one group per ``per_group`` tokens) and gives
    every token of a group the label its own model predicts most often there (``prior``:
    [N] ids). Returns (guess, group)."""
    d = g.size(-1)
    x = g.reshape(-1, d).float()
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    n = x.size(0)
    k = max(1, n // per_group)
    gen = torch.Generator().manual_seed(seed)
    centres = x[torch.randperm(n, generator=gen)[:k]].clone()
    for _ in range(rounds):
        group = (x @ centres.T).argmax(-1)
        sums = torch.zeros_like(centres).index_add_(0, group, x)
        norms = sums.norm(dim=-1, keepdim=True)
        centres = torch.where(norms > 0, sums / norms.clamp_min(1e-12), centres)
    group = (x @ centres.T).argmax(-1)
    prior = prior.reshape(-1)
    guess = prior.clone()
    for j in group.unique():
        members = group == j
        guess[members] = torch.mode(prior[members]).values
    return guess, group


def group_purity(group: Tensor, targets: Tensor, *, shuffle_seed: int | None = None) -> int:
    """Tokens whose group's most common true target is their own: how well the gradient
    alone tells which tokens share a target (the part a label mapping would turn into
    recovered targets). ``shuffle_seed``: the same groups with the targets shuffled (the
    chance level of this figure)."""
    targets = targets.reshape(-1)
    if shuffle_seed is not None:
        gen = torch.Generator().manual_seed(shuffle_seed)
        targets = targets[torch.randperm(targets.numel(), generator=gen)]
    pure = 0
    for j in group.unique():
        t = targets[group == j]
        pure += int((t == torch.mode(t).values).sum())
    return pure


def recover_targets_matching(
    h: Tensor, g: Tensor, stand_in: Replica, *, rounds: int = 100, lr: float = 0.3
) -> Tensor:
    """Gradient matching through a stand-in for the home (its layer and head): soft labels
    q (softmax of free logits, one row per token) are fitted so that the gradient of the
    stand-in's mean cross-entropy against q, taken at h, equals the received ∂L/∂h; the
    guess is each row's argmax. Works for token-mixing layers too (the whole micro-batch is
    matched at once); attention runs on its math kernel, which has second derivatives."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = h.shape[:-1].numel()
    vocab = stand_in.cfg.vocab_size
    target = g.detach().float()
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        hh = h.detach().float().clone().requires_grad_()
        logp = F.log_softmax(stand_in.logits(hh).reshape(n, vocab), -1)
        z = torch.zeros(n, vocab, requires_grad=True)
        opt = torch.optim.Adam([z], lr=lr)
        for _ in range(rounds):
            loss = -(torch.softmax(z, -1) * logp).sum(-1).mean()
            (gh,) = torch.autograd.grad(loss, hh, create_graph=True, retain_graph=True)
            mismatch = (gh - target).square().sum() * n * n
            opt.zero_grad()
            mismatch.backward(inputs=[z], retain_graph=True)
            opt.step()
    return z.detach().argmax(-1)
