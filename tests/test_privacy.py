"""Privacy audit: the attacks work where they should, the defences stop them, and bad
settings are refused with a clear message."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from pydantic import ValidationError

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.defences.accounting import (
    PrivacyExtraMissing,
    epsilon_spent,
    input_epsilon_spent,
)
from mobius_fed.defences.report import status_block
from mobius_fed.defences.stages import (
    InputNoise,
    NoiseKeys,
    build_stages,
    gaussian,
    label_release,
)
from mobius_fed.hop import HopContext
from mobius_fed.privacy.audit import Audit

P = 4
BASE = dict(preset="cpu-tiny", workers=P, steps=3, batch_size=4, eval_every=0)


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> list[SiteData]:
    root = tmp_path_factory.mktemp("privacy")
    prepare_sites(None, root / "sites", P, text=embedded_corpus())
    seq = TrainConfig(**BASE).model().seq_len
    return [SiteData(root / "sites" / f"site-{i}", seq) for i in range(P)]


def audit(sites, inverter_steps: int = 150, victim: int = 0, **kw):
    privacy = kw.pop("privacy", {})
    cfg = TrainConfig(**{**BASE, **kw}, privacy=privacy)
    return Audit(cfg, sites, victim=victim, inverter_steps=inverter_steps).run()


def test_without_defences_the_last_hop_reveals_every_target(sites):
    r = audit(sites, inverter_steps=1)
    assert r.target.attacker == P - 1 and r.target.tokens == 3 * 4 * 32
    assert r.target.accuracy >= 0.99, r.target
    assert r.target.model_accuracy < 0.5  # the gradient, not the model, gives them away


def test_label_noise_with_site_keys_hides_the_targets(sites, keys):
    r = audit(sites, privacy={"label_noise": 2.0, "noise_key_dir": keys}, inverter_steps=1)
    assert r.target.accuracy <= r.chance + 0.10, r.target
    assert r.epsilon is not None and r.epsilon > 0


def test_noise_keyed_by_the_public_seed_is_stripped_by_the_attacker(sites):
    r = audit(sites, privacy={"label_noise": 2.0}, inverter_steps=1)
    assert r.target.accuracy >= 0.99, r.target


def test_ordered_first_hop_sends_the_embedding_and_it_is_inverted(sites, keys):
    plain = audit(sites, order="ordered", victim=1)
    assert (plain.inversion.slot, plain.inversion.attacker) == (0, 0)
    assert plain.inversion.exact >= 0.9, plain.inversion
    noisy = audit(
        sites, order="ordered", victim=1, privacy={"input_noise": 4.0, "noise_key_dir": keys}
    )
    assert noisy.inversion.exact <= plain.inversion.exact - 0.3, noisy.inversion


def test_label_release_clips_each_token_and_is_a_pure_function_of_the_key(keys):
    g = torch.randn(2, 8, 16)
    rows = label_release(g, 1.0, 0.05, None).reshape(-1, 16) * 16
    assert rows.norm(dim=-1).max() <= 0.05 + 1e-6
    cfg = TrainConfig(**BASE, privacy={"label_noise": 1.0, "noise_key_dir": keys})
    ctx = HopContext("train", "backward", 5, 2, P, 0, 1, 2)
    a = NoiseKeys(cfg, "reference", None).generator(ctx)
    b = NoiseKeys(cfg, "ring", 2).generator(ctx)
    assert torch.equal(torch.randn(4, generator=a), torch.randn(4, generator=b))
    with pytest.raises(ValueError, match="worker 1 has no noise key of site 2"):
        NoiseKeys(cfg, "ring", 1).generator(ctx)


def test_clipped_input_noise_is_a_gaussian_mechanism_with_its_epsilon(keys):
    privacy = {"input_noise": 0.5, "input_clip": 2.0, "noise_key_dir": keys}
    cfg = TrainConfig(**BASE, privacy=privacy)
    stage = InputNoise(cfg, NoiseKeys(cfg, "reference", None))
    ctx = HopContext("train", "forward", 3, 1, 1, 0, 1, 2)  # cyclic: slot 1 leaves home
    assert stage.slots[1] == 1
    h = 10 * torch.randn(2, 8, 32)
    h[0, 0] = 0.1  # a short row stays as it is
    noise = gaussian(h, NoiseKeys(cfg, "ring", 1).generator(ctx))  # the sender's own key
    sent = stage.forward(h, ctx)
    clipped = sent - 0.5 * 2.0 * noise
    assert clipped.norm(dim=-1).max() <= 2.0 + 1e-5
    assert torch.allclose(clipped[0, 0], h[0, 0], atol=1e-6)
    assert torch.equal(stage.forward(h, HopContext("train", "forward", 3, 1, 2, 0, 2, 3)), h)
    # ε: the position is the label defence's mechanism; a sequence is √T times weaker
    pc, T = cfg.privacy, cfg.model().seq_len
    eps = input_epsilon_spent(pc, 50, T)
    assert eps["position"] == epsilon_spent(pc.model_copy(update={"label_noise": 0.5}), 50)
    scaled = pc.model_copy(update={"input_noise": 0.5 / T**0.5})
    assert eps["sequence"] == input_epsilon_spent(scaled, 50, 1)["position"] > eps["position"]
    assert input_epsilon_spent(pc, 0, T) == {"position": 0.0, "sequence": 0.0}
    unclipped = pc.model_copy(update={"input_clip": None})
    assert input_epsilon_spent(unclipped, 50, T)["position"] == float("inf")
    block = status_block(cfg, 50)["input"]
    assert block["clip"] == 2.0 and block["epsilon_position"] == eps["position"]
    assert status_block(TrainConfig(**BASE, privacy={"input_noise": 1.0}), 50).get("input") is None
    with pytest.raises(ValidationError, match=r"input_clip bounds the first send.*input_noise"):
        TrainConfig(privacy={"input_clip": 1.0})
    with pytest.raises(ValidationError, match=r"privacy\.input_clip"):
        TrainConfig(privacy={"input_noise": 1.0, "input_clip": 0})


def test_input_epsilon_is_stated_for_what_it_covers_and_an_unmeetable_target_is_refused(keys):
    """The status states ε per position and per sequence (so far and over the whole run), per
    site, what it covers and what it does not; a target ε the noise cannot meet stops the
    run at start, naming the σ it needs, and that σ does meet it."""
    from mobius_fed.defences.accounting import check_input_target, input_sigma_for_target

    privacy = {"input_noise": 4.0, "input_clip": 4.0, "noise_key_dir": keys}
    cfg = TrainConfig(**{**BASE, "steps": 60}, privacy=privacy)
    T = cfg.model().seq_len
    block = status_block(cfg, 30)["input"]
    assert block["epsilon_sequence"] == input_epsilon_spent(cfg.privacy, 30, T)["sequence"]
    assert (
        block["epsilon_sequence_whole_run"]
        == input_epsilon_spent(cfg.privacy, 60, T)["sequence"]
        > block["epsilon_sequence"]
        > block["epsilon_position"]
    )
    assert [e["site"] for e in block["per_site"]] == list(range(P))
    assert "first remote hop" in block["covers"] and "E/R update" in block["not_covered"]
    whole = block["epsilon_sequence_whole_run"]
    ok = cfg.privacy.model_copy(update={"input_epsilon_target": whole * 1.01})
    check_input_target(ok, 60, T)  # met: no error
    tight = cfg.privacy.model_copy(update={"input_epsilon_target": 8.0})
    with pytest.raises(ValueError, match=r"input_epsilon_target = 8 per sequence cannot be met"):
        check_input_target(tight, 60, T)
    with pytest.raises(ValueError, match="needs input_noise ≥"):
        build_stages(cfg.model_copy(update={"privacy": tight}), "reference", None)
    need = input_sigma_for_target(tight, 60, T, 8.0)
    enough = tight.model_copy(update={"input_noise": need})
    assert need > 4.0 and input_epsilon_spent(enough, 60, T)["sequence"] <= 8.0 * 1.02
    with pytest.raises(ValidationError, match="input_epsilon_target needs the accounted"):
        TrainConfig(privacy={"input_noise": 1.0, "input_epsilon_target": 5.0})


def test_privacy_preset_fills_unset_fields_and_needs_site_keys(keys):
    from mobius_fed.privacy_config import PRIVACY_PRESETS

    named = PRIVACY_PRESETS["states-only"]
    cfg = TrainConfig(privacy={"preset": "states-only", "noise_key_dir": keys})
    assert {k: getattr(cfg.privacy, k) for k in named} == named
    assert (cfg.subspace.rank, cfg.subspace.mode, cfg.subspace.writes) == (24, "home", "full")
    assert (cfg.wire.fwd, cfg.wire.bwd) == ("int8", "int4")
    mine = {"preset": "states-only", "noise_key_dir": keys, "input_noise": 9.0}
    again = TrainConfig(privacy=mine, subspace={"rank": 12, "mode": "home"})
    assert again.privacy.input_noise == 9.0 and again.subspace.rank == 12  # explicit wins
    assert TrainConfig(**cfg.model_dump(mode="json")).fingerprint() == cfg.fingerprint()
    with pytest.raises(ValidationError, match=r"needs privacy\.noise_key_dir"):
        TrainConfig(privacy={"preset": "states-only"})
    with pytest.raises(ValidationError, match=r"privacy\.preset"):
        TrainConfig(privacy={"preset": "paranoid"})
    with pytest.raises(ValidationError, match="'patient-neighbour' was removed: the audit"):
        TrainConfig(privacy={"preset": "patient-neighbour", "noise_key_dir": keys})


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"subspace": {"rank": 8, "mode": "tokens"}}, "mode 'tokens' sends the token ids"),
        ({"subspace": {"rank": 8, "mode": "stream"}}, "mode 'stream' and no subspace send E"),
        ({"privacy": {"input_noise": 0.0}}, "input_noise = 0 turns off the noise"),
        ({"privacy": {"home_input": "off"}}, "home_input = 'off'"),
    ],
)
def test_states_only_refuses_what_would_send_ids_or_undo_its_defence(keys, extra, reason):
    raw: dict = {"privacy": {"preset": "states-only", "noise_key_dir": keys}}
    for section, fields in extra.items():
        raw[section] = {**raw.get(section, {}), **fields}
    with pytest.raises(ValidationError, match=f"preset 'states-only' refused: .*{reason}"):
        TrainConfig(**raw)


def test_missing_key_file_and_bad_settings_are_named(tmp_path):
    cfg = TrainConfig(**BASE, privacy={"label_noise": 1.0, "noise_key_dir": str(tmp_path)})
    ctx = HopContext("train", "backward", 0, 0, P, 0, 3, 0)
    with pytest.raises(FileNotFoundError, match=r"site-0\.key"):
        NoiseKeys(cfg, "reference", None).generator(ctx)
    with pytest.raises(FileNotFoundError, match=r"site-2\.key"):
        build_stages(cfg, "ring", 2)
    with pytest.raises(ValidationError, match=r"privacy\.label_noise"):
        TrainConfig(privacy={"label_noise": -1})
    with pytest.raises(ValidationError, match=r"privacy\.input_nois"):
        TrainConfig(privacy={"input_nois": 1})


def test_status_block_reports_epsilon_and_names_the_missing_extra(monkeypatch):
    assert status_block(TrainConfig(**BASE), 10) is None
    cfg = TrainConfig(**BASE, privacy={"label_noise": 1.0, "sample_rate": 0.01})
    block = status_block(cfg, 100)
    assert [d["name"] for d in block["defences"]] == ["label_noise"]
    assert (
        0
        < block["epsilon"]
        < epsilon_spent(cfg.privacy.model_copy(update={"label_noise": 0.5}), 100)
    )
    monkeypatch.setitem(sys.modules, "opacus.accountants", None)
    with pytest.raises(PrivacyExtraMissing, match=r"mobius-fed\[privacy\]"):
        epsilon_spent(cfg.privacy, 10)
    assert "mobius-fed[privacy]" in status_block(cfg, 100)["error"]
    privacy = {"home_layer": "block", "decorrelation": 0.3, "home_input": "rotation"}
    block = status_block(TrainConfig(**BASE, privacy=privacy), 5)
    assert [d["name"] for d in block["defences"]] == ["decorrelation", "home_layer", "home_input"]
    assert block["defences"][2]["layer"] == "rotation" and block["defences"][2]["trained"]
    assert block["epsilon"] is None and block["defences"][1]["layer"] == "block"
    with pytest.raises(ValidationError, match=r"privacy\.home_layer"):
        TrainConfig(privacy={"home_layer": "lstm"})
    with pytest.raises(ValidationError, match=r"privacy\.decorrelation"):
        TrainConfig(privacy={"decorrelation": -0.1})


def test_audit_refuses_a_single_worker(sites):
    with pytest.raises(ValueError, match="P >= 2"):
        Audit(TrainConfig(**{**BASE, "workers": 1}), sites[:1])


def test_audit_command_writes_its_report_and_names_bad_flags(tmp_path, capsys):
    from mobius_fed.cli.main import main

    argv = ["audit", "--preset", "cpu-tiny", "--workers", "2", "--steps", "1"]
    argv += ["--batch-size", "2", "--threads", "1", "--out", str(tmp_path), "--json"]
    assert main([*argv, "--inverter-steps", "1"]) == 0
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["target"]["accuracy"] >= 0.99 and report["target"]["attacker"] == 1
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--inverter-steps", "0"])
    assert exc.value.code == 2 and "--inverter-steps" in capsys.readouterr().err


def test_distance_correlation_and_nopeek_decorrelates_the_first_hop(sites):
    from mobius_fed.defences.nopeek import distance_correlation
    from mobius_fed.engine import ReferenceEngine

    tokens = torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(0))
    scaled = 3.0 * torch.nn.functional.one_hot(tokens, 50).float()
    assert distance_correlation(tokens, scaled).item() == pytest.approx(1.0, abs=1e-5)
    code = torch.randn(50, 8, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(2))
    assert distance_correlation(tokens, noise) < distance_correlation(tokens, code[tokens])

    def first_hop_dcor(decorrelation: float) -> tuple[float, list[float]]:
        cfg = TrainConfig(**{**BASE, "steps": 8}, privacy={"decorrelation": decorrelation})
        eng = ReferenceEngine(cfg, sites)
        losses = [eng.train_step().loss for _ in range(cfg.steps)]
        x, _ = eng._micro("val", 0, 0)[0]
        with torch.no_grad():  # origin 0's first remote hop (cyclic): F_0(E(x))
            h = eng.groups[0](eng.replicas[0].embed(x), 0)
        return distance_correlation(x, h).item(), losses

    plain, plain_losses = first_hop_dcor(0.0)
    decorrelated, losses = first_hop_dcor(30.0)
    assert losses[0] == plain_losses[0] and losses[1:] != plain_losses[1:]  # CE is reported
    assert decorrelated < plain - 0.02, (decorrelated, plain)
