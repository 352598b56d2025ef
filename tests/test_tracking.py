"""Trackers: metrics.jsonl records become scalars, each backend is read back offline with its
own library, and a failing tracker is logged once and never ends a run."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from mobius_fed import tracking
from mobius_fed.tracking import (
    MetricsFollower,
    SafeTracker,
    Tracker,
    TrackerUnavailable,
    make_tracker,
    scalars_of,
    start_tracking,
)

LOCAL_STEP = {"step": 3, "loss": 5.5, "origin_losses": [5.4, 5.6], "seconds": 0.25, "tokens": 64}
LOCAL_EVAL = {"step": 4, "eval_loss": 5.0, "eval_origin_losses": [4.9, 5.1]}
ROUND = {
    "round": 2,
    "step": 4,
    "time": 1.7e9,
    "seconds": 1.5,
    "losses": [5.3, 5.2],
    "origin_losses": [[5.3, 5.3], [5.1, 5.3]],
    "loss": 5.2,
    "workers": {"0": {"train_s": 2.0, "wait_s": 0.5, "bytes_sent": 1e6}},
    "eval_loss": 5.0,
    "eval_origin_losses": [4.8, 5.2],
    "incidents": [{"id": 1}],
    "privacy": {"epsilon": 3.5, "delta": 1e-5},
}


def hint(kind: str) -> str:
    return f"{kind} is not installed: pip install 'mobius-fed[{kind}]'"


def test_records_become_named_scalars() -> None:
    assert scalars_of(LOCAL_STEP) == {
        "loss": 5.5,
        "origin/0/loss": 5.4,
        "origin/1/loss": 5.6,
        "time/seconds": 0.25,
        "tokens": 64.0,
    }
    assert scalars_of(LOCAL_EVAL) == {
        "eval/loss": 5.0,
        "eval/origin/0/loss": 4.9,
        "eval/origin/1/loss": 5.1,
    }
    got = scalars_of(ROUND)
    assert got["origin/0/loss"] == 5.1 and got["eval/origin/1/loss"] == 5.2  # the round's last
    assert got["worker/0/wait_share"] == 0.25 and got["worker/0/bytes_sent"] == 1e6
    assert got["incidents"] == 1.0 and got["privacy/epsilon"] == 3.5 and got["round"] == 2.0
    assert "time" not in got and "step" not in got


class Recorder(Tracker):
    name = "recorder"

    def __init__(self, fail_at: int | None = None) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.fail_at, self.closed = fail_at, False

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step == self.fail_at:
            raise OSError(28, "No space left on device")
        self.logged.append((step, scalars))

    def close(self) -> None:
        self.closed = True


def test_a_failing_tracker_is_logged_once_and_never_raises(caplog) -> None:
    rec = Recorder(fail_at=2)
    safe = SafeTracker(rec)
    with caplog.at_level(logging.ERROR, logger="mobius_fed.tracking"):
        for step in range(1, 6):
            safe.record({"step": step, "loss": 1.0})
        safe.close()
    assert [s for s, _ in rec.logged] == [1] and rec.closed
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0].getMessage()
    assert "run goes on" in errors[0].getMessage() and "No space" in safe.failure


def test_the_follower_sends_appended_lines_and_a_resumed_files_new_rows(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    rec = Recorder()
    follower = MetricsFollower(metrics, SafeTracker(rec), poll_s=0.05)
    with metrics.open("w") as f:
        f.write(json.dumps({"step": 1, "loss": 3.0}) + "\n" + '{"step": 2, "lo')  # half a line
    follower.drain()
    assert [s for s, _ in rec.logged] == [1]
    with metrics.open("a") as f:
        f.write('ss": 2.5}\n' + json.dumps({"step": 3, "loss": 2.0}) + "\n")
    follower.drain()
    assert [(s, d["loss"]) for s, d in rec.logged] == [(1, 3.0), (2, 2.5), (3, 2.0)]
    metrics.write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")  # resumed from step 2
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 1.9}) + "\n")
    follower.close()
    assert [(s, d["loss"]) for s, d in rec.logged][3:] == [(3, 1.9)] and rec.closed


def test_unknown_and_missing_trackers_are_named(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"unknown tracker 'neptune' \(expected one of"):
        make_tracker("neptune", tmp_path)
    assert start_tracking("none", tmp_path / "metrics.jsonl") is None
    assert tracking.tracker_kind(" off ") is None and tracking.tracker_kind("WandB") == "wandb"
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(TrackerUnavailable, match=r"pip install 'mobius-fed\[mlflow\]'"):
        start_tracking("mlflow", tmp_path / "metrics.jsonl")


def _local_run(tmp_path: Path, kind: str) -> tuple[Path, list]:
    """A `local` run (reference engine + trainer) tracked the way the CLI does it."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
    from mobius_fed.engine import ReferenceEngine
    from mobius_fed.engine.trainer import METRICS, train

    torch.set_num_threads(1)
    sites = prepare_sites(None, tmp_path / "sites", 2, text=embedded_corpus()[:60_000])
    cfg = TrainConfig(
        preset="cpu-tiny", workers=2, steps=3, batch_size=2, eval_every=2, eval_batches=1
    )
    engine = ReferenceEngine(cfg, [SiteData(d, cfg.model().seq_len) for d in sites])
    out = tmp_path / "run"
    follower = start_tracking(kind, out / METRICS, config=cfg.model_dump(mode="json"))
    try:
        evals = train(engine, out, checkpoint_every=0)
    finally:
        follower.close()
    return out, evals


