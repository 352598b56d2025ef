"""Tests for mobius_fed.model: parameter counts, init, determinism, tied head, soft-cap."""

from __future__ import annotations

import pytest
import torch

from mobius_fed.model import (
    PRESETS,
    build_group,
    build_replica,
    count_parameters,
    make_model_config,
)


def _tiny(groups: int = 4, **kw):
    return make_model_config("cpu-tiny", groups=groups, vocab_size=257, **kw)


def test_gpt2_small_parameter_count_matches_the_paper() -> None:
    mc = make_model_config("gpt2-small", groups=4, vocab_size=50257)
    assert mc.group_layers == (3, 3, 3, 3) and mc.even
    n = count_parameters(mc)
    assert abs(n - 123.6e6) <= 0.5e6, n


def test_untied_head_adds_vocab_times_width() -> None:
    tied = make_model_config("gpt2-small", groups=4, vocab_size=50257, tied=True)
    untied = make_model_config("gpt2-small", groups=4, vocab_size=50257, tied=False)
    assert count_parameters(untied) - count_parameters(tied) == tied.vocab_size * tied.d_model


def test_parameter_count_is_independent_of_the_split() -> None:
    counts = {P: count_parameters(_tiny(P)) for P in (1, 2, 3, 4, 6, 12)}
    assert len(set(counts.values())) == 1, counts


def test_an_uneven_split_sizes_each_group_and_keeps_the_parameter_count() -> None:
    mc = _tiny(split=(4, 4, 2, 2))
    assert mc.group_layers == (4, 4, 2, 2) and not mc.even
    assert [len(build_group(mc, i, seed=0).blocks) for i in range(4)] == [4, 4, 2, 2]
    assert count_parameters(mc) == count_parameters(_tiny())
    # F_i's first blocks are drawn as in the even split: the split adds or drops blocks
    even, a = build_group(_tiny(), 3, seed=0), build_group(mc, 3, seed=0)
    assert torch.equal(
        even.state_dict()["blocks.1.mlp.fc.weight"], a.state_dict()["blocks.1.mlp.fc.weight"]
    )


@pytest.mark.parametrize(
    ("split", "words"),
    [
        ((4, 4, 2, 1), "sums to 11 layers, not n_layer=12"),
        ((6, 6, 0, 0), "at least one layer, not 0"),
        ((7, 6, -1, 0), "at least one layer, not -1"),
        ((4, 4, 2, 1, 1), "names 5 groups, more groups than sites: the run has P=4"),
        ((6, 4, 2), "names 3 groups, but the run has P=4"),
    ],
)
def test_a_bad_split_is_refused_naming_the_problem(split: tuple, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _tiny(split=split)


def test_presets_resolve() -> None:
    for name in PRESETS:
        mc = make_model_config(name, groups=4, vocab_size=257)
        assert mc.n_layer % 4 == 0
    with pytest.raises(ValueError, match="unknown preset"):
        make_model_config("gpt5", groups=4, vocab_size=257)
    with pytest.raises(ValueError, match="not divisible"):
        make_model_config("cpu-tiny", groups=5, vocab_size=257)


def test_block_group_is_identity_at_init_but_trainable() -> None:
    mc = _tiny()
    group = build_group(mc, 0, seed=0)
    x = torch.randn(2, mc.seq_len, mc.d_model, requires_grad=True)
    y = group(x)
    assert torch.equal(y, x)  # zero-initialised output projections
    (y * torch.randn_like(y)).sum().backward()
    grads = {n: p.grad for n, p in group.named_parameters()}
    assert all(g is not None for g in grads.values())
    # The zero-initialised output projections get a gradient, so the group can learn.
    proj = [g for n, g in grads.items() if n.endswith("proj.weight")]
    assert proj and all(g.abs().sum() > 0 for g in proj)


def test_group_init_is_deterministic_per_seed_and_index() -> None:
    mc = _tiny()
    a, b = build_group(mc, 1, seed=7), build_group(mc, 1, seed=7)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb
        assert torch.equal(pa, pb), na
    c = build_group(mc, 2, seed=7)
    d = build_group(mc, 1, seed=8)
    qkv = "blocks.0.attn.qkv.weight"
    assert not torch.equal(a.state_dict()[qkv], c.state_dict()[qkv])
    assert not torch.equal(a.state_dict()[qkv], d.state_dict()[qkv])


def test_build_group_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_group(_tiny(), 0, seed=0)
    build_replica(_tiny(), seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_replicas_are_equal_and_tied_head_uses_the_embedding() -> None:
    mc = _tiny()
    r1, r2 = build_replica(mc, seed=3), build_replica(mc, seed=3)
    assert torch.equal(r1.wte.weight, r2.wte.weight)
    assert r1.lm_head is None
    assert [n for n, _ in r1.named_parameters()] == ["wte.weight"]
    h = torch.randn(2, 5, mc.d_model)
    with torch.no_grad():
        r1.wte.weight.mul_(2.0)  # the head must follow the embedding
        expected = r1.logits(h)
        normed = torch.nn.functional.rms_norm(h, (mc.d_model,))
        raw = normed @ r1.wte.weight.T
        assert torch.allclose(expected, mc.logit_cap * torch.tanh(raw / mc.logit_cap))
    untied = build_replica(_tiny(tied=False), seed=3)
    assert untied.lm_head is not None
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()


def test_logits_are_soft_capped() -> None:
    mc = _tiny()
    replica = build_replica(mc, seed=0)
    with torch.no_grad():
        replica.wte.weight.mul_(1000.0)  # huge raw logits
        logits = replica.logits(torch.randn(2, 4, mc.d_model))
    assert logits.dtype == torch.float32
    assert logits.abs().max() <= mc.logit_cap
    assert logits.abs().max() > 0.9 * mc.logit_cap  # the cap is actually reached


def test_replica_loss_is_mean_cross_entropy() -> None:
    mc = _tiny()
    replica = build_replica(mc, seed=0)
    idx = torch.randint(0, 257, (2, 8))
    h = replica.embed(idx)
    assert h.shape == (2, 8, mc.d_model)
    loss = replica.loss(h, idx)
    ref = torch.nn.functional.cross_entropy(replica.logits(h).flatten(0, 1), idx.flatten())
    assert torch.allclose(loss, ref)
