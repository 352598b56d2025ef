"""A shared residual subspace: the model-level compression of the ring's traffic.

With ``TrainConfig.subspace.rank`` = k > 0, a fixed orthonormal basis U ∈ R^{d×k} (run seed,
a buffer, never trained) constrains the stream wherever it leaves a machine: it travels as
c = Uᵀ(h − b) and is rebuilt as h = U·c + b; its gradient as ∂L/∂c = Uᵀ ∂L/∂h. ``mode``
(``stream``: b = 0; ``home``: b = E(x_s) at the origin, cyclic order only) and ``writes``
(``basis`` | ``full``) are described in docs/wan.md §7. One application is
Uᵀ(F_i(U·c + b) − b) either way; as a pure function of (c, b, U) the reference engine and a
ring compute the same tensors bit for bit, and any wire codec quantises c. Builds on Protocol
Models (arXiv 2506.01260) and ResBM (arXiv 2604.11947); how Möbius differs: docs/wan.md §7.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mobius_fed.model.config import SubspaceMode


def subspace_basis(d: int, k: int, seed: int) -> Tensor:
    """U ∈ R^{d×k} with orthonormal columns, a pure function of (d, k, seed) (float64 QR of a
    seeded Gaussian on the CPU, then fp32): the same on every machine."""
    if not 0 < k <= d:
        raise ValueError(f"subspace rank k={k} must be in 1..d_model={d}")
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))  # a unique QR: positive diagonal of R
    return q.float().contiguous()


class BasisLinear(nn.Module):
    """x ↦ U·(W′x): a linear map whose output lies in span(U); only W′ [k, in] trains."""

    basis: Tensor  # a buffer

    def __init__(self, in_features: int, basis: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(basis.size(1), in_features))
        self.register_buffer("basis", basis.clone(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(nn.functional.linear(x, self.weight), self.basis.to(x.dtype))


class StreamBasis:
    """The coordinate maps of one run: c = Uᵀ(h − b) and h = U·c + b."""

    def __init__(self, basis: Tensor, mode: SubspaceMode) -> None:
        self.U, self.mode = basis, mode

    def coords(self, h: Tensor, b: Tensor | None = None) -> Tensor:
        """c = Uᵀ(h − b): [B, T, d] → [B, T, k]."""
        return (h if b is None else h - b) @ self.U

    def expand(self, c: Tensor, b: Tensor | None = None) -> Tensor:
        """h = U·c + b: [B, T, k] → [B, T, d]."""
        h = c @ self.U.T
        return h if b is None else h + b

    def enter(self, e: Tensor) -> Tensor:
        """Slot 0's coordinates from the embedding E(x_s): Uᵀ E (stream) or 0 (home)."""
        if self.mode == "home":
            return e.new_zeros(*e.shape[:-1], self.U.size(1))
        return self.coords(e)

    def apply(self, group: nn.Module, c: Tensor, t: int, b: Tensor | None) -> Tensor:
        """One application in coordinates: Uᵀ(F_i(U·c + b, t) − b)."""
        return self.coords(group(self.expand(c, b), t), b)
