"""Model shape: presets and the validated model configuration."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mobius_fed.model.knobs import LoopKnobs, ResidualScale

Precision = Literal["bf16", "fp32"]
"""Block arithmetic on CUDA: bf16 autocast (residual stream fp32) or fp32 throughout."""
HomeInput = Literal["off", "rotation", "mlp", "block"]
"""The private input layer each origin applies to E(x) (``privacy.home_input``)."""
SubspaceMode = Literal["stream", "home", "tokens", "bottleneck", "bottleneck-home"]
BOTTLENECK_MODES = ("bottleneck", "bottleneck-home")  # no U: learned coders per group
HOME_MODES = ("home", "bottleneck-home")  # b = E(x) at the origin, cyclic order only
SubspaceWrites = Literal["basis", "full"]


class ModelConfig(BaseModel):
    """Shape of the modded GPT-2 split into P block groups."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_layer: int = Field(ge=1)
    d_model: int = Field(ge=8)
    n_head: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    vocab_size: int = Field(ge=2)
    seq_len: int = Field(ge=2)
    groups: int = Field(ge=1, description="P, the number of block groups (= workers)")
    tied: bool = True
    mlp_ratio: int = 4
    logit_cap: float = 30.0
    loops: int = Field(1, ge=1, description="L: passes, so K = L·P applications per path")
    depth_embedding: bool = False
    residual_scale: ResidualScale = "off"
    precision: Precision = "bf16"
    subspace_rank: int = Field(0, ge=0, description="k of the shared residual subspace; 0 = off")
    subspace_writes: SubspaceWrites = Field(
        "basis", description="basis: blocks write through U; full: only the hops are projected"
    )
    subspace_learn: bool = Field(False, description="U trains (each replica holds W, U = orth(W))")
    subspace_bottleneck: bool = Field(
        False, description="each group owns a learned encoder d → k and decoder k → d (no U)"
    )
    loss_chunk: int = Field(0, ge=0, description="tokens per head cross-entropy chunk; 0 = off")
    home_input: HomeInput = Field("off", description="each origin's private input layer")
    split: tuple[int, ...] | None = Field(
        None, description="blocks of each group F_0..F_{P-1}; None: n_layer / P each"
    )

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        problem = split_problem(self.split, self.n_layer, self.groups)
        if problem:
            raise ValueError(problem)
        if self.subspace_rank > self.d_model:
            raise ValueError(f"subspace rank {self.subspace_rank} exceeds d_model={self.d_model}")
        if self.subspace_bottleneck:
            if problem := bottleneck_problem(self.subspace_rank, self.d_model):
                raise ValueError(problem)
            if self.subspace_writes != "full" or self.subspace_learn:
                raise ValueError(
                    "the bottleneck has no U: it needs subspace_writes 'full' and no learned U"
                )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        return self

    @property
    def group_layers(self) -> tuple[int, ...]:
        """Blocks of each group F_0..F_{P-1} (the split; even unless ``split`` is set)."""
        return self.split or (self.n_layer // self.groups,) * self.groups

    @property
    def even(self) -> bool:
        return len(set(self.group_layers)) == 1

    @property
    def applications(self) -> int:
        """K = L·P: block-group applications on every stream's path."""
        return self.loops * self.groups


class MemoryConfig(BaseModel):
    """``TrainConfig.memory``: trade compute for memory on a worker."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recompute: bool = Field(
        False, description="keep only each group application's input; recompute in backward"
    )
    loss_chunk: int = Field(
        0, ge=0, description="tokens per chunk of the head's cross-entropy; 0 = all at once"
    )


class SubspaceConfig(BaseModel):
    """``TrainConfig.subspace``: rank 0 (the default) is the paper's unconstrained model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(
        0, ge=0, description="k: width of the shared residual subspace on the wire; 0 = off"
    )
    mode: SubspaceMode = Field(
        "stream",
        description="stream: the embedding is projected too (b = 0); home: the token "
        "embedding stays at its origin (b = E(x) there, cyclic order only); tokens: the token "
        "ids travel with the coordinates and every group rebuilds b = E(x) from its own E; "
        "bottleneck: no U, each group's learned encoder (d → k, with an identity path over "
        "every (d/k)-th channel) sends k channels and the receiver's learned decoder restores "
        "d (needs writes full, no learned U, k dividing d); bottleneck-home: the same, "
        "with E(x) kept at its origin as in home (cyclic order only)",
    )
    writes: SubspaceWrites = Field(
        "basis",
        description="basis: every block writes through U, so the residual stream is k wide "
        "everywhere; full: blocks write at full width inside a group and only the hops are "
        "projected (what leaves the machine)",
    )
    learn: bool = Field(
        False,
        description="U trains: averaged at every barrier like E/R, kept orthonormal by a QR "
        "retraction, the same on every worker in every step (docs/wan.md §7); off: U stays "
        "the seed's",
    )
    lr: float = Field(
        1e-3, gt=0, description="Adam learning rate of a learned U (one step per round)"
    )
    schedule: Literal["run", "constant"] = Field(
        "run",
        description="learned U's learning-rate schedule: run (the run's warmup and cooldown, "
        "as lr_adam) or constant",
    )

    @property
    def on(self) -> bool:
        return self.rank > 0

    @property
    def bottleneck(self) -> bool:
        """A learned bottleneck (modes ``bottleneck``, ``bottleneck-home``): no U."""
        return self.on and self.mode in BOTTLENECK_MODES


