"""The self-contained modded GPT-2 block (pre-norm, RoPE, QK-norm, ReLU², zero-init outputs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobius_fed.model.config import ModelConfig
from mobius_fed.model.subspace import BasisLinear


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``auto`` (cuda when available) → a torch device; asking for
    cuda without one is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device (use cpu or auto)")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r} (expected cpu, cuda or auto)")
    return torch.device(name)


def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    """Rotary position embedding over the head dimension."""

    cos: Tensor  # buffers
    sin: Tensor

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0) -> None:
        super().__init__()
        freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freq)
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # x: [B, T, H, D]
        T = x.size(1)
        cos, sin = self.cos[:, :T].to(x.dtype), self.sin[:, :T].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


def output_projection(in_features: int, d: int, basis: Tensor | None) -> nn.Linear | BasisLinear:
    """A block's output projection: unconstrained, or writing through U (see subspace.py).

    The unconstrained layer is built either way (its default init draws from the RNG), so
    every other weight draws the same values with or without U: paired comparisons."""
    unconstrained = nn.Linear(in_features, d, bias=False)
    return unconstrained if basis is None else BasisLinear(in_features, basis)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, basis: Tensor | None = None) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        inner = cfg.n_head * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * inner, bias=False)
        self.proj = output_projection(inner, cfg.d_model, basis)
        self.rotary = Rotary(cfg.head_dim, cfg.seq_len)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).unbind(2)
        q, k = self.rotary(rms_norm(q)), self.rotary(rms_norm(k))  # QK-norm, then RoPE
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, basis: Tensor | None = None) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, hidden, bias=False)
        self.proj = output_projection(hidden, cfg.d_model, basis)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    """One pre-norm block; it reads nothing but its input, so it works at any depth.

    With ``basis`` U its output projections write through U, so its update lies in span(U).
    """

    def __init__(self, cfg: ModelConfig, basis: Tensor | None = None) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, basis)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg, basis)
        self.bf16 = cfg.precision == "bf16"
        self.reset_parameters(cfg)

    @torch.no_grad()
    def reset_parameters(self, cfg: ModelConfig) -> None:
        bound = 3**0.5 * 0.5 * cfg.d_model**-0.5
        for lin in (self.attn.qkv, self.mlp.fc):
            lin.weight.uniform_(-bound, bound)
        for proj in (self.attn.proj, self.mlp.proj):  # zero-initialised output projections
            proj.weight.zero_()

    def forward(self, x: Tensor) -> Tensor:
        # On a GPU the block's matmuls and attention run in bf16 (autocast) unless the
        # precision is fp32; the residual stream, and so every hidden state handed between
        # groups, stays fp32.
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.is_cuda and self.bf16):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
