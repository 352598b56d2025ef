"""Defences on a real ring (mobius-worker processes, mTLS gRPC) equal the reference engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.defences.stages import write_site_keys
from mobius_fed.engine import ReferenceEngine
from mobius_fed.privacy_config import PRIVACY_PRESETS
from tests.ring_harness import Ring

pytestmark = pytest.mark.slow


class PrivateRing(Ring):
    """A ring whose workers run with ``privacy`` settings (nested flags --privacy-<field>)."""

    privacy: dict

    def config(self) -> TrainConfig:
        return TrainConfig(workers=self.P, **self.train, privacy=self.privacy)

    def worker_cmd(self, i: int, extra: list[str] = ()) -> list[str]:  # type: ignore[assignment]
        flags = []
        for key, value in self.privacy.items():
            flags += [f"--privacy-{key.replace('_', '-')}", str(value)]
        return super().worker_cmd(i, [*flags, *extra])


@pytest.mark.parametrize(
    ("order", "input_clip"), [("cyclic", None), ("ordered", None), ("ordered", 4.0)]
)
def test_ring_with_label_noise_input_noise_and_nopeek_equals_reference_bit_for_bit(
    tmp_path: Path, order: str, input_clip: float | None
):
    keys = tmp_path / "keys"
    write_site_keys(keys, 3)
    train = dict(
        preset="cpu-tiny",
        steps=3,
        batch_size=4,
        micro_batches=2,
        sync_every=0,
        eval_every=0,
        optimizer="adamw",
        order=order,
    )
    ring = PrivateRing(tmp_path, 3, train)
    ring.privacy = {
        "label_noise": 1.0,
        "input_noise": 0.5,
        "decorrelation": 3.0,
        "noise_key_dir": str(keys),
    }
    if input_clip is not None:  # clipped: the accounted Gaussian mechanism
        ring.privacy["input_clip"] = input_clip
    ring.prepare().start().wait()
    ref, ref_eval = ring.reference()
    got = ring.losses()
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) == 0.0, "ring must equal the reference exactly"
    ring_eval = ring.eval_losses()
    assert all(ring_eval[s] == v for s, v in enumerate(ref_eval))
    # and the defences did something: without them the reference trains differently
    cfg = TrainConfig(workers=3, **train)
    sites = [SiteData(ring.site(i), cfg.model().seq_len) for i in range(3)]
    plain = ReferenceEngine(cfg, sites)
    plain_losses = [plain.train_step().origin_losses for _ in range(cfg.steps)]
    assert plain_losses[-1] != [ref[cfg.steps - 1, s] for s in range(3)]


def test_ring_with_the_states_only_preset_equals_reference_bit_for_bit(tmp_path: Path):
    """``--privacy-preset states-only`` reaches every worker as the wire and fields it names
    (a home-mode subspace of rank d/4 with int8/int4 stochastic codecs, a private input layer
    and noise on the first send's coordinates, keyed per site; no token ids travel), and the
    ring still equals the reference exactly, in training and in evaluation."""
    keys = tmp_path / "keys"
    write_site_keys(keys, 3)
    train = dict(preset="cpu-tiny", steps=2, batch_size=4, sync_every=0, eval_every=0)
    ring = PrivateRing(tmp_path, 3, train)
    ring.privacy = {"preset": "states-only", "noise_key_dir": str(keys)}
    cfg = ring.config()
    named = PRIVACY_PRESETS["states-only"]
    assert {k: getattr(cfg.privacy, k) for k in named} == named
    assert (cfg.subspace.rank, cfg.subspace.mode) == (cfg.model().d_model // 4, "home")
    assert (cfg.wire.fwd, cfg.wire.bwd, cfg.wire.rounding) == ("int8", "int4", "stochastic")
    ring.prepare().start().wait()
    ref, ref_eval = ring.reference()
    got = ring.losses()
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) == 0.0, "ring must equal the reference exactly"
    ring_eval = ring.eval_losses()
    assert all(ring_eval[s] == v for s, v in enumerate(ref_eval))