def test_tensorboard_is_read_back_with_its_event_reader(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason=hint("tensorboard"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, evals = _local_run(tmp_path, "tensorboard")
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    got = acc.Scalars("eval/loss")
    assert [e.step for e in got] == [ev.step for ev in evals] == [2, 3]
    assert [e.value for e in got] == pytest.approx([ev.loss for ev in evals])
    assert [e.step for e in acc.Scalars("origin/1/loss")] == [0, 1, 2]  # training steps


def test_mlflow_is_read_back_from_its_local_store(tmp_path: Path, monkeypatch) -> None:
    """Without MLFLOW_TRACKING_URI the tracker makes a file store, which MLflow 3 refuses
    unless MLFLOW_ALLOW_FILE_STORE=true: the tracker sets it for the user."""
    pytest.importorskip("mlflow", reason=hint("mlflow"))
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # restored (unset) after the test
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    out, evals = _local_run(tmp_path, "mlflow")
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("mobius-fed").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["preset"] == "cpu-tiny"
    hist = sorted(
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/loss")
    )
    assert [h[0] for h in hist] == [ev.step for ev in evals]
    assert [h[1] for h in hist] == pytest.approx([ev.loss for ev in evals])


def test_wandb_offline_is_read_back_from_its_run_file(tmp_path: Path) -> None:
    """`mobius-fed local --tracker wandb`, offline: every eval row of metrics.jsonl is in
    W&B's run file. The command runs in its own process, as a user runs it (W&B keeps
    process-wide state, which a long-lived test process shares between tests)."""
    pytest.importorskip("wandb", reason=hint("wandb"))
    import subprocess
    import sys

    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.main", "local", "--preset", "cpu-tiny",
         "--workers", "2", "--steps", "3", "--batch-size", "2", "--eval-every", "2",
         "--eval-batches", "1", "--threads", "1", "--checkpoint-every", "0",
         "--tracker", "wandb", "--out", str(out)],
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [step for step, _ in evals] == [2, 3]
    (file,) = (out / "wandb").glob("offline-run-*/*.wandb")  # in <out>/wandb/ itself
    assert not (out / "wandb" / "wandb").exists()
    deadline = time.monotonic() + 60  # wandb's service may still write after finish()
    while (rows := _wandb_history(file)) is None:
        assert time.monotonic() < deadline, f"{file} has no exit record"
        time.sleep(0.2)
    got = [(r["_step"], r["eval/loss"]) for r in rows if "eval/loss" in r]
    assert [g[0] for g in got] == [step for step, _ in evals]
    assert [g[1] for g in got] == pytest.approx([loss for _, loss in evals])


def _wandb_history(file: Path) -> list[dict] | None:
    """History rows of an offline W&B run file (None until its exit record is written):
    wandb's ``Record`` protobufs in the LevelDB log framing its store uses (a 7-byte
    ``:W&B`` header, 32 KiB blocks, 7-byte record headers: crc32c, length, type FULL=1 /
    FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data = file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, parts, rows, done = 7, 32768, b"", [], False
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        body, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        parts = body if kind in (1, 2) else parts + body
        if kind not in (1, 4):
            continue
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(parts)
        done = done or rec.WhichOneof("record_type") == "exit"
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    return rows


def test_local_command_tracks_through_the_flag_and_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`mobius-fed local --tracker tensorboard` (and MOBIUS_TRACKER) log its metrics. The
    command runs through its own `main` in this process (the parser reads MOBIUS_TRACKER
    when it is built): no new interpreter importing torch for each run."""
    pytest.importorskip("tensorboard", reason=hint("tensorboard"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mobius_fed.cli.main import main

    base = ["local", "--preset", "cpu-tiny", "--workers", "2", "--steps", "3",
            "--batch-size", "2", "--eval-every", "3", "--eval-batches", "1", "--threads", "1",
            "--checkpoint-every", "0"]  # fmt: skip
    for how, extra, env in (
        ("flag", ["--tracker", "tensorboard"], {}),
        ("variable", [], {"MOBIUS_TRACKER": "tensorboard"}),
    ):
        out = tmp_path / how
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            assert main([*base, "--out", str(out), *extra]) == 0, capsys.readouterr().err
        acc = EventAccumulator(str(out / "tensorboard"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("eval/loss")] == [3], how
        final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        assert acc.Scalars("eval/loss")[0].value == pytest.approx(final["eval_loss"])
