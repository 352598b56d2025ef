"""The settings system: one name per setting in TOML, MOBIUS_* variables and flags."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mobius_fed.cli import coordinator as coordinator_cli
from mobius_fed.cli import main as main_cli
from mobius_fed.cli import worker as worker_cli
from mobius_fed.cli.common import (
    add_threads_flag,
    add_train_flags,
    default_threads,
    threads_from,
    train_config_from_args,
)
from mobius_fed.cli.variables import known_env_names
from mobius_fed.config import ConfigError, TrainConfig
from mobius_fed.coordinator.config import CoordinatorConfig, load_coordinator_config
from mobius_fed.settings import settings_of
from mobius_fed.worker.config import WorkerConfig, load_worker_config

ROOT = Path(__file__).resolve().parents[1]
FLAG_ALIASES = {"--strategy-options": "--strategy-option"}  # a repeatable KEY=VALUE flag
# Misspelt on purpose in tests and docs, to show the error.
DELIBERATE_TYPOS = {"MOBIUS_LR_ADAMW", "MOBIUS_STEPZ"}
NOISE = "MOBIUS_PRIVACY__LABEL_NOISE"
CERTS = {"MOBIUS_CA": "ca.crt", "MOBIUS_CERT": "tls.crt", "MOBIUS_KEY": "tls.key"}


def _local(argv: list[str], monkeypatch, env: dict[str, str] | None = None) -> TrainConfig:
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    return train_config_from_args(parser.parse_args(argv))


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


# ------------------------------------------------------------------------------ layering
def test_flags_beat_env_beat_toml_for_flat_and_nested_settings(tmp_path, monkeypatch) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[train]\nsteps = 7\nlr_adam = 0.1\nseed = 3\n"
        "[train.privacy]\nlabel_noise = 0.5\nlabel_clip = 0.2\n"
    )
    env = {"MOBIUS_STEPS": "9", "MOBIUS_PRIVACY__LABEL_NOISE": "0.25", "MOBIUS_OPTIMIZER": "adamw"}
    cfg = _local(
        ["--config", str(toml), "--steps", "11", "--privacy-label-clip", "0.3"], monkeypatch, env
    )
    assert cfg.steps == 11  # flag > env > file
    assert cfg.optimizer == "adamw"  # env (issue: MOBIUS_OPTIMIZER used to be ignored)
    assert cfg.lr_adam == 0.1 and cfg.seed == 3  # file
    assert cfg.privacy.label_noise == 0.25  # env > file, nested
    assert cfg.privacy.label_clip == 0.3  # flag > file, nested


def test_mobius_config_names_the_file(tmp_path, monkeypatch) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nmicro_batches = 2\n")
    assert _local([], monkeypatch, {"MOBIUS_CONFIG": str(toml)}).micro_batches == 2


def test_booleans_and_compact_flags(monkeypatch) -> None:
    assert _local(["--no-tied"], monkeypatch).tied is False
    assert _local(["--untied"], monkeypatch).tied is False
    assert _local([], monkeypatch, {"MOBIUS_TIED": "false"}).tied is False
    wire = _local(["--wire", "fwd=int8,bwd=fp8", "--wire-bwd", "int4"], monkeypatch).wire
    assert (wire.fwd, wire.bwd) == ("int8", "int4")  # the per-field flag wins


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({"MOBIUS_STEPZ": "3"}, [], "variable MOBIUS_STEPZ (did you mean MOBIUS_STEPS?)"),
        ({"MOBIUS_STEPS": "many"}, [], "steps (from MOBIUS_STEPS='many')"),
        ({NOISE: "-1"}, [], f"privacy.label_noise (from {NOISE}='-1')"),
        ({}, ["--lr-muon", "0"], "lr_muon (from --lr-muon"),
        (
            {"MOBIUS_KEEPALIVE_SCALE": "0.5"},
            [],
            "MOBIUS_KEEPALIVE_SCALE='0.5': expected a number from 1 to 10000",
        ),
        ({"MOBIUS_KEEPALIVE_SCALE": "slow"}, [], "MOBIUS_KEEPALIVE_SCALE='slow': expected"),
    ],
)  # fmt: skip
def test_bad_values_name_their_source(monkeypatch, env, argv, expected) -> None:
    with pytest.raises(ConfigError) as err:
        _local(argv, monkeypatch, env)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[train]\nstepz = 3\n", "stepz (from {toml}): unknown setting"),
        ("[train.privacy]\nlabel_nois = 1\n", "privacy.label_nois (from {toml}): unknown setting"),
        ("[trian]\nsteps = 3\n", "{toml}: unknown table [trian]"),
    ],
)
def test_unknown_toml_keys_are_named(tmp_path, monkeypatch, text, expected) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError) as err:
        _local(["--config", str(toml)], monkeypatch)
    assert expected.format(toml=toml) in str(err.value)


def test_daemons_read_every_training_setting_from_env(tmp_path) -> None:
    env = {
        **CERTS,
        "MOBIUS_COORDINATOR": "c:7300",
        "MOBIUS_DATA_DIR": "d",
        "MOBIUS_MICRO_BATCHES": "2",
        "MOBIUS_LR_ADAM": "0.001",
        "MOBIUS_PRIVACY__INPUT_NOISE": "0.1",
        "MOBIUS_THREADS": "3",
    }
    worker = load_worker_config(environ=env)
    assert worker.train.micro_batches == 2 and worker.train.lr_adam == 0.001
    assert worker.train.privacy.input_noise == 0.1 and worker.threads == 3
    assert worker.verify_train  # training settings given: checked against the coordinator's
    plain = {**CERTS, "MOBIUS_COORDINATOR": "c:7300", "MOBIUS_DATA_DIR": "d"}
    assert not load_worker_config(environ=plain).verify_train
    toml = tmp_path / "c.toml"
    toml.write_text('[coordinator]\nstrategy = "fedadam"\n[train]\nsteps = 8\nsync_every = 2\n')
    coord = load_coordinator_config(
        toml,
        {"checkpoint_every": 4},
        environ={**CERTS, "MOBIUS_STRATEGY_OPTIONS": "eta=0.5", "MOBIUS_SEED": "5"},
    )
    assert coord.strategy == "fedadam" and coord.strategy_options == {"eta": 0.5}
    assert (coord.train.steps, coord.train.seed, coord.checkpoint_round_interval()) == (8, 5, 2)


def test_checkpoint_every_counts_steps_and_must_fall_on_a_barrier() -> None:
    train = TrainConfig(sync_every=4)
    cfg = CoordinatorConfig(ca="a", cert="b", key="c", checkpoint_every=8, train=train)
    assert cfg.checkpoint_round_interval() == 2
    assert cfg.checkpoint_round_interval(TrainConfig(sync_every=1)) == 8
    with pytest.raises(ValueError, match="checkpoint_every=6 steps is not a multiple of"):
        CoordinatorConfig(ca="a", cert="b", key="c", checkpoint_every=6, train=train)


def test_flags_that_only_refuse_are_gone() -> None:
    assert "--insecure" not in _actions(coordinator_cli.build_parser())
    with pytest.raises(ConfigError, match="insecure is for static rings only"):
        env = {"MOBIUS_COORDINATOR": "c:1", "MOBIUS_DATA_DIR": "d", "MOBIUS_INSECURE": "1"}
        load_worker_config(environ=env)


# ------------------------------------------------------------------------------ the CLI
@pytest.mark.parametrize(
    ("parser", "model"),
    [
        (coordinator_cli.build_parser, CoordinatorConfig),
        (worker_cli.build_parser, WorkerConfig),
    ],
)
def test_every_daemon_setting_has_a_flag_with_help_default_env_and_choices(parser, model) -> None:
    actions = _actions(parser())
    for s in settings_of(model, flatten=("train",)):
        if s.key == "verify_train":
            continue
        action = actions.get(FLAG_ALIASES.get(s.flag, s.flag))
        assert action is not None, f"{model.__name__}: no flag {s.flag}"
        assert action.help and s.env in action.help, (s.flag, action.help)
        assert "default:" in action.help or "required" in action.help, (s.flag, action.help)
        if s.choices():
            assert tuple(action.choices) == s.choices(), s.flag


def test_local_has_every_train_flag_and_the_shared_ones() -> None:
    sub = main_cli.build_parser(["local"])._subparsers._group_actions[0]  # type: ignore[union-attr]
    actions = _actions(sub.choices["local"])
    for s in settings_of(TrainConfig):
        assert s.flag in actions and s.env in actions[s.flag].help, s.flag
    for flag in ("--data", "--threads", "--checkpoint-every", "--config"):
        assert actions[flag].help, flag
    assert "STEPS" in actions["--checkpoint-every"].metavar


@pytest.mark.parametrize(
    "build", [main_cli.build_parser, worker_cli.build_parser, coordinator_cli.build_parser]
)
def test_version_everywhere(build, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        build().parse_args(["--version"])
    assert done.value.code == 0
    assert re.fullmatch(
        r"mobius-(fed|worker|coordinator) \d+\.\d+\.\d+\S*\n", capsys.readouterr().out
    )


def test_top_level_help_is_plain_text(capsys) -> None:
    with pytest.raises(SystemExit):
        main_cli.build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out
    for command in ("local", "up", "status", "health", "certs", "prepare"):
        assert re.search(rf"^\s+{command}\s", out, re.M), command


def test_a_command_loads_only_its_own_plugin() -> None:
    assert main_cli._wanted(["health", "127.0.0.1:1"]) == ([], ["health"])
    assert main_cli._wanted(["experiment"]) == ([], ["research"])
    assert main_cli._wanted(["local", "--steps", "1"]) == (["local"], [])
    assert main_cli._wanted(["--version"]) == ([], [])
    assert main_cli._wanted([]) == (list(main_cli.BUILTIN), list(main_cli.PLUGINS))


def test_health_loads_no_torch() -> None:
    """A healthcheck probe runs every few seconds: building its parser must not load torch."""
    code = (
        "import sys; from mobius_fed.cli.main import build_parser; "
        "build_parser(['health', '127.0.0.1:1']).parse_args(['health', '127.0.0.1:1']); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------------ threads
def test_threads_flag_env_and_default(monkeypatch) -> None:
    parser = argparse.ArgumentParser()
    add_threads_flag(parser)
    monkeypatch.delenv("MOBIUS_THREADS", raising=False)
    assert threads_from(parser.parse_args([])) == default_threads()
    assert default_threads(10_000) == 1
    assert threads_from(parser.parse_args([]), processes=2) == default_threads(2)
    monkeypatch.setenv("MOBIUS_THREADS", "3")
    assert threads_from(parser.parse_args([])) == 3
    assert threads_from(parser.parse_args(["--threads", "2"])) == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])


# ---------------------------------------------------------------------- repository scan
def test_every_mobius_variable_in_the_repository_is_a_declared_setting() -> None:
    """compose, Kubernetes, systemd, the testbed, benchmarks, tests, docs: no MOBIUS_* name
    that no command reads (a typo there would be refused at start-up)."""
    known = {*known_env_names(), *DELIBERATE_TYPOS}
    pattern = re.compile(r"\bMOBIUS_[A-Z0-9_]*[A-Z0-9]\b")
    unknown: dict[str, set[str]] = {}
    folders = ("docker", "deploy", "mobius_fed", "tests", "benchmarks", "docs", ".ci", "scripts")
    for folder in folders:
        for path in (ROOT / folder).rglob("*"):
            if (
                not path.is_file()
                or path.suffix in (".pyc", ".png")
                or path.name == Path(__file__).name
            ):
                continue
            for name in pattern.findall(path.read_text(errors="replace")):
                if name not in known:
                    unknown.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert not unknown, f"undeclared MOBIUS_* variables: {unknown}"


def test_the_configuration_page_lists_every_variable() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = [name for name in known_env_names() if f"`{name}`" not in page]
    assert not missing, f"docs/configuration.md lacks {missing} (mobius-fed config env --markdown)"


def test_a_subset_of_coordinator_settings_as_flags() -> None:
    """What ``up`` uses to pass coordinator settings on with the same help and names."""
    from mobius_fed.cli.flags import add_settings_flags

    parser = argparse.ArgumentParser()
    added = add_settings_flags(parser, CoordinatorConfig, only=("rejoin_timeout", "state_copy"))
    assert [s.flag for s in added] == ["--rejoin-timeout", "--state-copy"]
    actions = _actions(parser)
    assert "MOBIUS_REJOIN_TIMEOUT" in actions["--rejoin-timeout"].help
    assert tuple(actions["--state-copy"].choices) == ("coordinator", "off")
    assert "--strategy" not in actions


def test_fingerprint_of_older_runs_is_stable() -> None:
    """A manifest stores its config's fingerprint: a new setting at its default must not
    change it (list the setting in config.LATER_SETTINGS), or older runs cannot resume."""
    assert TrainConfig().fingerprint() == "91b524307e57102c"  # the default config's, 2026-12
    full = TrainConfig(subspace={"rank": 8, "writes": "full"})
    assert full.fingerprint() != TrainConfig(subspace={"rank": 8}).fingerprint()


def test_layers_per_group_from_text_and_the_even_split_written_out() -> None:
    """``--layers-per-group 4,4,2,2`` (flag, env and TOML text alike); the even split
    written out is the default run (same fingerprint), an uneven one is another run."""
    uneven = TrainConfig(preset="cpu-tiny", layers_per_group="4, 4,2,2")
    assert uneven.layers_per_group == [4, 4, 2, 2] and uneven.split == "4,4,2,2"
    even = TrainConfig(preset="cpu-tiny", layers_per_group=[3, 3, 3, 3])
    assert even.layers_per_group is None and even.split == "3,3,3,3"
    assert even.fingerprint() == TrainConfig(preset="cpu-tiny").fingerprint()
    assert uneven.fingerprint() != even.fingerprint()
    assert even.difference(uneven) == (
        "it was written with layers_per_group 4,4,2,2, this run has layers_per_group 3,3,3,3"
    )
    with pytest.raises(ValueError, match="expected counts like 4,4,2,2"):
        TrainConfig(layers_per_group="4;4;4")
    with pytest.raises(ValueError, match="names 6 groups, more groups than sites"):
        TrainConfig(workers=4, layers_per_group="2,2,2,2,2,2")


def test_a_manifest_of_another_split_is_named_on_resume() -> None:
    from mobius_fed.coordinator.rounds import split_difference

    even = TrainConfig(preset="cpu-tiny")
    saved = TrainConfig(preset="cpu-tiny", layers_per_group="2,2,4,4")
    assert split_difference(saved.model_dump(mode="json"), even) == (
        ": it was written with layers_per_group 2,2,4,4, this run has layers_per_group 3,3,3,3"
    )
    assert split_difference(even.model_dump(mode="json"), even) == ""
    assert split_difference(None, even) == ""
