"""The coordinator's attack on a site's E/R update: it finds the site's tokens on a real
tiny run far above chance, its model of AdamW is exact, and bad input is named."""

from __future__ import annotations

import pytest
import torch

from mobius_fed.config import ConfigError, TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.model.training import ADAM_BETAS
from mobius_fed.privacy.er_attacks import adam_decay, otsu_threshold, presence, row_scores
from mobius_fed.privacy.leakage import LeakageAudit

P = 4
BASE = dict(preset="cpu-tiny", workers=P, steps=3, batch_size=4, eval_every=0, warmup_steps=1)


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> list[SiteData]:
    root = tmp_path_factory.mktemp("updates")
    prepare_sites(None, root / "sites", P, text=embedded_corpus())
    seq = TrainConfig(**BASE).model().seq_len
    return [SiteData(root / "sites" / f"site-{i}", seq) for i in range(P)]


def rows(report, rnd: int, name: str, score: str):
    (row,) = [r for r in report.updates if (r.round, r.rows, r.score) == (rnd, name, score)]
    return row


def test_step_one_update_gives_away_the_bag_of_tokens_tied_and_untied(sites):
    tied = LeakageAudit(TrainConfig(**BASE), sites, inverter_steps=1, known=()).run()
    first = rows(tied, 1, "E (tied: inputs and targets)", "sign")
    assert first.base_rate < 0.3
    assert first.topk_precision >= first.base_rate + 0.5, first
    assert first.precision >= first.base_rate + 0.5 and first.recall >= 0.8, first
    norm = rows(tied, 1, "E (tied: inputs and targets)", "norm")  # Adam: ±lr everywhere
    assert norm.topk_precision < first.topk_precision
    untied = LeakageAudit(TrainConfig(**BASE, tied=False), sites, inverter_steps=1, known=()).run()
    inputs = rows(untied, 1, "E (inputs)", "norm")  # absent rows get no gradient at all
    assert (inputs.precision, inputs.recall, inputs.topk_precision) == (1.0, 1.0, 1.0)
    later = rows(untied, 3, "E (inputs)", "residual")  # momentum moves absent rows too
    assert later.precision == 1.0 and later.topk_precision == 1.0, later
    moved = rows(untied, 3, "E (inputs)", "norm")
    assert moved.topk_precision < later.topk_precision, moved
    targets = rows(untied, 1, "R (targets)", "sign")
    assert targets.topk_precision >= targets.base_rate + 0.5, targets


def test_adam_decay_predicts_adamw_on_a_row_with_no_gradient():
    p = torch.nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.AdamW([p], lr=0.1, betas=ADAM_BETAS, eps=1e-10, weight_decay=0.0)
    steps, lrs = [], [0.1, 0.05, 0.05, 0.02]
    for t, lr in enumerate(lrs):
        opt.param_groups[0]["lr"] = lr
        before = p.detach().clone()
        p.grad = torch.randn(3, 5) if t == 0 else torch.zeros(3, 5)
        opt.step()
        steps.append(p.detach() - before)
    for t in range(1, len(lrs)):
        c = adam_decay(t + 1, lrs[t], lrs[t - 1])
        assert torch.allclose(steps[t], c * steps[t - 1], rtol=1e-5, atol=1e-9)
        assert row_scores(steps[t], "residual", steps[t - 1], c).max() < 1e-6
    with pytest.raises(ValueError, match="step must be >= 2"):
        adam_decay(1, 0.1, 0.1)


def test_threshold_and_bad_input_are_named(sites):
    scores = torch.cat([torch.full((30,), 0.1), torch.full((10,), 2.0)])
    assert 0.1 < otsu_threshold(scores) < 2.0
    got = presence(scores, torch.arange(30, 40), "norm")
    assert (got.precision, got.recall, got.topk_precision, got.base_rate) == (1, 1, 1, 0.25)
    with pytest.raises(ValueError, match="bag of tokens is empty"):
        presence(scores, torch.tensor([], dtype=torch.long), "norm")
    with pytest.raises(ValueError, match="unknown score 'size'"):
        row_scores(torch.zeros(4, 2), "size")
    with pytest.raises(ValueError, match="previous update"):
        row_scores(torch.zeros(4, 2), "residual")
    with pytest.raises(ConfigError, match="sync_every = 0"):
        LeakageAudit(TrainConfig(**{**BASE, "sync_every": 0}), sites)
    with pytest.raises(ValueError, match="P >= 2"):
        LeakageAudit(TrainConfig(**{**BASE, "workers": 1}), sites[:1])
