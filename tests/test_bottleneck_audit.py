"""The patient audit of the learned bottleneck (issue 55; docs/privacy.md §4k): the observer
keeps the k-wide code that crosses the first remote edge and, as it arrives, the receiver's
own decoder output, which equals what the receiving group is applied to in the reference
engine bit for bit; every patient attack runs on both surfaces; the other audits refuse
the bottleneck with the reason."""

from __future__ import annotations

import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.privacy.audit import first_hop_attacker, receiver_rebuild
from mobius_fed.privacy.input_attacks import embedding_rows, known_mask, known_plaintext
from mobius_fed.privacy.observer import Observer
from mobius_fed.privacy.patient import (
    FLOOR,
    SURFACES,
    PatientAudit,
    identity_path,
    load_report,
    write_report,
)

P = 4
BOTTLENECK = {"rank": 8, "mode": "bottleneck-home", "writes": "full"}  # d/4 at cpu-tiny


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> list[SiteData]:
    root = tmp_path_factory.mktemp("bottleneck-audit")
    prepare_sites(None, root / "sites", P, text=embedded_corpus())
    seq = TrainConfig(preset="cpu-tiny").model().seq_len
    return [SiteData(root / "sites" / f"site-{i}", seq) for i in range(P)]


@pytest.mark.parametrize("mode", ["bottleneck", "bottleneck-home"])
def test_observer_keeps_the_code_and_the_receivers_rebuild_equals_its_groups_input(
    sites, mode, tiny_train
):
    """Cyclic P = 4: stream 0's first remote hop is slot 1, read by worker 1 at application
    1 (the only stream worker 1 runs there). The observer keeps the k-wide code and, on
    arrival, dec_1(c) with worker 1's decoder of that step: equal to the input of worker 1's
    group in the engine's own forward, bit for bit, at every step, and not what the decoder
    of the end of the run would make of the same code."""
    from mobius_fed.engine import ReferenceEngine

    cfg = TrainConfig(
        **{**tiny_train, "workers": P, "steps": 3}, subspace={**BOTTLENECK, "mode": mode}
    )
    eng = ReferenceEngine(cfg, sites)
    slot, receiver = first_hop_attacker(cfg, 0) or (0, 0)
    assert (slot, receiver) == (1, 1)
    obs = Observer(
        rank=receiver, forward_slots={0: slot}, phases=("train",), rebuild=receiver_rebuild(eng)
    )
    obs.attach(eng.hops)
    seen: list[torch.Tensor] = []

    def group_input(_module: torch.nn.Module, args: tuple) -> None:
        x, t = args
        if t == slot:
            seen.append(x.detach().clone())

    handle = eng.groups[receiver].register_forward_pre_hook(group_input)
    try:
        for _ in range(cfg.steps):
            eng.train_step()
    finally:
        handle.remove()
    M, d, k = cfg.micro_batches, cfg.model().d_model, BOTTLENECK["rank"]
    keys = [("train", n, 0, slot, m) for n in range(cfg.steps) for m in range(M)]
    assert sorted(obs.received) == sorted(keys) == sorted(obs.rebuilt)
    assert len(seen) == len(keys)
    for key, x in zip(keys, seen):
        assert obs.received[key].shape[-1] == k, "what crosses the edge is the k-wide code"
        assert obs.rebuilt[key].shape[-1] == d
        assert torch.equal(obs.rebuilt[key], x), key
    last = keys[-1]
    later = eng.maps.basis_of(receiver).expand(obs.received[last]).detach()
    assert not torch.equal(later, obs.rebuilt[last]), "the decoder of that step, not the last"
    assert receiver_rebuild(ReferenceEngine(TrainConfig(**tiny_train, workers=P), sites)) is None


def test_known_plaintext_maps_a_narrow_code_through_a_prior():
    """The linear map accepts a code narrower than E given a prior (the identity path), and
    refuses one without; on a code that *is* E's identity-path channels (8 of 32) it reads
    most of the text (chance 1/40)."""
    gen = torch.Generator().manual_seed(0)
    wte = torch.randn(40, 32, generator=gen)
    tokens = torch.randint(0, 40, (4000,), generator=gen)
    code = embedding_rows(wte)[tokens][:, ::4]  # the decoder at step 0 keeps these channels
    prior = identity_path(8, wte)
    assert prior.shape == (8, 32) and torch.equal(prior.sum(0)[::4], torch.ones(8))
    mask = known_mask(tokens.numel(), 0.05, 0)
    guesses, rest = known_plaintext(code, tokens, wte, mask, prior=prior)
    assert (guesses[:, 0] == rest).float().mean() > 0.5
    with pytest.raises(ValueError, match="give a prior"):
        known_plaintext(code, tokens, wte, mask)


