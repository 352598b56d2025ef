"""The how-to guides cannot rot: every shell block of docs/howto/*.md and of the tutorial
carries a mark that says what CI does with it, and this module does it.

    <!-- ci: run -->         the block's commands run in order, in one fresh directory per
                             page, with small settings from the environment (``SMALL``: a
                             tiny preset, two steps, one thread); a command that fails,
                             fails the page
    <!-- ci: parse -->       each command is parsed by its program's own argument parser, so a
                             renamed flag or choice fails here (daemons, root-only commands
                             and long benchmarks, which CI cannot run as written)
    <!-- ci: file NAME -->   the next fenced block is written to NAME before the page's
                             commands run (the planner's sites.yaml, say)

Commands run in this process (``main(argv)``, or ``runpy`` for a benchmark script), not as
subprocesses: a fresh interpreter importing torch costs seconds per command. A run block
must not name flags that make it slow (``--steps``, ``--preset cpu-base``): the environment
shortens a run, a flag would override it. Each page also opens with its commands and its
measured price, and every figure of that price is in the evidence it links to.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import runpy
import shlex
import shutil
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HOWTOS = sorted((DOCS / "howto").glob("*.md"))
PAGES = [*HOWTOS, DOCS / "tutorial.md"]
SMALL = {
    "MOBIUS_PRESET": "cpu-tiny",
    "MOBIUS_STEPS": "2",
    "MOBIUS_BATCH_SIZE": "4",  # divisible by the guides' --micro-batches 4
    "MOBIUS_EVAL_EVERY": "0",
    "MOBIUS_EVAL_BATCHES": "1",
    "MOBIUS_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}
# Inputs a page names but does not make: small texts cut from the embedded corpus.
STAGED = {"corpus.txt": (0, 60_000), "book.txt": (60_000, 70_000)}
# The console scripts, by the module whose build_parser() and main() they run.
SCRIPTS = {
    "mobius-fed": "mobius_fed.cli.main",
    "mobius-worker": "mobius_fed.cli.worker",
    "mobius-coordinator": "mobius_fed.cli.coordinator",
    "mobius-relay": "mobius_fed.cli.relay",
}
SKIPPED = {"pip"}  # installs: what CI's own install and the quick-start test run
FORWARDED = {"privacy_audit.py": ["audit"]}  # flags it hands on to `mobius-fed audit`
MARK = re.compile(r"<!-- ci: (run|parse|file \S+) -->")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    mark: str  # "run", "parse", "file NAME" or "" (unmarked)
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, each with the mark on the last non-blank line before it."""
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, start = opened.group(1), i
        i += 1
        while not re.match(rf"^{indent}```\s*$", lines[i]):
            i += 1
        body = "\n".join(ln.removeprefix(indent) for ln in lines[start + 1 : i])
        before = [ln.strip() for ln in lines[:start] if ln.strip()]
        mark = MARK.fullmatch(before[-1]) if before else None
        found.append(Block(page, start + 1, opened.group(2), mark.group(1) if mark else "", body))
        i += 1
    return found


def commands(body: str) -> list[list[str]]:
    """Shell commands: continuation lines joined, comments dropped, split at ``&&``."""
    found: list[list[str]] = []
    for line in body.replace("\\\n", " ").splitlines():
        words: list[str] = []
        for word in [*shlex.split(line, comments=True), "&&"]:
            if word != "&&":
                words.append(word)
            elif words:
                found.append(words)
                words = []
    return found


def program(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """``(environment, argv)``: leading ``NAME=value`` words apart, ``sudo`` dropped."""
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words[0].partition("=")
        env[name] = value
        words = words[1:]
    return env, words[1:] if words[:1] == ["sudo"] else words


class Parsed(Exception):
    """Raised where a script's outermost parse returns: it parsed, and runs nothing."""

    def __init__(self, extras: list[str]) -> None:
        super().__init__(extras)
        self.extras = extras


@contextlib.contextmanager
def stop_after_parsing() -> Iterator[None]:
    """Every ArgumentParser stops its program once the outermost parse is done (its
    subcommands' parsers, which argparse calls inside it, parse as usual)."""
    original = argparse.ArgumentParser.parse_known_args
    depth = 0

    def parse_known_args(self, args=None, namespace=None):
        nonlocal depth
        depth += 1
        try:
            namespace, extras = original(self, args, namespace)
        finally:
            depth -= 1
        if depth == 0:
            raise Parsed(extras)
        return namespace, extras

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_known_args):
        yield


def python_target(argv: list[str]) -> tuple[str, str, list[str]]:
    """``python X.py ARGS`` → ("path", X.py, ARGS); ``python -m M ARGS`` → ("module", M, ARGS)."""
    if argv[1] == "-m":
        return "module", argv[2], argv[3:]
    return "path", str(ROOT / argv[1]), argv[2:]


