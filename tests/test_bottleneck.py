"""The shared residual subspace (TrainConfig.subspace): the basis, the model, the gradient,
the frame shapes, and ring == reference over real workers with and without a wire codec."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from mobius_fed import schedule
from mobius_fed.config import TrainConfig
from mobius_fed.engine import ReferenceEngine
from mobius_fed.model import build_group
from mobius_fed.model.groups import build_basis
from mobius_fed.model.subspace import BasisLinear, subspace_basis
from mobius_fed.proto import ring_pb2
from mobius_fed.transport.codec import FrameError, TensorAssembler, encode_frames, parse_frame
from mobius_fed.worker.frames import FrameRules
from tests.bench_loader import load_benchmark
from tests.ring_harness import Ring
from tests.test_export import val_losses


def test_basis_is_orthonormal_seeded_and_checked():
    u = subspace_basis(32, 8, seed=5)
    assert u.shape == (32, 8) and u.dtype == torch.float32
    assert torch.allclose(u.T @ u, torch.eye(8), atol=1e-6)
    assert torch.equal(u, subspace_basis(32, 8, seed=5)), "a pure function of (d, k, seed)"
    assert not torch.equal(u, subspace_basis(32, 8, seed=6))
    with pytest.raises(ValueError, match=r"subspace rank k=40 must be in 1\.\.d_model=32"):
        subspace_basis(32, 40, seed=0)


def test_bad_settings_are_refused_with_the_reason():
    with pytest.raises(ValidationError, match="subspace rank 33 exceeds d_model=32"):
        TrainConfig(preset="cpu-tiny", subspace={"rank": 33})
    with pytest.raises(ValidationError, match="subspace writes 'full' needs a subspace"):
        TrainConfig(preset="cpu-tiny", subspace={"writes": "full"})
    with pytest.raises(ValidationError, match="subspace mode 'home' needs the cyclic order"):
        TrainConfig(preset="cpu-tiny", order="ordered", subspace={"rank": 8, "mode": "home"})
    with pytest.raises(ValidationError, match="mode"):
        TrainConfig(preset="cpu-tiny", subspace={"rank": 8, "mode": "sideways"})
    tokens = {"rank": 8, "mode": "tokens"}
    for privacy, named in (
        ({"home_input": "rotation"}, "home_input = 'rotation'"),
        ({"input_noise": 0.5}, "input_noise = 0.5"),
        ({"decorrelation": 0.1}, "decorrelation = 0.1"),
    ):
        with pytest.raises(ValidationError, match=f"{named}.*token ids travel in the clear"):
            TrainConfig(preset="cpu-tiny", subspace=tokens, privacy=privacy)
    with pytest.raises(ValidationError, match="wire_dtype 'bf16' and no forward codec"):
        TrainConfig(preset="cpu-tiny", subspace=tokens, wire_dtype="bf16")
    cfg = TrainConfig(preset="cpu-tiny", subspace={"rank": 8})
    with pytest.raises(ValueError, match=r"needs a basis of shape \(32, 8\)"):
        from mobius_fed.model.group import BlockGroup

        BlockGroup(cfg.model())


def test_off_is_the_paper_model_and_on_writes_through_u():
    off = TrainConfig(preset="cpu-tiny")
    on = TrainConfig(preset="cpu-tiny", subspace={"rank": 8})
    assert off.subspace.rank == 0 and build_basis(off.model(), 0) is None
    g_off, g_on = build_group(off.model(), 1, 0), build_group(on.model(), 1, 0)
    assert all(isinstance(b.mlp.proj, torch.nn.Linear) for b in g_off.blocks)
    assert all(isinstance(b.attn.proj, BasisLinear) for b in g_on.blocks)
    assert g_on.blocks[0].mlp.proj.weight.shape == (8, 128)
    # every other weight draws the same values: paired comparisons with the same seed
    assert torch.equal(g_off.blocks[2].attn.qkv.weight, g_on.blocks[2].attn.qkv.weight)
    # a block's update lies in span(U): U Uᵀ (F(h) − h) = F(h) − h
    u = build_basis(on.model(), 0)
    with torch.no_grad():
        for p in g_on.parameters():
            p.normal_()
        h = torch.randn(2, 5, 32)
        upd = g_on.blocks[0](h) - h
    assert torch.allclose(upd @ u @ u.T, upd, atol=1e-4 * upd.abs().max().item())
    # writes=full: the blocks stay the paper's (only the hops are projected, by the engine)
    full = TrainConfig(preset="cpu-tiny", subspace={"rank": 8, "writes": "full"})
    g_full = build_group(full.model(), 1, 0)
    assert all(type(b.attn.proj) is torch.nn.Linear for b in g_full.blocks)
    assert all(torch.equal(a, b) for a, b in zip(g_off.parameters(), g_full.parameters()))


def _direct_gradients(
    engine: ReferenceEngine, remote_b: bool = True
) -> tuple[list[float], list[torch.Tensor]]:
    """Eq. 8's training losses and gradients of one step as one autograd graph per origin
    (no hops, no engine machinery): the oracle for the engine's coordinate bookkeeping.
    Mode ``tokens``: group i adds b = E_i(x_s) from its own replica (``remote_b`` False:
    a remote group omits it, the bug the oracle must tell apart)."""
    cfg, U = engine.cfg, engine.maps.basis.U
    home, tokens = cfg.subspace.mode == "home", cfg.subspace.mode == "tokens"
    losses = []
    for s in range(cfg.P):
        x, y = engine.sites[s].batch("train", seed=cfg.seed, step=0, batch_size=cfg.batch_size)
        e = engine.replicas[s].embed(x)
        c = torch.zeros(*e.shape[:-1], U.size(1)) if home or tokens else e @ U
        for t, i in enumerate(schedule.path(cfg.order, s, cfg.P, cfg.loops)):
            if tokens and (remote_b or i == s):
                b = engine.replicas[i].embed(x)
            else:
                b = e if home and i == s else torch.zeros_like(e)
            c = (engine.groups[i](c @ U.T + b, t) - b) @ U
        loss = engine.replicas[s].loss(c @ U.T + (e if home or tokens else 0), y)
        (loss / cfg.P).backward()  # groups: mean over origins
        losses.append(loss.item())
    grads = [p.grad.clone() for g in engine.groups for p in g.parameters()]
    grads += [p.grad.clone() * cfg.P for r in engine.replicas for p in r.parameters()]
    return losses, grads


@pytest.mark.parametrize(
    ("mode", "order", "loops", "writes"),
    [
        ("stream", "ordered", 2, "basis"),
        ("home", "cyclic", 2, "basis"),
        ("home", "cyclic", 1, "full"),
        ("tokens", "ordered", 1, "full"),
        ("tokens", "cyclic", 2, "basis"),
    ],
)
def test_engine_gradients_equal_one_autograd_graph(
    tmp_path: Path, mode, order, loops, writes, tiny_train, corpus_engine
):
    sub = {"rank": 8, "mode": mode, "writes": writes}
    cfg = TrainConfig(**tiny_train, workers=3, order=order, loops=loops, subspace=sub)
    engine = corpus_engine(cfg, tmp_path)
    got = engine.compute_gradients()
    mine = [p.grad.clone() for m in engine.groups + engine.replicas for p in m.parameters()]
    for m in engine.groups + engine.replicas:
        m.zero_grad(set_to_none=True)
    want, oracle = _direct_gradients(engine)
    assert got == pytest.approx(want, abs=1e-6)
    assert len(mine) == len(oracle)
    for a, b in zip(mine, oracle):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (a - b).abs().max()
    assert any(a.abs().sum() > 0 for a in mine[:-3]), "the groups must receive gradient"


def test_tokens_mode_fails_the_oracle_when_a_remote_group_omits_b(
    tmp_path, tiny_train, corpus_engine
):
    """Mode tokens: every group on a stream's path adds b = E_i(x_s) from its own E. An
    engine whose remote groups skipped b would match the oracle with ``remote_b=False``;
    the engine matches the full oracle and not that one, and a remote replica's E receives
    gradient from the streams of the other origins."""
    sub = {"rank": 8, "mode": "tokens"}
    cfg = TrainConfig(**tiny_train, workers=3, subspace=sub)
    engine = corpus_engine(cfg, tmp_path)
    got = engine.compute_gradients()
    mine = [p.grad.clone() for m in engine.groups + engine.replicas for p in m.parameters()]
    for m in engine.groups + engine.replicas:
        m.zero_grad(set_to_none=True)
    _, omitted = _direct_gradients(engine, remote_b=False)
    for m in engine.groups + engine.replicas:
        m.zero_grad(set_to_none=True)
    want, oracle = _direct_gradients(engine)
    assert got == pytest.approx(want, abs=1e-6)
    # (at step 0 the zero-initialised output projections make every loss equal: the
    # gradients tell the two apart)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(mine, oracle))
    assert not all(torch.allclose(a, b, rtol=1e-2, atol=1e-5) for a, b in zip(mine, omitted))


def test_subspace_trains(tiny_train, corpus_engine):
    cfg = TrainConfig(**tiny_train, workers=2, steps=6, subspace={"rank": 8, "mode": "home"})
    with tempfile.TemporaryDirectory() as tmp:
        engine = corpus_engine(cfg, Path(tmp))
        first = engine.evaluate().loss
        for _ in range(cfg.steps):
            engine.train_step()
        assert engine.evaluate().loss < first - 0.3


def _tensor_frame(shape: tuple[int, ...]) -> tuple[ring_pb2.Frame, bytes]:
    raw = next(
        iter(
            encode_frames(
                run_id="r",
                step=0,
                origin=0,
                tick=1,
                micro=0,
                direction=ring_pb2.FORWARD,
                tensor=torch.zeros(shape),
                chunk_bytes=1 << 22,
                wire="fp32",
            )
        )
    )
    return parse_frame(raw)


def test_frame_rules_accept_exactly_the_coordinates(tiny_train):
    cfg = TrainConfig(**tiny_train, workers=2, subspace={"rank": 8})
    rules = FrameRules(cfg, 1, "r", lambda: 0)
    assert rules.shape == (4, 32, 8)
    full = FrameRules(TrainConfig(**tiny_train, workers=2), 1, "r", lambda: 0).shape
    assert full == (4, 32, 32)
    asm = TensorAssembler(rules.shape, "fp32")
    frame, data = _tensor_frame((4, 32, 8))
    assert asm.add("k", frame, data=data).shape == (4, 32, 8)
    frame, data = _tensor_frame(full)  # a full-width hidden state: refused, shape named
    with pytest.raises(FrameError, match=r"shape \(4, 32, 32\) \(expected \(4, 32, 8\)\)"):
        TensorAssembler(rules.shape, "fp32").add("k", frame, data=data)
    # mode tokens: forward slots carry one more channel (the ids), gradients do not
    tokens = FrameRules(
        TrainConfig(**tiny_train, workers=2, subspace={"rank": 8, "mode": "tokens"}),
        1,
        "r",
        lambda: 0,
    )
    assert tokens.shape_of(ring_pb2.FORWARD) == (4, 32, 9)
    assert tokens.shape_of(ring_pb2.BACKWARD) == (4, 32, 8)
    frame, data = _tensor_frame((4, 32, 8))  # coordinates without their ids: refused
    with pytest.raises(FrameError, match=r"shape \(4, 32, 8\) \(expected \(4, 32, 9\)\)"):
        TensorAssembler(tokens.shape_of(ring_pb2.FORWARD), "fp32").add("k", frame, data=data)


# ----------------------------------------------------------------- ring == reference


class SubspaceRing(Ring):
    """The harness's ring with ``subspace_*`` and ``wire_*`` keys folded into sub-configs."""

    def config(self) -> TrainConfig:
        train = dict(self.train)
        sub = {k[9:]: train.pop(k) for k in list(train) if k.startswith("subspace_")}
        wire = {k[5:]: train.pop(k) for k in list(train) if k.startswith("wire_")}
        return TrainConfig(workers=self.P, subspace=sub, wire=wire, **train)


