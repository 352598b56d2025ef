"""Memory options (TrainConfig.memory): recompute and the chunked head loss are exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from mobius_fed.config import TrainConfig
from mobius_fed.model import build_replica
from mobius_fed.model.memory import chunked_cross_entropy
from tests.test_bottleneck import SubspaceRing


def _full_loss(hn, w, y, cap):
    logits = cap * torch.tanh(F.linear(hn, w).float() / cap)
    return F.cross_entropy(logits, y)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_cross_entropy_equals_the_full_loss_and_gradients(chunk):
    gen = torch.Generator().manual_seed(0)
    hn = (torch.randn(50, 16, generator=gen) * 3).requires_grad_()
    w = (torch.randn(40, 16, generator=gen) * 4).requires_grad_()  # big logits: cap bites
    y = torch.randint(0, 40, (50,), generator=gen)
    want = _full_loss(hn, w, y, 30.0)
    gh, gw = torch.autograd.grad(2.5 * want, (hn, w))
    got = chunked_cross_entropy(hn, w, y, 30.0, chunk)
    ch, cw = torch.autograd.grad(2.5 * got, (hn, w))
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert torch.allclose(ch, gh, rtol=1e-5, atol=1e-7)
    assert torch.allclose(cw, gw, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        assert chunked_cross_entropy(hn, w, y, 30.0, chunk).item() == pytest.approx(want.item())
    with pytest.raises(ValueError, match="loss_chunk must be ≥ 1"):
        chunked_cross_entropy(hn, w, y, 30.0, 0)


@pytest.mark.parametrize(("tied", "home"), [(True, "off"), (False, "mlp")])
def test_replica_loss_with_chunks_matches(tied, home):
    plain = TrainConfig(preset="cpu-tiny", tied=tied)
    chunked = TrainConfig(preset="cpu-tiny", tied=tied, memory={"loss_chunk": 24})
    a, b = build_replica(plain.model(), 0, home), build_replica(chunked.model(), 0, home)
    b.load_state_dict(a.state_dict())
    h = torch.randn(3, 32, 32)
    y = torch.randint(0, plain.model().vocab_size, (3, 32))
    la, lb = a.loss(h, y), b.loss(h, y)
    la.backward()
    lb.backward()
    assert lb.item() == pytest.approx(la.item(), rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None)  # untied: E takes no head gradient
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-8)


def test_bad_memory_settings_are_refused():
    with pytest.raises(ValidationError, match="loss_chunk"):
        TrainConfig(memory={"loss_chunk": -1})
    with pytest.raises(ValidationError, match="recompute"):
        TrainConfig(memory={"recompute": "sometimes"})


@pytest.mark.parametrize("subspace", [{}, {"rank": 8, "mode": "home"}])
def test_recompute_is_bit_identical(tmp_path: Path, subspace, tiny_train, corpus_engine):
    """Recomputing each application in backward gives exactly the same losses and weights."""
    runs = []
    for recompute in (False, True):
        train = dict(tiny_train, workers=3, loops=2, steps=2, subspace=subspace)
        cfg = TrainConfig(**train, memory={"recompute": recompute})
        engine = corpus_engine(cfg, tmp_path / str(recompute))
        losses = [engine.train_step().origin_losses for _ in range(2)]
        weights = [p.detach().clone() for g in engine.groups for p in g.parameters()]
        runs.append((losses, weights, engine.evaluate().loss))
    (l0, w0, e0), (l1, w1, e1) = runs
    assert l0 == l1 and e0 == e1
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


def test_chunked_loss_trains_like_the_full_loss(tmp_path: Path, tiny_train, corpus_engine):
    out = []
    for chunk in (0, 40):
        cfg = TrainConfig(**tiny_train, workers=2, steps=2, memory={"loss_chunk": chunk})
        engine = corpus_engine(cfg, tmp_path / str(chunk))
        out.append([engine.train_step().loss for _ in range(2)])
    assert out[1] == pytest.approx(out[0], rel=1e-5)


@pytest.mark.slow
def test_ring_equals_reference_with_memory_options(tmp_path: Path, tiny_train):
    """Real workers with recompute and the chunked loss (and the subspace) equal the
    reference engine with the same options exactly."""
    train = {**tiny_train, "steps": 2, "order": "cyclic", "loops": 2}
    train.update(subspace_rank=8, memory_recompute=True, memory_loss_chunk=40)
    ring = MemoryRing(tmp_path, 3, train).prepare()
    ring.start().wait()
    ref, ref_eval = ring.reference()
    got = ring.losses()
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) == 0.0
    assert all(ring.eval_losses()[s] == v for s, v in enumerate(ref_eval))


class MemoryRing(SubspaceRing):
    """The subspace ring with ``memory_*`` keys folded into TrainConfig.memory too."""

    def config(self) -> TrainConfig:
        train = dict(self.train)
        memory = {k[7:]: train.pop(k) for k in list(train) if k.startswith("memory_")}
        sub = {k[9:]: train.pop(k) for k in list(train) if k.startswith("subspace_")}
        return TrainConfig(workers=self.P, subspace=sub, memory=memory, **train)

    def worker_cmd(self, i: int, extra: list[str] = ()) -> list[str]:  # type: ignore[assignment]
        cmd = super().worker_cmd(i, extra)
        at = cmd.index("--memory-recompute")  # a boolean flag takes no value
        del cmd[at + 1]
        return cmd
