"""Lossy wire codecs for hidden states and their gradients (``TrainConfig.wire``); the codec
table, their sources and the exactness argument: docs/wan.md §2.

Contract: a codec maps a float tensor to a flat ``uint8`` payload whose size is a pure
function of the shape, and back; the reference engine runs :meth:`Codec.roundtrip` (=
decode(encode(x))) at the same hop, so both ends see bit-identical tensors. Nothing uses the
global RNG (``lowrank`` starts from a fixed seed; stochastic rounding takes the caller's
seed). ``lowrank`` saves 2·N·d / (r·(N+d)) against fp32 (bf16 factors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

CODECS = ("none", "int8", "fp8", "fp8e5m2", "int6", "int5", "int4", "int3", "int2", "lowrank")
_FP8 = {"fp8": (torch.float8_e4m3fn, 448.0), "fp8e5m2": (torch.float8_e5m2, 57344.0)}
_BITS = {"int8": 8, "int6": 6, "int5": 5, "int4": 4, "int3": 3, "int2": 2}
HADAMARD_MAX = 128


class CodecError(ValueError):
    """A payload that does not decode (wrong size, non-finite result)."""


def _bf16_bytes(t: Tensor) -> Tensor:
    return t.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)


def _from_bf16_bytes(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.bfloat16).float()


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack ``uint8`` codes < 2**bits (length a multiple of 8) into ``bits`` bytes per 8."""
    if bits == 8:
        return codes
    c = codes.reshape(-1, 8).to(torch.int64)
    shifts = torch.arange(8, dtype=torch.int64) * bits
    word = (c << shifts).sum(dim=1, keepdim=True)
    out = (word >> (torch.arange(bits, dtype=torch.int64) * 8)) & 0xFF
    return out.to(torch.uint8).reshape(-1)


