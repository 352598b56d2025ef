"""A shared residual subspace: the model-level compression of the ring's traffic.

With ``TrainConfig.subspace.rank`` = k > 0, a fixed orthonormal basis U ∈ R^{d×k} (run seed,
a buffer, never trained) constrains the stream wherever it leaves a machine: it travels as
c = Uᵀ(h − b) and is rebuilt as h = U·c + b; its gradient as ∂L/∂c = Uᵀ ∂L/∂h. ``mode``
(``stream``: b = 0; ``home``: b = E(x_s) at the origin, cyclic order only) and ``writes``
(``basis`` | ``full``) are described in docs/wan.md §7. One application is
Uᵀ(F_i(U·c + b) − b) either way; as a pure function of (c, b, U) the reference engine and a
ring compute the same tensors bit for bit, and any wire codec quantises c. Builds on Protocol
Models (arXiv 2506.01260) and ResBM (arXiv 2604.11947); how Möbius differs: docs/wan.md §7.

With ``subspace.learn`` U trains (:class:`SharedBasis`): each replica holds W [d, k], a
shared tensor averaged at the barriers like E/R, and every use of U in a round reads
U = orth(W) (:func:`orthonormal`, a sign-fixed QR), a pure function of the averaged W, so
U is the same on every worker in every step. At a round's end each worker takes one Adam
step on W from U with the gradient it accumulated in U over the round; the average of
those steps is retracted at the next use. docs/wan.md §7 "A learned U".

``mode = "bottleneck"`` has no U: each block group owns a learned :class:`Bottleneck`, an
encoder d → k (every (d/k)-th channel, the identity path, plus a learned projection) that
writes what the group sends, and a decoder k → d (the identity path's transpose plus a
learned projection) that reads what it receives. One application is
enc_i(F_i(dec_i(c), t)); the origin sends enc_s(E(x_s)) and its head reads dec_s(c_K)
(:class:`BottleneckBasis`). ``bottleneck-home`` keeps E(x_s) at the origin as ``home`` does:
b = E(x_s) there, enc_s(F_s(dec_s(c) + b) − b), slot 0 carries 0 and the head reads
dec_s(c_K) + E(x_s). docs/explanation/subspace.md "The learned bottleneck".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from mobius_fed.model.config import HOME_MODES, SubspaceMode

ADAM_BETAS = (0.9, 0.95)  # as model.training's AdamW


def orthonormal(w: Tensor) -> Tensor:
    """The retraction onto orthonormal columns: Q of the QR of ``w`` [d, k] with R's diagonal
    made positive (a unique factor), in float64 on the CPU, returned in ``w``'s dtype and
    device: a pure function of ``w``'s values, the same on every machine."""
    q, r = torch.linalg.qr(w.detach().to("cpu", torch.float64))
    sign = torch.sign(torch.diagonal(r))
    sign[sign == 0] = 1.0
    return (q * sign).to(w.device, w.dtype).contiguous()


def subspace_basis(d: int, k: int, seed: int) -> Tensor:
    """U ∈ R^{d×k} with orthonormal columns, a pure function of (d, k, seed) (float64 QR of a
    seeded Gaussian on the CPU, then fp32): the same on every machine."""
    if not 0 < k <= d:
        raise ValueError(f"subspace rank k={k} must be in 1..d_model={d}")
    gen = torch.Generator().manual_seed(seed)
    return orthonormal(torch.randn(d, k, generator=gen, dtype=torch.float64)).float()


