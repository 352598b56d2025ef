"""The run configuration shared by the reference engine, workers and the coordinator."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mobius_fed.data.vocab import BUILTIN_VOCAB, encoding_vocab, hf_path
from mobius_fed.model.config import (
    HOME_MODES,
    PRESETS,
    MemoryConfig,
    ModelConfig,
    Precision,
    SubspaceConfig,
    bottleneck_problem,
    make_model_config,
    show_split,
    split_problem,
)
from mobius_fed.model.knobs import LoopKnobs
from mobius_fed.privacy_config import PrivacyConfig
from mobius_fed.schedule import ORDERS, Order
from mobius_fed.settings import (  # noqa: F401 - re-exported: the config API lives here
    ENV_PREFIX,
    ConfigError,
    describe_validation_error,
    layered_config,
    read_toml,
    settings_of,
)
from mobius_fed.transport.wire_config import CodecName, WireConfig

ENCODING_VOCAB = BUILTIN_VOCAB  # plus hf:<tokenizer.json> (data §tokenizers)


class BoundsConfig(BaseModel):
    """Bounds on what a site sends (docs/security.md, "Bounds on what a site sends"): the
    per-token RMS of every hidden state and gradient a worker receives, checked against
    its sender's running median and a ceiling, and a clip of each site's E/R update at the
    barrier. On by default with generous limits: a clean run never reaches them, so its
    losses are those of a run without them."""

    model_config = ConfigDict(extra="forbid")

    frames: bool = Field(
        True,
        description="check the per-token RMS of every received hidden state and gradient "
        "(non-finite values are refused either way)",
    )
    state_factor: float = Field(
        100.0,
        gt=1,
        description="refuse a hidden state whose largest per-token RMS exceeds this many "
        "times the running median of its sender's",
    )
    grad_factor: float = Field(
        300.0,
        gt=1,
        description="refuse a gradient whose largest per-token RMS exceeds this many times "
        "the running median of its sender's",
    )
    state_ceiling: float = Field(
        1e4, gt=0, description="refuse a hidden state with a per-token RMS above this"
    )
    grad_ceiling: float = Field(
        1e4, gt=0, description="refuse a gradient with a per-token RMS above this"
    )
    window: int = Field(
        64, ge=1, description="frames per sender and kind the running median is taken over"
    )
    warmup: int = Field(
        8,
        ge=1,
        description="frames a sender's median needs before the relative bound applies "
        "(before: the ceiling alone)",
    )
    suspect_after: int = Field(
        3, ge=1, description="refused frames after which a sender is reported as suspect"
    )
    er_clip_factor: float = Field(
        10.0,
        ge=0,
        description="at a barrier, clip a site's E/R update norm to this many times the "
        "round's lower median of the update norms (0: off)",
    )
    er_clip_max: float | None = Field(
        None, gt=0, description="at a barrier, clip a site's E/R update norm to this; unset: none"
    )


class AuditConfig(BaseModel):
    """Checks that a site told the truth about what it sent (docs/security.md,
    "Commitments"): with ``commitments`` each site signs, with its own TLS key, the sha256
    of every ring frame it sent and received, and sends the list with its barrier reply;
    the coordinator compares every edge's two ends. With ``rate`` > 0 it also replays, in
    secret draws, a site's rounds from its upload and compares what its group sent
    (docs/audits.md, "Audits by recomputation"). Nothing here changes the math."""

    model_config = ConfigDict(extra="forbid")

    commitments: bool = Field(
        True,
        description="each site signs the sha256 of every ring frame it sent and received; "
        "the coordinator compares each hop's sender and receiver (coordinated runs)",
    )
    rate: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="audits by recomputation (docs/audits.md): the chance, drawn in secret "
        "after the fact, that one round of one site is replayed and compared with what it "
        "committed; the replay costs this fraction of the sites' compute (0: off; needs "
        "commitments)",
    )
    window: int = Field(
        0, ge=0, description="steps of an audited round replayed (0: all of its steps)"
    )
    keep_rounds: int = Field(
        2,
        ge=1,
        description="rounds of received and sent frames (and group state) a site keeps "
        "for an audit; older ones are dropped",
    )
    timeout_s: float = Field(
        3600.0,
        gt=0,
        description="an audit's upload that comes later than this after the train order "
        "asking for it was sent is named 'audit timed out' (keep it above a round's time)",
    )


ER_CODECS = ("none", "int8", "fp8", "fp8e5m2", "int6", "int5", "int4", "int3", "int2")
DOWN_CODECS = ("fp32", "int8", "int4")
MAX_SYNC_DELAY = 1


class SyncConfig(BaseModel):
    """How the E/R replicas are synced at each barrier (every ``sync_every`` steps,
    docs/er-sync.md): the outer step, the codec of
    each site's pseudo-gradient and how many rounds late the round's result lands."""

    model_config = ConfigDict(extra="forbid")

    outer: Literal["fedavg", "diloco"] | None = Field(
        None,
        description="outer step of the E/R round: fedavg (the average) or diloco (Nesterov "
        "SGD on the pseudo-gradient, outer_lr / outer_momentum; the coordinator's "
        "--strategy diloco); unset: the coordinator's --strategy (fedavg by default)",
    )
    codec: str = Field(
        "none",
        description="codec of each site's E/R pseudo-gradient (global E/R − its replica): "
        "int8, int4, ... (none: the replica travels in fp32)",
        json_schema_extra={"choices": list(ER_CODECS)},
    )
    error_feedback: bool = Field(
        True,
        description="with a codec: each site adds what its last payload rounded away into "
        "its next pseudo-gradient (--no-sync-error-feedback: off)",
    )
    down_codec: Literal["fp32", "int8", "int4"] = Field(
        "fp32",
        description="codec of the way down: the synced E/R in fp32, or the codec's payload of "
        "its change since the last broadcast (the coordinator keeps what every site holds; "
        "needs a sync codec)",
    )
    delay: int = Field(
        0,
        ge=0,
        description=f"τ: rounds the E/R round's result lands late (0 or 1, at most "
        f"{MAX_SYNC_DELAY}); with 1 a site trains on from its own E/R and adds the global "
        "change of round r at the end of round r + 1",
    )

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        if v not in ER_CODECS:
            raise ValueError(
                f"sync codec {v!r}: the E/R path takes {', '.join(ER_CODECS)} (lowrank needs "
                "matrices, and the E/R holds vectors)"
            )
        return v

    @property
    def on_sites(self) -> bool:
        """Whether a site does more than send its replica and load the average."""
        return self.codec != "none" or self.delay > 0

    @property
    def active(self) -> bool:
        """Whether the barrier differs from plain FedAvg of fp32 replicas."""
        return self.on_sites or self.outer == "diloco"

    def named(self) -> str:
        """The settings that differ from their defaults: ``sync.codec=int8 sync.delay=1``."""
        own = self.model_dump()
        plain = SyncConfig().model_dump()
        return " ".join(f"sync.{k}={v}" for k, v in own.items() if v != plain[k])

    def problem(self, train: TrainConfig) -> str | None:
        """Why ``train`` cannot run these settings (None: it can)."""
        if self.delay > MAX_SYNC_DELAY:
            return (
                f"sync delay τ={self.delay} exceeds the limit {MAX_SYNC_DELAY}: a site keeps "
                "one round's sent E/R, so the result of round r lands at the end of r + 1 at "
                "the latest"
            )
        if self.down_codec != "fp32" and self.codec == "none":
            return (
                f"sync.down_codec={self.down_codec} needs a sync codec (sync.codec ≠ none): a "
                "site's pseudo-gradient is taken against the E/R it holds, which lags the "
                "coordinator's by what the way down has not sent yet"
            )
        if not self.active:
            return None
        if train.sync_every < 1:
            return (
                f"{self.named()} needs E/R barriers: sync_every={train.sync_every} never "
                "syncs (set sync_every ≥ 1)"
            )
        if not self.on_sites:
            return None
        pc = train.privacy
        clash = [
            name
            for name, on in (
                ("rings > 1 (τ = 1 across rings is not built)", train.rings > 1 and self.delay > 0),
                (
                    "privacy.er_secagg (masked sums need exact arithmetic, not a codec's)",
                    pc.er_secagg and self.codec != "none",
                ),
                (
                    "privacy.er_secagg (masks are taken against the global E/R, and a down "
                    "codec leaves the sites another)",
                    pc.er_secagg and self.down_codec != "fp32",
                ),
                ("privacy.er_noise", pc.er_noise > 0),
                ("subspace.learn", train.subspace.learn),
            )
            if on
        ]
        if clash:
            return f"{self.named()} cannot be combined with {', '.join(clash)} yet"
        return None


class TrainConfig(BaseModel):
    """Everything that defines the math of a run: equal configs give equal losses."""

    model_config = ConfigDict(extra="forbid")

    preset: str = Field(
        "cpu-small",
        description="model preset (layers, width, heads, sequence length)",
        json_schema_extra={"choices": list(PRESETS)},
    )
    workers: int = Field(
        4, ge=1, description="worker processes = sites = origins (R·P; with one ring, P)"
    )
    rings: int = Field(
        1, ge=1, description="R: rings of P = workers / R block groups each (docs/rings.md)"
    )
    ring_sync_every: int = Field(
        1, ge=1, description="H: average each block group across the R rings every H steps"
    )
    ring_outer: Literal["fedavg", "diloco"] = Field(
        "fedavg",
        description="outer step of a ring sync: fedavg (the average) or diloco (Nesterov "
        "SGD on the pseudo-gradient, arXiv 2311.08105)",
    )
    ring_codec: CodecName = Field(
        "none",
        description="codec of the pseudo-gradients a ring sync sends (int8, int4, ...; "
        "none: the groups travel in fp32)",
    )
    ring_down_codec: Literal["fp32", "int8", "int4"] = Field(
        "fp32",
        description="codec of a ring sync's way down: the synced groups in fp32, or the "
        "codec's payload of their change since the last sync (needs ring_codec)",
    )
    ring_aggregate: Literal["mean", "median", "trimmed", "krum"] = Field(
        "mean",
        description="how a ring sync combines the R rings' F_i: mean (the weighted average), "
        "or Flower's median, trimmed mean or Krum (R ≥ 3; docs/rings.md)",
    )
    ring_trim: float = Field(
        0.34, ge=0, description="trimmed: fraction of the rings cut off each end (1/R to < 0.5)"
    )
    ring_krum_f: int = Field(1, ge=0, description="krum: rings that may lie (needs R ≥ 2f + 3)")
    outer_lr: float = Field(0.7, gt=0, description="diloco: outer learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="diloco: outer Nesterov momentum")
    loops: int = Field(1, ge=1, description="L: complete passes over the P groups")
    order: Order = Field("cyclic", description="cyclic (Möbius) or ordered (the baseline)")
    steps: int = Field(120, ge=1, description="optimizer steps")
    batch_size: int = Field(8, ge=1, description="sequences per origin per step")
    seq_len: int | None = Field(None, ge=2, description="tokens per sequence; unset: the preset's")
    n_layer: int | None = Field(None, ge=1, description="transformer blocks; unset: the preset's")
    layers_per_group: list[int] | None = Field(
        None,
        description="blocks of each group F_0..F_{P-1}, e.g. 4,4,2,2 (a slow site holds "
        "fewer); unset: n_layer / P each",
    )
    micro_batches: int = Field(
        1, ge=1, description="micro-batches per stream (overlap sending and computing)"
    )
    tied: bool = Field(True, description="embedding and head share weights (--no-tied: untied)")
    encoding: str = Field(
        "bytes",
        description="tokenizer: bytes (no download), a tiktoken encoding (gpt2, cl100k_base, "
        "...) or hf:<path to tokenizer.json>",
    )
    optimizer: Literal["muon", "adamw"] = Field(
        "muon", description="muon: Muon for block matrices + AdamW for the rest; adamw: AdamW only"
    )
    lr_adam: float = Field(8e-3, gt=0, description="AdamW learning rate")
    lr_muon: float = Field(0.02, gt=0, description="Muon learning rate")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    warmup_steps: int = Field(10, ge=0, description="linear learning-rate warmup steps")
    cooldown_frac: float = Field(
        0.3, ge=0, le=1, description="fraction of the steps with a linear cooldown to 0"
    )
    sync_every: int = Field(1, ge=0, description="average E/R replicas every k steps; 0 = never")
    seed: int = Field(0, description="seed of the weights, data order and noise")
    eval_every: int = Field(
        40, ge=0, description="validate (Eq. 8) every k steps; 0 = only at the end"
    )
    eval_batches: int = Field(2, ge=1, description="validation batches per origin")
    wire_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="dtype of hidden states and gradients on ring hops"
    )
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = Field(
        "original", description="torch.optim.Muon's adjust_lr_fn"
    )
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu", description="where blocks run; auto = cuda when available"
    )
    precision: Precision = Field(
        "bf16",
        description="block arithmetic on CUDA: bf16 autocast or fp32 (CPU always runs fp32)",
    )
    wire: WireConfig = Field(default_factory=WireConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    knobs: LoopKnobs = Field(default_factory=LoopKnobs)
    subspace: SubspaceConfig = Field(default_factory=SubspaceConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    bounds: BoundsConfig = Field(default_factory=BoundsConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)

    @model_validator(mode="before")
    @classmethod
    def _expand_states_only(cls, data: object) -> object:
        """``privacy.preset = states-only`` fills the wire it names where left unset: a
        home-mode subspace of rank d/4 with full-width writes, and int8/int4 stochastic
        codecs (:data:`STATES_ONLY`)."""
        if not isinstance(data, dict):
            return data
        privacy = data.get("privacy")
        name = (
            privacy.get("preset") if isinstance(privacy, dict) else getattr(privacy, "preset", None)
        )
        if name != "states-only":
            return data
        out = dict(data)
        d = PRESETS.get(str(out.get("preset", "cpu-small")), PRESETS["cpu-small"])["d_model"]
        sub = out.get("subspace")
        if sub is None or isinstance(sub, dict):
            fill = {"rank": int(d) // STATES_ONLY["rank_divisor"], **STATES_ONLY["subspace"]}
            out["subspace"] = {**fill, **(sub or {})}
        wire = out.get("wire")
        if wire is None or isinstance(wire, dict):
            out["wire"] = {**STATES_ONLY["wire"], **(wire or {})}
        return out

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError(f"unknown preset {v!r} (expected one of {', '.join(PRESETS)})")
        return v

    @field_validator("order", mode="before")
    @classmethod
    def _known_order(cls, v: object) -> object:
        if v not in ORDERS:
            raise ValueError(f"unknown order {v!r} (expected one of {', '.join(ORDERS)})")
        return v

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, v: str) -> str:
        if v not in ENCODING_VOCAB and hf_path(v) is None:
            raise ValueError(
                f"unknown encoding {v!r} (expected one of {', '.join(ENCODING_VOCAB)}, "
                "or hf:<path to tokenizer.json>)"
            )
        return v

    @field_validator("layers_per_group", mode="before")
    @classmethod
    def _split_text(cls, v: object) -> object:
        if isinstance(v, str):  # "4,4,2,2", as the flag and an environment variable write it
            try:
                return [int(p) for p in v.replace(" ", "").split(",") if p]
            except ValueError:
                raise ValueError(f"layers_per_group {v!r}: expected counts like 4,4,2,2") from None
        return v

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        n_layer = self.n_layer or PRESETS[self.preset]["n_layer"]
        problem = split_problem(self.layers_per_group, n_layer, self.P)
        if problem:
            raise ValueError(problem)
        if self.layers_per_group and len(set(self.layers_per_group)) == 1:
            self.layers_per_group = None  # the even split, written out: the same run
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by "
                f"micro_batches={self.micro_batches}"
            )
        if self.subspace.writes != "basis" and not self.subspace.on:
            raise ValueError(
                f"subspace writes {self.subspace.writes!r} needs a subspace: set subspace "
                "rank k > 0 (--subspace-rank K)"
            )
        if self.subspace.learn and not self.subspace.on:
            raise ValueError(
                "subspace learn needs a subspace: set subspace rank k > 0 (--subspace-rank K)"
            )
        if self.subspace.learn and self.sync_every < 1:
            raise ValueError(
                "subspace learn needs barriers (sync_every ≥ 1): a learned U is averaged at "
                "each barrier, so that every worker uses the same U"
            )
        if self.subspace.on and self.subspace.mode in HOME_MODES and self.order != "cyclic":
            other = "bottleneck" if self.subspace.bottleneck else "stream"
            raise ValueError(
                f"subspace mode {self.subspace.mode!r} needs the cyclic order: in the ordered "
                "order a stream would reach the groups before its origin's with no input "
                f"(its embedding stays home); use mode {other!r}"
            )
        if self.subspace.bottleneck:
            _check_bottleneck(self)
        if self.privacy.preset == "states-only":
            _check_states_only(self)
        if self.subspace.on and self.subspace.mode == "tokens":
            self._check_tokens_mode()
        _check_rings(self)
        if why := self.sync.problem(self):
            raise ValueError(why)
        self.model()  # raises on a rank above d_model
        return self

    def _check_tokens_mode(self) -> None:
        """Subspace mode ``tokens`` sends each micro-batch's token ids to every group on its
        path (docs/wan.md §7): an input defence has nothing left to hide, and the ids must
        arrive exactly."""
        pc = self.privacy
        defences = [
            f"privacy.{name} = {getattr(pc, name)!r}"
            for name in ("home_input", "input_noise", "decorrelation")
            if getattr(pc, name) != PrivacyConfig.model_fields[name].default
        ]
        if defences:
            raise ValueError(
                f"subspace mode 'tokens' cannot be combined with {', '.join(defences)}: in "
                "this mode the token ids travel in the clear to every group on a stream's "
                "path, so an input defence on E(x) protects nothing; use mode 'home' or "
                "'stream', or turn the input defence off"
            )
        if self.wire.fwd == "none" and self.wire_dtype != "fp32":
            raise ValueError(
                f"subspace mode 'tokens' with wire_dtype {self.wire_dtype!r} and no forward "
                "codec: the token ids travel as a channel of the forward tensor and would be "
                "rounded; use wire_dtype fp32 or a forward codec (--wire fwd=…), which sends "
                "them as exact 16-bit integers"
            )
        if self.model().vocab_size > 1 << 16:
            raise ValueError(
                f"subspace mode 'tokens' sends token ids as 16-bit integers: vocab_size "
                f"{self.model().vocab_size} exceeds 65536"
            )

    def model(self) -> ModelConfig:
        return make_model_config(
            self.preset,
            groups=self.P,
            vocab_size=encoding_vocab(self.encoding),
            tied=self.tied,
            seq_len=self.seq_len,
            n_layer=self.n_layer,
            loops=self.loops,
            knobs=self.knobs,
            precision=self.precision,
            subspace_rank=self.subspace.rank,
            subspace_writes=self.subspace.writes,
            subspace_learn=self.subspace.learn,
            subspace_bottleneck=self.subspace.bottleneck,
            loss_chunk=self.memory.loss_chunk,
            home_input=self.privacy.home_input,
            split=tuple(self.layers_per_group) if self.layers_per_group else None,
        )

    @property
    def P(self) -> int:
        """Block groups per ring (= workers with one ring)."""
        return self.workers // self.rings

    @property
    def K(self) -> int:
        return self.P * self.loops

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.batch_size * self.model().seq_len

    def ring_settings(self) -> str:
        """The settings every site of a run of rings must share, as a refusal names them."""
        text = f"workers={self.workers} rings={self.rings} ring_sync_every={self.ring_sync_every}"
        text += f" sync_every={self.sync_every} ring_outer={self.ring_outer}"
        text += f" ring_codec={self.ring_codec} ring_down_codec={self.ring_down_codec}"
        text += f" ring_aggregate={self.ring_aggregate}"
        knob = {"trimmed": f"ring_trim={self.ring_trim}", "krum": f"ring_krum_f={self.ring_krum_f}"}
        text += f" {knob[self.ring_aggregate]}" if self.ring_aggregate in knob else ""
        if self.ring_outer == "diloco":
            text += f" outer_lr={self.outer_lr} outer_momentum={self.outer_momentum}"
        return text

    def lr_multiplier(self, step: int) -> float:
        """Warmup / stable / linear cooldown, evaluated at 0-based ``step``."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        cooldown = math.ceil(self.cooldown_frac * self.steps)
        start = self.steps - cooldown
        if cooldown and step >= start:
            return max(0.0, (self.steps - step) / cooldown)
        return 1.0

    def training_math(self) -> dict[str, Any]:
        """The fields that change the trained weights (not run length or evaluation)."""
        return self.model_dump(
            mode="json", exclude={"steps", "eval_every", "eval_batches", "device", "precision"}
        )

    @property
    def split(self) -> str:
        """``4,4,2,2``: the blocks of each group (the even split included)."""
        return show_split(self.model().group_layers)

    def difference(self, saved: TrainConfig) -> str:
        """Why a checkpoint written under ``saved`` cannot continue this run ("" when its
        training math is this run's); a different split is named with both splits."""
        if saved.training_math() == self.training_math():
            return ""
        if saved.split != self.split:
            return (
                f"it was written with layers_per_group {saved.split}, this run has "
                f"layers_per_group {self.split}"
            )
        return "it was written with a different configuration"

    def fingerprint(self) -> str:
        """Hash of the whole config; peers refuse a run whose hash differs. A setting added
        after a release (``LATER_SETTINGS``) counts only when it differs from its default,
        so that manifests written before it existed still resume."""
        doc = self.model_dump(mode="json")
        for (*sections, key), default in LATER_SETTINGS.items():
            table = doc
            for section in sections:
                table = table[section]
            if table.get(key) == default:
                del table[key]
        blob = json.dumps(doc, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


MIN_ROBUST_RINGS = 3  # fewer: a median or trimmed mean is the mean, and no ring is outvoted


def ring_aggregate_problem(aggregate: str, rings: int, trim: float, krum_f: int) -> str | None:
    """Why ``rings`` rings cannot sync their groups with ``aggregate`` (None: they can);
    docs/rings.md "Robust aggregation across rings"."""
    if aggregate == "mean":
        return None
    if rings < MIN_ROBUST_RINGS:
        return (
            f"ring_aggregate={aggregate} needs rings ≥ {MIN_ROBUST_RINGS} (got rings={rings}): "
            "with fewer a median or trimmed mean is the mean, and no ring is outvoted"
        )
    if aggregate == "krum" and rings < 2 * krum_f + 3:
        return (
            f"ring_aggregate=krum with ring_krum_f={krum_f} needs rings ≥ 2·f + 3 = "
            f"{2 * krum_f + 3} (got rings={rings}): lower ring_krum_f or add rings"
        )
    cut = int(trim * rings)  # Flower's trimmed mean cuts int(beta·n) off each end
    if aggregate == "trimmed" and trim >= 0.5:
        every = ", every ring" if 2 * cut >= rings else ""
        return (
            f"ring_trim={trim} cuts {cut} of rings={rings} off each end{every}: the limit is "
            "ring_trim < 0.5 (Flower's trimmed mean)"
        )
    if aggregate == "trimmed" and cut == 0:
        return (
            f"ring_trim={trim} cuts int({trim}·{rings}) = 0 rings off each end, so the trimmed "
            f"mean is the mean: set ring_trim ≥ 1/{rings} (e.g. {math.ceil(100 / rings) / 100})"
        )
    return None


def _check_rings(cfg: TrainConfig) -> None:
    """R rings of P groups (docs/rings.md): workers = R·P, ring syncs at E/R barriers."""
    R = cfg.rings
    if cfg.workers % R:
        raise ValueError(
            f"rings={R} does not divide workers={cfg.workers}: R rings of P block groups "
            f"need workers = R·P (e.g. workers={R * max(1, cfg.workers // R)})"
        )
    if why := ring_aggregate_problem(cfg.ring_aggregate, R, cfg.ring_trim, cfg.ring_krum_f):
        raise ValueError(why)
    if R == 1:
        return
    if cfg.ring_down_codec != "fp32" and cfg.ring_codec == "none":
        raise ValueError(
            f"ring_down_codec={cfg.ring_down_codec} needs a ring codec (ring_codec ≠ none): a "
            "worker's pseudo-gradient is taken against the groups it holds, which lag the "
            "coordinator's by what the way down has not sent yet"
        )
    if cfg.sync_every < 1 or cfg.ring_sync_every % cfg.sync_every:
        raise ValueError(
            f"ring_sync_every={cfg.ring_sync_every} must be a multiple of "
            f"sync_every={cfg.sync_every} (≥ 1): a ring sync happens at an E/R barrier"
        )
    pc = cfg.privacy  # site-keyed features would key ring r's site i as site i
    clash = [
        name
        for name, on in (
            ("privacy.er_secagg", pc.er_secagg),
            ("privacy.home_layer", pc.home_layer != "off"),
            ("privacy.home_input", pc.home_input != "off"),
            ("privacy.noise_key_dir", pc.noise_key_dir is not None),
            ("subspace.learn", cfg.subspace.learn),
        )
        if on
    ]
    if clash:
        raise ValueError(f"rings > 1 cannot be combined with {', '.join(clash)} yet")


def _check_bottleneck(cfg: TrainConfig) -> None:
    """Subspace mode ``bottleneck`` (docs/explanation/subspace.md): each group's learned
    encoder sends k of the stream's d channels; there is no shared U."""
    sub = cfg.subspace
    if problem := bottleneck_problem(sub.rank, PRESETS[cfg.preset]["d_model"]):
        raise ValueError(problem)
    if sub.learn:
        raise ValueError(
            f"subspace mode {sub.mode!r} cannot be combined with subspace.learn: there is "
            "no shared U to learn (each group's encoder and decoder already train with "
            "the group); drop --subspace-learn"
        )
    if sub.writes != "full":
        raise ValueError(
            f"subspace mode {sub.mode!r} needs subspace writes 'full' (--subspace-writes "
            "full): the blocks write at full width inside a group and only what leaves "
            "it is encoded; writes 'basis' would make them write through a U the "
            "bottleneck does not have"
        )


def _check_states_only(cfg: TrainConfig) -> None:
    """The private wire mode refuses what would send ids or undo its defence."""
    pc, sub = cfg.privacy, cfg.subspace
    why = None
    if sub.bottleneck:
        why = (
            f"subspace mode {sub.mode!r} has not been audited with the preset's defences "
            "(the patient audit measures the bare bottleneck, docs/privacy.md §4k); the "
            "preset needs subspace mode 'home'"
        )
    elif not sub.on or sub.mode != "home":
        why = (
            "it needs a home-mode subspace (subspace mode 'home', rank > 0): mode 'tokens' "
            "sends the token ids, mode 'stream' and no subspace send E(x) itself"
            f" (got rank {sub.rank}, mode {sub.mode!r})"
        )
    elif pc.input_noise <= 0:
        why = "privacy.input_noise = 0 turns off the noise on the first send"
    elif pc.home_input == "off":
        why = "privacy.home_input = 'off' sends the shared E(x)'s image through U"
    if why:
        raise ValueError(f"privacy.preset 'states-only' refused: {why}")


# privacy.preset = states-only: the wire it fills where a configuration leaves it unset.
STATES_ONLY: dict[str, Any] = {
    "rank_divisor": 4,  # k = d / 4
    "subspace": {"mode": "home", "writes": "full"},
    "wire": {"fwd": "int8", "bwd": "int4", "rounding": "stochastic"},
}

# (sub-config, …, field) → default of the settings added after manifests were first written.
LATER_SETTINGS: dict[tuple[str, ...], Any] = {
    ("layers_per_group",): None,
    ("rings",): 1,
    ("ring_sync_every",): 1,
    ("ring_outer",): "fedavg",
    ("ring_codec",): "none",
    ("ring_down_codec",): "fp32",
    ("ring_aggregate",): "mean",
    ("ring_trim",): 0.34,
    ("ring_krum_f",): 1,
    ("outer_lr",): 0.7,
    ("outer_momentum",): 0.9,
    ("subspace", "writes"): "basis",
    ("subspace", "learn"): False,
    ("subspace", "lr"): 1e-3,
    ("subspace", "schedule"): "run",
    ("privacy", "preset"): "off",
    ("privacy", "input_epsilon_target"): None,
    ("bounds",): BoundsConfig().model_dump(mode="json"),
    ("sync", "down_codec"): "fp32",  # before ("sync",): a default sync then drops whole
    ("sync",): SyncConfig().model_dump(mode="json", exclude={"down_codec"}),
    ("audit",): AuditConfig().model_dump(mode="json"),
}
