"""What a stream carries between applications: hidden states, or subspace coordinates.

Both engines build one :class:`StreamMaps` and call it at exactly the same points, so a
ring equals the reference engine with the subspace on or off. Off (the paper's model)
every method is the identity and a slot carries the hidden state h itself; on
(``TrainConfig.subspace``, see :mod:`mobius_fed.model.subspace`) a slot carries
c = Uᵀ(h − b), each application runs Uᵀ(F_i(U·c + b) − b) and the head reads U·c + b.

In mode ``tokens`` a forward slot is [c, x] (the micro-batch's token ids as one more
channel, sent exactly) and every application rebuilds b = E_i(x) from its own worker's
embedding E_i; gradients travel without the ids channel (:meth:`StreamMaps.grad_out`,
:meth:`StreamMaps.grad_in`). The math: docs/wan.md §7.

With ``subspace.learn`` each worker's maps read its replica's learned U (:meth:`StreamMaps.bind`):
every use of U by worker i (its applications, its origin's entry and head, its blocks'
writes) adds to that U's gradient, in the same order in both engines; at the end of each
round (:meth:`StreamMaps.ends_round`) :meth:`StreamMaps.end_round` takes the worker's
local step on W, which the barrier then averages.

In mode ``bottleneck`` there is no U: a slot carries the k-wide code c = enc_i(h) of the
group that wrote it, an application is enc_i(F_i(dec_i(c), t)) with worker i's own group's
:class:`~mobius_fed.model.subspace.Bottleneck`, the origin sends enc_s(E(x_s)) and its head
reads dec_s(c_K); mode ``bottleneck-home`` adds b = E(x_s) back at the origin as ``home``
does (slot 0 carries 0). The coders are group parameters, so each one's gradient stays on its
worker and its group's optimizer trains it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mobius_fed.model.config import HOME_MODES
from mobius_fed.model.groups import build_basis
from mobius_fed.model.subspace import BottleneckBasis, StreamBasis, share_basis

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig


@dataclass
class Entry:
    """One micro-batch of a stream at its origin: E(x_s), what slot 0 carries, and b.

    ``base`` (home mode only) is a leaf copy of E(x_s): every use of b at the origin
    (its own group's applications and the head) accumulates its gradient there, and
    :meth:`backward` hands the sum to the embedding at the end of the step.
    """

    embedded: Tensor
    slot0: Tensor
    base: Tensor | None = None
    tokens: bool = False  # mode tokens: slot 0 is [0, x]; the head reads b = ``embedded``
    basis: StreamBasis | None = None  # the origin's maps (its own U when U is learned)

    def backward(self, grad: Tensor) -> None:
        """Back-propagate slot 0's gradient (and b's) into the replica's embedding."""
        if self.tokens:  # slot 0 does not depend on E; each use of b had its own graph
            return
        if self.base is None:
            self.slot0.backward(grad)
        elif self.base.grad is not None:  # home: slot 0 carries 0; E reached the loss via b
            self.embedded.backward(self.base.grad)