class SharedBasis(nn.Module):
    """A learned U (``subspace.learn``), part of each replica's shared state.

    ``weight`` W [d, k] is what the barriers average (it is not a trained parameter: no
    per-step optimizer touches it). :attr:`U` = :func:`orthonormal` (W) is computed again
    whenever W changes in place (a load, an average, :meth:`local_step`) and is a leaf
    whose ``.grad`` collects ∂L/∂U over every use in the round. :meth:`local_step` ends a
    round: W ← Adam step from U with that gradient (its moments are this worker's own)."""

    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d, k), requires_grad=False)
        self._U: Tensor | None = None
        self._seen: tuple[int, torch.device] | None = None
        self.steps = 0  # training steps whose gradient U.grad holds
        self._opt: torch.optim.Adam | None = None

    @property
    def U(self) -> Tensor:
        """orth(W), recomputed when W was written; a leaf that accumulates ∂L/∂U."""
        seen = (self.weight._version, self.weight.device)
        if self._U is None or self._seen != seen:
            self._U = orthonormal(self.weight).requires_grad_()
            self._seen, self.steps = seen, 0
        return self._U

    def count_step(self) -> None:
        """One more training step's gradient is in ``U.grad``."""
        self.steps += 1

    def optimizer(self) -> torch.optim.Adam:
        if self._opt is None:
            self._opt = torch.optim.Adam(
                [self.weight], lr=1.0, betas=ADAM_BETAS, eps=1e-10, foreach=False
            )
        return self._opt

    @torch.no_grad()
    def local_step(self, lr: float, micro_batches: int) -> None:
        """The end of a round: W ← U, then one Adam step with the round's mean gradient
        (U.grad / (M · steps)). The result is sent for averaging; U is not used again
        before W is replaced by the average."""
        U, steps = self.U, max(self.steps, 1)
        grad = U.grad
        self.weight.copy_(U)
        if grad is not None:
            opt = self.optimizer()
            self.weight.grad = grad / (micro_batches * steps)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            self.weight.grad = None
        self._U, self._seen, self.steps = None, None, 0

    def forget(self) -> None:
        """Drop the gradient accumulated in the round (an abandoned step)."""
        if self._U is not None:
            self._U.grad = None
        self.steps = 0

    def extra_state(self) -> dict[str, Any]:
        """What a checkpoint keeps besides W: the Adam moments and a round's partial
        gradient (a reference-engine checkpoint may fall between barriers)."""
        grad = None if self._U is None else self._U.grad
        return {
            "opt": None if self._opt is None else self._opt.state_dict(),
            "grad": None if grad is None else grad.detach().clone(),
            "steps": self.steps,
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state` (after W itself was loaded)."""
        self._opt = None
        if state.get("opt") is not None:
            self.optimizer().load_state_dict(state["opt"])
        U = self.U
        grad = state.get("grad")
        U.grad = None if grad is None else grad.to(U.device, U.dtype).clone()
        self.steps = int(state.get("steps", 0))


BasisSource = Tensor | SharedBasis


class BasisLinear(nn.Module):
    """x ↦ U·(W′x): a linear map whose output lies in span(U); only W′ [k, in] trains.
    With a learned U, :func:`share_basis` points it at its worker's :class:`SharedBasis`."""

    basis: Tensor  # a buffer (the fixed U)

    def __init__(self, in_features: int, basis: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(basis.size(1), in_features))
        self.register_buffer("basis", basis.clone(), persistent=False)
        self.source: Callable[[], Tensor] | None = None

    def current(self) -> Tensor:
        """The U this layer writes through: the fixed buffer, or the learned U."""
        return self.basis if self.source is None else self.source()

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(
            nn.functional.linear(x, self.weight), self.current().to(x.dtype)
        )


def share_basis(module: nn.Module, shared: SharedBasis) -> None:
    """Make every :class:`BasisLinear` in ``module`` write through ``shared``'s learned U
    (a plain reference: the group's state does not hold it)."""
    for m in module.modules():
        if isinstance(m, BasisLinear):
            m.source = lambda: shared.U


class Bottleneck(nn.Module):
    """A group's learned wire bottleneck (``subspace.mode = "bottleneck"``), part of the group.

    ``encode``: c = h[..., ::d/k] + A·h ([.., d] → [.., k]); ``decode``: h = Sᵀc + B·c
    ([.., k] → [.., d]), where S selects every (d/k)-th channel (the identity path). A [k, d]
    and B [d, k] start at zero (no random draw: the group's other weights draw what they
    would without it) and train with the group from step 0, so at step 0 the bottleneck
    is the identity path alone."""

    channels: Tensor  # a buffer: the identity path's channel indices [k]

    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        if not 0 < k <= d or d % k:
            raise ValueError(f"bottleneck rank k={k} must divide d_model={d}")
        self.encoder = nn.Parameter(torch.zeros(k, d))
        self.decoder = nn.Parameter(torch.zeros(d, k))
        self.register_buffer("channels", torch.arange(k) * (d // k), persistent=False)

    def encode(self, h: Tensor) -> Tensor:
        """[.., d] → [.., k]: the identity path's channels plus the learned projection."""
        return h.index_select(-1, self.channels) + nn.functional.linear(h, self.encoder.to(h.dtype))

    def decode(self, c: Tensor) -> Tensor:
        """[.., k] → [.., d]: the code back on its channels plus the learned projection."""
        out = nn.functional.linear(c, self.decoder.to(c.dtype))
        return out.index_add(-1, self.channels, c)


class StreamBasis:
    """The coordinate maps of one worker: c = Uᵀ(h − b) and h = U·c + b; U fixed, or the
    worker's learned :class:`SharedBasis`."""

    def __init__(self, basis: BasisSource, mode: SubspaceMode) -> None:
        self.source, self.mode = basis, mode

    @property
    def U(self) -> Tensor:
        return self.source.U if isinstance(self.source, SharedBasis) else self.source

    @property
    def rank(self) -> int:
        """k, the width of what a slot carries."""
        return int(self.U.size(1))

    def coords(self, h: Tensor, b: Tensor | None = None) -> Tensor:
        """c = Uᵀ(h − b): [B, T, d] → [B, T, k]."""
        return (h if b is None else h - b) @ self.U

    def expand(self, c: Tensor, b: Tensor | None = None) -> Tensor:
        """h = U·c + b: [B, T, k] → [B, T, d]."""
        h = c @ self.U.T
        return h if b is None else h + b

    def enter(self, e: Tensor) -> Tensor:
        """Slot 0's coordinates from the embedding E(x_s): Uᵀ E (stream) or 0 (home)."""
        if self.mode in HOME_MODES:
            return e.new_zeros(*e.shape[:-1], self.rank)
        return self.coords(e)

    def apply(self, group: nn.Module, c: Tensor, t: int, b: Tensor | None) -> Tensor:
        """One application in coordinates: Uᵀ(F_i(U·c + b, t) − b)."""
        return self.coords(group(self.expand(c, b), t), b)


class BottleneckBasis(StreamBasis):
    """The coordinate maps of one worker in a bottleneck mode: c = enc_i(h − b) and
    h = dec_i(c) + b with its group's :class:`Bottleneck`. Mode ``bottleneck``: b = 0
    everywhere and slot 0 carries enc_s(E(x_s)); mode ``bottleneck-home``: b = E(x_s) at the
    origin's own worker (as in ``home``) and slot 0 carries 0, so E(x) never leaves it."""

    def __init__(self, coder: Bottleneck, mode: SubspaceMode = "bottleneck") -> None:
        self.coder, self.mode = coder, mode

    @property
    def U(self) -> Tensor:
        raise ValueError(f"subspace mode {self.mode!r} has no basis U (a learned encoder/decoder)")

    @property
    def rank(self) -> int:
        return int(self.coder.channels.numel())

    def coords(self, h: Tensor, b: Tensor | None = None) -> Tensor:
        """c = enc_i(h − b): [B, T, d] → [B, T, k]."""
        return self.coder.encode(h if b is None else h - b)

    def expand(self, c: Tensor, b: Tensor | None = None) -> Tensor:
        """h = dec_i(c) + b: [B, T, k] → [B, T, d]."""
        h = self.coder.decode(c)
        return h if b is None else h + b
