"""Subspace mode ``bottleneck`` (issue 55): each block group owns a learned encoder d → k
(with an identity path over every (d/k)-th channel) and decoder k → d; only the k-wide code
and its k-wide gradient cross an edge, never a token id. The coder, the refusals, the
engine's gradients against one autograd graph, and ring == reference over real workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from mobius_fed import schedule
from mobius_fed.checkpoint import load_checkpoint
from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine import ReferenceEngine
from mobius_fed.model import build_group
from mobius_fed.model.subspace import Bottleneck
from mobius_fed.model.training import make_optimizers
from mobius_fed.worker.frames import FrameRules
from tests.test_bottleneck import SubspaceRing

BOTTLENECK = {"rank": 8, "mode": "bottleneck", "writes": "full"}


def test_coder_shapes_and_identity_path():
    coder = Bottleneck(32, 8)
    assert coder.encoder.shape == (8, 32) and coder.decoder.shape == (32, 8)
    assert coder.channels.tolist() == [0, 4, 8, 12, 16, 20, 24, 28]
    assert "channels" not in coder.state_dict(), "derived from (d, k), not saved"
    h, c = torch.randn(2, 5, 32), torch.randn(2, 5, 8)
    # at initialisation the learned parts are zero: the identity path alone, exactly
    assert torch.equal(coder.encode(h), h[..., ::4])
    out = coder.decode(c)
    assert out.shape == (2, 5, 32)
    assert torch.equal(out[..., ::4], c)
    assert torch.equal(out[..., 1::4], torch.zeros(2, 5, 8))
    assert torch.equal(coder.encode(coder.decode(c)), c)
    # trained: identity path plus the learned projection, both ways
    with torch.no_grad():
        coder.encoder.normal_()
        coder.decoder.normal_()
    want_c = h[..., ::4] + h @ coder.encoder.T
    assert torch.allclose(coder.encode(h), want_c, atol=1e-5)
    want_h = c @ coder.decoder.T
    want_h[..., ::4] += c
    assert torch.allclose(coder.decode(c), want_h, atol=1e-5)
    # the learned parts receive gradient through the identity path from step 0
    fresh = Bottleneck(32, 8)
    fresh.decode(fresh.encode(h)).square().sum().backward()
    assert fresh.encoder.grad is not None and fresh.encoder.grad.abs().sum() > 0
    assert fresh.decoder.grad is not None and fresh.decoder.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="must divide d_model=32"):
        Bottleneck(32, 12)


def test_each_group_owns_its_coder_and_draws_the_same_weights():
    cfg = TrainConfig(preset="cpu-tiny", subspace=BOTTLENECK)
    full = TrainConfig(preset="cpu-tiny", subspace={**BOTTLENECK, "mode": "home"})
    g, g_full = build_group(cfg.model(), 1, 0), build_group(full.model(), 1, 0)
    assert g_full.bottleneck is None and isinstance(g.bottleneck, Bottleneck)
    names = [n for n, _ in g.named_parameters()]
    assert names[-2:] == ["bottleneck.encoder", "bottleneck.decoder"]
    # every block weight draws what it draws without the bottleneck (paired comparisons)
    assert all(torch.equal(a, b) for a, b in zip(g_full.parameters(), g.parameters()))
    # the group's own optimizer trains the coder: its gradient never leaves the worker
    owned = {
        id(p)
        for opt in make_optimizers(g, cfg, blocks=True)
        for grp in opt.param_groups
        for p in grp["params"]
    }
    assert id(g.bottleneck.encoder) in owned and id(g.bottleneck.decoder) in owned


def test_bad_settings_are_refused_with_the_reason(tmp_path):
    def make(**sub):
        return TrainConfig(preset="cpu-tiny", subspace={**BOTTLENECK, **sub})

    with pytest.raises(ValidationError, match=r"rank k=12 does not divide d_model=32"):
        make(rank=12)
    with pytest.raises(ValidationError, match=r"rank k=64 must be in 1\.\.d_model=32"):
        make(rank=64)
    with pytest.raises(ValidationError, match=r"cannot be combined with subspace\.learn"):
        make(learn=True)
    with pytest.raises(ValidationError, match="needs subspace writes 'full'"):
        make(writes="basis")
    with pytest.raises(
        ValidationError, match=r"states-only' refused.*'bottleneck' has not been audited"
    ):
        privacy = {"preset": "states-only", "noise_key_dir": str(tmp_path)}
        TrainConfig(preset="cpu-tiny", subspace=BOTTLENECK, privacy=privacy)
    with pytest.raises(ValidationError, match="mode 'bottleneck-home' needs the cyclic order"):
        TrainConfig(
            preset="cpu-tiny", order="ordered", subspace={**BOTTLENECK, "mode": "bottleneck-home"}
        )
    with pytest.raises(ValidationError, match=r"mode 'bottleneck-home' cannot be combined"):
        make(mode="bottleneck-home", learn=True)
    ok = make(rank=4)  # d/8
    assert ok.model().subspace_bottleneck and ok.model().subspace_rank == 4
    off = TrainConfig(preset="cpu-tiny", subspace={"mode": "bottleneck"})
    assert not off.model().subspace_bottleneck, "rank 0 is off, whatever the mode"


def test_the_leakage_audit_refuses_the_bottleneck_and_the_patient_audit_takes_it(tiny_train):
    from mobius_fed.privacy.leakage import LeakageAudit
    from mobius_fed.privacy.patient import PatientAudit

    cfg = TrainConfig(**tiny_train, workers=2, subspace=BOTTLENECK)
    with pytest.raises(ValueError, match="leakage audit: subspace mode 'bottleneck'"):
        LeakageAudit(cfg, [])
    # the patient audit gets past the mode (tests/test_bottleneck_audit.py runs it): here it
    # stops at the missing sites
    with pytest.raises(ValueError, match="need one site per worker"):
        PatientAudit(cfg.model_copy(update={"encoding": "bytes"}), [], torch.zeros(1))


def test_frames_carry_the_k_wide_code_both_ways(tiny_train):
    from mobius_fed.proto import ring_pb2

    rules = FrameRules(TrainConfig(**tiny_train, workers=2, subspace=BOTTLENECK), 1, "r", lambda: 0)
    assert rules.shape_of(ring_pb2.FORWARD) == (4, 32, 8)
    assert rules.shape_of(ring_pb2.BACKWARD) == (4, 32, 8)


def _direct_gradients(engine: ReferenceEngine) -> tuple[list[float], list[torch.Tensor]]:
    """One step's losses and gradients as one autograd graph per origin, from the formula:
    c₀ = enc_s(E(x_s)), c_{t+1} = enc_i(F_i(dec_i(c_t), t)), loss = R_s(dec_s(c_K)); in
    mode ``bottleneck-home`` c₀ = 0 and b = E(x_s) at the origin's group and the head:
    c_{t+1} = enc_i(F_i(dec_i(c_t) + b, t) − b), loss = R_s(dec_s(c_K) + E(x_s))."""
    cfg, losses = engine.cfg, []
    home = cfg.subspace.mode == "bottleneck-home"
    for s in range(cfg.P):
        x, y = engine.sites[s].batch("train", seed=cfg.seed, step=0, batch_size=cfg.batch_size)
        e = engine.replicas[s].embed(x)
        coder = engine.groups[s].bottleneck
        c = torch.zeros(*e.shape[:-1], cfg.subspace.rank) if home else coder.encode(e)
        for t, i in enumerate(schedule.path(cfg.order, s, cfg.P, cfg.loops)):
            g = engine.groups[i]
            b = e if home and i == s else torch.zeros_like(e)
            c = g.bottleneck.encode(g(g.bottleneck.decode(c) + b, t) - b)
        loss = engine.replicas[s].loss(coder.decode(c) + (e if home else 0), y)
        (loss / cfg.P).backward()  # groups: mean over origins
        losses.append(loss.item())
    grads = [p.grad.clone() for g in engine.groups for p in g.parameters()]
    grads += [p.grad.clone() * cfg.P for r in engine.replicas for p in r.parameters()]
    return losses, grads


@pytest.mark.parametrize(
    ("mode", "order", "loops", "recompute"),
    [
        ("bottleneck", "cyclic", 2, False),
        ("bottleneck", "ordered", 1, True),
        ("bottleneck-home", "cyclic", 2, False),
        ("bottleneck-home", "cyclic", 1, True),
    ],
)
def test_engine_gradients_equal_one_autograd_graph(
    tmp_path, mode, order, loops, recompute, tiny_train, corpus_engine
):
    cfg = TrainConfig(
        **tiny_train,
        workers=3,
        order=order,
        loops=loops,
        subspace={**BOTTLENECK, "mode": mode},
        memory={"recompute": recompute},
    )
    engine = corpus_engine(cfg, tmp_path)
    # trained weights, so that every term of the gradient is live (at step 0 the blocks'
    # zero output projections make every F_i the identity, and in bottleneck-home every
    # code 0: the coders would receive no gradient)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for g in engine.groups:
            for p in g.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    got = engine.compute_gradients()
    mine = [p.grad.clone() for m in engine.groups + engine.replicas for p in m.parameters()]
    for m in engine.groups + engine.replicas:
        m.zero_grad(set_to_none=True)
    want, oracle = _direct_gradients(engine)
    assert got == pytest.approx(want, abs=1e-6)
    assert len(mine) == len(oracle)
    for a, b in zip(mine, oracle):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (a - b).abs().max()
    named = [n for m in engine.groups + engine.replicas for n, _ in m.named_parameters()]
    for n, a in zip(named, mine):
        if n.startswith("bottleneck."):
            assert a.abs().sum() > 0, f"{n} receives no gradient"


def test_bottleneck_trains(tmp_path, tiny_train, corpus_engine):
    cfg = TrainConfig(**tiny_train, workers=2, steps=6, subspace=BOTTLENECK)
    engine = corpus_engine(cfg, tmp_path)
    first = engine.evaluate().loss
    for _ in range(cfg.steps):
        engine.train_step()
    assert engine.evaluate().loss < first - 0.2  # 5.70 → 5.43 at the time of writing
    assert all(g.bottleneck.encoder.abs().sum() > 0 for g in engine.groups)


# ----------------------------------------------------------------- ring == reference

RING_CASES = [
    (3, "cyclic", 1, {}),  # fp32 codes
    (3, "ordered", 2, {"wire_fwd": "int8", "wire_bwd": "int4", "wire_rounding": "stochastic"}),
    (2, "cyclic", 2, {"wire_fwd": "int4", "wire_bwd": "int6", "wire_rounding": "stochastic"}),
    # E(x) stays at its origin: b = E(x_s) there, slot 0 carries 0
    (
        3,
        "cyclic",
        2,
        {
            "subspace_mode": "bottleneck-home",
            "wire_fwd": "int8",
            "wire_bwd": "int4",
            "wire_rounding": "stochastic",
        },
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("P", "order", "loops", "wire"), RING_CASES)
def test_ring_equals_reference_with_bottleneck(tmp_path: Path, P, order, loops, wire, tiny_train):
    """Real workers over mTLS ship k-wide codes forward and k-wide gradients back
    (quantised by the codec when one is set), relays included (ordered), and every loss
    (two training steps: the second depends on the first's backward) and the evaluation
    after them equal the reference engine's exactly."""
    train = {**tiny_train, "steps": 2, "order": order, "loops": loops}
    train.update(subspace_rank=8, subspace_mode="bottleneck", subspace_writes="full")
    train.update(wire)
    ring = SubspaceRing(tmp_path, P, train).prepare()
    ring.start().wait()
    cfg = ring.config()
    engine = ReferenceEngine(cfg, [SiteData(ring.site(i), cfg.model().seq_len) for i in range(P)])
    ref = {}
    for _ in range(cfg.steps):
        r = engine.train_step()
        ref.update({(r.step, s): v for s, v in enumerate(r.origin_losses)})
    got = ring.losses()
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) == 0.0
    assert all(ring.eval_losses()[s] == v for s, v in enumerate(engine.evaluate().origin_losses))
    # backward: each worker's encoder and decoder (trained by the k-wide gradients that
    # came back over the wire) equal the reference engine's, bit for bit
    for i in range(P):
        saved = load_checkpoint(ring.out(i) / f"worker-{i}.pt")["group"]
        mine = {k: v for k, v in saved.items() if k.startswith("bottleneck.")}
        assert set(mine) == {"bottleneck.encoder", "bottleneck.decoder"}
        want = engine.groups[i].state_dict()
        assert all(torch.equal(v, want[k]) for k, v in saved.items())
        assert mine["bottleneck.encoder"].abs().sum() > 0, "the coder trained"
    # the wire carried k = d/4 channels: about a quarter of fp32 hidden states' bytes
    edges = sum(len(schedule.ring_hops(order, s, P, loops)) for s in range(P))
    tensors = edges * (2 * cfg.steps + cfg.eval_batches)  # fwd + bwd per step, one eval
    full = tensors * 4 * 32 * 32 * 4  # fp32 [4, 32, 32]
    sent = 0
    for i in range(P):
        rows = [json.loads(x) for x in (ring.out(i) / "metrics.jsonl").read_text().splitlines()]
        sent += max(r.get("bytes_sent", 0) for r in rows)
    codec = any(k.startswith("wire_") for k in wire)
    assert 0 < sent < (0.12 if codec else 0.3) * full, (sent, full)


