"""Loop knobs: off by default, the math they promise, and exactness with them on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine import ReferenceEngine
from mobius_fed.model import build_group
from mobius_fed.model.config import ModelConfig
from mobius_fed.model.knobs import LoopKnobs, residual_epsilon
from tests.ring_harness import Ring

P = 2  # workers, and the sites of site_dirs (tests/conftest.py)
KNOBS = LoopKnobs(depth_embedding=True, residual_scale="inverse_loops")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _mc(**kw) -> ModelConfig:
    return TrainConfig(preset="cpu-tiny", workers=P, **kw).model()


def test_knobs_are_off_by_default() -> None:
    assert LoopKnobs().active() == {} and KNOBS.active() == KNOBS.model_dump()
    group = build_group(TrainConfig(preset="cpu-tiny", workers=P, loops=3).model(), 0, seed=0)
    assert group.depth_embedding is None and group.epsilon == 1.0
    with pytest.raises(ValueError, match="residual_scale"):
        LoopKnobs(residual_scale="half")  # type: ignore[arg-type]
    assert residual_epsilon("inverse_sqrt_loops", 4) == 0.5


def test_residual_scale_scales_each_visit() -> None:
    plain = build_group(_mc(loops=4), 0, seed=0)
    scaled = build_group(_mc(loops=4, knobs=LoopKnobs(residual_scale="inverse_loops")), 0, seed=0)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.03 * torch.randn_like(p))
        scaled.load_state_dict(plain.state_dict())
    x = torch.randn(2, 8, 32)
    assert torch.equal(scaled(x, 5), x + 0.25 * (plain(x, 5) - x))


def test_depth_embedding_is_owned_per_application(site_dirs: list[Path]) -> None:
    mc = _mc(loops=2, knobs=LoopKnobs(depth_embedding=True))
    group = build_group(mc, 1, seed=0)
    assert group.depth_embedding is not None and group.depth_embedding.shape == (2 * P, 32)
    with pytest.raises(ValueError, match=r"t=4 outside 0\.\.3"):
        group(torch.zeros(1, 4, 32), 4)
    rows = {}
    for order in ("cyclic", "ordered"):
        cfg = TrainConfig(
            preset="cpu-tiny", workers=P, loops=2, order=order, steps=3, batch_size=2,
            knobs=LoopKnobs(depth_embedding=True),
        )  # fmt: skip
        engine = ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len) for d in site_dirs])
        muon = [p for opt in engine.group_opts[0] for g in opt.param_groups for p in g["params"]]
        emb = engine.groups[0].depth_embedding
        assert all(
            not isinstance(opt, torch.optim.Muon) or all(p is not emb for p in g["params"])
            for opt in engine.group_opts[0]
            for g in opt.param_groups
        )
        assert muon  # Muon still takes the blocks' matrices
        for _ in range(3):
            engine.train_step()
        rows[order] = [int(t) for t in (emb.abs().sum(1) > 0).nonzero().flatten()]
    assert rows["cyclic"] == [0, 1, 2, 3]  # group 0 serves every depth
    assert rows["ordered"] == [0, 2]  # only t ≡ 0 (mod P)


class KnobbedRing(Ring):
    """The harness's ring, whose reference engine runs with the knobs on."""

    def config(self) -> TrainConfig:
        return TrainConfig(workers=self.P, knobs=KNOBS, **self.train)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["cyclic", "ordered"])
def test_ring_equals_reference_with_knobs_on(tmp_path: Path, order: str) -> None:
    """Real workers over mTLS gRPC with every loop knob on equal the reference, bit for bit."""
    train = dict(preset="cpu-tiny", loops=2, order=order, steps=4, batch_size=2)
    train |= dict(sync_every=0, eval_every=0, optimizer="muon")
    flags = ["--knobs-depth-embedding", "--knobs-residual-scale", "inverse_loops"]
    ring = KnobbedRing(tmp_path, P, train).prepare()
    assert ring.config().model().depth_embedding  # the knobs reach the groups
    ring.start(extra={i: flags for i in range(P)}).wait()
    ref, ref_eval = ring.reference()
    got = ring.losses()
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) == 0.0
    assert ring.eval_losses() == dict(enumerate(ref_eval))