RING_CASES = [
    ("cyclic", 1, "home", {}),  # blocks write through U
    (
        "ordered",
        2,
        "stream",
        {"wire_fwd": "int8", "wire_bwd": "int4", "wire_rounding": "stochastic"},
    ),
    (  # blocks write at full width, only the hops are projected (writes=full)
        "cyclic",
        2,
        "home",
        {
            "subspace_writes": "full",
            "wire_fwd": "int6",
            "wire_bwd": "int4",
            "wire_rounding": "stochastic",
        },
    ),
    ("ordered", 1, "stream", {"wire_fwd": "int8"}),
    # token ids travel with the coordinates; every group rebuilds b = E_i(x_s)
    (
        "cyclic",
        1,
        "tokens",
        {"wire_fwd": "int8", "wire_bwd": "int4", "wire_rounding": "stochastic"},
    ),
    ("ordered", 2, "tokens", {"subspace_writes": "full", "wire_bwd": "int4"}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("order", "loops", "mode", "wire"), RING_CASES)
def test_ring_equals_reference_with_subspace(tmp_path: Path, order, loops, mode, wire, tiny_train):
    """Real workers over mTLS ship k-wide coordinates (quantised by the codec when one is
    set), relays included (ordered), and their losses equal the reference engine's exactly."""
    train = {**tiny_train, "steps": 2, "order": order, "loops": loops}
    train.update(subspace_rank=8, subspace_mode=mode, **wire)
    ring = SubspaceRing(tmp_path, 3, train).prepare()
    ring.start().wait()
    ref, ref_eval = ring.reference()
    got = ring.losses()
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) == 0.0
    assert all(ring.eval_losses()[s] == v for s, v in enumerate(ref_eval))
    # the wire carried coordinates: about k/d = 1/4 of fp32 hidden states' bytes
    cfg = ring.config()
    edges = sum(len(schedule.ring_hops(order, s, 3, loops)) for s in range(3))
    tensors = edges * (2 * cfg.steps + cfg.eval_batches)  # fwd + bwd per step, one eval
    full = tensors * 4 * 32 * 32 * 4  # fp32 [4, 32, 32]
    sent = 0
    for i in range(3):
        rows = [json.loads(x) for x in (ring.out(i) / "metrics.jsonl").read_text().splitlines()]
        sent += max(r.get("bytes_sent", 0) for r in rows)
        # every step row carries the worker's peak memory so far (resident set on a CPU)
        assert all(r["peak_bytes"] > 2**20 for r in rows if "compute_s" in r)
    assert 0 < sent < 0.4 * full, (sent, full)


