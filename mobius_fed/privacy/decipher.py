"""The patient neighbour's unsupervised attacks: no paired data, only received states and a
public text of its own (docs/privacy.md §4i).

:func:`decipher` reads the received states as a substitution cipher: k-means turns every
position into a symbol (its cluster), and an HMM whose hidden states are tokens, whose
transitions are the bigram statistics of the public text and whose emissions P(cluster |
token) are fitted by EM (Baum–Welch with the transitions held fixed, as in classical
decipherment) reads each position's token off the posterior. :func:`best_over_clusters`
sweeps the cluster count k and keeps the best recovery: an upper bound on an attacker who
picks k well.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from mobius_fed.model.layers import rms_norm
from mobius_fed.privacy.input_attacks import TOP, Recovery, kmeans, recovery

CLUSTER_SWEEP = (16, 32, 48, 64, 96)


class BigramModel:
    """Unigram and smoothed bigram statistics of a public token stream over its support."""

    def __init__(self, public: Tensor, vocab: int, *, smoothing: float = 0.1) -> None:
        t = public.reshape(-1).long()
        if t.numel() < 2:
            raise ValueError(
                f"the public text needs at least 2 tokens for bigrams; got {t.numel()}"
            )
        counts = torch.bincount(t, minlength=vocab).double()
        self.states = torch.nonzero(counts > 0).reshape(-1)  # token id of each hidden state
        index = torch.full((vocab,), -1, dtype=torch.long)
        index[self.states] = torch.arange(self.states.numel())
        a, b = index[t[:-1]], index[t[1:]]
        s = self.states.numel()
        pairs = torch.zeros(s, s, dtype=torch.float64)
        pairs.index_put_((a, b), torch.ones(a.numel(), dtype=torch.float64), accumulate=True)
        pairs += smoothing
        self.transition = pairs / pairs.sum(-1, keepdim=True)  # P(next | current) [S, S]
        self.unigram = counts[self.states] / counts.sum()  # [S]


def _forward_backward(obs: Tensor, emit: Tensor, lm: BigramModel) -> tuple[Tensor, float]:
    """Posteriors P(token_t | clusters) [n, T, S] and the log-likelihood of ``obs`` [n, T]."""
    n, T = obs.shape
    e = emit.T[obs]  # [n, T, S]: P(cluster_t | state)
    a = lm.transition
    alpha = torch.empty(n, T, e.size(-1), dtype=torch.float64)
    scale = torch.empty(n, T, dtype=torch.float64)
    cur = lm.unigram * e[:, 0]
    for t in range(T):
        if t:
            cur = (alpha[:, t - 1] @ a) * e[:, t]
        scale[:, t] = cur.sum(-1).clamp_min(1e-300)
        alpha[:, t] = cur / scale[:, t, None]
    beta = torch.ones_like(alpha)
    for t in range(T - 2, -1, -1):
        beta[:, t] = ((beta[:, t + 1] * e[:, t + 1]) @ a.T) / scale[:, t + 1, None]
    post = alpha * beta
    post = post / post.sum(-1, keepdim=True).clamp_min(1e-300)
    return post, float(scale.log().sum())


@torch.no_grad()
def hmm_decipher(
    symbols: Tensor,
    lm: BigramModel,
    clusters: int,
    *,
    rounds: int = 30,
    restarts: int = 2,
    seed: int = 0,
) -> Tensor:
    """Top-5 token ids per position of ``symbols`` [n, T] (cluster ids < ``clusters``): EM
    on the emissions with the public bigram transitions fixed, from a frequency-rank start
    (the j-th largest cluster reads as the j-th most frequent public token) and random
    restarts; the restart of highest likelihood wins."""
    s = lm.states.numel()
    sizes = torch.bincount(symbols.reshape(-1), minlength=clusters).double()
    rank_state = lm.unigram.argsort(descending=True)
    rank_cluster = sizes.argsort(descending=True)
    gen = torch.Generator().manual_seed(seed)
    best: tuple[float, Tensor] | None = None
    for r in range(restarts):
        emit = torch.full((s, clusters), 1.0, dtype=torch.float64)
        if r == 0:  # frequency-rank start
            m = min(s, clusters)
            emit[rank_state[:m], rank_cluster[:m]] += 4.0 * clusters
        else:
            emit += torch.rand(s, clusters, generator=gen, dtype=torch.float64) * clusters
        emit = emit / emit.sum(-1, keepdim=True)
        flat = symbols.reshape(-1)
        for _ in range(rounds):
            post, ll = _forward_backward(symbols, emit, lm)
            counts = torch.zeros(clusters, s, dtype=torch.float64)
            counts.index_add_(0, flat, post.reshape(-1, s))
            emit = counts.T + 1e-6
            emit = emit / emit.sum(-1, keepdim=True)
        post, ll = _forward_backward(symbols, emit, lm)
        if best is None or ll > best[0]:
            best = (ll, post)
    assert best is not None
    top = best[1].reshape(-1, s).topk(min(TOP, s), -1).indices
    if top.size(-1) < TOP:
        top = torch.cat([top, top[:, :1].expand(-1, TOP - top.size(-1))], -1)
    return lm.states[top]


@torch.no_grad()
def decipher(h: Tensor, public: Tensor, vocab: int, *, clusters: int, seed: int = 0) -> Tensor:
    """Top-5 guesses [n·T, 5] of the cluster + bigram decipher on ``h`` [n, T, d] (rows are
    contiguous sequences, as a hop carries them)."""
    if h.dim() != 3:
        raise ValueError(f"decipher reads sequences [n, T, d]; got shape {tuple(h.shape)}")
    n, t, d = h.shape
    x = rms_norm(h.reshape(-1, d).float())
    group = kmeans(x, clusters, seed=seed)
    k = int(group.max()) + 1
    return hmm_decipher(group.reshape(n, t), BigramModel(public, vocab), k, seed=seed)


def best_over_clusters(
    attack: Callable[[int], Tensor], tokens: Tensor, sweep: Sequence[int] = CLUSTER_SWEEP
) -> tuple[Recovery, int]:
    """The best exact recovery of ``attack(k)`` over the cluster counts of ``sweep`` (and
    its k): what an attacker who chooses k well gets."""
    tried = [(recovery(attack(k), tokens), k) for k in sweep]
    if not tried:
        raise ValueError("the cluster sweep is empty")
    return max(tried, key=lambda rk: rk[0].exact)  # the first k of equal recoveries
