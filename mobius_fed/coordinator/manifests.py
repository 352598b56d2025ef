"""Checkpoint manifests on disk: the coordinator writes them (:mod:`.rounds`), and
:mod:`mobius_fed.run_reader` reads them; the names here are that module's."""

from mobius_fed.run_reader import complete_manifests, latest_manifest

__all__ = ["complete_manifests", "latest_manifest"]
