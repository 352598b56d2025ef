"""The widened poisoning table's pieces, in one process (benchmarks/poisoning.py,
benchmarks/chaos.py, tests/evil_worker.py): which frames the liar lies on and how, what
named it and when, and who else was accused. The attacks on real processes over mTLS are
tests/test_audits_ring.py's."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import torch

from mobius_fed.worker.executor import RingExecutor
from mobius_fed.worker.frames import BACKWARD, FORWARD, FrameKey

ROOT = Path(__file__).resolve().parents[1]
_send = RingExecutor._send
from tests import evil_worker  # noqa: E402  (imported without EVIL_*: it patches nothing)


def _bench(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(
        f"{name}_bench", ROOT / "benchmarks" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


poisoning, chaos = _bench("poisoning"), _bench("chaos")


def _key(step: int, direction: int = FORWARD, origin: int = 0, slot: int = 1) -> FrameKey:
    return FrameKey(0, step, direction, origin, slot, 0)


def test_an_honest_import_patches_nothing() -> None:
    assert RingExecutor._send is _send


def test_the_liar_scales_flips_and_noises_only_from_its_first_step() -> None:
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    flip = {FORWARD: -1.0, BACKWARD: 1.0}
    assert evil_worker.lie(_key(2), x, flip, start=3) is x  # before the attack
    assert torch.equal(evil_worker.lie(_key(3), x, flip, start=3), -x)
    assert torch.equal(evil_worker.lie(_key(3, BACKWARD), x, flip, start=3), x)
    noisy = evil_worker.lie(_key(5), x, {}, noise=1.0, start=0)
    rms = (noisy - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()
    assert 0.9 < float(rms) < 1.1, rms  # noise at 1× the tensor's RMS
    assert torch.equal(noisy, evil_worker.lie(_key(5), x, {}, noise=1.0, start=0))  # replayed
    assert not torch.equal(noisy, evil_worker.lie(_key(6), x, {}, noise=1.0, start=0))


def test_a_lie_on_ten_percent_of_frames_picks_about_a_tenth_the_same_way_each_time() -> None:
    keys = [_key(s, d, o, t) for s in range(100) for d in (FORWARD, BACKWARD) for o in range(3)
            for t in range(4)]  # fmt: skip
    picked = [k for k in keys if evil_worker.chosen(k, 0.1, 0)]
    assert 0.08 < len(picked) / len(keys) < 0.12, len(picked)
    assert picked == [k for k in keys if evil_worker.chosen(k, 0.1, 0)]
    assert all(evil_worker.chosen(k, 1.0, 0) for k in keys)


def _status(step: int = 30) -> dict[str, Any]:
    return {
        "step": step,
        "bounds": {"suspects": []},
        "audits": {
            "suspects": ["worker-2"],
            "incidents": [
                {
                    "kind": "audit failed",
                    "site": "worker-2",
                    "round": 6,
                    "step": 10,
                    "detected_at": 105.0,
                },
            ],
        },
        "commitments": {
            "incidents": [  # the liar as a hop's receiver is not named by this check
                {
                    "kind": "digest mismatch",
                    "edge": "worker-1 → worker-2",
                    "step": 4,
                    "detected_at": 101.0,
                },
            ],
        },
    }


def test_the_verdict_is_the_step_at_the_first_poll_after_it_and_names_its_mechanism() -> None:
    polls = [(100.0, 8), (104.0, 14), (106.0, 18), (108.0, 22)]
    (audit,) = poisoning.detections(_status(), polls, evil=2)
    assert audit == {"by": "audit", "kind": "audit failed", "lie_step": 10, "verdict_step": 18}
    found = poisoning.detections(_status(), polls, evil=2, frame_step=12)
    assert [(d["by"], d["verdict_step"]) for d in found] == [("bounds", 12), ("audit", 18)]
    late = poisoning.detections(_status(), polls[:2], evil=2)  # after the last poll: the end
    assert late[0]["verdict_step"] == 30


def test_suspects_other_than_the_liar_are_false_accusations() -> None:
    doc = _status()
    assert poisoning.accused(doc, evil=2) == []
    assert poisoning.accused(doc, evil=None) == ["worker-2"]  # a clean run: anyone is false
    doc["bounds"]["suspects"] = ["standby-0"]
    assert poisoning.accused(doc, evil=2) == ["standby-0"]


def test_the_widened_row_counts_over_seeds() -> None:
    args = argparse.Namespace(steps=30, workers=3)
    runs = []
    for seed, verdict in ((0, 18), (1, None)):
        out = poisoning.Outcome("grad-flip", "audit", "done", 30, [], 1, seed=seed, start=10)
        if verdict is not None:
            out.detections = [{"by": "audit", "kind": "audit failed", "lie_step": 10,
                               "verdict_step": verdict}]  # fmt: skip
            out.extra["evicted_step"] = verdict + 2
        out.delta_last, out.extra["last_eval_step"] = 0.01 * (seed + 1), 30
        runs.append(out)
    row = poisoning.widened_row(runs, args)
    assert row["detected_by"] == {"audit": 1}
    assert row["verdict_after"] == [8, None] and row["evicted_step"] == [20, None]
    assert row["delta"] == [0.01, 0.02]
    text, _ = poisoning.widened_table(runs, args)
    assert "| gradients sign-flipped | 10 | audit 1/2 | 10, no | +8, no | 20, no |" in text


def test_chaos_sums_what_the_audits_found_over_coordinator_incarnations() -> None:
    tally = chaos.Tally()
    block = {"asked": 4, "passed": 4, "skipped": 0, "incidents": [], "suspects": []}
    tally.observe({"incidents": [], "phase": "running", "step": 3, "audits": block})
    tally.epoch = 1  # a killed coordinator's successor counts from zero
    refused = {"kind": "audit refused", "what": "worker-1 did not upload round 3"}
    again = {**block, "asked": 2, "passed": 1, "incidents": [refused], "suspects": ["worker-1"]}
    tally.observe({"incidents": [], "phase": "running", "step": 5, "audits": again})
    r = tally.audit_report()
    assert (r["audits asked"], r["audits passed"]) == (6, 5)
    assert r["audit suspects"] == ["worker-1"] and len(r["audit incidents"]) == 1


def test_a_suspect_named_after_the_last_step_is_not_evicted() -> None:
    """An audit's verdict can come after the run's last step (the auditor replays beside
    training): handing the rank over then left the run recovering, never done."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.coordinator.server import Coordinator

    c = object.__new__(Coordinator)
    c.cfg = SimpleNamespace(evict_suspects=True)  # type: ignore[assignment]
    c.train = TrainConfig(preset="cpu-tiny", workers=3, steps=30)
    c.service = MagicMock()
    c.state = SimpleNamespace(step=29)  # type: ignore[assignment]
    c._evict_suspect(2, reason="audit failed")  # a step is left: handed over
    assert c.service.handovers.hand_over.call_count == 1
    c.state.step = 30
    c._evict_suspect(2, reason="audit failed")
    assert c.service.handovers.hand_over.call_count == 1
