"""How hidden states and gradients are encoded on ring hops (``TrainConfig.wire``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireConfig(BaseModel):
    """Per-direction wire codecs (the fp32/bf16/fp16 cast is still ``wire_dtype``)."""

    model_config = ConfigDict(extra="forbid")
