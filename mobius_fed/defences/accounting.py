"""(ε, δ) of the noise defences, from Opacus' accountants (optional extra ``privacy``).

Label defence: one step releases every target of the home's batch once, through a
Gaussian mechanism: each token's gradient of its own loss is clipped to L2 norm C and
noise N(0, σ²C²) is added. Changing one target moves that token's clipped gradient by at
most 2C, so under replace-one adjacency the effective noise multiplier is σ/2 (we account
with it). Steps compose; ``sample_rate`` < 1 claims amplification by Poisson sampling.

Input defence with ``input_clip`` C: one step releases each position's hidden state at the
first remote hop once, clipped to C, plus N(0, σ²C²) per coordinate. Two units:

* **position** — replacing what one position carries moves it by at most 2C: multiplier
  σ/2. Where the first send is the embedding itself (ordered order, origin s ≠ 0) a
  position is a token, so this is the per-token guarantee;
* **sequence** — after a block group (the cyclic first send, F_s's output) attention
  spreads one token over every later position, so changing one token can move all T
  positions: sensitivity 2C·√T, multiplier σ/(2√T). This is the guarantee for a token, or
  a whole sequence, wherever the first send has passed a group.
"""

from __future__ import annotations

import math
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