def run_python(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark script or module as ``__main__``, in this process, with its argv."""
    kind, target, args = python_target(argv)
    monkeypatch.setattr(sys, "argv", [target, *args])
    if kind == "path":
        monkeypatch.syspath_prepend(str(Path(target).parent))
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def parse(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse one command with its program's own parser; raise AssertionError if it refuses."""
    name = argv[0]
    try:
        if name in SCRIPTS:
            module = importlib.import_module(SCRIPTS[name])
            parser = (
                module.build_parser(argv[1:]) if name == "mobius-fed" else module.build_parser()
            )
            parser.parse_args(argv[1:])
            return
        assert name == "python", f"no parser known for {name!r}"
        with stop_after_parsing():
            run_python(argv, monkeypatch)
    except Parsed as done:
        forward = FORWARDED.get(Path(python_target(argv)[1]).name)
        if done.extras and forward is None:
            raise AssertionError(f"unrecognized arguments: {done.extras}") from None
        if done.extras:
            parse(["mobius-fed", *forward, *done.extras], monkeypatch)
        return
    except SystemExit as exc:
        raise AssertionError(
            f"{shlex.join(argv)}: the parser refused it (exit {exc.code})"
        ) from None
    raise AssertionError(f"{shlex.join(argv)} ran past its argument parser")


def run(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """Run one command as written (in this process for our own programs)."""
    if argv[0] == "cp":
        *sources, target = argv[1:]
        for source in sources:
            shutil.copy(source, target)
        return 0
    try:
        if argv[0] in SCRIPTS:
            return importlib.import_module(SCRIPTS[argv[0]]).main(argv[1:]) or 0
        assert argv[0] == "python", f"{argv[0]!r}: not a command this test runs"
        run_python(argv, monkeypatch)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


@contextlib.contextmanager
def own_signals() -> Iterator[None]:
    """The stop-signal handlers and wakeup fd as they were: ``up``, run in this process,
    takes them over (as it should in a shell) and leaves them in place when it returns."""
    from mobius_fed.cli.common import STOP_SIGNALS

    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(wakeup)


def every_command() -> list:
    """(block, words) of every command of a run or parse block, named by page, line and
    program (run blocks are parsed too: it costs nothing)."""
    found = []
    for page in PAGES:
        for block in blocks(page):
            for words in commands(block.body) if block.mark in ("run", "parse") else []:
                what = " ".join(w for w in program(words)[1][:2] if not w.startswith("-"))
                found.append(pytest.param(block, words, id=f"{block.where} {what}"))
    return found


def test_every_shell_block_of_a_howto_is_marked() -> None:
    unmarked = [
        b.where for p in PAGES for b in blocks(p) if b.lang in ("bash", "sh") and not b.mark
    ]
    assert not unmarked, f"mark these (<!-- ci: run --> or <!-- ci: parse -->): {unmarked}"
    assert len(HOWTOS) >= 10, "docs/howto/ lost a page"


@pytest.mark.parametrize(("block", "words"), every_command())
def test_every_command_parses(block: Block, words: list[str], monkeypatch) -> None:
    env, argv = program(words)
    if argv[0] in SKIPPED or argv[0] == "cp":
        return
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parse(argv, monkeypatch)


def pages_that_run() -> list[Path]:
    return [p for p in PAGES if any(b.mark == "run" for b in blocks(p))]


@pytest.mark.parametrize("page", pages_that_run(), ids=lambda p: p.name)
def test_the_run_blocks_of_a_page_run(page: Path, tmp_path, monkeypatch, capsys) -> None:
    from mobius_fed.data import embedded_corpus

    monkeypatch.chdir(tmp_path)
    for name, value in SMALL.items():
        monkeypatch.setenv(name, value)
    text = embedded_corpus()
    for name, (start, end) in STAGED.items():
        (tmp_path / name).write_text(text[start:end])
    for block in blocks(page):
        if block.mark.startswith("file "):
            (tmp_path / block.mark.removeprefix("file ")).write_text(block.body + "\n")
    for block in [b for b in blocks(page) if b.mark == "run"]:
        for words in commands(block.body):
            env, argv = program(words)
            with monkeypatch.context() as scoped, own_signals():
                for name, value in env.items():
                    scoped.setenv(name, value)
                code = run(argv, monkeypatch)
            out = capsys.readouterr()
            assert code == 0, f"{block.where}: {shlex.join(words)} exited {code}\n{out.err[-2000:]}"


def price(page: Path) -> str:
    """The paragraph after the page's first block: its measured price."""
    text = page.read_text()
    after = text.split("```", 2)[2].split("\n", 1)[1].strip()
    return after.split("\n\n", 1)[0]


@pytest.mark.parametrize("page", [p for p in HOWTOS if p.name != "index.md"], ids=lambda p: p.name)
def test_a_howto_opens_with_commands_and_a_price_that_its_evidence_holds(page: Path) -> None:
    title, first = page.read_text().split("\n\n", 2)[:2]
    assert title.startswith("# ") and MARK.fullmatch(first.split("\n", 1)[0]), page
    paragraph = price(page)
    assert "Price:" in paragraph and "[evidence](" in paragraph, paragraph
    evidence = ""
    for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", paragraph):
        evidence += (page.parent / target).resolve().read_text()
    flat = " ".join(evidence.split())
    for figure in re.findall(r"[+−-]?\d+(?:[.,]\d+)+", paragraph):
        assert figure in flat, f"{page.name}: {figure} is not in the evidence it links to"


def test_the_reader_reaches_the_private_text_page_from_the_readme() -> None:
    from mobius_fed.privacy_config import PRIVACY_PRESETS

    readme = (ROOT / "README.md").read_text()
    assert "(docs/howto/private-text.md)" in readme  # one click
    lines = (DOCS / "howto" / "private-text.md").read_text().splitlines()[:20]
    first_screen = " ".join(" ".join(lines).split())
    for preset in PRIVACY_PRESETS:
        assert f"`{preset}`" in first_screen or f"preset {preset}" in first_screen, preset
    assert "Price:" in first_screen and "Audited margin, worst case:" in first_screen
