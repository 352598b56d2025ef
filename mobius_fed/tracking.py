"""Experiment trackers: the records of ``metrics.jsonl`` sent to TensorBoard, MLflow or W&B.

``--tracker`` picks one (:func:`add_tracker_flag`); the scalars and extras are listed in
docs/export.md, "Trackers". A failing tracker is logged once and left alone: it never ends a
run. :func:`start_tracking` follows a ``metrics.jsonl`` as it grows (start, then ``close``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("mobius_fed.tracking")

TRACKERS = ("tensorboard", "mlflow", "wandb")  # each its library and its extra


class TrackerUnavailable(ValueError):
    """The tracker's library is not installed (the message gives the pip command)."""


# ------------------------------------------------------------------- records → scalars
def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _per_origin(prefix: str, values: Any, out: dict[str, float]) -> None:
    if values and isinstance(values[0], list):  # a round line: one list per step, keep the last
        values = values[-1]
    for s, v in enumerate(values or []):
        if (x := _number(v)) is not None:
            out[f"{prefix}origin/{s}/loss"] = x


def _worker(rank: str, fig: dict, out: dict[str, float]) -> None:
    out.update({f"worker/{rank}/{k}": x for k, v in fig.items() if (x := _number(v)) is not None})
    train, wait = _number(fig.get("train_s")), _number(fig.get("wait_s"))
    if train and wait is not None and "wait_share" not in fig:
        out[f"worker/{rank}/wait_share"] = min(1.0, wait / train)


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one ``metrics.jsonl`` record (names in the module doc)."""
    out: dict[str, float] = {}
    renames = {"eval_loss": "eval/loss", "seconds": "time/seconds", "epsilon": "privacy/epsilon"}
    for k, v in record.items():
        if k in ("step", "time", "losses"):
            continue
        if k == "origin_losses":
            _per_origin("", v, out)
        elif k == "eval_origin_losses":
            _per_origin("eval/", v, out)
        elif k == "workers" and isinstance(v, dict):
            for rank, fig in v.items():
                if isinstance(fig, dict):
                    _worker(str(rank), fig, out)
        elif k == "incidents" and isinstance(v, list):
            out["incidents"] = float(len(v))
        elif k == "privacy" and isinstance(v, dict):
            out.update({f"privacy/{p}": x for p, y in v.items() if (x := _number(y)) is not None})
        elif (x := _number(v)) is not None:
            out[renames.get(k, k)] = x
    return out


# --------------------------------------------------------------------------- backends
class Tracker:
    """One experiment tracker: scalars at a step, the run's configuration, close."""

    name = "tracker"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release the tracker (idempotent)."""


class TensorBoardTracker(Tracker):
    """Event files in ``directory`` (``tensorboard --logdir`` reads them)."""

    name = "tensorboard"

    def __init__(self, directory: Path, run_name: str, config: dict | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))
        if config:
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowTracker(Tracker):
    """An MLflow run: ``MLFLOW_TRACKING_URI`` if set, else a local store in ``directory``."""

    name = "mlflow"

    def __init__(self, directory: Path, run_name: str, config: dict | None = None) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow's local file store: MLflow 3 refuses it without this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # (docs/export.md)
            uri = Path(directory).resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "mobius-fed")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        for k, v in _flat(config or {}):
            self.client.log_param(self.run_id, k[:250], str(v)[:6000])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id)
            self.run_id = ""


class WandbTracker(Tracker):
    """A W&B run; ``WANDB_MODE=offline`` (or no login) keeps it in ``directory``.

    W&B always writes into a ``wandb/`` folder of the root it is given, so a ``directory``
    named ``wandb`` (the default, ``<out>/wandb``) is handed over as its parent: the files
    land in ``<out>/wandb/``, not ``<out>/wandb/wandb/``."""

    name = "wandb"

    def __init__(self, directory: Path, run_name: str, config: dict | None = None) -> None:
        import wandb

        directory = Path(directory)
        root = directory.parent if directory.name == "wandb" else directory
        directory.mkdir(parents=True, exist_ok=True)
        self.run: Any = wandb.init(  # a wandb Run; None once closed
            project=os.environ.get("WANDB_PROJECT", "mobius-fed"),
            name=run_name,
            dir=str(root),
            config=config or {},
            reinit="create_new",
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


BACKENDS: dict[str, Callable[[Path, str, dict | None], Tracker]] = {
    t.name: t for t in (TensorBoardTracker, MlflowTracker, WandbTracker)
}


def _flat(d: dict, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


# ------------------------------------------------------------------ safety and following
class SafeTracker:
    """A backend whose failures never reach the run: the first is logged (once) and the
    tracker is switched off; records after that are dropped."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker: Tracker | None = tracker
        self.name = tracker.name
        self.failure: str | None = None

    def _fail(self, what: str, exc: BaseException) -> None:
        self.failure = f"{type(exc).__name__}: {exc}"
        log.error("tracker %s failed (%s): %s; the run goes on without it", self.name, what, exc)
        tracker, self.tracker = self.tracker, None
        with contextlib.suppress(Exception):  # already failing: nothing more to report
            if tracker is not None:
                tracker.close()

    def record(self, record: dict[str, Any]) -> None:
        """Log one ``metrics.jsonl`` record (nothing when it holds no step or no scalar)."""
        step, scalars = record.get("step"), scalars_of(record)
        if self.tracker is None or not isinstance(step, int) or not scalars:
            return
        try:
            self.tracker.log(step, scalars)
        except Exception as exc:  # a tracker never ends a run
            self._fail(f"step {step}", exc)

    def close(self) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.close()
        except Exception as exc:
            self._fail("close", exc)
        self.tracker = None


