"""Exported models: equal to the run's own evaluation through both loaders, a KV cache equal
to the full forward, seeded generation, text evaluation, refused inputs named."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine import ReferenceEngine
from mobius_fed.export import export_run, load
from mobius_fed.export.files import ExportError
from mobius_fed.export.generation import Decoder, generate_ids, score_text
from mobius_fed.export.modeling_mobius import MobiusLM

P = 2  # workers, and the sites of site_dirs (tests/conftest.py)
HF_HINT = "transformers is not installed: pip install 'mobius-fed[transformers]'"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _cfg(**kw) -> TrainConfig:
    base = dict(preset="cpu-tiny", workers=P, loops=2, steps=4, batch_size=2, eval_batches=2)
    return TrainConfig(**{**base, **kw})


def val_losses(models: list, sites: list[SiteData], cfg: TrainConfig, hf: bool = False):
    """Each origin's mean validation loss on the batches the run evaluates (Eq. 8's terms)."""
    out = []
    for s, model in enumerate(models):
        losses = []
        for b in range(cfg.eval_batches):
            x, y = sites[s].batch("val", seed=cfg.seed, step=b, batch_size=cfg.batch_size)
            with torch.no_grad():
                logits = model(x).logits if hf else model(x)
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
        out.append(float(torch.stack(losses).mean()))
    return out


def _hf_models(dirs: list[Path]) -> list:
    transformers = pytest.importorskip("transformers", reason=HF_HINT)
    return [
        transformers.AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
        for d in dirs
    ]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"privacy": {"home_layer": "block"}, "tied": False},
        {"knobs": {"depth_embedding": True, "residual_scale": "inverse_loops"}},
        {
            "subspace": {"rank": 8, "mode": "home", "writes": "full"},
            "privacy": {"home_input": "mlp"},
        },
        {"subspace": {"rank": 8, "mode": "stream"}},
        {"layers_per_group": [8, 4]},
    ],
    ids=[
        "paper",
        "home-block-untied",
        "loop-knobs",
        "subspace-home-full-input-mlp",
        "subspace-stream",
        "uneven-split",
    ],
)
def test_local_run_export_equals_the_engines_evaluation(
    site_dirs: list[Path], tmp_path: Path, extra: dict
) -> None:
    cfg = _cfg(**extra)
    sites = [SiteData(d, cfg.model().seq_len) for d in site_dirs]
    engine = ReferenceEngine(cfg, sites)
    for _ in range(3):
        engine.train_step()
    engine.save(tmp_path / "run" / "checkpoint.pt")
    want = engine.evaluate().origin_losses
    dirs = export_run(tmp_path / "run", tmp_path / "models")  # a `local` run directory
    assert dirs == [tmp_path / "models" / f"origin-{s}" for s in range(P)]
    conf = json.loads((dirs[1] / "config.json").read_text())
    assert conf["source_groups"] == [1, 0] and conf["path"] == [0, 1, 0, 1]
    assert conf["encoding"] == "bytes" and conf["eos_token_id"] == 256
    # an uneven split: one count per group of the path, origin 1's F1 (4 blocks) first
    assert conf["layers_per_group"] == ([4, 8] if cfg.layers_per_group else 6)
    got = val_losses([load(d) for d in dirs], sites, cfg)
    assert got == pytest.approx(want, abs=1e-5)
    assert val_losses(_hf_models(dirs), sites, cfg, hf=True) == pytest.approx(want, abs=1e-5)


def test_one_origin_goes_to_out_itself_and_bad_origins_are_named(
    site_dirs: list[Path], tmp_path: Path
) -> None:
    cfg = _cfg()
    engine = ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len) for d in site_dirs])
    ckpt = engine.save(tmp_path / "checkpoint.pt")
    (d,) = export_run(ckpt, tmp_path / "one", [1])
    assert d == tmp_path / "one" and json.loads((d / "config.json").read_text())["origin"] == 1
    assert sorted(p.name for p in d.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "modeling_mobius.py",
    ]
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in d.iterdir()}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes  # safetensors alone: 0600
    card = (d / "README.md").read_text()
    assert "origin 1 of P = 2, its path\nF1 → F0 applied L = 2 times" in card
    with pytest.raises(ExportError, match=r"origin 2 does not exist \(the run has P=2"):
        export_run(ckpt, tmp_path / "x", [2])
    with pytest.raises(ExportError, match="nowhere"):
        export_run(tmp_path / "nowhere", tmp_path / "x")


def test_loader_names_missing_and_mismatched_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json not found"):
        load(tmp_path)
    conf = _tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(conf))
    from safetensors.torch import save_file

    save_file({"wte.weight": torch.zeros(3, 3)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors does not match .*config\.json"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**conf, "path": [0, 5]}))
    with pytest.raises(ValueError, match="path names a group outside"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({**conf, "subspace_rank": 8, "subspace_mode": "hom"})
    )
    with pytest.raises(ValueError, match="unknown subspace_mode 'hom'"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**conf, "layers_per_group": [2, 2, 2]}))
    with pytest.raises(ValueError, match="layers_per_group names 3 groups, groups_in_path is 2"):
        load(tmp_path)


def _tiny_config(**kw) -> dict:
    base = dict(model_type="mobius", vocab_size=64, d_model=32, n_head=2, head_dim=16)
    base.update(seq_len=24, layers_per_group=2, mlp_ratio=4, path=[0, 1, 0, 1], groups_in_path=2)
    return {**base, **kw}


def _random_model(**kw) -> MobiusLM:
    torch.manual_seed(0)
    model = MobiusLM(_tiny_config(**kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # output projections are not zero: every path matters
    return model


SUBSPACE = {"subspace_rank": 8, "subspace_mode": "home", "origin": 1, "source_groups": [1, 0]}


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"home_layer": "mlp"},
        {"home_layer": "block"},
        {"depth_embedding": True},
        SUBSPACE,
        {"layers_per_group": [3, 1]},
    ],
    ids=["paper", "home-mlp", "home-block", "depth-embedding", "subspace-home", "uneven"],
)
def test_kv_cache_logits_equal_the_full_forward(kw: dict) -> None:
    model = _random_model(residual_epsilon=0.5, **kw)
    if model.subspace_basis is not None:  # a buffer: the weights file brings U
        model.subspace_basis.copy_(torch.linalg.qr(torch.randn(32, 8))[0])
    ids = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        full = model(torch.tensor([ids]))[0]
    dec = Decoder(model)
    steps = [dec.feed(ids[:6])] + [dec.feed([t]) for t in ids[6:]]
    torch.testing.assert_close(torch.stack(steps), full[5:], atol=1e-5, rtol=1e-5)


def test_generation_is_deterministic_for_a_seed_and_runs_past_the_context() -> None:
    model = _random_model()
    a = generate_ids(model, [1, 2, 3], max_new_tokens=40, seed=7)  # 43 > seq_len 24
    assert a == generate_ids(model, [1, 2, 3], max_new_tokens=40, seed=7)
    assert a != generate_ids(model, [1, 2, 3], max_new_tokens=40, seed=8)
    assert len(a) == 40 and all(0 <= t < 64 for t in a)
    greedy = generate_ids(model, [1, 2, 3], max_new_tokens=5, temperature=0)
    with torch.no_grad():
        assert greedy[0] == int(model(torch.tensor([[1, 2, 3]]))[0, -1].argmax())
    assert all(t < 10 for t in generate_ids(model, [1], max_new_tokens=20, vocab=10))
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_ids(model, [], max_new_tokens=1)


def _export_one(site_dirs: list[Path], tmp_path: Path) -> Path:
    cfg = _cfg()
    engine = ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len) for d in site_dirs])
    return export_run(engine.save(tmp_path / "c.ckpt"), tmp_path / "m", [0])[0]


def test_generate_and_eval_commands(
    site_dirs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from mobius_fed.cli.main import main
    from mobius_fed.data.tokenizers import get_encoding

    d = _export_one(site_dirs, tmp_path)
    args = ["generate", str(d), "--prompt", "The ship", "--max-new-tokens", "30", "--threads", "1"]
    outs = []
    for seed in ("3", "3", "4"):
        assert main([*args, "--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] != outs[2] and outs[0].startswith("The ship")
    text = "It was the best of times, it was the worst of times."
    (tmp_path / "t.txt").write_text(text)
    assert main(["eval", str(d), "--data", str(tmp_path / "t.txt"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == len(get_encoding("bytes").encode_ordinary(text))  # + EOT − 1
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))
    score = score_text(load(d), text)
    assert (score.tokens, score.loss) == (got["tokens"], got["loss"])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit):
        main(["eval", str(d), "--data", str(tmp_path / "empty.txt")])
    assert "the text is empty" in capsys.readouterr().err


def test_transformers_generate_matches_our_greedy_decoding(
    site_dirs: list[Path], tmp_path: Path
) -> None:
    d = _export_one(site_dirs, tmp_path)
    (hf,) = _hf_models([d])
    prompt = [84, 104, 101, 32]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    new = out[0, len(prompt) :].tolist()
    assert new == generate_ids(load(d), prompt, max_new_tokens=len(new), temperature=0)


@pytest.mark.slow
def test_coordinated_run_export_equals_the_rings_evaluation(tmp_path: Path) -> None:
    """A real coordinated run (coordinator + 2 worker processes over mTLS) with private
    home layers: each origin's export equals the ring's own evaluation at that round, and a
    worker file that fails its manifest's sha256 stops the export, named."""
    from mobius_fed.ops.federation import LocalFederation
    from mobius_fed.research import analyze

    train = _cfg(sync_every=1, eval_every=4, privacy={"home_layer": "mlp"})
    fed = LocalFederation(tmp_path / "up", train, checkpoint_every=2, threads=1)
    fed.prepare().start()
    try:
        final = fed.wait(timeout=300)
        assert final["phase"] == "done", (final, fed.tail("coordinator"))
        evals = fed.rest("/v1/history")["evals"]
    finally:
        fed.stop()
    (last,) = [e for e in evals if e["step"] == 4]
    dirs = export_run(tmp_path / "up", tmp_path / "models")  # the up root: newest manifest
    manifest = tmp_path / "up" / "coordinator" / "checkpoints" / "round-000004" / "manifest.json"
    sites = analyze.sites_for(train, manifest, None, tmp_path / "an")
    want = last["origin_losses"]
    assert val_losses([load(d) for d in dirs], sites, train) == pytest.approx(want, abs=1e-5)
    hf = _hf_models(dirs)
    assert val_losses(hf, sites, train, hf=True) == pytest.approx(want, abs=1e-5)
    worker = Path(json.loads(manifest.read_text())["workers"]["1"]["path"])
    raw = bytearray(worker.read_bytes())
    raw[-1] ^= 0x01
    worker.write_bytes(bytes(raw))
    with pytest.raises(ExportError, match="does not match its manifest") as err:
        export_run(manifest, tmp_path / "bad")
    assert worker.name in str(err.value)
