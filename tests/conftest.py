"""Test-session setup: one torch thread everywhere, and a clean ``MOBIUS_*`` environment.

Tests run many small models and many processes at once; torch's default (one thread per
core, spinning OpenMP workers) slows a shared 2-core machine to a crawl. The variables set
here are inherited by every subprocess the tests start (daemons, ``mobius-fed``), whose
``--threads`` default reads ``MOBIUS_THREADS``. ``MOBIUS_*`` variables of the calling shell
are removed so that they cannot change what a test trains. The repository root goes first
on ``PYTHONPATH`` so that ``python -m mobius_fed...`` subprocesses import this checkout.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_THREADS = "1"

WARM_START = os.environ.get("MOBIUS_WARM_START", "1")  # `=0`: every child a fresh interpreter
TEST_TIMES = os.environ.get("TEST_TIMES")  # a file: per-test wall and CPU (timing_plugin)
for _name in [n for n in os.environ if n.startswith("MOBIUS_")]:
    del os.environ[_name]
os.environ.update(
    OMP_NUM_THREADS=TEST_THREADS,
    MKL_NUM_THREADS=TEST_THREADS,
    MOBIUS_THREADS=TEST_THREADS,
    MOBIUS_WARM_START=WARM_START,
    MOBIUS_WARM_PACKAGES="tests",  # the lying workers (tests/evil_worker.py) start warm too
    PYTHONPATH=os.pathsep.join(
        [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    ),
)


def pytest_configure(config) -> None:
    import torch

    if TEST_TIMES:
        from tests.timing_plugin import TestTimes

        config.pluginmanager.register(TestTimes(TEST_TIMES), "mobius-test-times")

    torch.set_num_threads(int(TEST_THREADS))
    with contextlib.suppress(RuntimeError):  # already set, or inter-op work has started
        torch.set_num_interop_threads(int(TEST_THREADS))


# xdist groups (`-n 2 --dist loadgroup`, pyproject's addopts): a group's tests run on one
# worker, one after another; every other test may run beside them.
# - Modules that share one host-wide resource (network namespaces, iptables, the WAN
#   shaping of the namespace testbed).
# - Modules whose tests share one expensive module-scoped fixture (a ring under attack, a
#   finished federation): in one group the fixture is built once, not once per worker.
GROUPS = {
    "test_netns_faults.py": "netns",
    "test_netns_testbed.py": "netns",
    "test_reachability_netns.py": "netns",
    "test_wan.py": "netns",
    "test_trust.py": "trust-ring",
    "test_dashboard.py": "dashboard-run",
}

# The longest tests go out first (longest processing time first): a long test started
# last keeps one worker busy while the other has nothing left. Node-id prefixes, longest
# first, from `python -m pytest --durations=40` on a fresh clone (docs/testing.md); the
# `slow` tests follow, then the rest, each in collection order. Order only: a test missing
# here runs all the same.
LONGEST_FIRST = (
    "test_quickstart.py::test_quickstart_commands_return_in_a_script",
    "test_netns_faults.py::",  # with the other namespace modules, one group of ~190 s
    "test_handover.py::test_mobius_fed_replace_hands",
    "test_patient_attacks.py::test_the_audit_at_the_attackers_strength",
    "test_bounds.py::test_a_site_returning_gradients_x1000",
    "test_cli.py::test_status_follows_up_from_start_to_kill",
    "test_chaos.py::",
    "test_coordinator.py::test_worker_that_never_comes_back",
    "test_crossover.py::test_sigterm_stops_a_sweep_and_its_cells",
    "test_signals.py::test_up_",
    "test_ring.py::test_ring_equals_reference[4-",
    "test_ring.py::test_ring_equals_reference[3-cyclic",
    "test_ring.py::test_ring_with_muon",
    "test_research.py::test_sweep_runs_resumes_and_reports",
    "test_recovery.py::test_bad_and_missing_worker_checkpoints",
    "test_secagg.py::test_a_killed_worker_heals_with_secagg_on",
    "test_tracking.py::test_wandb_offline",
    "test_ring.py::",
    "test_recovery.py::",
)


# The quick tier (`python -m pytest -m quick`, docs/testing.md): every test that is not
# `slow` or `long`, less the namespace testbed and these, which start daemons, a browser or a
# tracker, or train or attack for seconds (node-id prefixes; each took over 5 s in a measured
# run, `python scripts/test_times.py`). The full suite runs them all.
NOT_QUICK = (
    "test_cli.py::test_status_follows_up_from_start_to_kill",  # a real `up`, killed
    "test_cli.py::test_experiment_prints_the_table",  # trains every arm of a table
    "test_identity.py::",  # impostor daemons in processes of their own
    "test_patient_attacks.py::",  # trains a victim and its attackers
    "test_rings_robust.py::test_one_lying_ring",  # trains each aggregate clean and attacked
    "test_tracking.py::test_wandb_offline",  # W&B in a process of its own
    "test_howto.py::test_the_run_blocks_of_a_page_run",  # each page's commands, trained
    "test_link.py::test_an_idle_link_outlives_many_keepalive_periods",  # waits out keepalives
    "test_bottleneck_audit.py::test_patient_audit",  # trains a victim, then its attackers
    "test_bottleneck_audit.py::test_audit_command_runs",  # the same, through the command
    "test_cli.py::test_up_writes_its_endpoints_before_preparing",  # a real `up`
    "test_crossover.py::test_sigterm_stops_a_sweep",  # a sweep's cells as processes
    "test_crossover.py::test_cli_sweep_over_lengths",  # trains every cell of a sweep
    "test_research.py::test_sweep_runs_resumes_and_reports",  # the same
)


def _quick(item: pytest.Item) -> bool:
    name = item.nodeid.rsplit("/", 1)[-1]
    return not (
        item.get_closest_marker("slow")
        or item.get_closest_marker("long")
        or GROUPS.get(item.path.name) == "netns"
        or name.startswith(NOT_QUICK)
    )


def _rank(item: pytest.Item) -> tuple[int, int]:
    name = item.nodeid.rsplit("/", 1)[-1]
    for i, prefix in enumerate(LONGEST_FIRST):
        if name.startswith(prefix):
            return 0, i
    return (1 if item.get_closest_marker("slow") else 2), 0


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.name in GROUPS:
            item.add_marker(pytest.mark.xdist_group(GROUPS[item.path.name]))
        if _quick(item):
            item.add_marker(pytest.mark.quick)
    items.sort(key=_rank)  # stable: collection order within each rank


# --------------------------------------------------------------------------- shared setup
# Fixtures more than one test module uses. Their imports stay inside them, so that nothing
# loads torch before the environment above is set.
SITE_TEXT_CHARS = 120_000


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures(...)``),
    restoring what was there after it, should a test have changed it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def site_dirs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The module's ``P`` (else 2) sites cut from the embedded corpus's first
    ``SITE_TEXT_CHARS`` characters, one set per test module."""
    from mobius_fed.data import embedded_corpus, prepare_sites

    root = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    P = getattr(request.module, "P", 2)
    return prepare_sites(None, root / "sites", P, text=embedded_corpus()[:SITE_TEXT_CHARS])


