"""Reading a finished run: its manifests, its checkpoints, its model (docs/export.md).

One module below both ``export`` and ``research`` (and beside the coordinator, which writes
what this reads): it imports only the config, the model and the checkpoint format.

A coordinated run's checkpoint is a manifest, ``<out>/checkpoints/round-<r>/manifest.json``,
the commit point of round r: the averaged E/R file (``er``), and per worker its file
(``file``: relative to ``<out>``, the coordinator's output directory, when it lies beside it,
else absolute; ``path``: as the worker reported it, all that older manifests hold) and, when
the worker sent one, the coordinator's copy (``copy``, next to the manifest). Every copy
found is checked against the manifest's sha256 (and size) before any is used; a file that
fails is named.

A reference-engine run is a ``checkpoint.pt`` (``mobius-fed local``, ``experiment``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import torch

from mobius_fed.checkpoint import (
    ARRAYS_TAG,
    load_checkpoint,
    sha256_of,
    verify_file,
)
from mobius_fed.config import TrainConfig
from mobius_fed.model import BlockGroup, Replica
from mobius_fed.model.config import ModelConfig
from mobius_fed.model.groups import build_basis, build_replica
from mobius_fed.strategies import RING_STATE

log = logging.getLogger("mobius.runs")
MANIFEST = "manifest.json"
ER_FILE = "er.ckpt"
CHECKPOINT = "checkpoint.pt"  # a reference-engine run's checkpoint
NO_CHECKPOINT_HINT = (
    "the run wrote none: it writes one when it ends; pass --checkpoint-every N to up/local "
    "for one every N steps"
)


class RunError(ValueError):
    """A run cannot be read; the message names the file and the problem (callers prefix
    their command's name)."""


class NoCheckpoint(RunError, FileNotFoundError):
    """The run holds no checkpoint (also a FileNotFoundError)."""


class _Plan(Protocol):
    def steps_of(self, rnd: int) -> tuple[int, int]: ...


# ------------------------------------------------------------------------ layout
def checkpoint_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def round_dir(out_dir: Path, rnd: int) -> Path:
    return checkpoint_dir(out_dir) / f"round-{rnd:06d}"


def round_of(manifest: Path) -> int:
    """The round of ``checkpoints/round-<r>/manifest.json``."""
    return int(manifest.parent.name.removeprefix("round-"))


def stored_path(out_dir: Path, file: str | Path) -> str:
    """How a manifest stores ``file``: relative to ``out_dir`` when both lie in the same
    run directory (``out_dir``'s parent, an ``up`` root), so a moved run still reads;
    absolute otherwise (a worker's file on another host)."""
    out, path = Path(out_dir).resolve(), Path(file).resolve()
    if path.is_relative_to(out.parent):
        return os.path.relpath(path, out)
    return str(path)


# --------------------------------------------------------------------- manifests
def manifest_problem(path: Path, doc: dict[str, Any], plan: _Plan | None = None) -> str | None:
    """Why the manifest at ``path`` cannot be used (None: it can)."""
    try:
        rnd = int(doc["round"])
        if path.parent.name != f"round-{rnd:06d}":
            return f"it names round {rnd} but lies in {path.parent.name}"
        if plan is not None and int(doc["step"]) != plan.steps_of(rnd)[1]:
            return f"round {rnd} ends at step {plan.steps_of(rnd)[1]}, it says {doc['step']}"
        er = path.parent / doc["er"]
        if not er.is_file():
            return f"{er} is missing"
        if "er_sha256" in doc and sha256_of(er) != doc["er_sha256"]:
            return f"{er}: sha256 {sha256_of(er)} does not match the manifest's {doc['er_sha256']}"
        if not isinstance(doc["workers"], dict):
            return "no worker table"
    except (KeyError, TypeError, ValueError) as exc:
        return f"malformed ({exc!r})"
    return None


def complete_manifests(out_dir: Path, plan: _Plan | None = None) -> list[Path]:
    """Every complete, verified manifest, newest first; unusable ones are logged and skipped."""
    found = []
    for path in sorted(checkpoint_dir(out_dir).glob("round-*/" + MANIFEST), reverse=True):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            log.warning("skipping manifest %s: %s", path, exc)
            continue
        problem = manifest_problem(path, doc, plan)
        if problem:
            log.warning("skipping manifest %s: %s", path, problem)
            continue
        found.append(path)
    return found


def latest_manifest(out_dir: Path) -> Path | None:
    """The newest complete manifest (its E/R file present and verified), or None."""
    return next(iter(complete_manifests(out_dir)), None)


def find_manifest(path: Path) -> Path | None:
    """The manifest ``path`` names: the file itself, a round directory, a coordinator's
    output directory or an ``up`` root (the newest complete manifest); None if none."""
    path = Path(path)
    if path.is_file():
        return path if path.name == MANIFEST else None
    if (path / MANIFEST).is_file():
        return path / MANIFEST
    for out_dir in (path, path / "coordinator"):
        if checkpoint_dir(out_dir).is_dir():
            found = latest_manifest(out_dir)
            if found is not None:
                return found
    return None


def verified_worker_file(manifest: Path, rank: int, entry: dict[str, Any]) -> Path:
    """Worker ``rank``'s checkpoint once every copy of it that exists was checked against the
    manifest (sha256; the copy's size too), the first failing file named: the coordinator's
    copy next to the manifest, and the worker's own file (where the manifest says, else where
    an ``up`` run keeps it)."""
    out = manifest.parent.parent.parent  # <out>/checkpoints/round-<r>/: paths are relative to it
    copy: Path | None = manifest.parent / entry["copy"] if entry.get("copy") else None
    stored = entry.get("file", entry["path"])  # older manifests: the absolute path only
    reported = Path(os.path.normpath(out / stored))
    beside = out.parent / f"worker-{rank}" / "checkpoints" / reported.name
    own = next((f for f in (reported, beside) if f.is_file()), None)
    found = [f for f in (copy, own) if f is not None and f.is_file()]
    if not found:
        raise NoCheckpoint(
            f"worker-{rank}'s checkpoint for {manifest} is in none of: "
            + ", ".join(str(f) for f in (copy, reported, beside) if f is not None)
            + " (copy the worker's file next to the manifest, or run with --state-copy "
            "coordinator)"
        )
    for file in found:
        if file is copy:
            verify_file(file, entry.get("copy_sha256", entry["sha256"]), entry.get("copy_bytes"))
        else:
            verify_file(file, entry["sha256"])
    return found[0]


# ------------------------------------------------------------------------ models
@dataclass
class Model:
    """A trained model: the run's config, its P block groups and P (E, R) replicas (each
    origin's, with its home layer)."""

    cfg: TrainConfig
    groups: list[BlockGroup]
    replicas: list[Replica]
    name: str = ""

    @cached_property
    def mc(self) -> ModelConfig:
        """The run's model config (with L and the loop knobs, which size a group)."""
        return self.cfg.model()


def read_run(path: Path) -> Model:
    """The model of a finished run at ``path``: a coordinated run (a manifest, its round
    directory, a coordinator's output directory or an ``up`` root: the newest complete
    manifest), or a reference-engine ``checkpoint.pt`` (or the directory holding it)."""
    path = Path(path)
    file = path / CHECKPOINT if path.is_dir() else path
    if file.is_file() and file.name != MANIFEST:
        return read_engine_checkpoint(file, path.name if path.is_dir() else path.parent.name)
    manifest = find_manifest(path)
    if manifest is not None:
        return read_manifest(manifest)
    raise NoCheckpoint(_no_checkpoint(path, file))


def _no_checkpoint(path: Path, file: Path) -> str:
    """Why ``path`` holds no checkpoint, and the fix."""
    if not path.exists():
        return f"no checkpoint at {path}: no such file or directory"
    coordinated = checkpoint_dir(path).is_dir() or path.name == "coordinator"
    for out in [path] * coordinated + [path / "coordinator"]:  # a coordinator --out, an up root
        if out.is_dir():
            return (
                f"no checkpoint in {path}: no complete {MANIFEST} under {checkpoint_dir(out)} "
                f"({NO_CHECKPOINT_HINT})"
            )
    return (
        f"no checkpoint in {path}: neither {file} nor a coordinator's {MANIFEST} "
        f"({NO_CHECKPOINT_HINT})"
    )


def read_engine_checkpoint(file: Path, name: str) -> Model:
    """A reference-engine checkpoint: P groups and P replicas."""
    state = load_checkpoint(file)
    if "groups" not in state or "replicas" not in state:
        raise RunError(f"{file} is not a reference-engine checkpoint (no groups/replicas)")
    cfg = TrainConfig.model_validate(state["config"])
    mc = cfg.model()
    groups = [BlockGroup(mc, build_basis(mc, cfg.seed), i) for i in range(cfg.P)]
    replicas = [Replica(mc, cfg.privacy.home_layer) for _ in range(cfg.P)]  # home layers too
    for module, sd in zip(groups + replicas, state["groups"] + state["replicas"], strict=True):
        _load(module, sd, file)
        module.eval()
    return Model(cfg, groups, replicas, name=f"{name} ({cfg.order}, L={cfg.loops})")


def read_manifest(manifest: Path) -> Model:
    """The model one manifest describes: each worker's group F_i from its (verified) file,
    and for every origin s the averaged E/R with the site's own home layer."""
    manifest = Path(manifest)
    doc = json.loads(manifest.read_text())
    problem = manifest_problem(manifest, doc)
    if problem:
        raise RunError(f"manifest {manifest} cannot be used: {problem}")
    cfg = TrainConfig.model_validate(doc["train"])
    mc = cfg.model()
    er_file = manifest.parent / doc["er"]
    saved = load_checkpoint(er_file, doc.get("er_sha256"))
    shared = _er_arrays(er_file, saved)
    synced = _synced_groups(er_file, saved, cfg, doc["round"])
    groups, replicas = [], []
    for rank in range(cfg.P):
        entry = doc["workers"].get(str(rank))
        if entry is None:
            raise RunError(f"manifest {manifest} names no checkpoint of worker-{rank}")
        file = verified_worker_file(manifest, rank, entry)
        state = load_checkpoint(file, entry["sha256"])
        if state.get("rank") != rank or "group" not in state or "replica" not in state:
            raise RunError(f"{file} is not worker-{rank}'s checkpoint")
        group = BlockGroup(mc, build_basis(mc, cfg.seed), rank)
        replica = build_replica(mc, cfg.seed, cfg.privacy.home_layer)
        _load(group, state["group"] if synced is None else synced[rank], file)
        _load(replica, state["replica"], file)  # the site's home layer, if any
        want = replica.shared_state_dict()
        if set(shared) != set(want):
            raise RunError(
                f"{er_file}: E/R tensors {sorted(shared)} are not the model's {sorted(want)}"
            )
        _load(replica, shared, er_file, strict=False)  # the averaged E/R
        groups.append(group.eval())
        replicas.append(replica.eval())
    name = f"{doc.get('run_id', 'run')} round {doc['round']}"
    return Model(cfg, groups, replicas, name=f"{name} ({cfg.order}, L={cfg.loops})")


def _load(module: torch.nn.Module, state: dict[str, Any], file: Path, strict: bool = True) -> None:
    try:
        module.load_state_dict(state, strict=strict)
    except RuntimeError as exc:
        raise RunError(f"{file} does not fit the run's model: {exc}") from None


def _synced_groups(
    file: Path, saved: dict[str, Any], cfg: TrainConfig, rnd: int
) -> list[dict[str, Any]] | None:
    """R > 1: the P groups of the ring sync that ended round ``rnd`` (the coordinator keeps
    them until they are sent; a worker's file holds its ring's F_i from before the sync).
    None with one ring; a round between ring syncs, whose rings differ, is refused."""
    if cfg.rings == 1:
        return None
    pending = (saved.get("server_state") or {}).get(RING_STATE, {}).get("pending", {})
    found = [pending.get(i, pending.get(str(i))) for i in range(cfg.P)]
    if any(not isinstance(g, dict) or set(g) != {ARRAYS_TAG} for g in found):
        raise RunError(
            f"{file}: round {rnd} of a run of {cfg.rings} rings ended between ring syncs, so "
            "its rings' groups differ; use the manifest of a ring-sync round (the last "
            "round always is one)"
        )
    return [dict(g[ARRAYS_TAG]) for g in found]


def _er_arrays(file: Path, saved: dict[str, Any]) -> dict[str, Any]:
    """The averaged E/R tensors of an ``er.ckpt`` (a Flower ArrayRecord stored plain)."""
    arrays = saved.get("arrays")
    if not isinstance(arrays, dict) or set(arrays) != {ARRAYS_TAG}:
        raise RunError(f"{file} holds no E/R arrays")
    return dict(arrays[ARRAYS_TAG])