class StreamMaps:
    """The run's maps between hidden states and what travels (identity when off)."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.bottleneck = cfg.subspace.bottleneck
        basis = None if self.bottleneck else build_basis(cfg.model(), cfg.seed)
        self.basis = None if basis is None else StreamBasis(basis.to(device), cfg.subspace.mode)
        self.on = cfg.subspace.on  # a slot carries k-wide coordinates, not h
        self.recompute = cfg.memory.recompute
        self.tokens = self.on and cfg.subspace.mode == "tokens"
        self.learn = self.on and cfg.subspace.learn
        self.cfg = cfg
        # learned U: worker → its replica's maps; bottleneck: worker → its group's coder
        self._bases: dict[int, StreamBasis] = {}

    def bind(self, worker: int, group: nn.Module, replica: nn.Module) -> None:
        """Worker ``worker``'s group and replica: with a learned U, its maps (and its
        blocks' writes through U) read the replica's :class:`SharedBasis`; in mode
        ``bottleneck`` its maps are its group's encoder and decoder (every engine binds
        every worker it runs)."""
        coder = getattr(group, "bottleneck", None)
        if self.bottleneck:
            if coder is None:
                raise ValueError("subspace mode 'bottleneck': the group has no bottleneck")
            self._bases[worker] = BottleneckBasis(coder, self.cfg.subspace.mode)
            return
        shared = getattr(replica, "subspace", None)
        if not self.learn or shared is None:
            return
        assert self.basis is not None
        self._bases[worker] = StreamBasis(shared, self.basis.mode)
        share_basis(group, shared)
        if len(self._bases) == 1:  # what a reader of ``basis`` sees (privacy analyses)
            self.basis = self._bases[worker]

    def basis_of(self, worker: int | None) -> StreamBasis:
        """The maps of worker ``worker`` (the run's one fixed U unless U is learned; None:
        the first bound worker's, equal to every worker's at a barrier). In mode
        ``bottleneck`` the worker's group's coder (a worker is required)."""
        if self.bottleneck:
            if worker is None or worker not in self._bases:
                raise ValueError(
                    f"subspace mode 'bottleneck': worker {worker} is not bound (bind()); "
                    "its maps are its own group's encoder and decoder"
                )
            return self._bases[worker]
        assert self.basis is not None
        if self.learn and worker is not None:
            if worker not in self._bases:
                raise ValueError(f"learned subspace: worker {worker} is not bound (bind())")
            return self._bases[worker]
        return self.basis

    def enter(
        self, e: Tensor, grad: bool = True, ids: Tensor | None = None, worker: int | None = None
    ) -> Entry:
        """Slot 0 of a stream from its embedding ``e`` = E(ids) (with ``grad``: a training
        step) at its origin ``worker`` (needed with a learned U). Mode ``tokens`` needs the
        token ids: slot 0 is [0, ids]."""
        if not self.on:
            return Entry(e, e)
        basis = self.basis_of(worker)
        if self.tokens:
            if ids is None:
                raise ValueError("subspace mode 'tokens': the stream's entry needs its token ids")
            zeros = e.new_zeros(*e.shape[:-1], basis.U.size(1))
            slot0 = torch.cat([zeros, ids.to(e.dtype).unsqueeze(-1)], dim=-1)
            return Entry(e, slot0, None, True, basis)
        base = None
        if basis.mode in HOME_MODES:
            base = e.detach().requires_grad_() if grad else e
        return Entry(e, basis.enter(e), base, basis=basis)

    def ends_round(self, step: int) -> bool:
        """Whether 0-based training step ``step`` is the last of a round (a barrier follows:
        every ``sync_every`` steps and at the end, as the coordinator's RoundPlan)."""
        sync, steps = self.cfg.sync_every, self.cfg.steps
        return bool(sync) and ((step + 1) % sync == 0 or step + 1 == steps)

    def count_step(self, replica: nn.Module) -> None:
        """A training step of ``replica``'s worker is done (its gradient is in U.grad)."""
        shared = getattr(replica, "subspace", None)
        if self.learn and shared is not None:
            shared.count_step()

    def end_round(self, replica: nn.Module, step: int) -> None:
        """The worker's local step on its learned W at the end of a round ending with step
        ``step``: lr = ``subspace.lr`` × (the run's multiplier at ``step`` for schedule run)."""
        shared = getattr(replica, "subspace", None)
        if not self.learn or shared is None:
            return
        sub = self.cfg.subspace
        mult = self.cfg.lr_multiplier(step) if sub.schedule == "run" else 1.0
        shared.local_step(sub.lr * mult, self.cfg.micro_batches)

    def apply(
        self,
        group: nn.Module,
        x: Tensor,
        t: int,
        worker: int,
        origin: int,
        entry: Entry | None,
        embed: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """Group ``worker`` at application t on a slot of stream ``origin``; ``entry`` is
        that stream's own :class:`Entry` where the worker is its origin (else None);
        ``embed`` is the worker's own E (mode ``tokens``: b = E_worker(x)).

        With ``memory.recompute`` (in a training step) only the inputs are kept; the
        group's activations are recomputed in backward, bit for bit."""
        base = None
        if self.on and entry is not None and worker == origin:
            base = entry.base
        if self.tokens and embed is None:
            raise ValueError("subspace mode 'tokens': an application needs its worker's E")
        basis = self.basis_of(worker) if self.on else None
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._apply, group, x, t, base, embed, basis, use_reentrant=False)
        return self._apply(group, x, t, base, embed, basis)

    def _apply(
        self,
        group: nn.Module,
        x: Tensor,
        t: int,
        base: Tensor | None,
        embed: Callable[[Tensor], Tensor] | None = None,
        basis: StreamBasis | None = None,
    ) -> Tensor:
        if basis is None:
            return group(x, t)
        if self.tokens:
            assert embed is not None
            c, ids = self.split(x)
            out = basis.apply(group, c, t, embed(ids.squeeze(-1).long()))
            return torch.cat([out, ids.detach()], dim=-1)
        return basis.apply(group, x, t, base)

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Mode ``tokens``: a forward slot [c, x] → (c [B, T, k], ids [B, T, 1] as floats)."""
        assert self.basis is not None
        k = self.basis.U.size(1)
        return x[..., :k], x[..., k:]

    def head(self, x: Tensor, entry: Entry) -> Tensor:
        """The hidden state the head reads from slot K (at the origin)."""
        if not self.on:
            return x
        basis = entry.basis or self.basis_of(None)
        if self.tokens:
            return basis.expand(self.split(x)[0], entry.embedded)
        return basis.expand(x, entry.base)

    def grad_out(self, g: Tensor) -> Tensor:
        """What a backward hop carries for a slot's gradient ``g``: in mode ``tokens`` its
        coordinates' part [B, T, k] (the ids channel's gradient is 0 and is not sent)."""
        return g[..., :-1].contiguous() if self.tokens else g

    def grad_in(self, g: Tensor) -> Tensor:
        """The slot's gradient from what a backward hop carried (mode ``tokens``: a zero
        gradient for the ids channel appended)."""
        return nn.functional.pad(g, (0, 1)) if self.tokens else g


def subspace_state(replicas: list[nn.Module]) -> dict:
    """A checkpoint's entry for learned U's (``{}`` when U is not learned): each replica's
    Adam moments and partial gradient (W itself is in the replica's state)."""
    shared = [getattr(r, "subspace", None) for r in replicas]
    if not any(s is not None for s in shared):
        return {}
    return {"subspace": [None if s is None else s.extra_state() for s in shared]}


def load_subspace_state(replicas: list[nn.Module], state: dict) -> None:
    """Restore :func:`subspace_state` (after the replicas' own state)."""
    for replica, extra in zip(replicas, state.get("subspace") or []):
        shared = getattr(replica, "subspace", None)
        if shared is not None and extra is not None:
            shared.load_extra_state(extra)