def test_bytes_and_projection_count_the_coordinates():
    compression, wan = load_benchmark("compression"), load_benchmark("wan")
    sub = compression.parse_subspace("rank=12,mode=home")
    assert sub == {"rank": 12, "mode": "home"}
    assert compression.parse_subspace("rank=12,writes=full")["writes"] == "full"
    with pytest.raises(ValueError, match="unknown key"):
        compression.parse_subspace("rank=12,width=3")
    sent, fp32 = compression.step_bytes(TrainConfig(subspace=sub))
    assert fp32 / sent == 8.0  # cpu-small: d = 96, k = 12
    codec = {"fwd": "int8", "bwd": "int4", "rounding": "stochastic"}
    sent, fp32 = compression.step_bytes(TrainConfig(subspace=sub, wire=codec))
    assert fp32 / sent == pytest.approx(32 / ((8.25 + 4.25) / 2) * 8)
    # mode tokens: each forward hop also carries a 16-bit id per token
    tok = compression.parse_subspace("rank=12,mode=tokens")
    fwd, bwd = compression.hop_bytes(TrainConfig(subspace=tok, wire=codec))
    plain_fwd, plain_bwd = compression.hop_bytes(TrainConfig(subspace=sub, wire=codec))
    assert (fwd - plain_fwd, bwd) == (2 * 8 * 128, plain_bwd)  # batch 8 × 128 tokens
    # the figure: gpt2-small, batch 8, P = 4, bf16: 100.7 MB per worker and step
    assert wan.worker_bytes("gpt2-small", 4, 1, 8, "bf16") == 2 * 4 * 8 * 1024 * 768 * 2
    r = wan.project(0.05, 1.25e8, 1e9, 0.0, 4)  # 1 Gbit/s moves 125 MB in 1 s
    assert r["transfer_s"] == pytest.approx(1.0) and r["busy"] == pytest.approx(0.05)
    r = wan.project(0.05, 1e6, 1e9, 0.01, 4)  # bytes hide behind compute; latency does not
    assert r["step_s"] == pytest.approx(0.05 + 4 * 0.01)
    with pytest.raises(ValueError, match="link rate '1gbps'"):
        wan.parse_rate_bps("1gbps")


