"""(ε, δ) of the label defence, from Opacus' accountants (optional extra ``privacy``).

One step releases every target of the home's batch once, through a Gaussian mechanism:
each token's gradient of its own loss is clipped to L2 norm C and noise N(0, σ²C²) is
added. Changing one target moves that token's clipped gradient by at most 2C, so under
replace-one adjacency the effective noise multiplier is σ/2 (we account with it). Steps
compose; ``sample_rate`` < 1 claims amplification by Poisson sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mobius_fed.defences.config import PrivacyConfig

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


def effective_multiplier(pc: PrivacyConfig) -> float:
    """σ for replace-one adjacency of one target (sensitivity 2C, noise σC)."""
    return pc.label_noise / 2.0


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
    """ε of the label defence after ``steps`` steps (0 steps: 0; no noise: infinity)."""
    return _epsilon(pc, effective_multiplier(pc), pc.sample_rate, steps)


def er_epsilon_spent(pc: PrivacyConfig, rounds: int) -> float:
    """ε of the E/R's DP-FedAvg after ``rounds`` barriers (replace-one site: z/2, q = 1)."""
    return _epsilon(pc, pc.er_noise / 2.0, 1.0, rounds)
