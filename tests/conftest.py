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
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_THREADS = "1"

for _name in [n for n in os.environ if n.startswith("MOBIUS_")]:
    del os.environ[_name]
os.environ.update(
    OMP_NUM_THREADS=TEST_THREADS,
    MKL_NUM_THREADS=TEST_THREADS,
    MOBIUS_THREADS=TEST_THREADS,
    PYTHONPATH=os.pathsep.join(
        [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    ),
)


def pytest_configure(config) -> None:
    import torch

    torch.set_num_threads(int(TEST_THREADS))
    with contextlib.suppress(RuntimeError):  # already set, or inter-op work has started
        torch.set_num_interop_threads(int(TEST_THREADS))


# Modules that share one host-wide resource (network namespaces, iptables, the WAN
# shaping of the namespace testbed) run on one xdist worker, one after another; every
# other test may run beside them (`-n 2 --dist loadgroup`, pyproject's addopts).
SERIAL_MODULES = {
    "test_netns_faults.py",
    "test_netns_testbed.py",
    "test_reachability_netns.py",
    "test_wan.py",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.name in SERIAL_MODULES:
            item.add_marker(pytest.mark.xdist_group("netns"))


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
