"""Optimizers, learning-rate schedule and gradient scaling shared by every trainer.

The reference engine and the ring workers call exactly these functions, so a group's
update is computed by the same code on one machine or many.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from mobius_fed.model.group import LOOP_PARAMETERS

ADAM_BETAS = (0.9, 0.95)


class OptimizerSettings(Protocol):
    """The optimizer's part of a run's settings (``TrainConfig`` has it): this layer reads
    no more of the run configuration than these."""

    optimizer: Literal["muon", "adamw"]
    lr_adam: float
    lr_muon: float
    weight_decay: float
    muon_adjust_lr: Literal["original", "match_rms_adamw"]

    def lr_multiplier(self, step: int) -> float: ...


def make_optimizers(
    module: nn.Module, cfg: OptimizerSettings, *, blocks: bool
) -> list[torch.optim.Optimizer]:
    """Muon for the 2-D weight matrices of block groups, AdamW for everything else
    (embedding, head, gains and the loop knobs' depth vectors).

    ``cfg.optimizer == "adamw"`` uses AdamW for every parameter (no bf16 Newton–Schulz).
    ``cfg.muon_adjust_lr`` is torch's ``adjust_lr_fn``: "original" scales a matrix's step by
    sqrt(max(1, rows/cols)) (Keller Jordan's Muon, as in modded-nanogpt and the paper);
    "match_rms_adamw" by 0.2·sqrt(max(rows, cols)) (Moonshot's, to match AdamW's update RMS).
    """
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    matrices = [
        p
        for n, p in named
        if blocks and p.ndim == 2 and cfg.optimizer == "muon" and n not in LOOP_PARAMETERS
    ]
    rest = [p for _, p in named if not any(p is q for q in matrices)]
    opts: list[torch.optim.Optimizer] = []
    if matrices:
        opts.append(
            torch.optim.Muon(
                matrices,
                lr=cfg.lr_muon,
                weight_decay=cfg.weight_decay,
                momentum=0.95,
                adjust_lr_fn=cfg.muon_adjust_lr,
            )
        )
    if rest:
        opts.append(
            torch.optim.AdamW(
                rest, lr=cfg.lr_adam, betas=ADAM_BETAS, eps=1e-10, weight_decay=cfg.weight_decay
            )
        )
    for opt in opts:
        for group in opt.param_groups:
            group["base_lr"] = group["lr"]
    return opts


def step_optimizers(
    opts: Sequence[torch.optim.Optimizer], cfg: OptimizerSettings, step: int
) -> None:
    """Apply the warmup/stable/cooldown multiplier for ``step``, step, and clear gradients."""
    mult = cfg.lr_multiplier(step)
    for opt in opts:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * mult
        opt.step()
        opt.zero_grad(set_to_none=True)


def scale_grads(params: Iterable[Tensor], factor: float) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def mean_loss(losses: Sequence[Tensor]) -> float:
    """Mean of per-micro-batch losses (equal-size micro-batches = the full-batch mean)."""
    return torch.stack([x.detach() for x in losses]).mean().item()


@torch.no_grad()
def average_parameters(modules: Sequence[nn.Module]) -> None:
    """Plain FedAvg of replicas in place: every shared parameter becomes the mean over modules."""
    shared = [getattr(m, "shared_parameters", m.parameters)() for m in modules]
    for params in zip(*shared):
        mean = torch.stack(list(params)).mean(0)
        for p in params:
            p.copy_(mean)
