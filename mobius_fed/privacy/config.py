"""Privacy defences of a run (``TrainConfig.privacy``); all off by default."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class PrivacyConfig(BaseModel):
    """Defences against an honest-but-curious neighbour on the ring."""

    model_config = ConfigDict(extra="forbid")
