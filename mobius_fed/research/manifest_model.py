"""The model of a coordinated run, assembled from one coordinator checkpoint manifest: every
worker's group F_i from its (sha256-checked) file, and for every origin s the manifest's
averaged E/R with the site's own home layer. Where a worker's file is looked for:
docs/research.md, "mobius-fed analyze".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.manifests import MANIFEST, latest_manifest, manifest_problem


def find_manifest(path: Path) -> Path | None:
    """The manifest ``path`` names: the file itself, a round directory, a coordinator's
    output directory or an ``up`` root (the newest complete manifest); None if none."""
    path = Path(path)
    if path.is_file():
        return path if path.name == MANIFEST else None
    if (path / MANIFEST).is_file():
        return path / MANIFEST
    for out_dir in (path, path / "coordinator"):
        if (out_dir / "checkpoints").is_dir():
            found = latest_manifest(out_dir)
            if found is not None:
                return found
    return None


def _worker_file(manifest: Path, rank: int, entry: dict[str, Any]) -> Path:
    """The first of the places a worker's checkpoint can be that holds a file."""
    reported = Path(entry["path"])
    coordinator = manifest.parent.parent.parent  # <out>/checkpoints/round-<r>/manifest.json
    tried = [manifest.parent / entry["copy"]] if "copy" in entry else []
    tried += [reported, coordinator.parent / f"worker-{rank}" / "checkpoints" / reported.name]
    for file in tried:
        if file.is_file():
            return file
    raise FileNotFoundError(
        f"analyze: worker-{rank}'s checkpoint for {manifest} is in none of: "
        + ", ".join(str(f) for f in tried)
        + " (copy the worker's file next to the manifest, or run with --state-copy coordinator)"
    )


def load_manifest_model(manifest: Path):
    """The :class:`~mobius_fed.research.trained_model.Model` that ``manifest`` describes."""
    from mobius_fed.checkpoint import load_checkpoint
    from mobius_fed.model.groups import BlockGroup, build_basis, build_replica
    from mobius_fed.research.trained_model import Model, model_config
    from mobius_fed.strategies import from_plain
    from mobius_fed.transport.safe_arrays import array_record_to_torch, spec_of

    manifest = Path(manifest)
    doc = json.loads(manifest.read_text())
    problem = manifest_problem(manifest, doc)
    if problem:
        raise ValueError(f"analyze: manifest {manifest} cannot be used: {problem}")
    cfg = TrainConfig.model_validate(doc["train"])
    mc = model_config(cfg)
    er = load_checkpoint(manifest.parent / doc["er"], doc.get("er_sha256"))
    groups, replicas = [], []
    for rank in range(cfg.P):
        entry = doc["workers"].get(str(rank))
        if entry is None:
            raise ValueError(f"analyze: manifest {manifest} names no checkpoint of worker-{rank}")
        file = _worker_file(manifest, rank, entry)
        state = load_checkpoint(file, entry["sha256"])  # a copy was checked against it too
        if state.get("rank") != rank or "group" not in state or "replica" not in state:
            raise ValueError(f"analyze: {file} is not worker-{rank}'s checkpoint")
        group = BlockGroup(mc, build_basis(mc, cfg.seed))
        group.load_state_dict(state["group"])
        replica = build_replica(cfg.model(), cfg.seed, cfg.privacy.home_layer)
        replica.load_state_dict(state["replica"])  # the site's home layer, if any
        shared = array_record_to_torch(
            from_plain(er["arrays"]), expected=spec_of(replica.shared_state_dict())
        )
        replica.load_state_dict(shared, strict=False)  # the averaged E/R
        groups.append(group.eval())
        replicas.append(replica.eval())
    name = f"{doc.get('run_id', 'run')} round {doc['round']}"
    return Model(cfg, groups, replicas, name=f"{name} ({cfg.order}, L={cfg.loops})")
