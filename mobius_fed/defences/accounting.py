"""(ε, δ) of the noise defences, from Opacus' accountants (optional extra ``privacy``).

Label defence: per-token clip C, noise σC, replace-one adjacency, so the effective multiplier
is σ/2, composed over steps (``sample_rate`` < 1 claims Poisson amplification). Input defence
(``input_clip`` C) in two units: **position** (multiplier σ/2) and **sequence** (attention
spreads one token over T positions: multiplier σ/(2√T)). Derivations: docs/privacy.md §3.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mobius_fed.privacy_config import PrivacyConfig

EXTRA_HINT = (
    "the label defence's (epsilon, delta) needs Opacus' accountants: "
    "pip install 'mobius-fed[privacy]' (or: pip install opacus)"
)
ACCOUNTANT_NAMES = {
    "rdp": "opacus.accountants.RDPAccountant",
    "prv": "opacus.accountants.PRVAccountant",
}


class PrivacyExtraMissing(RuntimeError):
    """Opacus is not installed (the ``privacy`` extra)."""


def _accountant_class(kind: str) -> type:
    try:
        from opacus.accountants import PRVAccountant, RDPAccountant
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise PrivacyExtraMissing(EXTRA_HINT) from exc
    return {"rdp": RDPAccountant, "prv": PRVAccountant}[kind]


def _epsilon(pc: PrivacyConfig, sigma: float, q: float, count: int) -> float:
    """ε after ``count`` Gaussian releases of multiplier ``sigma`` at rate ``q``, at
    ``pc.delta`` (none: 0; no noise: infinity)."""
    if count <= 0:
        return 0.0
    if sigma <= 0:
        return float("inf")
    accountant = _accountant_class(pc.accountant)()
    accountant.history = [(sigma, q, count)]
    return float(accountant.get_epsilon(delta=pc.delta))


def epsilon_spent(pc: PrivacyConfig, steps: int) -> float:
    """ε of the label defence after ``steps`` steps (0 steps: 0; no noise: infinity), with
    σ/2 for replace-one adjacency of one target (sensitivity 2C, noise σC)."""
    return _epsilon(pc, pc.label_noise / 2.0, pc.sample_rate, steps)


def input_epsilon_spent(pc: PrivacyConfig, steps: int, seq_len: int) -> dict[str, float]:
    """ε of the clipped input noise after ``steps`` steps: {"position": …, "sequence": …}
    (no ``input_clip``: both infinite; 0 steps: 0)."""
    if pc.input_clip is None:
        return {"position": float("inf"), "sequence": float("inf")}
    sigma = pc.input_noise / 2.0
    return {
        "position": _epsilon(pc, sigma, pc.sample_rate, steps),
        "sequence": _epsilon(pc, sigma / math.sqrt(seq_len), pc.sample_rate, steps),
    }


def er_epsilon_spent(pc: PrivacyConfig, rounds: int) -> float:
    """ε of the E/R's DP-FedAvg after ``rounds`` barriers (replace-one site: z/2, q = 1)."""
    return _epsilon(pc, pc.er_noise / 2.0, 1.0, rounds)
