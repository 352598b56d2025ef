"""Loop-count knobs shared by both orders (``TrainConfig.knobs``); all off by default.

* ``depth_embedding``: a learned vector per application index t (0..K-1), added to the
  hidden state before the group runs. Group i owns its own table ``[K, d]`` (zero at
  init), so a worker needs nothing from anyone else and both engines stay exact.
* ``residual_scale``: the update of a repeated visit is scaled, h ← h + ε·(F_i(h) − h),
  with ε = 1/L (``inverse_loops``) or 1/√L (``inverse_sqrt_loops``) for L passes — the
  1/N rule of "On the Residual Scaling of Looped Transformers" (Wang et al., 2026,
  arXiv 2606.18524) against the 1/√N rule of deep non-shared residual networks.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ResidualScale = Literal["off", "inverse_loops", "inverse_sqrt_loops"]


class LoopKnobs(BaseModel):
    """Options the looped-transformer literature found important (the paper has none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    depth_embedding: bool = Field(
        False,
        description="learned vector per application index t added before each group "
        "(owned by the group; zero at init)",
    )
    residual_scale: ResidualScale = Field(
        "off",
        description="scale each visit's update F(h) - h by 1/L (inverse_loops) or "
        "1/sqrt(L) (inverse_sqrt_loops)",
    )

    def active(self) -> dict[str, object]:
        """The knobs that are on (empty for the paper's model)."""
        return {k: v for k, v in self.model_dump().items() if v not in (False, "off")}


def residual_epsilon(scale: ResidualScale, loops: int) -> float:
    """ε of ``residual_scale`` for L = ``loops`` passes (1.0 when off)."""
    if loops < 1:
        raise ValueError(f"loops must be ≥ 1, got {loops}")
    if scale == "inverse_loops":
        return 1.0 / loops
    if scale == "inverse_sqrt_loops":
        return 1.0 / math.sqrt(loops)
    if scale == "off":
        return 1.0
    raise ValueError(f"unknown residual_scale {scale!r}")
