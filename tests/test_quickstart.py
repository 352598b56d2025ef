"""The README's two quick-start commands, exactly as the README writes them.

The commands are read from the README itself (the ```bash block under "## Quick start"), so
the test and the page cannot drift apart. They run one after the other in a copy of this
checkout and a new virtualenv, with standard input and output not a terminal, the way a
script or a CI job runs them: both must return, and succeed.

The virtualenv sees the packages this interpreter already has (``system_site_packages``),
so pip finds torch, flwr and the extras installed and the test spends its time on the
commands, not on downloads. That a clean machine installs everything is what CI's own run
proves: it runs the same install command on a fresh clone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
INNER = "QUICKSTART_TEST_COPY"  # set in the copy, so its test command does not recurse


def quickstart_blocks(text: str) -> list[list[str]]:
    """The shell commands of each ```bash block under "## Quick start", in order."""
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M)
    if section is None:
        raise ValueError("README.md has no '## Quick start' section")
    blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
    if not blocks:
        raise ValueError("README.md's quick start has no ```bash block")
    lines = ([ln.strip() for ln in block.splitlines()] for block in blocks)
    return [[ln for ln in block if ln and not ln.startswith("#")] for block in lines]


def quickstart_commands(text: str) -> list[str]:
    """The set-up commands: the first block (install and run, install and test)."""
    return quickstart_blocks(text)[0]


def use_commands(text: str) -> list[str]:
    """What the quick start does with the trained model (the block after the set-up)."""
    blocks = quickstart_blocks(text)
    return blocks[1] if len(blocks) > 1 else []


def test_readme_has_the_two_commands_ci_runs() -> None:
    run, test = quickstart_commands(README.read_text())  # exactly two
    assert any("mobius-fed generate" in c for c in use_commands(README.read_text()))
    assert "mobius-fed up" in run and run.startswith("pip install")
    assert test.endswith("python -m pytest -q") and "'.[dev]'" in test
    ci = (REPO / ".ci" / "run").read_text()
    assert "-e '.[dev]'" in ci and "python -m pytest -q" in ci  # CI runs the same command


def test_quickstart_parser_refuses_a_page_without_it() -> None:
    with pytest.raises(ValueError, match="Quick start"):
        quickstart_commands("# mobius-fed\n\n## Install\n")


def _copy_checkout(dest: Path) -> None:
    """The files a fresh clone has (tracked and untracked-not-ignored), nothing built."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:  # not a git checkout: copy all but what is built or run
        ignore = shutil.ignore_patterns(".git", "runs", "*.egg-info", "__pycache__", ".venv")
        shutil.copytree(REPO, dest, ignore=ignore)
        return
    for name in filter(None, listed.stdout.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.mark.slow(reason="the README's two commands as written: two pip installs, a new venv")
@pytest.mark.skipif(bool(os.environ.get(INNER)), reason="inside the quick-start test's copy")
def test_quickstart_commands_return_in_a_script(tmp_path: Path) -> None:
    commands = quickstart_commands(README.read_text())
    checkout, env_dir = tmp_path / "mobius-fed", tmp_path / "venv"
    checkout.mkdir()
    _copy_checkout(checkout)
    venv.EnvBuilder(with_pip=True, system_site_packages=True).create(env_dir)
    # as a newcomer's shell: no PYTHONPATH, and `up` starts each child as a fresh interpreter
    drop = ("PYTHONPATH", "PYTHONHOME", "MOBIUS_WARM_START", "TEST_TIMES")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        VIRTUAL_ENV=str(env_dir),
        PATH=f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        MOBIUS_STEPS="3",  # the run's length only (and a checkpoint); the command is the README's
        MOBIUS_THREADS="1",
        # A small part, once, in one process (no two xdist workers importing torch for it).
        PYTEST_ADDOPTS="-p no:cacheprovider -n 0 tests/test_schedule.py",
        **{INNER: "1"},
    )
    run, test = commands
    for command in [run, *use_commands(README.read_text()), test]:
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=checkout,
            env=env,
            stdin=subprocess.DEVNULL,  # neither stdin nor stdout is a terminal
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=900,
        )
        out = done.stdout.decode(errors="replace")
        assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{out[-4000:]}"
        if "mobius-fed up" in command:
            assert "final validation loss (Eq. 8)" in out, out[-3000:]
            assert "its status was served at https://127.0.0.1:" in out, out[-3000:]
            assert (checkout / "runs" / "up" / "endpoints.json").is_file()
        if "mobius-fed generate" in command:
            assert (checkout / "models" / "origin-0" / "model.safetensors").is_file()
            assert out.strip(), "generate printed nothing"
    assert re.search(r"\d+ passed", out), out[-2000:]  # the test command ran tests
    # What a newcomer tries next: the run is reported as over, and `up` again is refused.
    for command, code, said in (
        ("mobius-fed status", 3, "exited"),
        ("mobius-fed up", 2, "--resume"),
    ):
        done = subprocess.run(
            ["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        told = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == code and said in told, (command, done.returncode, told)
    where = subprocess.run(
        ["python", "-c", "import mobius_fed; print(mobius_fed.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(checkout), where  # the copy's install, not this one


def test_up_lingers_only_where_a_person_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from mobius_fed.cli.up import linger_default

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdout", io.StringIO())  # a pipe or a file: a script
    assert linger_default(None) == 0.0 and linger_default(30.0) == 30.0
    monkeypatch.setattr("sys.stdout", Terminal())
    assert linger_default(None) == -1.0 and linger_default(0.0) == 0.0


def test_readme_figures_say_where_they_come_from() -> None:
    """The quick start's measured figures (a loss, a wall time, a sampled text) are labelled
    as one machine's, with the machine and the command that measured them."""
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", README.read_text(), re.S | re.M)
    assert section is not None
    figures = re.compile(r"Eq\. 8 \d\.\d{3,}|\b\d+ s\b")
    paragraphs = [p for p in section.group(1).split("\n\n") if figures.search(p)]
    assert paragraphs, "the quick start quotes no figure"
    for text in paragraphs:
        flat = " ".join(text.split())
        assert "machine-specific" in flat and "development machine" in flat, flat
        assert "docs/benchmarks.md" in flat and "`mobius-fed up > up.log`" in flat, flat
