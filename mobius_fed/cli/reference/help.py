"""Every console script's ``--help``, one page per command, rendered the same on any
terminal: a fixed width, no colour, no ``MOBIUS_*`` variable changing a default."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mobius_fed.cli.reference.markdown import NOTE, cell

WIDTH = 100  # COLUMNS while the help is rendered
FOLDER = "reference/cli"
MAIN = "mobius-fed"  # the script whose subcommands get a page each
LAYOUT_CHANGED = (3, 13)  # argparse lays help out differently from Python 3.13 on


def same_layout() -> bool:
    """Whether this Python's argparse renders help as the committed pages do (3.11, 3.12:
    the Docker image's and CI's Python)."""
    return sys.version_info[:2] < LAYOUT_CHANGED


@dataclass(frozen=True)
class Command:
    """One parser: its full name (``mobius-fed certs ca``), one-line summary and parser."""

    name: str
    summary: str
    parser: argparse.ArgumentParser

    @property
    def page(self) -> str:
        """``mobius-fed certs`` → ``reference/cli/mobius-fed-certs.md``."""
        return f"{FOLDER}/{self.name.replace(' ', '-')}.md"

    def help_block(self) -> list[str]:
        return ["```text", self.parser.format_help().rstrip(), "```", ""]


@contextlib.contextmanager
def fixed_terminal() -> Iterator[None]:
    """``COLUMNS`` fixed, colour off and every ``MOBIUS_*`` variable unset, then restored."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("MOBIUS_")]:
        del os.environ[name]
    os.environ.update(COLUMNS=str(WIDTH), NO_COLOR="1")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def scripts(pyproject: Path) -> list[Command]:
    """``[project.scripts]``, each with its module's ``build_parser()`` and the first
    sentence of its description."""
    with pyproject.open("rb") as f:
        targets: dict[str, str] = tomllib.load(f)["project"]["scripts"]
    commands = []
    for name, target in targets.items():
        module = importlib.import_module(target.partition(":")[0])
        parser: argparse.ArgumentParser = module.build_parser()
        paragraph = " ".join((parser.description or "").strip().split("\n\n")[0].split())
        summary = paragraph.split(". ")[0].rstrip(".") + "."
        commands.append(Command(name, summary, parser))
    return commands


def subcommands(command: Command) -> list[Command]:
    """The commands under ``command`` in the order its help lists them (aliases once)."""
    found: list[Command] = []
    for action in command.parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help or "" for a in action._choices_actions}
        seen: set[int] = set()
        for name, parser in action.choices.items():
            if id(parser) not in seen:
                seen.add(id(parser))
                found.append(Command(f"{command.name} {name}", helps.get(name, ""), parser))
    return found


def command_page(command: Command, nested: bool) -> str:
    """A command's help; ``nested``: its subcommands' too (``certs ca`` …), else links."""
    lines = [f"# {command.name}", "", NOTE, "", *command.help_block()]
    subs = subcommands(command)
    if subs and not nested:
        lines += ["Each command's help:", ""]
        lines += [f"- [`{s.name}`]({Path(s.page).name}): {s.summary}" for s in subs]
        lines.append("")
    stack = list(reversed(subs)) if nested else []
    while stack:  # depth first, in the order the help lists them
        sub = stack.pop()
        lines += [f"## {sub.name}", "", *sub.help_block()]
        stack += reversed(subcommands(sub))
    return "\n".join(lines)


def index_page(commands: list[Command]) -> str:
    """What every command does and where its help is."""
    lines = ["# Command line", "", NOTE, ""]
    lines += [f"Every command's `--help`, as printed on a terminal {WIDTH} columns wide.", ""]
    lines += ["| Command | What it does |", "|---|---|"]
    for c in commands:
        lines.append(f"| [`{c.name}`]({Path(c.page).name}) | {cell(c.summary)} |")
    return "\n".join(lines) + "\n"


def cli_pages(root: Path) -> dict[str, str]:
    """Pages (path under docs/ → text): an index, one per console script and one per
    subcommand of ``mobius-fed`` (holding its own subcommands)."""
    pages: dict[str, str] = {}
    listed: list[Command] = []
    with fixed_terminal():
        for top in scripts(root / "pyproject.toml"):
            subs = subcommands(top) if top.name == MAIN else []
            pages[top.page] = command_page(top, nested=not subs)
            listed.append(top)
            for sub in subs:
                pages[sub.page] = command_page(sub, nested=True)
                listed.append(sub)
    pages[f"{FOLDER}/index.md"] = index_page(listed)
    return pages
