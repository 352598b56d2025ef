"""The run's record: each round's and evaluation's figures into the status model, and on
disk as ``metrics.jsonl`` (one line per round) and ``history.json`` (rewritten at most every
``HISTORY_EVERY_S`` while the run goes, and at each checkpoint and its end: the whole
history each time, so rewriting it every round grew the coordinator's share of a round with
the run's length)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, cast

from flwr.app import Message

from mobius_fed.checkpoint import CheckpointError, write_bytes_atomic
from mobius_fed.coordinator.state import RunState, json_safe
from mobius_fed.messages import METRICS, TrainReport
from mobius_fed.strategies import RoundPlan
from mobius_fed.transport.flower_wire import rank_of_node

log = logging.getLogger("mobius.coordinator")
METRICS_FILE = "metrics.jsonl"
HISTORY_FILE = "history.json"
HISTORY_EVERY_S = 1.0


class RunRecorder:
    """Records train and evaluate replies; times rounds from the last record on."""

    def __init__(self, out_dir: Path, state: RunState, plan: RoundPlan) -> None:
        self.out, self.state, self.plan = Path(out_dir), state, plan
        self._pending_line: dict[str, Any] | None = None
        self._round_started = time.perf_counter()
        self._history_written = -HISTORY_EVERY_S  # monotonic seconds: the first round writes

    def restart_clock(self) -> None:
        self._round_started = time.perf_counter()

    def record_train(self, rnd: int, replies: list[Message]) -> None:
        """Round ``rnd``'s train replies: losses, figures, the round line."""
        seconds = time.perf_counter() - self._round_started
        start, end = self.plan.steps_of(rnd)
        worker_seconds = snapshot_seconds = tokens = 0.0
        figures: dict[int, dict[str, float]] = {}
        for reply in replies:
            rank = rank_of_node(reply.metadata.src_node_id)
            report = TrainReport.of(reply.content[METRICS])
            self.state.record_losses(rank, start, report.losses)
            self.state.update_worker(rank, last_loss=report.losses[-1], step=end)
            worker_seconds = max(worker_seconds, report.train_s)
            snapshot_seconds = max(snapshot_seconds, report.snapshot_s)
            tokens += report.num_examples
            figures[rank] = report.figures()
        self.state.record_round(
            rnd,
            seconds,
            worker_seconds,
            snapshot_seconds,
            workers=figures,
            steps=end - start,
            tokens=tokens,
        )
        self.state.set(round=rnd, step=end)
        self._round_line(rnd, start, end, seconds, figures)

    def record_eval(self, rnd: int, replies: list[Message]) -> None:
        per = {
            rank_of_node(r.metadata.src_node_id): float(
                cast(float, r.content.metric_records["metrics"]["eval-loss"])
            )
            for r in replies
        }
        self.state.record_eval(rnd, self.plan.steps_of(rnd)[1], per)
        log.info("round %d: validation loss (Eq. 8) %.4f", rnd, sum(per.values()) / len(per))
        self._eval_line(rnd, per)
        self.restart_clock()

    def replay(self, history: dict[str, Any]) -> None:
        """Put a checkpoint's history back into the status model."""
        for row in history.get("steps", []):
            for origin, loss in enumerate(row["origin_losses"]):
                if loss is not None:
                    self.state.record_losses(origin, row["step"], [loss])
        for ev in history.get("evals", []):
            self.state.record_eval(ev["round"], ev["step"], dict(enumerate(ev["origin_losses"])))

    # ------------------------------------------------------------ on disk
    def _round_line(
        self, rnd: int, start: int, end: int, seconds: float, figures: dict[int, dict[str, float]]
    ) -> None:
        """metrics.jsonl: one line per round; an evaluating round's waits for its Eq. 8."""
        self.flush()
        steps = self.state.step_rows(start, end)
        self._pending_line = {
            "round": rnd,
            "step": end,
            "time": time.time(),
            "seconds": seconds,
            "barrier_s": max(
                0.0, seconds - max((f.get("train_s") or 0.0) for f in figures.values())
            )
            if figures
            else None,  # the round's time outside training (status "timeline")
            "losses": [row["loss"] for row in steps],
            "origin_losses": [row["origin_losses"] for row in steps],
            "loss": steps[-1]["loss"] if steps else None,
            "workers": {str(r): f for r, f in sorted(figures.items())},
        }
        if not self.plan.evaluates(rnd):
            self.flush()

    def _eval_line(self, rnd: int, per: dict[int, float]) -> None:
        line = self._pending_line
        if line is None or line["round"] != rnd:  # an evaluation redone after a restore
            self.flush()
            line = self._pending_line = {"round": rnd, "step": self.plan.steps_of(rnd)[1]}
        line["eval_loss"] = sum(per.values()) / len(per)
        line["eval_origin_losses"] = [per[s] for s in sorted(per)]
        self.flush()

    def flush(self, history: bool = False) -> None:
        """Append the pending round line to metrics.jsonl; rewrite history.json if
        ``history`` (the run's end) or ``HISTORY_EVERY_S`` passed since."""
        line, self._pending_line = self._pending_line, None
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            if line is not None:
                with open(self.out / METRICS_FILE, "a") as f:
                    f.write(json.dumps(json_safe(line), allow_nan=False) + "\n")
        except OSError as exc:  # metrics on disk never end a run
            log.error("cannot write the run's metrics in %s: %s", self.out, exc)
        if history or time.monotonic() - self._history_written >= HISTORY_EVERY_S:
            self.write_history()

    def write_history(self) -> None:
        """Rewrite history.json (every step, and the status): at a checkpoint, so that the
        status on disk is never older than the newest manifest."""
        self._history_written = time.monotonic()
        try:
            doc = {**self.state.history_doc(), "status": self.state.status_doc()}
            write_bytes_atomic(
                self.out / HISTORY_FILE, json.dumps(json_safe(doc), allow_nan=False).encode()
            )
        except (OSError, CheckpointError) as exc:  # metrics on disk never end a run
            log.error("cannot write the run's metrics in %s: %s", self.out, exc)