def test_front_pairs_each_arm_with_fp32_and_the_plain_codec():
    from tests.bench_loader import load_benchmark

    compression = load_benchmark("compression")
    codec, sub = "fwd=int8,bwd=int4,rounding=stochastic", "rank=8,mode=bottleneck,writes=full"
    assert compression.parse_subspace(sub) == {"rank": 8, "mode": "bottleneck", "writes": "full"}
    rows = []
    for seed, (base, plain, mine) in enumerate([(3.0, 3.01, 3.1), (3.2, 3.2, 3.25)]):
        for s, w, eq8, ratio in (
            ("off", "none", base, 1.0),
            ("off", codec, plain, 5.12),
            (sub, codec, mine, 20.48),
        ):
            rows.append(
                {
                    "subspace": s,
                    "wire": w,
                    "order": "cyclic",
                    "loops": 1,
                    "seed": seed,
                    "eq8": eq8,
                    "ratio": ratio,
                    "hop_bytes": [2112, 1088],
                    "fp32_hop_bytes": 32768,
                }
            )
    lines = compression.front_table(rows).splitlines()
    assert lines[2].startswith(f"| {sub} | {codec} | cyclic L=1 | 2,112, 1,088 (32,768) | 20.5×")
    # paired over two seeds: Δ = 0.1, 0.05 against fp32; 0.09, 0.05 against the codec
    assert "+0.0750 ± 0.3177 (n=2)" in lines[2] and "+0.0700 ± 0.2541 (n=2)" in lines[2]
    assert lines[-1].endswith("| 1.0× | 2 | — | — |")