def unpack_bits(packed: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack_bits`."""
    if bits == 8:
        return packed
    b = packed.reshape(-1, bits).to(torch.int64)
    word = (b << (torch.arange(bits, dtype=torch.int64) * 8)).sum(dim=1, keepdim=True)
    codes = (word >> (torch.arange(8, dtype=torch.int64) * bits)) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(-1)


@lru_cache(maxsize=8)
def hadamard(n: int) -> Tensor:
    """The orthonormal n × n Sylvester–Hadamard matrix (n a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard_block(width: int) -> int:
    """Largest power of two dividing ``width``, at most :data:`HADAMARD_MAX`."""
    return min(width & -width, HADAMARD_MAX)


@dataclass(frozen=True)
class Codec:
    """One codec with its parameters; ``spec`` names it on the wire (e.g. ``int3/g64``)."""

    name: str
    group: int = 64
    rank: int = 8
    stochastic: bool = False  # int* codes: unbiased stochastic rounding (seeded per call)
    # The last channel holds token ids (subspace mode ``tokens``, docs/wan.md §7): they are
    # sent exactly, as 16-bit integers after the payload of the other channels.
    ids: bool = False

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"unknown wire codec {self.name!r} (expected one of {CODECS})")

    @property
    def spec(self) -> str:
        if self.name == "lowrank":
            return f"lowrank/r{self.rank}" + ("+ids" if self.ids else "")
        sr = "/sr" if self.stochastic and self.name in _BITS else ""
        return f"{self.name}/g{self.group}{sr}" + ("+ids" if self.ids else "")

    @property
    def lossless(self) -> bool:
        return self.name == "none"

    # ------------------------------------------------------------------ sizes
    def _groups(self, numel: int) -> int:
        return -(-numel // self.group)

    def payload_bytes(self, shape: tuple[int, ...]) -> int:
        """Exact payload size for a tensor of ``shape`` (what a receiver expects)."""
        if self.ids:
            inner, tokens = self._split_shape(shape)
            return self._values_only().payload_bytes(inner) + 2 * tokens
        if self.name == "lowrank":
            rows, width, r = self._factors(shape)
            return 2 * r * (rows + width)
        numel = math.prod(shape)
        groups = self._groups(numel)
        if self.name in _FP8:
            return 2 * groups + numel
        bits = _BITS[self.name]
        padded = groups * self.group
        return 2 * groups + -(-padded // 8) * bits

    def ratio(self, shape: tuple[int, ...]) -> float:
        """fp32 bytes / payload bytes."""
        return 4 * math.prod(shape) / self.payload_bytes(shape)

    # ------------------------------------------------------------ encode/decode
    def encode(self, t: Tensor, seed: int = 0) -> Tensor:
        """The payload of ``t`` (flat ``uint8``, :meth:`payload_bytes` long). ``seed``
        draws the stochastic rounding (the same seed gives the same payload)."""
        x = t.detach().to(device="cpu", dtype=torch.float32)
        if self.ids:
            ids = x[..., -1].reshape(-1).to(torch.int32)
            body = self._values_only().encode(x[..., :-1], seed)
            return torch.cat([body, ids.to(torch.int16).view(torch.uint8)])
        if self.name == "lowrank":
            return self._encode_lowrank(x)
        flat = self._rotate(x).reshape(-1)
        pad = self._groups(flat.numel()) * self.group - flat.numel()
        g = torch.nn.functional.pad(flat, (0, pad)).view(-1, self.group)
        absmax = g.abs().amax(dim=1, keepdim=True)
        if self.name in _FP8:
            dtype, top = _FP8[self.name]
            scale = (absmax / top).to(torch.bfloat16).float()
            q = (g / torch.where(scale > 0, scale, 1.0)).clamp(-top, top).to(dtype)
            return torch.cat([_bf16_bytes(scale), q.view(torch.uint8).reshape(-1)[: flat.numel()]])
        levels = 1 << _BITS[self.name]
        half = (levels - 1) / 2
        scale = (absmax / half).to(torch.bfloat16).float()
        v = g / torch.where(scale > 0, scale, 1.0) + half
        if self.stochastic:  # floor(v + u), u ~ U[0, 1): unbiased
            u = torch.rand(v.shape, generator=torch.Generator().manual_seed(seed))
            q = torch.floor(v + u).clamp(0, levels - 1)
        else:
            q = torch.round(v).clamp(0, levels - 1)
        codes = q.to(torch.uint8).reshape(-1)
        codes = torch.nn.functional.pad(codes, (0, -codes.numel() % 8))
        return torch.cat([_bf16_bytes(scale), pack_bits(codes, _BITS[self.name])])

    def decode(self, payload: Tensor, shape: tuple[int, ...]) -> Tensor:
        """The fp32 tensor of ``shape`` a payload stands for; :class:`CodecError` when the
        payload has the wrong size or decodes to non-finite values."""
        want = self.payload_bytes(shape)
        if payload.dtype != torch.uint8 or payload.numel() != want:
            raise CodecError(
                f"{self.spec} payload of {payload.numel()} bytes (expected {want} for shape "
                f"{tuple(shape)})"
            )
        if self.ids:
            inner, tokens = self._split_shape(shape)
            split = payload.numel() - 2 * tokens
            values = self._values_only().decode(payload[:split], inner)
            ids = payload[split:].clone().view(torch.int16).to(torch.int32) & 0xFFFF
            return torch.cat([values, ids.float().view(*inner[:-1], 1)], dim=-1)
        if self.name == "lowrank":
            out = self._decode_lowrank(payload, shape)
        else:
            numel = math.prod(shape)
            groups = self._groups(numel)
            scale = _from_bf16_bytes(payload[: 2 * groups]).view(-1, 1)
            body = payload[2 * groups :]
            if self.name in _FP8:
                dtype, _ = _FP8[self.name]
                pad = groups * self.group - numel
                codes = torch.nn.functional.pad(body, (0, pad)).view(dtype).float()
                g = codes.view(-1, self.group) * scale
            else:
                bits = _BITS[self.name]
                half = ((1 << bits) - 1) / 2
                codes = unpack_bits(body, bits)[: groups * self.group].float()
                g = (codes.view(-1, self.group) - half) * scale
            # the normalised Sylvester matrix is its own inverse: rotating again undoes it
            out = self._rotate(g.reshape(-1)[:numel].view(shape))
        if not bool(torch.isfinite(out).all()):
            raise CodecError(f"{self.spec} payload decodes to non-finite values")
        return out

    def roundtrip(self, t: Tensor, seed: int = 0) -> Tensor:
        """What the receiver of ``t`` gets: ``decode(encode(t))``."""
        return self.decode(self.encode(t, seed), tuple(t.shape)).to(device=t.device, dtype=t.dtype)

    # --------------------------------------------------------------- helpers
    def _values_only(self) -> Codec:
        """This codec for the channels before the ids."""
        return Codec(self.name, self.group, self.rank, self.stochastic)

    @staticmethod
    def _split_shape(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """(shape of the values, number of token ids) of a tensor whose last channel is ids."""
        if not shape or shape[-1] < 2:
            raise CodecError(f"a tensor with token ids needs ≥ 2 channels, got shape {shape}")
        return (*shape[:-1], shape[-1] - 1), math.prod(shape[:-1])

    def _rotate(self, x: Tensor) -> Tensor:
        if self.name not in _BITS or self.name == "int8":
            return x
        n = hadamard_block(x.shape[-1])
        return (x.reshape(*x.shape[:-1], -1, n) @ hadamard(n)).reshape(x.shape)

    def _factors(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        width = shape[-1]
        rows = math.prod(shape) // width
        return rows, width, min(self.rank, rows, width)

    def _encode_lowrank(self, x: Tensor) -> Tensor:
        rows, width, r = self._factors(tuple(x.shape))
        m = x.reshape(rows, width)
        gen = torch.Generator().manual_seed(0x4D0B1)
        q = torch.randn(width, r, generator=gen)
        p, _ = torch.linalg.qr(m @ q)  # one subspace iteration (PowerSGD)
        q = m.T @ p
        p, _ = torch.linalg.qr(m @ q)
        q = m.T @ p  # m ≈ p q^T, p orthonormal
        return torch.cat([_bf16_bytes(p), _bf16_bytes(q)])

    def _decode_lowrank(self, payload: Tensor, shape: tuple[int, ...]) -> Tensor:
        rows, width, r = self._factors(shape)
        p = _from_bf16_bytes(payload[: 2 * rows * r]).view(rows, r)
        q = _from_bf16_bytes(payload[2 * rows * r :]).view(width, r)
        return (p @ q.T).view(shape)
