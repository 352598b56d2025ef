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


INPUT_COVERS = (
    "the hidden state of each of the site's streams at its first remote hop (clipped to C, "
    "noised with the site's key) and everything computed from that send alone: the later "
    "forward hops of the stream and what receivers compute from them"
)
INPUT_NOT_COVERED = (
    "the gradient the home returns for the final hidden state (it depends on the targets, "
    "the next tokens: the label defence's own epsilon covers it when label_noise is on), "
    "the site's E/R update at each barrier (covered only by DP-FedAvg, er_noise), and the "
    "weights of the site's own block group, trained on its raw embedding and applied to "
    "other sites' streams"
)


def input_sigma_for_target(pc: PrivacyConfig, steps: int, seq_len: int, target: float) -> float:
    """The smallest ``input_noise`` σ whose per-sequence ε after ``steps`` steps is ≤
    ``target`` (Opacus' search over the noise multiplier; ``pc``'s accountant and δ)."""
    try:
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise PrivacyExtraMissing(EXTRA_HINT) from exc
    z = get_noise_multiplier(
        target_epsilon=target,
        target_delta=pc.delta,
        sample_rate=pc.sample_rate,
        steps=steps,
        accountant=pc.accountant,
    )
    return 2.0 * math.sqrt(seq_len) * float(z)


def check_input_target(pc: PrivacyConfig, steps: int, seq_len: int) -> None:
    """Refuse a run whose clipped input noise cannot keep the per-sequence ε over all
    ``steps`` at or below ``pc.input_epsilon_target`` (an error naming the σ it needs)."""
    target = pc.input_epsilon_target
    if target is None:
        return
    eps = input_epsilon_spent(pc, steps, seq_len)["sequence"]
    if eps <= target:
        return
    need = input_sigma_for_target(pc, steps, seq_len, target)
    raise ValueError(
        f"privacy.input_epsilon_target = {target:g} per sequence cannot be met: "
        f"input_noise σ = {pc.input_noise:g} (clip {pc.input_clip:g}) gives ε = {eps:.3g} "
        f"per sequence after {steps} steps at δ = {pc.delta:g}, sample rate "
        f"{pc.sample_rate:g}; it needs input_noise ≥ {need:.3g}, or fewer steps"
    )


def er_epsilon_spent(pc: PrivacyConfig, rounds: int) -> float:
    """ε of the E/R's DP-FedAvg after ``rounds`` barriers (replace-one site: z/2, q = 1)."""
    return _epsilon(pc, pc.er_noise / 2.0, 1.0, rounds)