def test_checkpoint_resumes_the_coders_and_export_refuses(tmp_path, tiny_train, corpus_engine):
    from mobius_fed.export import export_run
    from mobius_fed.export.files import ExportError

    cfg = TrainConfig(**tiny_train, workers=2, steps=3, subspace=BOTTLENECK)
    engine = corpus_engine(cfg, tmp_path / "a")
    engine.train_step()
    ckpt = engine.save(tmp_path / "c.ckpt")
    want = [engine.train_step().loss for _ in range(2)]
    again = corpus_engine(cfg, tmp_path / "b")
    again.load(ckpt)  # the coders are group weights: the checkpoint holds them
    assert [again.train_step().loss for _ in range(2)] == want
    with pytest.raises(ExportError, match="subspace mode 'bottleneck' cannot be exported yet"):
        export_run(ckpt, tmp_path / "m")


def test_a_ring_sync_averages_the_coders_with_the_groups(tmp_path) -> None:
    """R = 2 rings of P = 2: each coder is a group weight, so the ring sync (Flower, every
    F_i over the rings) leaves every ring with the same encoder and decoder, bit for bit."""
    from mobius_fed.data import embedded_corpus, prepare_sites
    from mobius_fed.engine.rings import RingsEngine
    from tests.test_rings import BASE, run

    dirs = prepare_sites(None, tmp_path, 4, text=embedded_corpus()[:200_000])
    cfg = TrainConfig(workers=4, rings=2, ring_sync_every=2, subspace=BOTTLENECK, **BASE)
    _, _, engine = run(cfg, dirs, [0, 1, 2, 3])
    assert isinstance(engine, RingsEngine)
    for i in range(cfg.P):
        a, b = (ring.groups[i].bottleneck for ring in engine.rings)
        assert a.encoder.abs().sum() > 0 and torch.equal(a.encoder, b.encoder)
        assert torch.equal(a.decoder, b.decoder)