def test_patient_audit_attacks_the_code_and_the_decoders_output(sites, tmp_path):
    """Two steps of bottleneck-home at d/4: every victim is attacked on both surfaces, the
    code without a nearest row of E; the report's worst per victim is over both, names the
    surface, and survives JSON."""
    cfg = TrainConfig(
        preset="cpu-tiny", workers=P, steps=2, batch_size=8, eval_every=0, subspace=BOTTLENECK
    )
    public = torch.tensor(list(embedded_corpus().encode()[:50_000]), dtype=torch.long)
    report = PatientAudit(
        cfg, sites, public, windows=(2,), known=(0.05,), cluster_sweep=(16,),
        decipher_sweep=(16,),
    ).run()  # fmt: skip
    assert {r.surface for r in report.rows if r.attack != FLOOR} == set(SURFACES)
    for surface in SURFACES:
        attacks = {r.attack for r in report.rows if r.surface == surface}
        assert all(a.endswith(f" [{surface}]") for a in attacks), attacks
        assert (f"nearest row of E [{surface}]" in attacks) == (surface == "dec(c)")
        for name in (
            "known plaintext 5 % pooled: MLP decoder",
            "known plaintext 5 % pooled + linear map",
        ):
            assert f"{name} [{surface}]" in attacks
        assert f"decipher: clusters + public bigrams (best k) [{surface}]" in attacks
    floors = [r for r in report.rows if r.attack == FLOOR]
    assert len(floors) == len({(r.stage, r.victim, r.window, r.start) for r in floors})
    per_victim = report.worst_per_victim()
    assert [w.victim for w in per_victim] == [0, 1, 2, 3]
    assert all(w.attack.endswith(("[code]", "[dec(c)]")) for w in per_victim)
    # every code is 0 at step 0 in bottleneck-home, the worst window need not be; a step-1
    # code is read above the floor by some attack on some victim
    assert report.worst_margin() > 0.0, report.table()
    write_report(report, tmp_path)
    again = load_report(tmp_path / "patient.json")
    assert again.worst_per_victim() == per_victim and again.rows == report.rows


def test_the_other_audits_refuse_the_bottleneck_with_the_reason(sites, tiny_train):
    from mobius_fed.privacy.audit import Audit
    from mobius_fed.privacy.leakage import LeakageAudit

    cfg = TrainConfig(**tiny_train, workers=P, subspace=BOTTLENECK)
    with pytest.raises(
        ValueError, match=r"leakage audit: .*'bottleneck-home' is not audited here.*--patient"
    ):
        LeakageAudit(cfg, sites)
    with pytest.raises(
        ValueError, match=r"one-victim audit: .*carries k-wide coordinates.*--patient"
    ):
        Audit(cfg, sites)
    home = TrainConfig(**tiny_train, workers=P, subspace={"rank": 8, "mode": "home"})
    with pytest.raises(ValueError, match="one-victim audit: with subspace mode 'home'"):
        Audit(home, sites)


def test_audit_command_runs_the_patient_audit_on_the_bottleneck(cli, tmp_path):
    """``mobius-fed audit --patient`` takes the bottleneck (both surfaces in patient.md);
    the one-victim audit refuses it, naming --patient."""
    public = tmp_path / "public.txt"
    public.write_bytes(embedded_corpus().encode()[:20_000])
    argv = ["audit", "--preset", "cpu-tiny", "--workers", "2", "--steps", "1", "--threads", "1"]
    argv += ["--batch-size", "2", "--subspace-rank", "8", "--subspace-mode", "bottleneck"]
    argv += ["--subspace-writes", "full", "--out", str(tmp_path / "out")]
    got = cli(*argv, "--patient", "--public", str(public), "--windows", "1", "--known", "0.05")
    assert got.returncode == 0, got.stderr
    table = (tmp_path / "out" / "patient.md").read_text()
    assert "[code]" in table and "[dec(c)]" in table and "| site 1 |" in table
    refused = cli(*argv, "--inverter-steps", "1")
    assert refused.returncode != 0 and "--patient" in refused.stderr + refused.stdout
    both = cli(*argv, "--patient", "--leakage")
    assert both.returncode == 2 and "two audits" in both.stderr