def test_tokens_mode_exports_and_generates(site_dirs: list[Path], tmp_path: Path):
    """Mode tokens in the exported model: after the final barrier every E is the same, so
    the file's one E rebuilds b at every group and its loss equals the run's evaluation;
    the KV cache equals the full forward and generation is seeded."""
    from mobius_fed.data import SiteData
    from mobius_fed.export import export_run, load
    from mobius_fed.export.generation import Decoder, generate_ids

    cfg = TrainConfig(
        preset="cpu-tiny", workers=2, loops=2, steps=2, batch_size=2, eval_batches=2,
        subspace={"rank": 8, "mode": "tokens"},
    )  # fmt: skip
    sites = [SiteData(d, cfg.model().seq_len) for d in site_dirs]
    engine = ReferenceEngine(cfg, sites)
    for _ in range(cfg.steps):
        engine.train_step()
    engine.save(tmp_path / "run" / "checkpoint.pt")
    want = engine.evaluate().origin_losses
    dirs = export_run(tmp_path / "run", tmp_path / "models")
    assert json.loads((dirs[0] / "config.json").read_text())["subspace_mode"] == "tokens"
    models = [load(d) for d in dirs]
    assert val_losses(models, sites, cfg) == pytest.approx(want, abs=1e-5)
    ids = list(b"The ship sails at dawn")
    with torch.no_grad():
        full = models[1](torch.tensor([ids]))[0]
    dec = Decoder(models[1])
    steps = [dec.feed(ids[:6])] + [dec.feed([t]) for t in ids[6:]]
    torch.testing.assert_close(torch.stack(steps), full[5:], atol=1e-5, rtol=1e-5)
    a = generate_ids(models[1], ids[:4], max_new_tokens=12, seed=3)
    assert a == generate_ids(models[1], ids[:4], max_new_tokens=12, seed=3) and len(a) == 12


