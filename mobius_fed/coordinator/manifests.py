"""Checkpoint manifests on disk: the coordinator writes them (:mod:`.rounds`), and
:mod:`mobius_fed.run_reader` reads them; the names here are that module's."""

from mobius_fed.run_reader import (
    ER_FILE,
    MANIFEST,
    checkpoint_dir,
    complete_manifests,
    latest_manifest,
    manifest_problem,
    round_dir,
    round_of,
    stored_path,
)

__all__ = [
    "ER_FILE",
    "MANIFEST",
    "checkpoint_dir",
    "complete_manifests",
    "latest_manifest",
    "manifest_problem",
    "round_dir",
    "round_of",
    "stored_path",
]
