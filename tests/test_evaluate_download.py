"""The synced model travels down once per barrier: a train message right after an evaluate
leaves out the array records that evaluate brought (the E/R and, R > 1, the synced F_i),
and the site takes them from its evaluate. The reference engine takes them the same way, so
a DiLoCo run (the race's shape: P = 1, R sites, int4 pseudo-gradients) trains to the same
losses bit for bit as when every train message carried them again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine.federated import EngineGrid, train_with_strategy
from mobius_fed.engine.rings import make_engine
from mobius_fed.messages import ARRAYS, CONFIG, FROM_EVALUATE, GROUP, EvaluatedRecords
from mobius_fed.strategies import EvaluateSent, RingPlan, RoundPlan, make_strategy
from mobius_fed.transport.flower_wire import (
    COORDINATOR_NODE_ID,
    message_to_bytes,
    set_task_identity,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
logging.getLogger("flwr").setLevel(logging.WARNING)
DILOCO = dict(
    preset="cpu-tiny",
    batch_size=4,
    optimizer="adamw",
    steps=6,
    eval_every=2,
    workers=2,
    rings=2,
    sync_every=2,
    ring_sync_every=2,
    ring_outer="diloco",
    ring_codec="int4",
)


def run(cfg: TrainConfig, dirs: list[Path], sent: list | None = None):
    """Origin losses per step and per evaluation under DiLoCo; each message the grid is
    sent (type, round, its array records' keys, its order's ``from-evaluate``, its
    serialised bytes) appended to ``sent``."""
    engine = make_engine(cfg, [SiteData(d, cfg.model().seq_len) for d in dirs[: cfg.workers]])
    strategy = make_strategy("diloco", cfg.workers, RoundPlan.of(cfg), rings=RingPlan.of(cfg))
    if sent is not None:
        answer = EngineGrid.send_and_receive

        def spy(self, messages, *, timeout=None):
            messages = list(messages)
            for m in messages:
                conf = m.content.config_records[CONFIG]
                sent.append((m.metadata.message_type, conf.get("round"),
                             sorted(m.content.array_records), conf.get(FROM_EVALUATE),
                             len(message_to_bytes(m))))  # fmt: skip
            return answer(self, messages, timeout=timeout)

        EngineGrid.send_and_receive = spy  # type: ignore[method-assign]
    try:
        grid = train_with_strategy(engine, strategy)
    finally:
        if sent is not None:
            EngineGrid.send_and_receive = answer  # type: ignore[method-assign]
    return [r.origin_losses for r in grid.steps], [e.origin_losses for e in grid.evals]


def test_a_train_message_after_an_evaluate_carries_no_model(site_dirs: list[Path]) -> None:
    """Rounds 2 and 3 follow an evaluate: their train messages carry neither the E/R nor
    the synced F_i (named in ``from-evaluate`` instead) and are a small fraction of the
    bytes of round 1's, which carried the E/R and the global F_i its pseudo-gradient is
    taken against."""
    sent: list = []
    run(TrainConfig(**DILOCO), site_dirs, sent)
    train = [s for s in sent if s[0] == "train"]
    assert [s[1] for s in train] == [1, 1, 2, 2, 3, 3]
    assert all(s[2] == [ARRAYS, "group-base"] and s[3] is None for s in train[:2])
    assert all(s[2] == [] and s[3] == f"{ARRAYS},{GROUP}" for s in train[2:])
    assert max(s[4] for s in train[2:]) * 20 < min(s[4] for s in train[:2])
    evaluate = [s for s in sent if s[0] == "evaluate"]
    assert [s[1] for s in evaluate] == [1, 1, 2, 2, 3, 3]
    assert all(s[2] == [ARRAYS, GROUP] for s in evaluate)


def test_diloco_from_its_evaluate_equals_carrying_the_model_twice(
    site_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same DiLoCo run with every train message carrying the model again (the old
    path): every step's and every evaluation's loss is equal, bit for bit."""
    cfg = TrainConfig(**DILOCO)
    new = run(cfg, site_dirs)
    monkeypatch.setattr(EvaluateSent, "leave_out", lambda self, rnd, messages: messages)
    old = run(cfg, site_dirs)
    assert new == old and len(new[1]) == 3


def _message(kind: str, content: dict) -> Message:
    set_task_identity(COORDINATOR_NODE_ID)
    return Message(RecordDict(content), dst_node_id=1, message_type=kind)


def test_a_site_without_that_evaluate_refuses_the_train_message() -> None:
    """A site asked to take records from an evaluate it does not hold (another round's,
    or none after a restore) raises, naming both rounds, instead of training on stale
    weights; with the right round the records come back into the message."""
    kept = EvaluatedRecords()
    er = ArrayRecord()
    kept.keep(_message("evaluate", {ARRAYS: er, CONFIG: ConfigRecord({"round": 4})}))
    order = {"round": 5, FROM_EVALUATE: ARRAYS}
    msg = kept.restore(_message("train", {CONFIG: ConfigRecord(order)}))
    assert msg.content.array_records[ARRAYS] is er
    with pytest.raises(RuntimeError, match="round 6's train message leaves out arrays"):
        kept.restore(_message("train", {CONFIG: ConfigRecord({**order, "round": 6})}))
    kept.forget()
    with pytest.raises(RuntimeError, match="kept round None's"):
        kept.restore(_message("train", {CONFIG: ConfigRecord(order)}))
    plain = _message("train", {ARRAYS: er, CONFIG: ConfigRecord({"round": 9})})
    assert kept.restore(plain) is plain  # a message that leaves nothing out is untouched
