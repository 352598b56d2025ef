"""Checkpoint manifests on disk: where they lie, which are complete, the newest one.

A manifest (``<out>/checkpoints/round-<r>/manifest.json``) is the commit point of round
``r``'s checkpoint. These helpers read manifests only: ``mobius-fed up``, the research
tools and the coordinator share them without importing the coordinator daemon.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mobius_fed.checkpoint import sha256_of

if TYPE_CHECKING:
    from mobius_fed.strategies import RoundPlan

log = logging.getLogger("mobius.coordinator")
MANIFEST = "manifest.json"
ER_FILE = "er.ckpt"


def checkpoint_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def round_dir(out_dir: Path, rnd: int) -> Path:
    return checkpoint_dir(out_dir) / f"round-{rnd:06d}"


def round_of(manifest: Path) -> int:
    """The round of ``checkpoints/round-<r>/manifest.json``."""
    return int(manifest.parent.name.removeprefix("round-"))


def manifest_problem(path: Path, doc: dict[str, Any], plan: RoundPlan | None = None) -> str | None:
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


def complete_manifests(out_dir: Path, plan: RoundPlan | None = None) -> list[Path]:
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