# ------------------------------------------------------------------- a learned U

LEARN = {"rank": 8, "mode": "tokens", "writes": "full", "learn": True, "lr": 0.02}


def _bases(engine: ReferenceEngine) -> list[torch.Tensor]:
    return [r.subspace.U.detach().clone() for r in engine.replicas]


def test_learned_u_trains_stays_orthonormal_and_shared(tmp_path, tiny_train, corpus_engine):
    """A learned U moves, keeps orthonormal columns, and is the same tensor on every worker
    in every step (each worker's copy is orth of the averaged W); a checkpoint taken between
    barriers resumes to the same losses, U included."""
    train = {**tiny_train, "workers": 3, "steps": 6, "sync_every": 2, "micro_batches": 2}
    cfg = TrainConfig(**train, subspace={**LEARN, "writes": "basis"})
    with pytest.raises(ValidationError, match="subspace learn needs barriers"):
        TrainConfig(**{**train, "sync_every": 0}, subspace=LEARN)
    with pytest.raises(ValidationError, match="subspace learn needs a subspace"):
        TrainConfig(**train, subspace={"learn": True})
    engine = corpus_engine(cfg, tmp_path / "a")
    start = _bases(engine)[0]
    seed_u = build_basis(cfg.model(), cfg.seed)
    assert torch.allclose(start, seed_u, atol=1e-6), "U starts from orth(the seed's U)"
    seen, losses = [], []
    for n in range(cfg.steps):
        us = _bases(engine)
        assert all(torch.equal(us[0], u) for u in us[1:]), f"step {n}: U differs across workers"
        seen.append(us[0])
        losses.append(engine.train_step().loss)
        if n == 2:  # between barriers: the round's partial gradient is in the checkpoint
            engine.save(tmp_path / "mid.pt")
    final = _bases(engine)[0]
    assert all(torch.equal(seen[n], seen[n + 1]) for n in (0, 2, 4)), "constant within a round"
    assert not torch.equal(seen[1], seen[2]) and (final - start).abs().max() > 1e-3
    assert (final.T @ final - torch.eye(8)).abs().max() < 1e-5
    ev = engine.evaluate().loss
    again = corpus_engine(cfg, tmp_path / "b")
    again.load(tmp_path / "mid.pt")
    assert [again.train_step().loss for _ in range(3)] == losses[3:]
    assert torch.equal(_bases(again)[0], final) and again.evaluate().loss == ev
    # fixed U (learn off) never moves
    fixed = corpus_engine(TrainConfig(**train, subspace={**LEARN, "learn": False}), tmp_path / "c")
    fixed.train_step()
    assert torch.equal(fixed.maps.basis.U, seed_u)


