"""What the coordinator learns from one site's E/R update: which tokens were in its batch.

The coordinator holds Δ_s = θ_s − θ̄, one row per token; E/R step with AdamW
(``model/training.py``), so a row with no gradient moves only by its decaying momentum,
predictably. Four per-row scores (higher = "in the batch"): ``norm``, ``sign``, ``residual``
(‖Δ_s^t[v] − c_t·Δ_s^{t−1}[v]‖, c_t: AdamW's public shrink of a zero-gradient row's step;
needs the previous update) and ``residual sign``. :func:`presence` reads them as top-k
(k = true bag size) and by an Otsu threshold. Why each score works: docs/privacy.md §4e.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mobius_fed.model.training import ADAM_BETAS

SCORES = ("norm", "sign", "residual", "residual sign")


@dataclass
class Presence:
    """Token-presence guesses from one site's update against its true bag of tokens."""

    score: str
    bag: int  # tokens truly present
    vocab: int
    topk_precision: float  # top-|bag| rows (precision = recall)
    precision: float  # rows above the coordinator's own threshold
    recall: float
    flagged: int  # rows above the threshold

    @property
    def base_rate(self) -> float:
        """Precision of a guess that knows nothing: the share of tokens present."""
        return self.bag / self.vocab


def adam_decay(
    step: int, lr: float, lr_prev: float, betas: tuple[float, float] = ADAM_BETAS
) -> float:
    """c_t: AdamW's step for a row whose gradient is zero at Adam step ``step`` (1-based,
    ≥ 2), relative to its step at ``step − 1`` (weight decay 0, ε neglected)."""
    if step < 2:
        raise ValueError(f"the decay relates two consecutive steps; step must be >= 2, not {step}")
    b1, b2 = betas

    def bias(t: int) -> float:
        return (1 - b2**t) ** 0.5 / (1 - b1**t)

    return (lr / lr_prev) * (b1 / b2**0.5) * bias(step) / bias(step - 1)


@torch.no_grad()
def row_scores(
    delta: Tensor, kind: str, previous: Tensor | None = None, decay: float = 0.0
) -> Tensor:
    """Per-row score [V] of an update ``delta`` [V, d] (see the module docstring)."""
    delta = delta.float()
    if kind == "norm":
        return delta.norm(dim=-1)
    if kind in ("residual", "residual sign"):
        if previous is None:
            raise ValueError("the residual score needs the site's previous update (round ≥ 2)")
        residual = delta - decay * previous.float()
        return residual.norm(dim=-1) if kind == "residual" else row_scores(residual, "sign")
    if kind == "sign":
        sign = delta.sign()
        majority = sign.sum(0).sign()
        score = (sign != majority).float().mean(-1)
        moved = delta.abs().sum(-1) > 0
        return torch.where(moved, score, torch.full_like(score, -1.0))
    raise ValueError(f"unknown score {kind!r}; choose from {', '.join(SCORES)}")


def otsu_threshold(scores: Tensor) -> float:
    """The cut that splits ``scores`` into two groups with the least within-group variance."""
    s = scores.float().sort().values
    n = s.numel()
    if n < 2 or s[0] == s[-1]:
        return float(s[-1])
    csum = s.cumsum(0)
    total = csum[-1]
    i = torch.arange(1, n, dtype=torch.float32)
    left, right = csum[:-1] / i, (total - csum[:-1]) / (n - i)
    between = i * (n - i) * (left - right).square()  # maximising this minimises within
    best = int(between.argmax())
    return float((s[best] + s[best + 1]) / 2)


def presence(scores: Tensor, bag: Tensor, kind: str) -> Presence:
    """Precision/recall of ``scores`` [V] against ``bag``: ids of the tokens truly present."""
    vocab = scores.numel()
    truth = torch.zeros(vocab, dtype=torch.bool)
    truth[bag.reshape(-1).unique()] = True
    k = int(truth.sum())
    if k == 0:
        raise ValueError("the site's bag of tokens is empty: nothing to attack")
    top = scores.topk(k).indices
    cut = otsu_threshold(scores)
    flagged = scores > cut
    hits = int((flagged & truth).sum())
    return Presence(
        score=kind,
        bag=k,
        vocab=vocab,
        topk_precision=float(truth[top].float().mean()),
        precision=hits / max(1, int(flagged.sum())),
        recall=hits / k,
        flagged=int(flagged.sum()),
    )
