"""The privacy block of the coordinator's status: defences on and the (ε, δ) spent."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from mobius_fed.defences.accounting import (
    ACCOUNTANT_NAMES,
    INPUT_COVERS,
    INPUT_NOT_COVERED,
    PrivacyExtraMissing,
    epsilon_spent,
    er_epsilon_spent,
    input_epsilon_spent,
)

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig
    from mobius_fed.privacy_config import PrivacyConfig


_LAST_HOP = "gradient returned by the home for the final hidden state"
_FIRST_HOP = "hidden state of a stream's first remote hop"
_BARRIER = "the shared E/R each site sends at a barrier"


def _entries(pc: PrivacyConfig) -> list[tuple[bool, dict[str, Any]]]:
    """(on?, entry) for every defence, in the order the status lists them."""
    # fmt: skip below keeps the table one defence to a row group: when it is on, its entry.
    return [
        (pc.label_noise > 0, {"name": "label_noise", "hop": _LAST_HOP,
                              "sigma": pc.label_noise, "clip": pc.label_clip}),
        (pc.input_noise > 0, {"name": "input_noise", "hop": _FIRST_HOP,
                              "sigma": pc.input_noise, "clip": pc.input_clip}),
        (pc.decorrelation > 0, {"name": "decorrelation",
                                "hop": f"{_FIRST_HOP} (NoPeek loss at its origin)",
                                "weight": pc.decorrelation}),
        (pc.home_layer != "off", {"name": "home_layer", "hop": _LAST_HOP,
                                  "layer": pc.home_layer, "trained": pc.home_layer_trained}),
        (pc.home_input != "off", {"name": "home_input",
                                  "hop": "every hidden state of a stream (a private layer on "
                                  "E(x) at its origin)",
                                  "layer": pc.home_input, "trained": pc.home_input_trained}),
        (pc.er_noise > 0, {"name": "er_dp", "hop": f"{_BARRIER} (DP-FedAvg)",
                           "z": pc.er_noise, "clip": pc.er_clip}),
        (pc.er_secagg, {"name": "er_secagg",
                        "hop": f"{_BARRIER} (masked: the coordinator learns only the sum)",
                        "bits": pc.er_secagg_bits, "range": pc.er_secagg_range}),
    ]  # fmt: skip


def defences(cfg: TrainConfig) -> list[dict[str, Any]]:
    """One entry per defence that is on, with its parameters and the hop it guards."""
    return [entry for on, entry in _entries(cfg.privacy) if on]


def _input_block(cfg: TrainConfig, step: int) -> dict[str, Any]:
    """The clipped input noise and its ε per position and per sequence (None: infinite,
    or the ``privacy`` extra is missing, which ``error`` names)."""
    pc = cfg.privacy
    out: dict[str, Any] = {
        "noise": pc.input_noise,
        "clip": pc.input_clip,
        "covers": INPUT_COVERS,
        "not_covered": INPUT_NOT_COVERED,
        "target_sequence": pc.input_epsilon_target,
    }
    try:
        eps = input_epsilon_spent(pc, step, cfg.model().seq_len)
        run = input_epsilon_spent(pc, cfg.steps, cfg.model().seq_len)
    except PrivacyExtraMissing as exc:
        return {**out, "epsilon_position": None, "epsilon_sequence": None, "error": str(exc)}
    for suffix, spent in (("", eps), ("_whole_run", run)):
        for unit, value in spent.items():
            out[f"epsilon_{unit}{suffix}"] = value if math.isfinite(value) else None
    # every site sends each of its streams' first hop once per step, with its own key
    per_step = {k: out[k] for k in ("epsilon_position", "epsilon_sequence")}
    out["per_site"] = [{"site": s, **per_step} for s in range(cfg.workers)]
    return out


def status_block(cfg: TrainConfig, step: int) -> dict[str, Any] | None:
    """None when no defence is on; else the defences, the noise key and (ε, δ) spent.

    ``step`` is the number of training steps done. ``epsilon`` covers the label defence's
    hop only (see docs/privacy.md); it is None when the label defence is off, or when the
    ``privacy`` extra is missing (``error`` then says what to install). ``er.epsilon`` is
    the E/R's DP-FedAvg, for a whole site, after the barriers done; ``input`` the clipped
    input noise's, per position and per sequence (see :mod:`.accounting`).
    """
    pc = cfg.privacy
    if not pc.any_defence():
        return None
    block: dict[str, Any] = {
        "defences": defences(cfg),
        "noise_key": "site secrets" if pc.noise_key_dir else "public seed (removable)",
        "steps": step,
        "delta": pc.delta,
        "epsilon": None,
    }
    if pc.er_noise > 0:  # DP-FedAvg of the shared E/R: whole-site adjacency, per barrier
        rounds = -(-step // cfg.sync_every) if cfg.sync_every else 0
        block["er"] = {"noise": pc.er_noise, "clip": pc.er_clip, "rounds": rounds}
        block["accountant"] = ACCOUNTANT_NAMES[pc.accountant]
        try:
            eps = er_epsilon_spent(pc, rounds)
            block["er"]["epsilon"] = eps if math.isfinite(eps) else None
        except PrivacyExtraMissing as exc:
            block["error"] = str(exc)
    if pc.input_noise > 0 and pc.input_clip is not None:
        block["input"] = _input_block(cfg, step)
        block["accountant"] = ACCOUNTANT_NAMES[pc.accountant]
    if pc.label_noise > 0:
        block["accountant"] = ACCOUNTANT_NAMES[pc.accountant]
        block["sample_rate"] = pc.sample_rate
        try:
            eps = epsilon_spent(pc, step)
            block["epsilon"] = eps if math.isfinite(eps) else None
        except PrivacyExtraMissing as exc:
            block["error"] = str(exc)
    return block