def bottleneck_problem(k: int, d: int) -> str:
    """Why a bottleneck of width ``k`` cannot sit on a stream of width ``d``, or ""."""
    if not 0 < k <= d:
        return (
            f"subspace mode 'bottleneck': rank k={k} must be in 1..d_model={d} (the code is "
            "k channels of the d-wide stream)"
        )
    if d % k:
        return (
            f"subspace mode 'bottleneck': rank k={k} does not divide d_model={d}: the "
            f"identity path keeps every (d/k)-th channel (try k = {d // 2}, {d // 4} or "
            f"{d // 8})"
        )
    return ""


def show_split(split: tuple[int, ...] | list[int]) -> str:
    """``4,4,2,2``: a split as the flag writes it."""
    return ",".join(map(str, split))


def split_problem(split: tuple[int, ...] | list[int] | None, n_layer: int, groups: int) -> str:
    """Why ``split`` (blocks per group; None: even) cannot hold ``n_layer`` blocks in
    ``groups`` groups, or "" when it can."""
    if split is None:
        if n_layer < groups:
            return f"n_layer={n_layer} is fewer than P={groups} workers: a group needs a layer"
        if n_layer % groups:
            return (
                f"n_layer={n_layer} is not divisible by P={groups} workers: an even split needs "
                f"the same number of layers in every group; give the split with "
                f"--layers-per-group (e.g. {show_split(near_even_split(n_layer, groups))})"
            )
        return ""
    shown = show_split(split)
    bad = [n for n in split if n < 1]
    if bad:
        return f"layers_per_group {shown}: every group needs at least one layer, not {bad[0]}"
    if len(split) > groups:
        return (
            f"layers_per_group {shown} names {len(split)} groups, more groups than sites: "
            f"the run has P={groups} workers, one group each"
        )
    if len(split) < groups:
        return (
            f"layers_per_group {shown} names {len(split)} groups, but the run has P={groups} "
            f"workers: give one count per worker"
        )
    if sum(split) != n_layer:
        return f"layers_per_group {shown} sums to {sum(split)} layers, not n_layer={n_layer}"
    return ""


def near_even_split(n_layer: int, groups: int) -> tuple[int, ...]:
    """The even split, or the nearest one where ``groups`` does not divide ``n_layer``."""
    q, r = divmod(n_layer, groups)
    return tuple(q + (i < r) for i in range(groups))


# vocab_size None = derived from the encoding (padded to a multiple of 64).
PRESETS: dict[str, dict] = {
    # The paper's 124M model: 12 layers, width 768, 6 heads × 128, 4 groups × 3 layers.
    "gpt2-small": dict(
        n_layer=12, d_model=768, n_head=6, head_dim=128, vocab_size=50304, seq_len=1024
    ),
    # A GPU-sized model on the byte vocabulary (no tokenizer download): 21M parameters.
    "gpu-small": dict(n_layer=12, d_model=384, n_head=6, head_dim=64, vocab_size=None, seq_len=512),
    # CPU presets for tests and demos (12 layers so that P = 2, 3, 4 and 6 all divide).
    "cpu-tiny": dict(n_layer=12, d_model=32, n_head=2, head_dim=16, vocab_size=None, seq_len=32),
    "cpu-small": dict(n_layer=12, d_model=96, n_head=3, head_dim=32, vocab_size=None, seq_len=128),
    "cpu-base": dict(n_layer=12, d_model=192, n_head=6, head_dim=32, vocab_size=None, seq_len=256),
    # The width ladder of the compression benchmark (docs/wan.md §7): one depth, one context,
    # one vocabulary; only the width d (and the heads with it) changes.
    "width-48": dict(n_layer=12, d_model=48, n_head=3, head_dim=16, vocab_size=None, seq_len=64),
    "width-96": dict(n_layer=12, d_model=96, n_head=3, head_dim=32, vocab_size=None, seq_len=64),
    "width-192": dict(n_layer=12, d_model=192, n_head=6, head_dim=32, vocab_size=None, seq_len=64),
    "width-384": dict(n_layer=12, d_model=384, n_head=6, head_dim=64, vocab_size=None, seq_len=64),
}


def pad_vocab(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def make_model_config(
    preset: str,
    *,
    groups: int,
    vocab_size: int,
    tied: bool = True,
    seq_len: int | None = None,
    n_layer: int | None = None,
    loops: int = 1,
    knobs: LoopKnobs | None = None,
    precision: Precision = "bf16",
    subspace_rank: int = 0,
    subspace_writes: SubspaceWrites = "basis",
    subspace_learn: bool = False,
    subspace_bottleneck: bool = False,
    loss_chunk: int = 0,
    home_input: HomeInput = "off",
    split: tuple[int, ...] | None = None,
) -> ModelConfig:
    """Resolve a preset name into a ModelConfig; unknown names raise ValueError.

    ``loops`` and ``knobs`` matter only when a loop knob is on (the groups' extra
    parameters depend on K = loops · groups).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (expected one of {', '.join(PRESETS)})")
    spec = dict(PRESETS[preset])
    if spec["vocab_size"] is None:
        spec["vocab_size"] = pad_vocab(vocab_size)
    elif spec["vocab_size"] < vocab_size:
        raise ValueError(f"preset {preset!r} vocab {spec['vocab_size']} < encoding {vocab_size}")
    if seq_len is not None:
        spec["seq_len"] = seq_len
    if n_layer is not None:
        spec["n_layer"] = n_layer
    knobs = knobs or LoopKnobs()
    return ModelConfig(
        groups=groups,
        tied=tied,
        loops=loops,
        depth_embedding=knobs.depth_embedding,
        residual_scale=knobs.residual_scale,
        precision=precision,
        subspace_rank=subspace_rank,
        subspace_writes=subspace_writes,
        subspace_learn=subspace_learn,
        subspace_bottleneck=subspace_bottleneck,
        loss_chunk=loss_chunk,
        home_input=home_input,
        split=split,
        **spec,
    )
