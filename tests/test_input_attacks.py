"""Input attacks at every hop: each recovers what it should, on a real run and on
constructed data, and bad input is refused with a clear message."""

from __future__ import annotations

import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.privacy.input_attacks import (
    cluster_frequency,
    frequency_floor,
    known_class_means,
    known_codebook,
    known_mask,
    known_plaintext,
    nearest_row,
    recovery,
)
from mobius_fed.privacy.leakage import LeakageAudit, remote_hops
from mobius_fed.privacy.leakage_report import describe

P = 4
BASE = dict(preset="cpu-tiny", workers=P, steps=1, batch_size=4, eval_every=0)


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> list[SiteData]:
    root = tmp_path_factory.mktemp("inputs")
    prepare_sites(None, root / "sites", P, text=embedded_corpus())
    seq = TrainConfig(**BASE).model().seq_len
    return [SiteData(root / "sites" / f"site-{i}", seq) for i in range(P)]


def test_remote_hops_name_every_worker_that_receives_the_stream():
    assert remote_hops(TrainConfig(**BASE), 0) == [(1, 1), (2, 2), (3, 3)]
    assert remote_hops(TrainConfig(**BASE), 2) == [(1, 3), (2, 0), (3, 1)]
    ordered = TrainConfig(**BASE, order="ordered")
    assert remote_hops(ordered, 1) == [(0, 0), (2, 2), (3, 3)]  # slot 1 is its own group
    assert remote_hops(TrainConfig(**BASE, loops=2), 0) == [
        (1, 1), (2, 2), (3, 3), (5, 1), (6, 2), (7, 3)
    ]  # fmt: skip


def test_at_step_zero_every_hop_carries_the_embedding_and_nearest_row_reads_it(sites):
    report = LeakageAudit(TrainConfig(**BASE), sites, inverter_steps=1, known=(0.05,)).run()
    first = {
        r.slot: r for r in report.hops if r.stage == "step 0" and r.attack == "nearest row of E"
    }
    assert sorted(first) == [1, 2, 3]
    for r in first.values():  # output projections start at zero: h = E(x) exactly
        assert r.exact == 1.0 and r.tokens == 4 * 32, r
    floor = [r for r in report.hops if r.attack.startswith("floor")]
    assert all(r.exact < 0.5 for r in floor)  # the attack, not the text, gives them away
    assert "| step 0 | nearest row of E | 100.0 % / 100.0 %" in describe(report)


def test_subspace_hops_are_attacked_as_the_receiver_rebuilds_them(sites):
    """stream mode: slot 0 carries Uᵀ E(x) and the identity groups hand it on, so the nearest
    projected row of E still reads most of step 0. home mode: the embedding stays at its
    origin and the identity groups write nothing, so every remote hop carries zeros."""

    def step0(mode: str) -> dict[int, float]:
        cfg = TrainConfig(**BASE, subspace={"rank": 8, "mode": mode})
        report = LeakageAudit(cfg, sites, inverter_steps=1, known=(0.05,)).run()
        return {
            r.slot: r.exact
            for r in report.hops
            if r.stage == "step 0" and r.attack == "nearest row of E"
        }

    stream, home = step0("stream"), step0("home")
    assert sorted(stream) == sorted(home) == [1, 2, 3]
    assert all(v > 0.5 for v in stream.values()), stream  # 8 of 32 dimensions suffice
    assert all(v == 0.0 for v in home.values()), home


def test_known_plaintext_undoes_an_unknown_linear_map_and_refuses_no_known_tokens():
    gen = torch.Generator().manual_seed(0)
    vocab, d, n = 64, 16, 2000
    wte = torch.randn(vocab, d, generator=gen)
    x = torch.randint(0, vocab, (n,), generator=gen)
    mix = torch.randn(d, d, generator=gen)
    h = (wte[x] / wte[x].square().mean(-1, keepdim=True).sqrt()) @ mix
    assert recovery(nearest_row(h, wte), x).exact < 0.3  # the map hides the rows
    guesses, rest = known_plaintext(h, x, wte, known_mask(n, 0.05, 0))
    assert rest.numel() == n - 100 and recovery(guesses, rest).exact >= 0.95
    with pytest.raises(ValueError, match="at least one known"):
        known_plaintext(h, x, wte, known_mask(n, 0.0, 0))
    with pytest.raises(ValueError, match="metric must be"):
        nearest_row(h, wte, metric="dot")
    with pytest.raises(ValueError, match="known fraction"):
        known_mask(n, 1.5, 0)
    with pytest.raises(ValueError, match="3 guesses for 2000 tokens"):
        recovery(guesses[:3], x)


def test_pooled_class_means_average_the_noise_out_where_the_codebook_cannot():
    """A secret code per token plus noise as large as the code: the nearest known position
    is often another token's, the mean of many known positions of a token is not."""
    gen = torch.Generator().manual_seed(2)
    vocab, d, n = 40, 32, 6000
    weights = 1.0 / torch.arange(1, vocab + 1).float()
    x = torch.multinomial(weights, n, replacement=True, generator=gen)
    code = torch.randn(vocab, d, generator=gen)
    h = code[x] + 1.5 * torch.randn(n, d, generator=gen)
    mask = known_mask(n, 0.1, 0)
    means = recovery(*known_class_means(h, x, mask))
    book = recovery(*known_codebook(h, x, mask))
    assert means.exact >= 0.8 and means.exact > book.exact + 0.1, (means, book)
    with pytest.raises(ValueError, match="some known and some unknown"):
        known_class_means(h, x, torch.zeros(n, dtype=torch.bool))


def test_clusters_matched_to_public_frequencies_break_a_substitution_cipher():
    gen = torch.Generator().manual_seed(1)
    vocab, d = 40, 24
    weights = 1.0 / torch.arange(1, 11).float()  # 10 symbols, Zipf frequencies
    draw = lambda n: torch.multinomial(weights, n, replacement=True, generator=gen)  # noqa: E731
    secret = torch.randperm(vocab, generator=gen)[:10]  # which ids the symbols are
    x = secret[draw(4000)]
    public = secret[draw(4000)]
    code = torch.randn(vocab, d, generator=gen)  # an unknown code: no row of E to match
    h = code[x] + 0.05 * torch.randn(x.numel(), d, generator=gen)
    got = recovery(cluster_frequency(h, public, vocab), x)
    floor = recovery(frequency_floor(public, x.numel(), vocab), x)
    assert got.exact >= 0.8 and got.exact > floor.exact + 0.4, (got, floor)


def test_audit_command_writes_the_leakage_tables(tmp_path, capsys):
    import json

    from mobius_fed.cli.main import main

    argv = ["audit", "--leakage", "--preset", "cpu-tiny", "--workers", "2", "--steps", "1"]
    argv += ["--batch-size", "2", "--threads", "1", "--inverter-steps", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "leakage.json").read_text())
    assert {r["slot"] for r in report["hops"]} == {1} and report["updates"][0]["round"] == 1
    assert "What the coordinator learns" in (tmp_path / "leakage.md").read_text()
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--sweep", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--leakage runs no sweep" in capsys.readouterr().err
