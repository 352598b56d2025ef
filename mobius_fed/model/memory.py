"""Memory options that let a small GPU hold its share (``TrainConfig.memory``); all off by
default, and both exact (docs/wan.md §8).

* ``recompute``: blocks' activations recomputed in backward (``torch.utils.checkpoint``,
  non-reentrant): the same kernels on the same inputs, so bit-identical.
* ``loss_chunk``: chunked cross-entropy that never materialises B×T×V logits; as in Liger
  Kernel (arXiv 2410.10989) each chunk's gradients are computed in forward, with the logit
  soft-cap folded in. Equal to the full loss up to float summation order (~1e-7 relative).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor


def _chunk(hn: Tensor, weight: Tensor, y: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    """Soft-capped logits' summed cross-entropy of one chunk, its logits, and tanh(z/cap)."""
    t = torch.tanh(F.linear(hn, weight).float() / cap)
    logits = cap * t
    loss = F.cross_entropy(logits, y, reduction="sum")
    return loss, logits, t


class LinearCrossEntropy(torch.autograd.Function):
    """mean CE(cap·tanh(hn·Wᵀ / cap), y), chunk by chunk, gradients computed in forward."""

    @staticmethod
    def forward(ctx, hn: Tensor, weight: Tensor, y: Tensor, cap: float, chunk: int) -> Tensor:
        n = hn.size(0)
        total = hn.new_zeros((), dtype=torch.float32)
        grad_h = torch.empty_like(hn)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        rows = torch.arange(min(chunk, n), device=hn.device)
        for i in range(0, n, chunk):
            x, target = hn[i : i + chunk], y[i : i + chunk]
            loss, logits, t = _chunk(x, weight, target, cap)
            total = total + loss
            g = torch.softmax(logits, dim=-1)
            g[rows[: x.size(0)], target] -= 1.0
            g = g * (1.0 - t * t) / n  # d(cap·tanh(z/cap))/dz = 1 − tanh²
            grad_h[i : i + chunk] = (g @ weight.float()).to(hn.dtype)
            grad_w += g.T @ x.float()
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None, None


def chunked_cross_entropy(
    hn: Tensor, weight: Tensor, targets: Tensor, cap: float, chunk: int
) -> Tensor:
    """Mean token cross-entropy of the soft-capped head over ``hn`` [N, d] (already
    normalised) in chunks of ``chunk`` tokens, never holding more than chunk × V logits."""
    if chunk < 1:
        raise ValueError(f"loss_chunk must be ≥ 1 tokens, got {chunk}")
    if torch.is_grad_enabled() and (hn.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(hn, weight, targets, cap, chunk)
    total = cast(
        Tensor,
        sum(
            _chunk(hn[i : i + chunk], weight, targets[i : i + chunk], cap)[0]
            for i in range(0, hn.size(0), chunk)
        ),
    )
    return total / hn.size(0)