@pytest.fixture(scope="module")
def keys(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory of one secret key per site (the module's ``P``) and the coordinator's,
    as ``privacy.noise_key_dir`` names it; one per test module."""
    from mobius_fed.defences.stages import write_site_keys

    directory = tmp_path_factory.mktemp("keys")
    write_site_keys(directory, request.module.P)
    return str(directory)


@pytest.fixture
def tiny_train() -> dict:
    """TrainConfig keywords of the small ring runs: cpu-tiny, batch 4, no E/R
    averaging, no evaluation (a fresh dict per test)."""
    return dict(preset="cpu-tiny", batch_size=4, sync_every=0, eval_every=0)


@pytest.fixture
def corpus_engine():
    """``make(cfg, root)``: a reference engine for ``cfg`` on ``cfg.P`` sites of the whole
    embedded corpus, prepared under ``root`` in ``cfg.encoding``."""
    from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
    from mobius_fed.engine import ReferenceEngine

    def make(cfg, root: Path) -> ReferenceEngine:
        dirs = prepare_sites(None, root, cfg.P, cfg.encoding, text=embedded_corpus())
        return ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len, cfg.encoding) for d in dirs])

    return make


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """``cli(*args)``: ``mobius-fed ARGS`` through the command's own ``main`` in this process,
    in ``tmp_path``, giving what a subprocess would (exit status, stdout, stderr) without
    starting an interpreter and importing torch again: seconds per call on 2 shared cores.
    The subprocess tests (tests/test_cli.py ``mobius_fed``) keep the entry point covered."""
    from mobius_fed.cli.main import main

    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> subprocess.CompletedProcess:
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse and run_guarded's refusals
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run
