"""The reference pages generated from the code (docs/reference/, the variable table of
docs/configuration.md) are in step with it: regenerated, they are what is committed."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from mobius_fed.cli.reference.help import Command, same_layout, subcommands
from mobius_fed.cli.reference.markdown import REGENERATE
from mobius_fed.cli.reference.pages import generated, stale

ROOT = Path(__file__).resolve().parents[1]
MAX_PAGE_LINES = 500  # issue 47: no docs page over 500 lines


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return generated(ROOT)


def test_every_generated_page_is_in_step_with_the_code() -> None:
    out = stale(ROOT)
    assert not out, f"out of step with the code: {out}; regenerate with `{REGENERATE}`"


@pytest.mark.skipif(not same_layout(), reason="argparse lays help out differently here")
def test_every_console_script_and_command_has_a_help_page(pages: dict[str, str]) -> None:
    names = {p.removeprefix("reference/cli/").removesuffix(".md") for p in pages}
    for script in ("mobius-fed", "mobius-worker", "mobius-coordinator", "mobius-relay"):
        assert script in names
    for command in ("local", "up", "status", "certs", "prepare", "config", "export"):
        assert f"mobius-fed-{command}" in names
    up = pages["reference/cli/mobius-fed-up.md"]
    assert "usage: mobius-fed up" in up and "--steps N" in up
    certs = pages["reference/cli/mobius-fed-certs.md"]
    assert "## mobius-fed certs ca" in certs  # subcommands on their command's page
    assert "| [`mobius-worker`](mobius-worker.md) |" in pages["reference/cli/index.md"]


def test_the_help_ignores_the_terminal_and_the_environment(
    monkeypatch: pytest.MonkeyPatch, pages: dict[str, str]
) -> None:
    monkeypatch.setenv("COLUMNS", "57")
    monkeypatch.setenv("MOBIUS_TRACKER", "mlflow")  # a default that the help shows
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert generated(ROOT) == pages
    assert os.environ["COLUMNS"] == "57" and "NO_COLOR" not in os.environ  # restored


def test_subcommands_are_listed_once_in_help_order() -> None:
    parser = argparse.ArgumentParser(prog="p")
    sub = parser.add_subparsers()
    sub.add_parser("b", help="bee", aliases=["bb"])
    sub.add_parser("a", help="ay")
    found = subcommands(Command("p", "", parser))
    assert [(c.name, c.summary) for c in found] == [("p b", "bee"), ("p a", "ay")]


def test_the_status_page_has_every_model_and_field(pages: dict[str, str]) -> None:
    from mobius_fed.coordinator.status_model import StatusModel, WorkerModel

    page = pages["reference/status.md"]
    for model in (StatusModel, WorkerModel):
        assert f"## {model.__name__}" in page
        for field in model.model_fields:
            assert f"| `{field}` |" in page, field
    assert "| `GET /v1/status` | 200: [StatusModel](#statusmodel)" in page


def test_the_metrics_page_has_every_metric(pages: dict[str, str]) -> None:
    import re

    source = (ROOT / "mobius_fed" / "coordinator" / "metrics.py").read_text()
    names = set(re.findall(r'"(mobius_[a-z_]+)"', source))
    page = pages["reference/metrics.md"]
    for name in names:
        assert f"| `{name}` |" in page or f"| `{name}_total` |" in page, name
    assert "| `mobius_worker_up` | gauge | `run_id`, `rank`, `ring` |" in page
    assert "| `mobius_incidents_total` | counter | `run_id` |" in page


def test_no_generated_page_is_over_500_lines(pages: dict[str, str]) -> None:
    long = {p: t.count("\n") for p, t in pages.items() if t.count("\n") > MAX_PAGE_LINES}
    assert not long, f"split these pages: {long}"


def test_the_site_lists_every_generated_page(pages: dict[str, str]) -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p for p in pages if f": {p}\n" not in nav]
    assert not missing, f"add to mkdocs.yml's nav (Reference): {missing}"
