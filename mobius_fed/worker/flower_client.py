"""The worker's Flower ClientApp, run in-process by the daemon for each barrier.

``train``: load the averaged E/R arrays, train the round's step range on the ring, write a
checkpoint when asked, and reply with this worker's E/R arrays and metrics.
``evaluate``: load the averaged E/R arrays and compute this origin's Eq. 8 term.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from mobius_fed.checkpoint import save_checkpoint, sha256_of
from mobius_fed.strategies import CHECKPOINT, STEP_END, STEP_START
from mobius_fed.worker.executor import RingExecutor, WorkerStep

ARRAYS, METRICS, CONFIG = "arrays", "metrics", "config"


def replica_arrays(executor: RingExecutor) -> ArrayRecord:
    return ArrayRecord({k: v.detach().clone() for k, v in executor.replica.state_dict().items()})


def load_replica(executor: RingExecutor, arrays: ArrayRecord) -> None:
    state = arrays.to_torch_state_dict()
    with torch.no_grad():
        for name, p in executor.replica.state_dict().items():
            p.copy_(state[name])


def make_client_app(
    executor: RingExecutor,
    checkpoint_dir: Path,
    on_step: Callable[[WorkerStep], None] | None = None,
    on_state: Callable[[str], None] | None = None,
) -> ClientApp:
    app = ClientApp()
    cfg = executor.cfg
    tokens_per_step = cfg.batch_size * cfg.model().seq_len

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        conf = msg.content[CONFIG]
        start, end = int(conf[STEP_START]), int(conf[STEP_END])
        if executor.step != start:
            raise RuntimeError(
                f"worker-{executor.rank} is at step {executor.step}, round asks for {start}..{end}"
            )
        load_replica(executor, msg.content[ARRAYS])
        if on_state:
            on_state("training")
        losses, seconds = [], 0.0
        for _ in range(start, end):
            r = executor.train_step()
            losses.append(r.loss)
            seconds += r.seconds
            if on_step:
                on_step(r)
        reply = RecordDict(
            {
                ARRAYS: replica_arrays(executor),
                METRICS: MetricRecord(
                    {
                        "num-examples": tokens_per_step * (end - start),
                        "loss": losses[-1],
                        "losses": losses,
                        "train-seconds": seconds,
                    }
                ),
            }
        )
        if bool(conf[CHECKPOINT]):
            rnd = int(conf["round"])
            path = save_checkpoint(checkpoint_dir / f"round-{rnd:06d}.pt", executor.state_dict())
            reply["checkpoint"] = ConfigRecord(
                {"path": str(path.resolve()), "sha256": sha256_of(path)}
            )
        if on_state:
            on_state("ready")
        return Message(reply, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        load_replica(executor, msg.content[ARRAYS])
        if on_state:
            on_state("evaluating")
        t0 = time.perf_counter()
        loss = executor.evaluate()
        if on_state:
            on_state("ready")
        metrics = MetricRecord(
            {"num-examples": 1, "eval-loss": loss, "eval-seconds": time.perf_counter() - t0}
        )
        return Message(RecordDict({METRICS: metrics}), reply_to=msg)

    return app
