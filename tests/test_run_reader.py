"""The run reader (docs/export.md): a run without a checkpoint is named with its fix, every
copy of a worker's checkpoint is verified against the manifest and a failing one named,
manifests store paths relative to the run, and a moved run directory still reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mobius_fed.checkpoint import ARRAYS_TAG, save_checkpoint, sha256_of
from mobius_fed.config import TrainConfig
from mobius_fed.export import export_run
from mobius_fed.export.files import ExportError
from mobius_fed.model.groups import build_group, build_replica
from mobius_fed.research import analyze
from mobius_fed.run_reader import (
    ER_FILE,
    MANIFEST,
    NoCheckpoint,
    read_run,
    round_dir,
    stored_path,
)

P = 2
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _cfg(**kw) -> TrainConfig:
    base = dict(preset="cpu-tiny", workers=P, loops=2, steps=2, batch_size=2, sync_every=1)
    return TrainConfig(**{**base, **kw})


def _write_run(
    root: Path, cfg: TrainConfig, *, copies: bool, relative: bool = True, rnd: int = 2
) -> Path:
    """A coordinated run's files as the coordinator and its workers write them: each worker's
    checkpoint in its own directory (named unlike an ``up`` run's, so only the manifest's
    path finds it), the averaged E/R and, with ``copies``, the coordinator's copies."""
    out, mc = root / "coordinator", cfg.model()
    rdir = round_dir(out, rnd)
    rdir.mkdir(parents=True)
    shared = build_replica(mc, cfg.seed).shared_state_dict()
    er_state = {k: v.detach().clone() + 0.5 for k, v in shared.items()}  # "averaged"
    er = save_checkpoint(rdir / ER_FILE, {"arrays": {ARRAYS_TAG: er_state}, "server_state": {}})
    workers = {}
    for rank in range(P):
        with torch.no_grad():
            group = build_group(mc, rank, cfg.seed)
            for p in group.parameters():
                p.add_(0.25 * (rank + 1))  # trained: not what a seed rebuilds
        replica = build_replica(mc, cfg.seed, cfg.privacy.home_layer)
        state = {"rank": rank, "group": group.state_dict(), "replica": replica.state_dict()}
        file = root / f"host-{rank}" / "ckpt" / f"round-{rnd:06d}.ckpt"
        save_checkpoint(file, state)
        digest = sha256_of(file)
        entry = {"identity": f"worker-{rank}", "path": str(file.resolve()), "sha256": digest}
        if relative:  # older manifests hold the absolute path only
            entry["file"] = stored_path(out, file)
        if copies:
            shutil.copyfile(file, rdir / f"worker-{rank}.ckpt")
            size = file.stat().st_size
            entry |= {"copy": f"worker-{rank}.ckpt", "copy_sha256": digest, "copy_bytes": size}
        workers[str(rank)] = entry
    doc = {
        "run_id": "t",
        "round": rnd,
        "step": rnd,
        "train": cfg.model_dump(mode="json"),
        "er": er.name,
        "er_sha256": sha256_of(er),
        "workers": workers,
    }
    (rdir / MANIFEST).write_text(json.dumps(doc))
    return rdir / MANIFEST


