"""How hidden states and gradients are encoded on ring hops (``TrainConfig.wire``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

CodecName = Literal[
    "none", "int8", "fp8", "fp8e5m2", "int6", "int5", "int4", "int3", "int2", "lowrank"
]


class WireConfig(BaseModel):
    """Per-direction wire codecs (see :mod:`mobius_fed.transport.compress`).

    ``none`` keeps the fp32/bf16/fp16 cast of ``wire_dtype``; any other codec replaces it
    on the hops it applies to (hops that leave a machine). The reference engine applies
    the same codec at the same hops, so a ring still equals it bit for bit.
    """

    model_config = ConfigDict(extra="forbid")

    fwd: CodecName = Field("none", description="codec of forward hidden states")
    bwd: CodecName = Field("none", description="codec of backward gradients")
    group: int = Field(
        64, ge=8, le=4096, description="values per scale of int*/fp8 codecs (a multiple of 8)"
    )
    rank: int = Field(8, ge=1, le=1024, description="rank of the lowrank codec")
    rounding: Literal["nearest", "stochastic"] = Field(
        "nearest",
        description="int* codecs: round to nearest, or stochastically (unbiased; drawn from "
        "a seed per hop, so the ring and the reference draw alike)",
    )

    @field_validator("group")
    @classmethod
    def _whole_bytes(cls, v: int) -> int:
        if v % 8:
            raise ValueError(f"group={v} is not a multiple of 8 (codes are packed 8 at a time)")
        return v

    @classmethod
    def parse_flag(cls, text: str) -> dict[str, Any]:
        """``--wire fwd=int8,bwd=fp8`` (also ``group=…``, ``rank=…``, ``rounding=…``;
        ``both=…`` sets fwd and bwd): the fields given, validated; ValueError names the
        bad item."""
        values: dict[str, object] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or not value:
                raise ValueError(f"--wire {item!r}: expected KEY=VALUE (e.g. fwd=int8,bwd=fp8)")
            if key == "both":
                values["fwd"] = values["bwd"] = value
            elif key in cls.model_fields:
                values[key] = value
            else:
                raise ValueError(
                    f"--wire {item!r}: unknown key {key!r} (expected one of "
                    f"both, {', '.join(cls.model_fields)})"
                )
        try:
            model = cls.model_validate(values)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(x) for x in err.get("loc", ())) or "wire"
            raise ValueError(f"--wire {text!r}: {loc}: {err.get('msg', '')}") from exc
        return {key: getattr(model, key) for key in values}
