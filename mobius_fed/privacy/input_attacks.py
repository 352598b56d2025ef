"""Attacks on a stream's input tokens from a hidden state a worker receives at some hop.

Each attack returns ``guesses`` [N, 5] (five best token ids per position, best first) for
:func:`recovery`. :func:`nearest_row`, :func:`cluster_frequency`, :func:`known_plaintext` and
:func:`frequency_floor` are described in docs/privacy.md §4d. :func:`known_codebook` uses the
known (position, token) pairs as a codebook: each other position takes the tokens of the
known positions nearest to it; no map is fitted, so it breaks any token-by-token transform of
E(x), linear or not (a substitution cipher).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mobius_fed.model.layers import rms_norm

TOP = 5


@dataclass
class Recovery:
    """Exact and top-5 recovery of ``tokens`` positions."""

    exact: float
    top5: float
    tokens: int


def recovery(guesses: Tensor, tokens: Tensor) -> Recovery:
    """``guesses`` [N, k] best first against true ``tokens`` [N]."""
    tokens = tokens.reshape(-1)
    if guesses.shape[0] != tokens.numel():
        raise ValueError(f"{guesses.shape[0]} guesses for {tokens.numel()} tokens")
    exact = (guesses[:, 0] == tokens).float().mean().item()
    top = (guesses[:, :TOP] == tokens.unsqueeze(-1)).any(-1).float().mean().item()
    return Recovery(exact, top, tokens.numel())


def embedding_rows(wte: Tensor) -> Tensor:
    """The vectors E(v) the model feeds in for every token v: rms_norm of E's rows [V, d]."""
    return rms_norm(wte.detach().float())


@torch.no_grad()
def nearest_row(h: Tensor, wte: Tensor, *, metric: str = "cosine", chunk: int = 4096) -> Tensor:
    """Top-5 ids of the rows of E nearest to each received vector of ``h`` [..., d]."""
    if metric not in ("cosine", "l2"):
        raise ValueError(f"metric must be 'cosine' or 'l2', not {metric!r}")
    rows = embedding_rows(wte)
    x = h.reshape(-1, h.size(-1)).float()
    if metric == "cosine":
        x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        rows = rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    out = []
    for i in range(0, x.size(0), chunk):
        part = x[i : i + chunk]
        score = part @ rows.T if metric == "cosine" else -torch.cdist(part, rows)
        out.append(score.topk(TOP, -1).indices)
    return torch.cat(out)


def frequency_ranking(public: Tensor, vocab: int) -> Tensor:
    """Token ids of public text, most frequent first (every id of the vocabulary)."""
    counts = torch.bincount(public.reshape(-1), minlength=vocab).float()
    return counts.argsort(descending=True, stable=True)


def frequency_floor(public: Tensor, n: int, vocab: int) -> Tensor:
    """The guesses of an attacker who ignores the hidden state: the five most frequent
    tokens of its own text, at every one of ``n`` positions."""
    return frequency_ranking(public, vocab)[:TOP].expand(n, TOP)


@torch.no_grad()
def kmeans(x: Tensor, k: int, *, rounds: int = 25, seed: int = 0) -> Tensor:
    """Euclidean k-means with k-means++ seeding; returns each row's cluster id."""
    n = x.size(0)
    k = max(1, min(k, n))
    gen = torch.Generator().manual_seed(seed)
    centres = [x[torch.randint(0, n, (1,), generator=gen)].squeeze(0)]
    dist = (x - centres[0]).square().sum(-1)
    for _ in range(k - 1):
        if dist.sum() <= 0:
            break
        pick = torch.multinomial(dist / dist.sum(), 1, generator=gen)
        centres.append(x[pick].squeeze(0))
        dist = torch.minimum(dist, (x - centres[-1]).square().sum(-1))
    c = torch.stack(centres)
    for _ in range(rounds):
        group = torch.cdist(x, c).argmin(-1)
        sums = torch.zeros_like(c).index_add_(0, group, x)
        sizes = torch.bincount(group, minlength=c.size(0)).unsqueeze(-1)
        c = torch.where(sizes > 0, sums / sizes.clamp_min(1), c)
    return torch.cdist(x, c).argmin(-1)