def test_learned_u_exports_and_generates(site_dirs: list[Path], tmp_path: Path):
    """The exported model holds the learned U (not the seed's): its loss equals the run's
    evaluation, and generation works."""
    from mobius_fed.data import SiteData
    from mobius_fed.export import export_run, load
    from mobius_fed.export.generation import generate_ids

    cfg = TrainConfig(
        preset="cpu-tiny", workers=2, steps=3, batch_size=2, eval_batches=2,
        subspace={**LEARN, "writes": "basis", "lr": 0.05},
    )  # fmt: skip
    sites = [SiteData(d, cfg.model().seq_len) for d in site_dirs]
    engine = ReferenceEngine(cfg, sites)
    for _ in range(cfg.steps):
        engine.train_step()
    engine.save(tmp_path / "run" / "checkpoint.pt")
    want = engine.evaluate().origin_losses
    dirs = export_run(tmp_path / "run", tmp_path / "models")
    models = [load(d) for d in dirs]
    learned = engine.replicas[0].subspace.U.detach()
    assert torch.equal(models[0].subspace_basis, learned)
    assert not torch.equal(learned, build_basis(cfg.model(), cfg.seed))
    assert val_losses(models, sites, cfg) == pytest.approx(want, abs=1e-5)
    ids = list(b"The ship")
    assert len(generate_ids(models[1], ids, max_new_tokens=6, seed=1)) == 6


LEARNED_RING_CASES = [
    ("cyclic", 1, {}),
    # ordered, L = 2, relays, activation recompute in both engines
    ("ordered", 2, {"memory": {"recompute": True}}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("order", "loops", "extra"), LEARNED_RING_CASES)
def test_ring_equals_reference_with_learned_u(tmp_path: Path, order, loops, extra):
    """Mode tokens with a learned U on a coordinated ring (real coordinator and workers over
    mTLS, int8/int4 codec): W travels with E/R, each worker retracts the average, and every
    per-step loss and every Eq. 8 equals the reference engine under the same Flower FedAvg
    exactly; the coordinator's final U has moved and is orthonormal."""
    from mobius_fed.checkpoint import load_checkpoint
    from mobius_fed.coordinator.manifests import latest_manifest
    from mobius_fed.data import SiteData
    from mobius_fed.engine.federated import train_with_strategy
    from mobius_fed.model.subspace import orthonormal
    from mobius_fed.ops.federation import LocalFederation
    from mobius_fed.strategies import RoundPlan, from_plain, make_strategy

    cfg = TrainConfig(
        workers=3, preset="cpu-tiny", batch_size=4, optimizer="adamw", steps=4, sync_every=2,
        eval_every=2, order=order, loops=loops, subspace=LEARN,
        wire={"fwd": "int8", "bwd": "int4", "rounding": "stochastic"}, **extra,
    )  # fmt: skip
    fed = LocalFederation(tmp_path, cfg)
    fed.prepare().start()
    try:
        final = fed.wait(timeout=300)
        assert final["phase"] == "done", (final, fed.tail("coordinator"))
        hist = fed.rest("/v1/history")
    finally:
        fed.stop()
    got = {(r["step"], s): v for r in hist["steps"] for s, v in enumerate(r["origin_losses"])}
    sites = [SiteData(fed.sites / f"site-{i}", cfg.model().seq_len) for i in range(cfg.P)]
    engine = ReferenceEngine(cfg, sites)
    grid = train_with_strategy(engine, make_strategy("fedavg", cfg.P, RoundPlan.of(cfg)))
    ref = {(r.step, s): v for r in grid.steps for s, v in enumerate(r.origin_losses)}
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) == 0.0
    assert [(e["step"], e["loss"]) for e in hist["evals"]] == [(e.step, e.loss) for e in grid.evals]
    manifest = latest_manifest(fed.coordinator_out)
    assert manifest is not None
    doc = json.loads(manifest.read_text())
    arrays = from_plain(load_checkpoint(manifest.parent / doc["er"])["arrays"])
    U = orthonormal(arrays.to_torch_state_dict()["subspace.weight"])
    assert (U.T @ U - torch.eye(8)).abs().max() < 1e-5
    assert (U - build_basis(cfg.model(), cfg.seed)).abs().max() > 1e-3