def _flip_last_byte(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    raw[-1] ^= 0x01
    file.write_bytes(bytes(raw))


# ---------------------------------------------------------------- no checkpoint
def test_an_up_run_without_a_checkpoint_names_export_the_directory_and_the_fix(
    tmp_path: Path,
) -> None:
    up = tmp_path / "up"
    (up / "coordinator").mkdir(parents=True)
    (up / "logs").mkdir()
    with pytest.raises(ExportError) as err:
        export_run(up, tmp_path / "models")
    msg = str(err.value)
    assert msg.startswith(f"export: no checkpoint in {up}: ")
    assert f"under {up / 'coordinator' / 'checkpoints'}" in msg
    assert "--checkpoint-every N to up/local" in msg and "analyze" not in msg
    # a local run directory without checkpoint.pt: the file it looked for, and the fix
    (tmp_path / "local").mkdir()
    with pytest.raises(ExportError, match=r"^export: no checkpoint in .*checkpoint\.pt"):
        export_run(tmp_path / "local", tmp_path / "models")
    with pytest.raises(FileNotFoundError, match=r"^analyze: no checkpoint in .*--checkpoint"):
        analyze.load_model(up)  # the same reader, named as analyze's


# ---------------------------------------------------------------- paths, copies
def test_manifest_paths_are_relative_and_a_moved_run_reads(tmp_path: Path) -> None:
    cfg = _cfg(privacy={"home_layer": "mlp"})  # no copies: only the workers' own files
    manifest = _write_run(tmp_path / "a", cfg, copies=False)
    entry = json.loads(manifest.read_text())["workers"]["1"]
    assert entry["file"] == "../host-1/ckpt/round-000002.ckpt"  # relative to <out>
    before = read_run(tmp_path / "a")
    shutil.move(tmp_path / "a", tmp_path / "moved")
    after = read_run(tmp_path / "moved")
    for g0, g1 in zip(before.groups, after.groups, strict=True):
        for (k, v0), v1 in zip(g0.state_dict().items(), g1.state_dict().values(), strict=True):
            assert torch.equal(v0, v1), k
    assert torch.equal(after.replicas[0].wte.weight, before.replicas[0].wte.weight)
    qkv = "blocks.0.attn.qkv.weight"
    assert not torch.equal(after.groups[0].state_dict()[qkv], after.groups[1].state_dict()[qkv])


def test_an_old_manifest_with_absolute_paths_still_reads(tmp_path: Path) -> None:
    cfg = _cfg(privacy={"home_layer": "mlp"})
    manifest = _write_run(tmp_path / "a", cfg, copies=False, relative=False)
    assert "file" not in json.loads(manifest.read_text())["workers"]["0"]
    model = read_run(manifest)
    assert len(model.groups) == P and "round 2" in model.name


def test_a_moved_run_without_its_worker_files_names_every_place_tried(tmp_path: Path) -> None:
    cfg = _cfg(privacy={"home_layer": "mlp"})
    _write_run(tmp_path / "a", cfg, copies=False)
    shutil.move(tmp_path / "a" / "coordinator", tmp_path / "coordinator")  # workers left behind
    with pytest.raises(NoCheckpoint, match=r"worker-0's checkpoint .* is in none of: .*host-0"):
        read_run(tmp_path / "coordinator")


@pytest.mark.parametrize("damaged", ["own", "copy"])
def test_export_verifies_every_copy_and_names_the_culprit(tmp_path: Path, damaged: str) -> None:
    """The coordinator's copy and the worker's own file are both checked: a damaged one
    stops the export, named, whichever of the two it is."""
    manifest = _write_run(tmp_path / "a", _cfg(), copies=True)
    export_run(manifest, tmp_path / "ok", origins=[0])  # both intact: it exports
    culprit = (
        tmp_path / "a" / "host-1" / "ckpt" / "round-000002.ckpt"
        if damaged == "own"
        else manifest.parent / "worker-1.ckpt"
    )
    _flip_last_byte(culprit)
    with pytest.raises(ExportError, match="does not match its manifest") as err:
        export_run(tmp_path / "a", tmp_path / "bad")
    assert str(culprit) in str(err.value)


def test_a_truncated_copy_is_named_by_its_size(tmp_path: Path) -> None:
    manifest = _write_run(tmp_path / "a", _cfg(), copies=True)
    copy = manifest.parent / "worker-0.ckpt"
    copy.write_bytes(copy.read_bytes()[:-8])
    with pytest.raises(
        ExportError,
        match=rf"{copy} does not match its manifest: sha256 .* \(\d+ bytes, expected \d+\)",
    ):
        export_run(manifest, tmp_path / "bad")


@pytest.mark.slow
def test_a_real_runs_manifest_is_relative_moves_and_every_copy_is_verified(
    tmp_path: Path,
) -> None:
    """A real coordinated run (coordinator + 2 worker processes over mTLS) writes worker
    paths relative to its output directory; moved elsewhere it exports the same weights;
    a damaged worker file is named although the coordinator's copy is intact."""
    from mobius_fed.cli.up import LocalFederation

    fed = LocalFederation(tmp_path / "up", _cfg(steps=2), threads=1)
    fed.prepare().start()
    try:
        final = fed.wait(timeout=300)
        assert final["phase"] == "done", (final, fed.tail("coordinator"))
    finally:
        fed.stop()
    export_run(tmp_path / "up", tmp_path / "before", origins=[1])
    shutil.move(tmp_path / "up", tmp_path / "moved")
    manifest = tmp_path / "moved" / "coordinator" / "checkpoints" / "round-000002" / MANIFEST
    entry = json.loads(manifest.read_text())["workers"]["1"]
    assert entry["file"] == "../worker-1/checkpoints/round-000002.ckpt" and "copy" in entry
    export_run(tmp_path / "moved", tmp_path / "after", origins=[1])
    weights = "model.safetensors"
    assert (tmp_path / "after" / weights).read_bytes() == (
        tmp_path / "before" / weights
    ).read_bytes()
    own = tmp_path / "moved" / "worker-1" / "checkpoints" / "round-000002.ckpt"
    _flip_last_byte(own)
    with pytest.raises(ExportError, match="does not match its manifest") as err:
        export_run(tmp_path / "moved", tmp_path / "bad")
    assert str(own) in str(err.value)