@torch.no_grad()
def cluster_frequency(
    h: Tensor, public: Tensor, vocab: int, *, clusters: int | None = None, seed: int = 0
) -> Tensor:
    """Top-5 guesses of the unsupervised attack on ``h`` [..., d]: k-means over the
    rms-normalised positions (k = the number of distinct tokens of the public text unless
    given); the j-th largest cluster is read as the j-th most frequent public token, and
    its top-5 are the public tokens of the two ranks either side."""
    x = rms_norm(h.reshape(-1, h.size(-1)).float())
    ranked = frequency_ranking(public, vocab)
    distinct = int((torch.bincount(public.reshape(-1), minlength=vocab) > 0).sum())
    k = clusters if clusters is not None else distinct
    group = kmeans(x, k, seed=seed)
    sizes = torch.bincount(group, minlength=int(group.max()) + 1)
    order = sizes.argsort(descending=True, stable=True)
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(order.numel())
    offsets = torch.tensor([0, -1, 1, -2, 2])
    ranks = (rank_of[group].unsqueeze(-1) + offsets).clamp(0, vocab - 1)
    return ranked[ranks]


def _positions(h: Tensor, tokens: Tensor, known: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(states [N, d] in fp32, tokens [N], known mask [N]) of the positions of ``h`` [..., d];
    a mask of another length is refused."""
    x, t, known = h.reshape(-1, h.size(-1)).float(), tokens.reshape(-1), known.reshape(-1)
    if known.numel() != t.numel():
        raise ValueError(f"known mask has {known.numel()} entries for {t.numel()} positions")
    return x, t, known


@torch.no_grad()
def known_plaintext(
    h: Tensor,
    tokens: Tensor,
    wte: Tensor,
    known: Tensor,
    *,
    ridge: float = 1e-2,
    prior: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Fit A (k×d) with h·A ≈ E(x) on the ``known`` positions (bool mask over the flattened
    positions of ``h`` [..., k]) by least squares with a ridge towards ``prior`` [k, d] (by
    default the identity, k = d: the residual stream starts as E(x), so A = I is the
    attacker's prior; a k-wide code gives its own), then take the nearest row of E to h·A
    at every unknown position. Returns (top-5 guesses, true tokens) of the unknown
    positions."""
    x, t, known = _positions(h, tokens, known)
    n_known = int(known.sum())
    if n_known == 0:
        raise ValueError(
            "known plaintext needs at least one known (position, token) pair; got 0 "
            "(raise the known fraction or the number of positions)"
        )
    if n_known == t.numel():
        raise ValueError("every position is known: nothing is left to recover")
    rows = embedding_rows(wte)
    xk, yk = x[known], rows[t[known]]
    k = x.size(-1)
    if prior is None:
        if k != rows.size(-1):
            raise ValueError(f"states of width {k} and rows of E of {rows.size(-1)}: give a prior")
        prior = torch.eye(k)
    lam = ridge * max(float(xk.square().sum()) / n_known, 1e-12)  # > 0 even for h = 0
    a = torch.linalg.solve(xk.T @ xk + lam * torch.eye(k), xk.T @ yk + lam * prior.float())
    return nearest_row(x[~known] @ a, wte), t[~known]


@torch.no_grad()
def known_codebook(
    h: Tensor, tokens: Tensor, known: Tensor, *, neighbours: int = 64
) -> tuple[Tensor, Tensor]:
    """Each unknown position of ``h`` [..., d] takes the distinct tokens of its nearest
    ``known`` positions by cosine (the ``neighbours`` nearest), nearest first (padded with
    its first guess). Returns (top-5 guesses, true tokens) of the unknown positions."""
    x, t, known = _positions(h, tokens, known)
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    if not bool(known.any()) or bool(known.all()):
        raise ValueError("the codebook needs some known and some unknown positions")
    n = min(neighbours, int(known.sum()))
    order = (x[~known] @ x[known].T).topk(n, -1).indices
    ranked = t[known][order]  # known tokens, nearest first, per unknown position
    guesses = ranked[:, :1].repeat(1, TOP)
    for row, toks in enumerate(ranked.tolist()):
        picked = list(dict.fromkeys(toks))[:TOP]
        guesses[row, : len(picked)] = torch.tensor(picked)
    return guesses, t[~known]


@torch.no_grad()
def known_class_means(h: Tensor, tokens: Tensor, known: Tensor) -> tuple[Tensor, Tensor]:
    """Gaussian class means on the ``known`` pairs of ``h`` [..., d]: each known token's mean
    state μ_v (pooling many noisy pairs averages the noise out), one isotropic variance s²
    pooled within tokens, and the known tokens' frequencies π_v; each unknown position takes
    the tokens of highest log π_v − ‖h − μ_v‖² / 2s². Returns (top-5 guesses, true tokens)
    of the unknown positions."""
    x, t, known = _positions(h, tokens, known)
    if not bool(known.any()) or bool(known.all()):
        raise ValueError("the class means need some known and some unknown positions")
    xk, tk = x[known], t[known]
    ids, inverse, counts = torch.unique(tk, return_inverse=True, return_counts=True)
    means = torch.zeros(ids.numel(), x.size(-1)).index_add_(0, inverse, xk) / counts[:, None]
    spread = (xk - means[inverse]).square().sum() / max(xk.numel() - means.numel(), 1)
    score = counts.float().log() - torch.cdist(x[~known], means).square() / (2 * spread + 1e-12)
    top = score.topk(min(TOP, ids.numel()), -1).indices
    if top.size(-1) < TOP:
        top = torch.cat([top, top[:, :1].expand(-1, TOP - top.size(-1))], -1)
    return ids[top], t[~known]


def known_mask(n: int, fraction: float, seed: int) -> Tensor:
    """A random mask of round(fraction · n) known positions out of n."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"known fraction must be in [0, 1), not {fraction}")
    count = round(fraction * n)
    mask = torch.zeros(n, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    mask[torch.randperm(n, generator=gen)[:count]] = True
    return mask


DECODER_WIDTHS = (0, 64, 256)  # hidden units of the decoder's capacity sweep (0: linear)
DECODER_DECAYS = (1e-4, 1e-2)


def _fit_decoder(
    x: Tensor, y: Tensor, classes: int, width: int, decay: float, steps: int, seed: int
) -> torch.nn.Module:
    """A softmax classifier x ↦ class (one hidden ReLU layer of ``width``, or linear for 0),
    fitted full-batch with AdamW."""
    d = x.size(-1)
    with torch.random.fork_rng():  # the default init, seeded, leaving the global RNG alone
        torch.manual_seed(seed)
        net = torch.nn.Sequential(
            *(
                [torch.nn.Linear(d, width), torch.nn.ReLU(), torch.nn.Linear(width, classes)]
                if width
                else [torch.nn.Linear(d, classes)]
            )
        )
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=decay)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.eval()


def known_decoder(
    h: Tensor,
    tokens: Tensor,
    known: Tensor,
    *,
    widths: tuple[int, ...] = DECODER_WIDTHS,
    decays: tuple[float, ...] = DECODER_DECAYS,
    steps: int = 300,
    seed: int = 0,
) -> tuple[Tensor, Tensor, int]:
    """A small nonlinear decoder fitted on the ``known`` pairs only: a softmax classifier
    over the known tokens on the rms-normalised, standardised states, its capacity (hidden
    width, weight decay) chosen by accuracy on a held-out fifth of the known pairs, then
    refitted on all of them. Returns (top-5 guesses, true tokens) of the unknown positions
    and the chosen width."""
    x, t, known = _positions(h, tokens, known)
    if int(known.sum()) < 2 or bool(known.all()):
        raise ValueError("the decoder needs at least 2 known and some unknown positions")
    x = rms_norm(x)
    x = (x - x[known].mean(0)) / x[known].std(0).clamp_min(1e-6)
    ids, y = torch.unique(t[known], return_inverse=True)
    xk = x[known]
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(xk.size(0), generator=gen)
    held = perm[: max(1, xk.size(0) // 5)]
    fit = perm[max(1, xk.size(0) // 5) :]
    best, best_acc = (0, decays[0]), -1.0
    with torch.enable_grad():
        if fit.numel() >= 1:
            for width in widths:
                for decay in decays:
                    net = _fit_decoder(xk[fit], y[fit], ids.numel(), width, decay, steps, seed)
                    with torch.no_grad():
                        acc = (net(xk[held]).argmax(-1) == y[held]).float().mean().item()
                    if acc > best_acc:
                        best, best_acc = (width, decay), acc
        net = _fit_decoder(xk, y, ids.numel(), *best, steps, seed)
    with torch.no_grad():
        scores = net(x[~known])
    top = scores.topk(min(TOP, ids.numel()), -1).indices
    if top.size(-1) < TOP:
        top = torch.cat([top, top[:, :1].expand(-1, TOP - top.size(-1))], -1)
    return ids[top], t[~known], best[0]
