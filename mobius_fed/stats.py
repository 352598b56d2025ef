"""Small-sample statistics for seeds: mean, sample std, Student-t 95 % intervals."""

from __future__ import annotations

import math
from collections.abc import Sequence

# Two-sided 97.5 % quantiles of Student's t for 1..30 degrees of freedom.
# fmt: skip below keeps ten quantiles a row, so a degree of freedom is found by its row.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """Student-t 0.975 quantile (df ≥ 1); the normal 1.960 beyond 30 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be ≥ 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.960


def mean(xs: Sequence[float]) -> float:
    if not xs:
        raise ValueError("mean of no values")
    return sum(xs) / len(xs)


def std(xs: Sequence[float]) -> float:
    """Sample standard deviation (n − 1); 0 for a single value."""
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ci95(xs: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width) of the 95 % t-interval; half-width is nan for a single value."""
    m = mean(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, t975(len(xs) - 1) * std(xs) / math.sqrt(len(xs))
