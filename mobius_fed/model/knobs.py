"""Loop-count knobs shared by both orders (``TrainConfig.knobs``); all off by default."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class LoopKnobs(BaseModel):
    """Options the looped-transformer literature found important (the paper has none)."""

    model_config = ConfigDict(extra="forbid")
