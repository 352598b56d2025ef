"""Privacy defences of a run (``TrainConfig.privacy``); all off by default."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Named sets of input-defence fields (docs/privacy.md §4i). A preset fills the fields a
# configuration leaves unset; a field set explicitly wins. ``states-only`` also sets the wire
# (TrainConfig: a home-mode subspace and int8/int4 codecs, see STATES_ONLY in config.py).
PRIVACY_PRESETS: dict[str, dict[str, object]] = {
    # only hidden states and gradients travel (no token ids), compressed, with a private
    # input layer and RMS-relative noise on the k coordinates of the first send; its measured
    # price and audited margin: docs/privacy.md §4j
    "states-only": {"home_input": "mlp", "input_noise": 1.0},
}
# Presets that were removed, and why: a name must not promise what the audit cannot show.
REMOVED_PRESETS: dict[str, str] = {
    "patient-neighbour": (
        "the audit at the attacker's strength (short early windows, docs/privacy.md §4i) "
        "reads its worst victim far above the floor, so the name promised what it does not "
        "hold; set privacy.home_input = 'mlp' and privacy.input_noise = 1 to keep its "
        "fields, or use preset 'states-only'"
    ),
}


class PrivacyConfig(BaseModel):
    """Defences against an honest-but-curious neighbour on the ring."""

    model_config = ConfigDict(extra="forbid")

    preset: Literal["off", "states-only"] = Field(
        "off",
        description=(
            "a named private wire mode (docs/privacy.md §4j), filling the fields left unset: "
            "states-only = only hidden states travel (no token ids), in a home-mode subspace "
            "of rank d/4 with int8/int4 codecs, behind a private input layer (mlp) and noise "
            "on the coordinates of the first send (input_noise 1); needs noise_key_dir; "
            "off = none"
        ),
    )
    label_noise: float = Field(
        0.0,
        ge=0,
        description=(
            "label defence: Gaussian noise multiplier sigma on the gradient the home returns "
            "for the final hidden state (each token's gradient clipped to label_clip first); "
            "0 = off"
        ),
    )
    label_clip: float = Field(
        0.1,
        gt=0,
        description="label defence: L2 bound C of one token's gradient of its own loss",
    )
    input_noise: float = Field(
        0.0,
        ge=0,
        description=(
            "input defence: Gaussian noise on the hidden state of a stream's first remote hop, "
            "std = input_noise x each token's RMS; 0 = off"
        ),
    )
    input_clip: float | None = Field(
        None,
        gt=0,
        description=(
            "input defence: L2 bound C of each position's hidden state at the first remote "
            "hop; when set, that state is clipped to C and the noise std is input_noise x C "
            "(a Gaussian mechanism with an (epsilon, delta)); unset = std relative to each "
            "token's RMS, no bound and no accounting"
        ),
    )
    input_epsilon_target: float | None = Field(
        None,
        gt=0,
        description=(
            "input defence: the largest epsilon per sequence the clipped input noise may "
            "spend over the whole run (at delta, the accountant and sample_rate); a run whose "
            "input_noise cannot meet it is refused at start, naming the sigma it needs; unset "
            "= no target"
        ),
    )
    decorrelation: float = Field(
        0.0,
        ge=0,
        description=(
            "input defence (NoPeek): weight of the distance correlation between an origin's "
            "tokens and the hidden state of its first remote hop, added to its loss; 0 = off"
        ),
    )
    home_layer: Literal["off", "mlp", "block"] = Field(
        "off",
        description=(
            "architectural defence (a deviation from the paper): a private layer each home "
            "applies to the final hidden state before the shared head, drawn from the site's "
            "key, never averaged, never sent; mlp = a two-layer MLP with no identity path, "
            "block = a transformer block then that MLP; off = the paper's model"
        ),
    )
    home_layer_trained: bool = Field(
        True,
        description=(
            "home layer: train it with the site's loss (true) or keep it as drawn from the "
            "site's key (false: it never drifts towards the other sites' layers, which an "
            "attacker could use as a stand-in)"
        ),
    )
    home_input: Literal["off", "rotation", "mlp", "block"] = Field(
        "off",
        description=(
            "input defence (a deviation from the paper): a private layer each origin applies "
            "to E(x) before its first block group, drawn from the site's key, never averaged, "
            "never sent; rotation = a random orthogonal d x d map, mlp = a two-layer MLP with "
            "no identity path, block = a transformer block then that MLP (each followed by "
            "rms_norm); off = the paper's model"
        ),
    )
    home_input_trained: bool = Field(
        True,
        description=(
            "input layer: train it with the site's loss (true) or keep it as drawn from the "
            "site's key (false)"
        ),
    )
    er_noise: float = Field(
        0.0,
        ge=0,
        description=(
            "DP-FedAvg for the shared E/R: noise multiplier z; at each barrier every site's "
            "E/R update is clipped to er_clip and N(0, (z*er_clip/P)^2) is added to the "
            "average; 0 = off"
        ),
    )
    er_clip: float = Field(
        1.0, gt=0, description="DP-FedAvg: L2 bound C of one site's E/R update per barrier"
    )
    er_secagg: bool = Field(
        False,
        description=(
            "Secure Aggregation of the shared E/R: each site sends its E/R update quantised "
            "into Z_2^b plus pairwise masks that cancel in the sum, so the coordinator learns "
            "only the sum of the sites' updates"
        ),
    )
    er_secagg_bits: int = Field(
        32, ge=16, le=64, description="Secure Aggregation: b, the ring Z_2^b of the masked sum"
    )
    er_secagg_range: float = Field(
        1.0,
        gt=0,
        description=(
            "Secure Aggregation: r, each element of a site's E/R update is clipped to [-r, r] "
            "and rounded to a step of r*P/(2^(b-1)-1)"
        ),
    )
    noise_key_dir: str | None = Field(
        None,
        description=(
            "directory of site-<s>.key files: each site keys its noise with its own secret "
            "(a worker reads only its own file; the coordinator reads coordinator.key for "
            "the E/R noise); unset = keyed by the public seed, which any worker can "
            "regenerate and subtract"
        ),
    )
    accountant: Literal["rdp", "prv"] = Field(
        "rdp",
        description=(
            "Opacus accountant for the (epsilon, delta) of the label defence and of the E/R's "
            "DP-FedAvg"
        ),
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the reported (epsilon, delta)")
    sample_rate: float = Field(
        1.0,
        gt=0,
        le=1,
        description=(
            "accounting: chance that a given target is in one step's batch (Poisson "
            "assumption); 1 = no amplification by sampling"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("preset") in REMOVED_PRESETS:
            name = data["preset"]
            raise ValueError(f"privacy.preset {name!r} was removed: {REMOVED_PRESETS[name]}")
        if not isinstance(data, dict) or data.get("preset") not in PRIVACY_PRESETS:
            return data  # no preset, "off", or an unknown name (refused by the field's check)
        name = data["preset"]
        if data.get("noise_key_dir") is None:
            raise ValueError(
                f"privacy.preset {name!r} needs privacy.noise_key_dir (one secret per site): "
                "noise keyed by the public seed is removed by any worker"
            )
        return {**PRIVACY_PRESETS[name], **data}

    @model_validator(mode="after")
    def _clip_needs_noise(self) -> PrivacyConfig:
        if self.input_clip is not None and self.input_noise <= 0:
            raise ValueError(
                "privacy.input_clip bounds the first send for the input noise: set "
                "privacy.input_noise > 0 with it, or leave input_clip unset"
            )
        if self.input_epsilon_target is not None and (
            self.input_clip is None or self.input_noise <= 0
        ):
            raise ValueError(
                "privacy.input_epsilon_target needs the accounted input mechanism: set "
                "privacy.input_noise > 0 and privacy.input_clip (without a clip no epsilon "
                "is finite)"
            )
        return self

    def any_on(self) -> bool:
        """True when at least one noise defence changes what crosses the ring."""
        return self.label_noise > 0 or self.input_noise > 0

    def any_defence(self) -> bool:
        """True when any defence is on (noise, NoPeek, a private home or input layer, DP or
        Secure Aggregation of the E/R)."""
        return (
            self.any_on()
            or self.decorrelation > 0
            or self.home_layer != "off"
            or self.home_input != "off"
            or self.er_noise > 0
            or self.er_secagg
        )