def tracker_kind(kind: str | None) -> str | None:
    """``kind`` checked; None for no tracker (``none``, ``off``, empty or None)."""
    kind = (kind or "").strip().lower()
    if kind in ("", "none", "off"):
        return None
    if kind not in BACKENDS:
        raise ValueError(f"unknown tracker {kind!r} (expected one of {', '.join(TRACKERS)})")
    return kind


def make_tracker(
    kind: str | None, directory: Path, run_name: str = "mobius-fed", config: dict | None = None
) -> SafeTracker | None:
    """The tracker ``kind`` names (see :func:`tracker_kind`) writing into ``directory``.

    A missing library raises :class:`TrackerUnavailable` with its install command (before
    the run starts); a tracker that cannot start (a server gone…) is logged and is None.
    """
    import importlib.util

    kind = tracker_kind(kind)
    if kind is None:
        return None
    if importlib.util.find_spec(kind) is None:
        raise TrackerUnavailable(
            f"--tracker {kind}: the {kind} library is not installed: "
            f"pip install 'mobius-fed[{kind}]'"
        )
    try:
        return SafeTracker(BACKENDS[kind](Path(directory), run_name, config))
    except Exception as exc:  # never end a run over its tracker
        log.error("tracker %s cannot start: %s; the run goes on without it", kind, exc)
        return None


class MetricsFollower:
    """Feeds every record appended to a ``metrics.jsonl`` to a tracker, from a thread
    polling the file; :meth:`close` reads what is left, then closes the tracker. A file
    rewritten shorter (a resumed run) is read again from the step it was cut back to."""

    def __init__(self, path: Path, tracker: SafeTracker, poll_s: float = 1.0) -> None:
        self.path, self.tracker, self.poll_s = Path(path), tracker, poll_s
        self.offset, self.last_step = 0, -1
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="metrics-tracker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.drain()

    def drain(self) -> None:
        """Send the complete lines written since the last call."""
        with self._lock:
            try:
                skip_below = -1  # a file rewritten by a resume: its kept rows were sent
                if self.path.stat().st_size < self.offset:
                    skip_below, self.offset = self.last_step, 0
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read()
            except OSError:  # not written yet, or gone: try again later
                return
            end = data.rfind(b"\n") + 1
            self.offset += end
            for line in data[:end].splitlines():
                self._send(line, skip_below)

    def _send(self, line: bytes, skip_below: int) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return
        if not isinstance(record, dict) or record.get("step", 0) < skip_below:
            return
        self.last_step = max(self.last_step, int(record.get("step", 0)))
        self.tracker.record(record)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.drain()
        self.tracker.close()


def start_tracking(
    kind: str | None,
    metrics_file: Path,
    *,
    run_name: str | None = None,
    config: dict | None = None,
    directory: Path | None = None,
    poll_s: float = 1.0,
) -> MetricsFollower | None:
    """Track ``metrics_file`` with the tracker ``kind`` names; None when it names none.
    The tracker's files go to ``directory`` (default: next to the metrics,
    ``tensorboard/``, ``mlruns/`` or ``wandb/``). Call ``close()`` when the run ends."""
    metrics_file = Path(metrics_file)
    kind = tracker_kind(kind)
    if kind is None:
        return None
    where = directory or metrics_file.parent / {"mlflow": "mlruns"}.get(kind, kind)
    name = run_name or metrics_file.parent.name
    tracker = make_tracker(kind, where, name, config)
    return None if tracker is None else MetricsFollower(metrics_file, tracker, poll_s)


@contextlib.contextmanager
def tracked(kind: str | None, metrics_file: Path, **options: Any) -> Iterator[None]:
    """Follow ``metrics_file`` with the tracker ``kind`` names for the ``with`` block's
    duration (nothing when it names none); the tracker is closed however the block ends."""
    follower = start_tracking(kind, metrics_file, **options)
    try:
        yield
    finally:
        if follower is not None:
            follower.close()


def add_tracker_flag(parser: Any) -> None:
    """``--tracker {tensorboard,mlflow,wandb,none}``, defaulting to ``MOBIUS_TRACKER``."""
    default = os.environ.get("MOBIUS_TRACKER") or None
    parser.add_argument(
        "--tracker",
        choices=[*TRACKERS, "none"],
        default=default,
        help="also log the metrics to TensorBoard, MLflow or W&B (an optional extra each; "
        f"default: {default or 'none'})",
    )
