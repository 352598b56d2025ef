"""The run configuration shared by the reference engine, workers and the coordinator."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from mobius_fed.model.config import PRESETS, ModelConfig, make_model_config
from mobius_fed.model.knobs import LoopKnobs
from mobius_fed.privacy.config import PrivacyConfig
from mobius_fed.schedule import ORDERS, Order
from mobius_fed.transport.wire_config import WireConfig

ENCODING_VOCAB = {"bytes": 257, "gpt2": 50257}
WIRE_DTYPES = ("fp32", "bf16", "fp16")


class TrainConfig(BaseModel):
    """Everything that defines the math of a run: equal configs give equal losses."""

    model_config = ConfigDict(extra="forbid")

    preset: str = "cpu-small"
    workers: int = Field(4, ge=1, description="P: workers = block groups = origins")
    loops: int = Field(1, ge=1, description="L: complete passes over the P groups")
    order: Order = "cyclic"
    steps: int = Field(120, ge=1)
    batch_size: int = Field(8, ge=1, description="sequences per origin per step")
    seq_len: int | None = Field(None, ge=2, description="default: the preset's")
    n_layer: int | None = Field(None, ge=1, description="default: the preset's")
    micro_batches: int = Field(1, ge=1)
    tied: bool = True
    encoding: str = "bytes"
    optimizer: Literal["muon", "adamw"] = "muon"
    lr_adam: float = Field(8e-3, gt=0)
    lr_muon: float = Field(0.02, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0)
    cooldown_frac: float = Field(0.3, ge=0, le=1)
    sync_every: int = Field(1, ge=0, description="average E/R replicas every k steps; 0 = never")
    seed: int = 0
    eval_every: int = Field(40, ge=0, description="0 = only at the end")
    eval_batches: int = Field(2, ge=1)
    wire_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = Field(
        "original", description="torch.optim.Muon's adjust_lr_fn"
    )
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu", description="where blocks run; auto = cuda when available"
    )
    wire: WireConfig = Field(default_factory=WireConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    knobs: LoopKnobs = Field(default_factory=LoopKnobs)

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
        if v not in ENCODING_VOCAB:
            raise ValueError(
                f"unknown encoding {v!r} (expected one of {', '.join(ENCODING_VOCAB)})"
            )
        return v

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by "
                f"micro_batches={self.micro_batches}"
            )
        self.model()  # raises on layers not divisible by P
        return self

    def model(self) -> ModelConfig:
        return make_model_config(
            self.preset,
            groups=self.workers,
            vocab_size=ENCODING_VOCAB[self.encoding],
            tied=self.tied,
            seq_len=self.seq_len,
            n_layer=self.n_layer,
        )

    @property
    def P(self) -> int:
        return self.workers

    @property
    def K(self) -> int:
        return self.workers * self.loops

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.batch_size * self.model().seq_len

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
            mode="json", exclude={"steps", "eval_every", "eval_batches", "device"}
        )

    def fingerprint(self) -> str:
        """Hash of the whole config; peers refuse a run whose hash differs."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


ENV_PREFIX = "MOBIUS_"
# MOBIUS_<NAME> → TrainConfig field, read by both daemons.
TRAIN_ENV_KEYS = {
    "PRESET": "preset",
    "WORKERS": "workers",
    "LOOPS": "loops",
    "ORDER": "order",
    "SEED": "seed",
    "STEPS": "steps",
    "WIRE_DTYPE": "wire_dtype",
    "SYNC_EVERY": "sync_every",
    "EVAL_EVERY": "eval_every",
    "BATCH_SIZE": "batch_size",
}


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


def describe_validation_error(exc: Exception) -> str:
    """Turn a pydantic ValidationError into 'field: problem' lines."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    parts = []
    for err in errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "config"
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def read_toml(path: Path) -> dict[str, Any]:
    """Read a TOML file, with a clear error for a missing or malformed file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc


def load_train_config(
    path: Path | None = None, overrides: dict[str, Any] | None = None, *, section: str = "train"
) -> TrainConfig:
    """TrainConfig from an optional TOML file (its ``[train]`` table) plus overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        doc = read_toml(path)
        data.update(doc.get(section, {}) if section in doc else doc)
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid configuration: {describe_validation_error(exc)}") from exc
    except ValueError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc


def env_values(keys: dict[str, str], environ: dict[str, str]) -> dict[str, Any]:
    """``{field: value}`` for every ``MOBIUS_<NAME>`` of ``keys`` present in ``environ``."""
    return {key: environ[ENV_PREFIX + n] for n, key in keys.items() if ENV_PREFIX + n in environ}


def layered_settings(
    path: Path | None,
    section: str,
    env_keys: dict[str, str],
    flags: dict[str, Any],
    train_flags: dict[str, Any],
    environ: dict[str, str],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A daemon's settings and its ``[train]`` table: TOML, then MOBIUS_* env, then flags."""
    doc = read_toml(path) if path else {}
    top = {**doc.get(section, {}), **env_values(env_keys, environ)}
    train = {**doc.get("train", {}), **env_values(TRAIN_ENV_KEYS, environ)}
    top.update({k: v for k, v in flags.items() if v is not None})
    train.update({k: v for k, v in train_flags.items() if v is not None})
    return top, train
