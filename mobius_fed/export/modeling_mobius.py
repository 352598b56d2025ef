"""One origin's path of a Möbius-trained model as a standalone causal LM (torch only).

This file is copied next to every export's ``model.safetensors`` and ``config.json``; it
needs only torch, and with ``transformers`` installed it also defines the classes that
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` loads.

Notation (Möbius Learning, arXiv 2607.17843): the model of origin s is
``R_s(home_s(F_{φ(K-1)}(… F_{φ(0)}(E_s(x)) …)))`` where φ = ``path`` lists the block group
applied at each application index t = 0..K-1 (K = L·P), E/R are the averaged embedding and
head (tied by default), ``home`` the origin's private home layer, if any, and E_s(x) =
rms_norm(input_s(rms_norm(E(x)))) with the origin's private input layer ``input_s``, if any.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KVCache = list  # one (k, v) pair per (application t, block), each [B, T, H, D]


def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    """Rotary position embedding over the head dimension, from position ``start``. The
    angles are computed when used (no buffers: nothing to initialise after loading)."""

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.base = head_dim, max_len, base

    def forward(self, x: Tensor, start: int = 0) -> Tensor:  # x: [B, T, H, D]
        end = start + x.size(1)
        if end > self.max_len:
            raise ValueError(f"position {end - 1} is past the model's context of {self.max_len}")
        d = self.head_dim
        freq = self.base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
        pos = torch.arange(start, end, dtype=torch.float32, device=x.device)
        angles = torch.outer(pos, freq)[None, :, None, :]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg["n_head"], cfg["head_dim"]
        inner = self.n_head * self.head_dim
        self.qkv = nn.Linear(cfg["d_model"], 3 * inner, bias=False)
        self.proj = nn.Linear(inner, cfg["d_model"], bias=False)
        self.rotary = Rotary(self.head_dim, cfg["seq_len"])

    def forward(self, x: Tensor, past: tuple[Tensor, Tensor] | None = None):
        """Attention of the new tokens ``x`` over ``past`` keys/values and their own;
        returns the output and the keys/values to cache."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).unbind(2)
        start = 0 if past is None else past[0].size(1)
        q, k = self.rotary(rms_norm(q), start), self.rotary(rms_norm(k), start)
        if past is not None:
            k, v = torch.cat((past[0], k), 1), torch.cat((past[1], v), 1)
        mask = None
        if start and T > 1:  # new token i sees the cache and new tokens 0..i
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=start == 0,
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden = cfg["mlp_ratio"] * cfg["d_model"]
        self.fc = nn.Linear(cfg["d_model"], hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg["d_model"], bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    """Pre-norm block: RMSNorm, attention with QK-norm and RoPE, RMSNorm, ReLU² MLP."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg["d_model"])
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.RMSNorm(cfg["d_model"])
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, past=None):
        a, kv = self.attn(self.norm1(x), past)
        x = x + a
        return x + self.mlp(self.norm2(x)), kv


def group_layers(cfg: dict) -> list[int]:
    """Blocks of each stored group j: ``layers_per_group`` is one count for all, or a list
    (an uneven split: one count per group of ``source_groups``)."""
    n = cfg["layers_per_group"]
    return list(n) if isinstance(n, list) else [n] * cfg["groups_in_path"]


class BlockGroup(nn.Module):
    """F_i: consecutive blocks, an optional depth table [K, d] and a residual scale ε."""

    def __init__(self, cfg: dict, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(layers))
        self.epsilon = float(cfg.get("residual_epsilon", 1.0))
        K = len(cfg["path"])
        self.depth_embedding = (
            nn.Parameter(torch.zeros(K, cfg["d_model"])) if cfg.get("depth_embedding") else None
        )

    def forward(self, x: Tensor, t: int, past: list | None = None):
        h = x if self.depth_embedding is None else x + self.depth_embedding[t]
        cache = []
        for b, block in enumerate(self.blocks):
            h, kv = block(h, None if past is None else past[b])
            cache.append(kv)
        if self.epsilon != 1.0:
            h = x + self.epsilon * (h - x)
        return h, cache


class HomeMLP(MLP):
    """The private home layer ``mlp``: W2 relu²(W1 rms_norm(h)), no identity path."""

    def forward(self, h: Tensor) -> Tensor:
        return super().forward(rms_norm(h))


class HomeBlock(nn.Module):
    """The private home layer ``block``: a block on rms_norm(h), then a HomeMLP. Its
    attention sees the whole sequence given (no cache: the home layer runs on it again)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.block = Block(cfg)
        self.mlp = HomeMLP(cfg)

    def forward(self, h: Tensor) -> Tensor:
        return self.mlp(self.block(rms_norm(h))[0])


class InputRotation(nn.Module):
    """The private input layer ``rotation``: e ↦ e·Q (Q drawn orthogonal, maybe trained)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg["d_model"], cfg["d_model"], bias=False)

    def forward(self, e: Tensor) -> Tensor:
        return self.proj(e)


INPUT_LAYERS = {"rotation": InputRotation, "mlp": HomeMLP, "block": HomeBlock}


def check_config(cfg: dict) -> None:
    """Refuse a config.json this file cannot build, naming the problem."""
    need = ("vocab_size", "d_model", "n_head", "head_dim", "seq_len", "layers_per_group")
    missing = [k for k in (*need, "path", "groups_in_path") if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    if cfg.get("home_layer", "off") not in ("off", "mlp", "block"):
        raise ValueError(f"config.json: unknown home_layer {cfg['home_layer']!r}")
    if cfg.get("home_input", "off") not in ("off", *INPUT_LAYERS):
        raise ValueError(f"config.json: unknown home_input {cfg['home_input']!r}")
    if any(not 0 <= j < cfg["groups_in_path"] for j in cfg["path"]):
        raise ValueError("config.json: path names a group outside groups_in_path")
    n = cfg["layers_per_group"]
    counts = n if isinstance(n, list) else [n]
    if not all(isinstance(c, int) and c >= 1 for c in counts):
        raise ValueError(f"config.json: layers_per_group {n!r} must be counts ≥ 1")
    if isinstance(n, list) and len(n) != cfg["groups_in_path"]:
        raise ValueError(
            f"config.json: layers_per_group names {len(n)} groups, groups_in_path is "
            f"{cfg['groups_in_path']}"
        )
    k, mode = cfg.get("subspace_rank", 0), cfg.get("subspace_mode", "stream")
    if not (isinstance(k, int) and 0 <= k <= cfg["d_model"]):
        raise ValueError(f"config.json: subspace_rank {k!r} outside 0..d_model={cfg['d_model']}")
    if mode not in ("stream", "home", "tokens"):
        raise ValueError(f"config.json: unknown subspace_mode {mode!r} (stream, home, tokens)")
    if k and mode == "home" and cfg.get("origin") not in (cfg.get("source_groups") or []):
        raise ValueError("config.json: subspace_mode home needs the origin among source_groups")


class Hops:
    """What travels between two applications of one forward pass: the hidden state, or
    with a shared subspace U its coordinates c = Uᵀ(h − b) (b = E(x) at the origin's own
    group in ``home`` mode, at every group in ``tokens`` mode, else 0), rebuilt as
    h = U·c + b by the next group. In ``tokens`` mode training rebuilt b from each group's
    worker's own E; they are equal after the final barrier's averaging, and the file
    holds one E (docs/wan.md §7)."""

    def __init__(self, core: MobiusCore, e: Tensor) -> None:
        self.U, self.e = core.subspace_basis, e
        self.home = core.mobius.get("subspace_mode") == "home"
        self.tokens = core.mobius.get("subspace_mode") == "tokens"
        groups, origin = core.mobius.get("source_groups") or [], core.mobius.get("origin")
        self.own = groups.index(origin) if origin in groups else None  # the origin's group
        if self.U is None:
            self.x = e
        else:
            zeros = self.home or self.tokens
            self.x = e.new_zeros(*e.shape[:-1], self.U.size(1)) if zeros else e @ self.U

    def apply(self, group: BlockGroup, j: int, t: int, past: list | None) -> list:
        """Group j at application t; returns its keys/values."""
        if self.U is None:
            self.x, kv = group(self.x, t, past)
            return kv
        b = self.e if (self.home and j == self.own) or self.tokens else None
        h = self.x @ self.U.T
        out, kv = group(h if b is None else h + b, t, past)
        self.x = (out if b is None else out - b) @ self.U
        return kv

    def last(self) -> Tensor:
        """The hidden state the head reads."""
        if self.U is None:
            return self.x
        h = self.x @ self.U.T
        return h + self.e if self.home or self.tokens else h


class MobiusCore:
    """The modules and forward pass shared by :class:`MobiusLM` and the transformers class."""

    def build(self, cfg: dict) -> None:
        check_config(cfg)
        self.mobius = dict(cfg)
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["d_model"])
        tied = cfg.get("tied", True)
        self.lm_head = None if tied else nn.Linear(cfg["d_model"], cfg["vocab_size"], bias=False)
        self.groups = nn.ModuleList(BlockGroup(cfg, n) for n in group_layers(cfg))
        kind = cfg.get("home_layer", "off")
        self.home = HomeMLP(cfg) if kind == "mlp" else HomeBlock(cfg) if kind == "block" else None
        entry = INPUT_LAYERS.get(cfg.get("home_input", "off"))
        self.home_input = None if entry is None else entry(cfg)
        k = int(cfg.get("subspace_rank", 0))
        if k:  # U [d, k] of the run's shared subspace (from the weights file)
            # Ignored: a mixin; MobiusLM and the transformers class are the nn.Modules.
            self.register_buffer("subspace_basis", torch.zeros(cfg["d_model"], k))  # type: ignore[attr-defined]
        else:
            self.subspace_basis = None

    def embed(self, idx: Tensor, past: KVCache | None) -> tuple[Tensor, tuple | None]:
        """E_s(x), and the keys/values of the input layer ``block`` (cached last)."""
        e = rms_norm(self.wte(idx))  # E
        layer = self.home_input
        if layer is None:
            return e, None
        if isinstance(layer, HomeBlock):
            h, kv = layer.block(rms_norm(e), None if past is None else past[-1])
            return rms_norm(layer.mlp(h)), kv
        return rms_norm(layer(e)), None

    def hidden_and_cache(self, idx: Tensor, past: KVCache | None = None) -> tuple[Tensor, KVCache]:
        """Final hidden states [B, T, d] of the tokens ``idx`` that follow ``past``, and the
        keys/values of all of them."""
        h, entry_kv = self.embed(idx, past)
        layers = group_layers(self.mobius)
        hop = Hops(self, h)
        cache: KVCache = []
        start = 0  # the cache holds each application's blocks in turn
        for t, j in enumerate(self.mobius["path"]):
            group_past = None if past is None else past[start : start + layers[j]]
            start += layers[j]
            cache.extend(hop.apply(self.groups[j], j, t, group_past))
        if entry_kv is not None:
            cache.append(entry_kv)
        return hop.last(), cache

    def head(self, h: Tensor) -> Tensor:
        """The home layer (if any), then R: soft-capped logits [B, T, V] in fp32."""
        if self.home is not None:
            h = self.home(h)
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(rms_norm(h), weight).float()
        cap = float(self.mobius.get("logit_cap", 30.0))
        return cap * torch.tanh(logits / cap)

    def logits(self, idx: Tensor) -> Tensor:
        return self.head(self.hidden_and_cache(idx)[0])


class MobiusLM(nn.Module, MobiusCore):
    """The exported model as a plain ``nn.Module``: ``model(idx)`` → logits [B, T, V]."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.build(cfg)

    def forward(self, idx: Tensor) -> Tensor:
        return self.logits(idx)

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean token cross-entropy (the training loss) of next tokens ``targets``."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    @property
    def seq_len(self) -> int:
        return int(self.mobius["seq_len"])

    @property
    def cached_home(self) -> bool:
        """False when the home layer attends (``block``): it then reruns on the sequence."""
        return self.mobius.get("home_layer", "off") != "block"


try:  # transformers is optional: without it the classes below are simply not defined
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput
except ImportError:  # pragma: no cover - exercised where transformers is missing
    pass
else:

    class MobiusConfig(PretrainedConfig):
        """config.json as a transformers config (every export field kept as is)."""

        model_type = "mobius"

        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("tie_word_embeddings", kwargs.get("tied", True))
            kwargs.setdefault("use_cache", False)  # generate() reruns the window (no HF cache)
            super().__init__(**kwargs)
            self.hidden_size = kwargs.get("d_model")
            self.num_attention_heads = kwargs.get("n_head")
            path, n = kwargs.get("path") or [], kwargs.get("layers_per_group") or 0
            self.num_hidden_layers = sum(n[j] if isinstance(n, list) else n for j in path)

    class MobiusForCausalLM(PreTrainedModel, GenerationMixin, MobiusCore):
        """``AutoModelForCausalLM`` of an export: forward(input_ids, labels=…) → logits and
        the next-token loss (labels shifted inside, as every causal LM of the Hub)."""

        config_class = MobiusConfig
        base_model_prefix = ""
        _tied_weights_keys: Any = None

        def __init__(self, config: MobiusConfig) -> None:
            super().__init__(config)
            self.build(config.to_dict())
            self.post_init()

        def _init_weights(self, module: nn.Module) -> None:  # weights come from the file
            return

        def get_input_embeddings(self) -> nn.Module:
            return self.wte

        def forward(self, input_ids: Tensor, labels: Tensor | None = None, **_: Any):
            logits = self.logits(input_ids)
            loss = None
            if labels is not None:
                shift, target = logits[:, :-1], labels[:, 1:]
                loss = F.cross_entropy(shift.reshape(-1, shift.size(-1)), target.reshape(-1))
            return CausalLMOutput(loss=loss, logits=logits)

        def prepare_inputs_for_generation(self, input_ids: Tensor, **kwargs: Any) -> dict:
            return {"input_ids": input_ids[:, -int(self.mobius["seq_len"]) :]}


__all__ = ["MobiusLM", "check_config"]
