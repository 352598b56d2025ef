"""Bounds on what a site sends (docs/security.md, "Bounds on what a site sends"): the
per-token RMS of received hidden states and gradients against their sender's running
median and a ceiling, non-finite tensors refused and counted per sender, a sender reported
suspect past a threshold, and each site's E/R update clipped at the barrier. On a clean
run none of it fires: the losses are those of a run without bounds, bit for bit."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from mobius_fed.config import BoundsConfig, TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.messages import ARRAYS
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.strategies import ErClip, RoundPlan, UpdateClip, make_strategy, wrapper_of
from mobius_fed.transport.codec import FrameError, NonFiniteError, encode_frames
from mobius_fed.transport.flower_wire import COORDINATOR_NODE_ID, set_task_identity, worker_node_id
from mobius_fed.warmstart import spawn
from mobius_fed.worker.frames import BACKWARD, FORWARD, TRAIN, BoundError, FrameKey, FrameRules
from mobius_fed.worker.link_session import FrameRouter, Inbox
from tests.ring_harness import WORKER, Ring

RUN = "bounds"
CFG = TrainConfig(preset="cpu-tiny", workers=4, batch_size=4)
# worker-1 of a cyclic ring of 4: FORWARD (origin, slot) frames it takes straight from
# worker-0, BACKWARD ones from worker-2
FROM_PRED = [(0, 1), (2, 3), (3, 2), (1, 4)]
FROM_SUCC = [(0, 2), (1, 1), (3, 3), (2, 4)]


def _rules(wire: str = "fp32", **bounds: Any) -> FrameRules:
    cfg = CFG.model_copy(update={"bounds": BoundsConfig(**bounds), "wire_dtype": wire})
    return FrameRules(cfg, 1, RUN, lambda: 0)


def _state(scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(
        CFG.batch_size, CFG.model().seq_len, CFG.model().d_model, generator=g
    )


def test_the_settings_are_on_by_default_and_leave_old_fingerprints_alone() -> None:
    b = TrainConfig().bounds
    assert b.frames and b.er_clip_factor > 0 and b.state_factor > 1 and b.grad_factor > 1
    doc = TrainConfig(preset="cpu-tiny").model_dump(mode="json")
    del doc["bounds"]  # a manifest written before the bounds existed
    assert (
        TrainConfig.model_validate(doc).fingerprint()
        == TrainConfig(preset="cpu-tiny").fingerprint()
    )
    tighter = TrainConfig(preset="cpu-tiny", bounds={"state_factor": 20})
    assert tighter.fingerprint() != TrainConfig(preset="cpu-tiny").fingerprint()


def test_a_steady_sender_passes_and_a_scaled_state_is_refused_naming_sender_and_figure() -> None:
    rules = _rules(warmup=4, suspect_after=2)
    for i in range(16):  # a clean stream: states of the same size, seeds apart
        o, t = FROM_PRED[i % 4]
        rules.check_tensor(FrameKey(TRAIN, 0, FORWARD, o, t, 0), _state(seed=i), FORWARD)
    assert rules.bounds.refused == {}
    # ×1000 is far below the ceiling (1e4) but 1000 × the running median of worker-0's
    key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
    with pytest.raises(BoundError, match=r"hidden state from worker-0 \(TRAIN FORWARD step 0 "
                       r"origin 0 slot 1 micro 0\) has a per-token RMS of [0-9.e+]+, above its "
                       r"bound [0-9.e+]+ \(100 × its running median"):  # fmt: skip
        rules.check_tensor(key, _state(1e3, seed=99), FORWARD)
    assert rules.bounds.refused == {0: 1} and rules.bounds.suspects == []
    # a refused frame does not move the median: the same frame is refused again
    with pytest.raises(BoundError):
        rules.check_tensor(key, _state(1e3, seed=99), FORWARD)
    assert rules.bounds.suspects == [0]
    assert rules.bounds.report() == {"refused_frames": {"worker-0": 2}, "suspects": ["worker-0"]}
    # a gradient has its own median: the first ones are bounded by the ceiling alone
    o, t = FROM_SUCC[0]
    rules.check_tensor(FrameKey(TRAIN, 0, BACKWARD, o, t, 0), _state(1e-3), BACKWARD)
    with pytest.raises(BoundError, match=r"gradient from worker-2 .* above its bound 1e\+04 "
                       r"\(the ceiling 1e\+04\)"):  # fmt: skip
        rules.check_tensor(FrameKey(TRAIN, 0, BACKWARD, o, t, 0), _state(2e4), BACKWARD)
    assert rules.bounds.refused == {0: 2, 2: 1}


def test_bounds_off_accept_any_finite_size() -> None:
    rules = _rules(frames=False)
    for i in range(10):
        rules.check_tensor(
            FrameKey(TRAIN, 0, FORWARD, 0, 1, 0), _state(1e6 if i == 9 else 1), FORWARD
        )
    assert rules.bounds.refused == {}


def _router(rules: FrameRules) -> tuple[FrameRouter, Any]:
    inbox = Inbox(rules.current_step, frozenset({0, 2, 3}))
    router = FrameRouter(rules, inbox, lambda d: None, None, 8)  # type: ignore[arg-type,return-value]
    return router, router.new_session("worker-0", FORWARD)


def _frames(origin: int, slot: int, tensor: torch.Tensor, wire: str = "fp32", step: int = 0):
    return list(
        encode_frames(
            run_id=RUN, step=step, origin=origin, tick=slot, micro=0, direction=FORWARD,
            tensor=tensor, wire=wire, chunk_bytes=1 << 14,
        )
    )  # fmt: skip


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_a_received_frame_x1e6_or_non_finite_is_refused_and_counted_per_sender(wire: str) -> None:
    """At the frame-validation layer, as the link's receiving thread calls it: a state
    ×1e6 (above the ceiling, so even a sender's first frames) and one with a NaN or an Inf
    are refused before they reach the inbox, each counted against the worker that
    computed it."""
    rules = _rules(wire, suspect_after=4)
    router, s = _router(rules)
    for data in _frames(0, 1, _state(), wire):  # a clean frame, delivered
        router.accept(data, FORWARD, s)
    assert router.inbox.get(FrameKey(TRAIN, 0, FORWARD, 0, 1, 0), 1, "test").shape == _state().shape
    refusal = r"hidden state from worker-0 \(TRAIN FORWARD step 0 origin 2 slot 3 micro 0\) "
    with pytest.raises(BoundError, match=refusal + r"has a per-token RMS of 1\.\d+e\+06"):
        for data in _frames(2, 3, _state(1e6), wire):  # stream 2 after worker-0's group
            router.accept(data, FORWARD, s)
    for bad in (float("nan"), float("inf")):
        t = _state()
        t[1, 5, 3] = bad
        _, s = _router(rules)
        with pytest.raises(NonFiniteError, match=r"non-finite .* computed by worker-0"):
            for data in _frames(0, 1, t, wire, step=1):
                router.accept(data, FORWARD, s)
    assert rules.bounds.refused == {0: 3}
    assert rules.bounds.suspects == []
    t = _state()
    t[0, 0, 0] = float("nan")
    _, s = _router(rules)
    with pytest.raises(FrameError):
        for data in _frames(0, 1, t, wire, step=1):
            router.accept(data, FORWARD, s)
    assert rules.bounds.suspects == [0]
    assert "worker-0" in rules.bounds.last[0]
    assert all(k.step != 1 for k in router.inbox._items)  # nothing refused was delivered


def test_the_ids_channel_of_mode_tokens_is_left_out() -> None:
    cfg = TrainConfig(
        preset="cpu-tiny", workers=4, batch_size=4, subspace={"rank": 8, "mode": "tokens"}
    )
    rules = FrameRules(cfg, 1, RUN, lambda: 0)
    t = torch.randn(4, cfg.model().seq_len, 9)
    t[..., -1] = 60000.0  # token ids as numbers: no hidden state is this large
    rules.check_tensor(FrameKey(TRAIN, 0, FORWARD, 0, 1, 0), t, FORWARD)
    assert rules.bounds.refused == {}


# --------------------------------------------------------------- E/R at the barrier
P = 4


class _Grid:
    def get_node_ids(self) -> Iterable[int]:
        return [worker_node_id(r) for r in range(P)]


def _round(strategy: Any, updates: list[np.ndarray], start: np.ndarray) -> np.ndarray:
    """One barrier: the strategy sends ``start``, site r replies start + updates[r]."""
    set_task_identity(COORDINATOR_NODE_ID)
    orders = list(
        strategy.configure_train(1, ArrayRecord({"wte.weight": torch.from_numpy(start)}),
                                 ConfigRecord(), _Grid())
    )  # fmt: skip
    for m in orders:
        m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    orders.sort(key=lambda m: m.metadata.dst_node_id)
    replies = []
    for msg, u in zip(orders, updates, strict=True):
        set_task_identity(msg.metadata.dst_node_id)
        arrays = ArrayRecord({"wte.weight": torch.from_numpy(start + u)})
        content = RecordDict({ARRAYS: arrays, "metrics": MetricRecord({"num-examples": 1})})
        replies.append(Message(content, reply_to=msg))
    set_task_identity(COORDINATOR_NODE_ID)
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays.to_torch_state_dict()["wte.weight"].numpy()


def _updates(poison: float) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    start = rng.standard_normal((16, 8)).astype(np.float32)
    updates = [(1e-2 * rng.standard_normal((16, 8))).astype(np.float32) for _ in range(P)]
    updates[3] = updates[3] * np.float32(poison)  # worker-3 scales its update
    return start, updates


def _strategy(name: str, bounds: dict | None) -> Any:
    cfg = TrainConfig(preset="cpu-tiny", workers=P, steps=2, sync_every=1, bounds=bounds or {})
    clip = UpdateClip.of(cfg) if bounds is not None else None
    return make_strategy(name, P, RoundPlan.of(cfg), update_clip=clip)


def test_clean_updates_are_averaged_bit_for_bit_with_the_clip_on() -> None:
    start, updates = _updates(1.0)
    on, off = _strategy("fedavg", {}), _strategy("fedavg", None)
    assert np.array_equal(_round(on, updates, start), _round(off, updates, start))
    assert wrapper_of(on, ErClip).clipped == {}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "bounds"),
    [
        ("fedavg", {}),  # the default clip: 10 × the round's lower median
        ("fedavg", {"er_clip_factor": 0, "er_clip_max": 0.5}),  # an absolute one
        ("fedmedian", None),  # Flower's robust aggregators, no clip
        ("fedtrimmedavg", None),
    ],
)
def test_a_poisoned_er_update_moves_the_average_unless_bounded(name: str, bounds: Any) -> None:
    """A site that scales its E/R update ×1000 drags plain FedAvg's average ~250× an honest
    update away; the clip (or a robust strategy) keeps it within a few honest updates."""
    start, clean = _updates(1.0)
    _, poisoned = _updates(1000.0)
    honest = float(np.linalg.norm(_round(_strategy("fedavg", None), clean, start) - start))
    plain = float(np.linalg.norm(_round(_strategy("fedavg", None), poisoned, start) - start))
    assert plain > 100 * honest  # bounds off: the attack works
    strategy = _strategy(name, bounds)
    kwargs = {"beta": 0.25} if name == "fedtrimmedavg" else {}
    if kwargs:
        cfg = TrainConfig(preset="cpu-tiny", workers=P, steps=2, sync_every=1)
        strategy = make_strategy(name, P, RoundPlan.of(cfg), kwargs)
    bounded = float(np.linalg.norm(_round(strategy, poisoned, start) - start))
    one = max(float(np.linalg.norm(u)) for u in clean)  # the largest honest update
    assert bounded < 4 * one, (name, bounded, one)  # at most 10/P of it comes from worker-3
    clip = wrapper_of(strategy, ErClip)
    if clip is not None:
        assert clip.clipped == {3: 1} and "worker-3's E/R update norm" in clip.last[3]


def test_the_update_clip_is_off_under_secure_aggregation_and_when_zeroed() -> None:
    cfg = TrainConfig(preset="cpu-tiny", bounds={"er_clip_factor": 0})
    assert UpdateClip.of(cfg) is None
    assert UpdateClip(10.0).bound([3.0, 1.0, 100.0, 2.0]) == 20.0  # lower median: 2
    assert UpdateClip(10.0, 5.0).bound([1.0, 1.0]) == 5.0


def test_metrics_lines_name_refused_senders(tmp_path: Path) -> None:
    rules = _rules()
    with pytest.raises(BoundError):
        rules.check_tensor(FrameKey(TRAIN, 0, FORWARD, 0, 1, 0), _state(1e6), FORWARD)
    line = json.dumps({"step": 0, **rules.bounds.report()})
    assert json.loads(line)["refused_frames"] == {"worker-0": 1}


# ------------------------------------------------------------------ clean runs, real rings
def test_the_reference_engine_under_the_update_clip_equals_it_without(tmp_path: Path) -> None:
    """With Flower's FedAvg at every barrier, the default E/R clip on and off give the same
    losses bit for bit: on a clean run it never fires."""
    cfg = TrainConfig(
        preset="cpu-tiny", workers=3, batch_size=4, steps=8, sync_every=2, eval_every=4
    )
    prepare_sites(None, tmp_path, cfg.P, text=embedded_corpus())
    runs = []
    for clip in (UpdateClip.of(cfg), None):
        sites = [SiteData(tmp_path / f"site-{i}", cfg.model().seq_len) for i in range(3)]
        strategy = make_strategy("fedavg", 3, RoundPlan.of(cfg), update_clip=clip)
        grid = train_with_strategy(ReferenceEngine(cfg, sites), strategy)
        runs.append([r.origin_losses for r in grid.steps] + [[e.loss] for e in grid.evals])
        if clip is not None:
            assert wrapper_of(strategy, ErClip).clipped == {}  # type: ignore[union-attr]
    assert runs[0] == runs[1]


RING = dict(preset="cpu-tiny", steps=12, batch_size=4, sync_every=0, eval_every=0)
OFF = ["--no-bounds-frames", "--bounds-er-clip-factor", "0"]


@pytest.mark.slow
def test_a_clean_ring_with_every_bound_on_equals_the_ring_without_and_the_reference(
    tmp_path: Path,
) -> None:
    """(Real workers, mTLS gRPC.) The bounds never fire on a clean run: the ring with
    them on (the defaults) and with them off report the same losses, bit for bit, and
    both equal the reference engine's; no metrics line names a refused sender."""
    P, train = 4, {**RING, "optimizer": "adamw", "steps": 24}  # medians from step 8 on
    on = Ring(tmp_path / "on", P, train).prepare().start()
    on.wait()
    off = Ring(tmp_path / "off", P, train).prepare()
    off.start(extra={i: OFF for i in range(P)})
    off.wait()
    ref, _ = on.reference()
    assert on.losses() == off.losses() == ref
    for i in range(P):
        text = (on.out(i) / "metrics.jsonl").read_text()
        assert "refused_frames" not in text and "suspect" not in on.log(i, None)


def _evil_ring(
    root: Path, bounds_on: bool, lie: dict[str, str] | None = None, flags: list[str] | None = None
) -> Any:
    """A static ring of 3 whose worker-0 runs tests/evil_worker.py with ``lie`` (default:
    hidden states ×1e6 from step 3); every worker gets ``flags``. A refusal ends the
    refusing worker; the others give up on it after their peer timeout or link grace
    (30 s and 5 s here; the peer timeout also covers a loaded machine's start-up)."""
    quick = ["--peer-timeout", "30", "--link-grace", "5"]
    P, flags = 3, [*quick, *(flags or []), *([] if bounds_on else OFF)]
    ring = Ring(root, P, {**RING, "optimizer": "adamw", "steps": 8}).prepare()
    evil = ring.worker_cmd(0, flags)
    evil[: len(WORKER)] = [WORKER[0], "-m", "tests.evil_worker"]
    ring.start(extra=dict.fromkeys(range(1, P), flags), only=(1, 2))
    lie = lie or {"EVIL_SCALE": "1e6", "EVIL_FROM": "3"}
    env = {**os.environ, "OMP_NUM_THREADS": "1", **lie}
    log = root / "worker-0.log"
    log.write_bytes(b"")
    ring.procs.insert(0, spawn(evil, log, env))
    codes = {}
    try:
        for i, p in enumerate(ring.procs):
            codes[i] = p.wait(timeout=180)
    finally:
        ring.stop()
    return ring, codes


@pytest.mark.slow(reason="two rings of 3, bounds on then off; the refuser waits out its peers")
def test_a_site_sending_hidden_states_x1e6_over_grpc_is_refused_by_its_successor(
    tmp_path: Path,
) -> None:
    """(Real workers, mTLS gRPC.) worker-0 holds a valid certificate and, from step 3
    on, scales every hidden state it sends by 1e6. With the bounds on, worker-1 refuses the
    first such frame, naming worker-0 and the figure, and the run stops there (a ring run
    fails rather than train on it); with them off the frames pass and the losses leave the
    clean run's."""
    ring, codes = _evil_ring(tmp_path / "on", bounds_on=True)
    victim = ring.log(1, None)
    assert "hidden state from worker-0 (TRAIN FORWARD step 3" in victim, victim[-3000:]
    assert "per-token RMS of" in victim and "above its bound" in victim
    assert codes[1] != 0
    losses = ring.losses()
    assert max(step for step, _ in losses) < 3  # nothing trained on the lie
    ref, _ = ring.reference()
    assert all(losses[k] == ref[k] for k in losses)

    ring, codes = _evil_ring(tmp_path / "off", bounds_on=False)
    assert "per-token RMS" not in ring.log(1, None)
    losses = ring.losses()
    ref, _ = ring.reference()
    assert any(losses.get(k) != ref[k] for k in ref if k[0] >= 3)  # the lie went through


@pytest.mark.slow(reason="two rings of 3, bounds on then off; the refuser waits out its peers")
def test_a_site_returning_gradients_x1000_is_refused_by_its_predecessor(tmp_path: Path) -> None:
    """(Real workers, mTLS gRPC.) worker-0 scales every gradient it sends back by 1000 from
    step 3 on, once its predecessor holds a running median of its gradients (a warmup of 2
    frames here; 8 by default). With the bounds on, worker-2 refuses the first such
    gradient, naming worker-0, against the median (a ×1000 gradient is far below the
    ceiling); with them off the gradients pass and the losses leave the clean run's."""
    lie, flags = {"EVIL_GRAD": "1000", "EVIL_FROM": "3"}, ["--bounds-warmup", "2"]
    ring, codes = _evil_ring(tmp_path / "on", True, lie, flags)
    victim = ring.log(2, None)
    assert "gradient from worker-0 (TRAIN BACKWARD step 3" in victim, victim[-3000:]
    assert "× its running median" in victim  # the median's bound, not the ceiling
    assert codes[2] != 0
    losses = ring.losses()
    assert max(step for step, _ in losses) < 3  # nothing trained on the lie
    ref, _ = ring.reference()
    assert all(losses[k] == ref[k] for k in losses)

    ring, codes = _evil_ring(tmp_path / "off", False, lie, flags)
    assert "tensor rejected" not in ring.log(2, None)
    losses = ring.losses()
    ref, _ = ring.reference()
    assert any(losses.get(k) != ref[k] for k in ref if k[0] >= 3)  # the lie went through


def test_clipped_sites_reach_the_coordinator_status_and_become_suspects() -> None:
    from mobius_fed.coordinator.state import RunState
    from mobius_fed.coordinator.status_model import StatusModel

    strategy = _strategy("fedavg", {})
    start, poisoned = _updates(1000.0)
    state = RunState(run_id="r", P=P, steps=4, strategy="fedavg", num_rounds=4)
    assert state.status_doc()["bounds"] is None
    for n in range(1, 4):
        _round(strategy, poisoned, start)
        clip = wrapper_of(strategy, ErClip)
        assert clip is not None and list(clip.round_clipped) == [3]
        for rank, why in clip.round_clipped.items():  # as the coordinator's after_train does
            state.record_clip(rank, why, suspect_after=3)
        doc = state.status_doc()["bounds"]
        assert doc["er_clipped"] == {"worker-3": n}
        assert doc["suspects"] == (["worker-3"] if n == 3 else [])
    assert "worker-3's E/R update norm" in doc["last"]["worker-3"]
    StatusModel.model_validate(state.status_doc())  # the status schema holds it


def test_a_sender_of_all_zero_tensors_is_bounded_by_the_ceiling_alone() -> None:
    rules = _rules(warmup=2)
    key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
    for _ in range(4):
        rules.check_tensor(key, torch.zeros_like(_state()), FORWARD)
    rules.check_tensor(key, _state(), FORWARD)  # a median of 0 does not refuse everything
    with pytest.raises(BoundError, match=r"RMS of inf, above its bound 1e\+04"):
        rules.check_tensor(key, torch.full_like(_state(), 3e38), FORWARD)  # overflows: inf


class _EvilFederation(LocalFederation):
    """A federation whose last worker runs tests/evil_worker.py (``EVIL_ER`` in its env)."""

    def worker_cmd(self, i: int) -> list[str]:
        cmd = super().worker_cmd(i)
        if i == self.train.workers - 1:
            cmd[1:3] = ["-m", "tests.evil_worker"]
        return cmd


def _clean_reference(fed: LocalFederation) -> list[list[float]]:
    cfg = fed.train.model_copy(update={"bounds": BoundsConfig(er_clip_factor=0)})
    sites = [SiteData(fed.sites / f"site-{i}", cfg.model().seq_len) for i in range(cfg.P)]
    grid = train_with_strategy(
        ReferenceEngine(cfg, sites), make_strategy("fedavg", cfg.P, RoundPlan.of(cfg))
    )
    return [e.origin_losses for e in grid.evals]


@pytest.mark.slow(reason="three rings of 3 with a liar at every barrier: clip on, tight, off")
def test_a_poisoned_er_update_is_clipped_by_the_coordinator_and_its_site_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Coordinator and workers as processes, mTLS.) worker-2 scales its E/R update ×1000
    at every barrier. With the bounds off it drags the averaged E/R, and the honest
    origins' validation losses leave the clean run's; with them on, the coordinator clips
    it every round and names worker-2 a suspect in its status; the default clip (×10 the
    round's lower median) only bounds the damage, a tight one (×1.5) keeps the honest
    origins close to the clean run."""
    monkeypatch.setenv("EVIL_ER", "1000")
    dev, status = {}, {}
    runs = (("on", {}), ("tight", {"er_clip_factor": 1.5}), ("off", {"er_clip_factor": 0}))
    for name, bounds in runs:
        train = TrainConfig(
            workers=3, preset="cpu-tiny", batch_size=4, optimizer="adamw", steps=4,
            sync_every=1, eval_every=2, bounds=bounds,
        )  # fmt: skip
        fed = _EvilFederation(tmp_path / name, train)
        fed.prepare().start()
        try:
            final = fed.wait(timeout=300)
            assert final["phase"] == "done", (final, fed.tail("coordinator"))
            status[name] = fed.rest("/v1/status")
            evals = [e["origin_losses"] for e in fed.rest("/v1/history")["evals"]]
        finally:
            fed.stop()
        clean = _clean_reference(fed)
        dev[name] = max(abs(a[s] - b[s]) for a, b in zip(evals, clean) for s in (0, 1))
    assert status["off"]["bounds"] is None
    for name in ("on", "tight"):
        b = status[name]["bounds"]
        assert b["er_clipped"] == {"worker-2": 4} and b["suspects"] == ["worker-2"]
        assert "worker-2's E/R update norm" in b["last"]["worker-2"]
    assert dev["off"] > 0.5, dev  # the lie moved the honest origins
    # the default clip (10 × the lower median) bounds the lie but lets up to 10/P honest
    # updates' worth through each round; a tight one (1.5) keeps the honest origins close
    assert dev["tight"] < dev["on"] < dev["off"], dev
    assert dev["tight"] < dev["off"] / 3, dev


def _run_to_the_end(fed: LocalFederation) -> dict[str, Any]:
    """Start ``fed``, wait for its end, stop it; the final status, which must be done."""
    fed.prepare().start()
    try:
        final = fed.wait(timeout=300)
    finally:
        fed.stop()
    assert final["phase"] == "done", (final.get("error"), fed.tail("coordinator", 40))
    return final


@pytest.mark.slow
def test_evict_suspects_hands_the_poisoners_rank_to_a_standby(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Processes, mTLS.) With ``--evict-suspects`` and a standby waiting, worker-2, whose
    ×1000 E/R updates are clipped at every barrier, is evicted once it is a suspect (3
    clips): standby-0 takes rank 2 from the newest checkpoint copy, the run finishes, and
    nothing is clipped after that (without eviction every one of the 10 rounds is)."""
    monkeypatch.setenv("EVIL_ER", "1000")
    monkeypatch.setenv("MOBIUS_EVICT_SUSPECTS", "true")
    train = TrainConfig(
        workers=3, preset="cpu-tiny", batch_size=4, optimizer="adamw", steps=10,
        sync_every=1, eval_every=0,
    )  # fmt: skip
    final = _run_to_the_end(
        _EvilFederation(tmp_path, train, checkpoint_every=2, threads=1, standbys=1)
    )
    (h,) = final["handovers"]
    assert h["rank"] == 2 and h["replaced"] == "mobius://worker/2", h
    assert "evicted as a suspect" in h["why"] and h["standby"].startswith("mobius://standby/")
    assert final["workers"][2]["identity"] == h["standby"]
    assert final["bounds"]["er_clipped"] == {"worker-2": 3}, final["bounds"]
    evicted = [i for i in final["incidents"] if "evicted as a suspect" in i["what"]]
    named = [(i["site"], i["what"].split(" lost:")[0]) for i in evicted]
    assert named == [("worker-2", "worker-2 (mobius://worker/2)")], named  # not the standby


@pytest.mark.slow
def test_evict_suspects_hands_a_sender_of_refused_frames_to_a_standby(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Processes, mTLS.) worker-2 scales every hidden state it sends by 1e6 from step 3;
    worker-0 refuses each such frame, its error reply names the sender, and the coordinator
    counts the refusal against worker-2. At its suspect threshold (1 here: a liar that
    replays its lie after a rollback is refused again only after the receiver's peer
    timeout) worker-2 is a suspect in status and, with ``--evict-suspects``, standby-0
    takes its rank and the run finishes (without eviction it fails after --max-incidents:
    docs/security.md)."""
    monkeypatch.setenv("EVIL_SCALE", "1e6")
    monkeypatch.setenv("MOBIUS_EVICT_SUSPECTS", "true")
    train = TrainConfig(
        workers=3, preset="cpu-tiny", batch_size=4, optimizer="adamw", steps=6,
        sync_every=1, eval_every=0, bounds=BoundsConfig(suspect_after=1),
    )  # fmt: skip
    final = _run_to_the_end(
        _EvilFederation(
            tmp_path, train, checkpoint_every=1, threads=1, standbys=1, heartbeat_timeout=3.0
        )
    )
    b = final["bounds"]
    assert b["frames_refused"] == {"worker-2": 1} and b["suspects"] == ["worker-2"], b
    assert "rejected from mobius://worker/2" in b["last"]["worker-2"], b
    (h,) = final["handovers"]
    assert h["rank"] == 2 and "frames refused" in h["why"], h
    assert final["workers"][2]["identity"] == h["standby"]


def test_suspects_and_handovers_reach_the_metrics_per_site() -> None:
    """Counted per site, not per rank: after a handover the standby starts clean and the
    replaced site keeps its record, in status and in the Prometheus metrics."""
    from mobius_fed.coordinator.state import RunState

    state = RunState(run_id="r", P=3, steps=4, strategy="fedavg", num_rounds=4)
    for _ in range(3):
        state.record_refusal(2, "tensor rejected from mobius://worker/2 …", suspect_after=3)
    state.record_handover(2, "mobius://worker/2", "mobius://standby/0", "evicted")
    state.update_worker(2, identity="mobius://standby/0")
    assert not state.record_refusal(2, "tensor rejected …", suspect_after=3)  # standby's 1st
    b = state.status_doc()["bounds"]
    assert b["frames_refused"] == {"standby-0": 1, "worker-2": 3}
    assert b["suspects"] == ["worker-2"]
    text = state.prometheus()
    assert 'mobius_site_suspect{run_id="r",site="worker-2"} 1.0' in text
    assert 'mobius_site_suspect{run_id="r",site="standby-0"} 0.0' in text
    assert 'mobius_site_frames_refused{run_id="r",site="standby-0"} 1.0' in text
    assert 'mobius_site_er_clipped{run_id="r",site="worker-0"} 0.0' in text
    assert 'mobius_handovers_total{run_id="r"} 1.0' in text


def test_a_refusal_names_its_sender_and_counts_against_it() -> None:
    """The coordinator reads the sender from a worker's refusal (only a reply that opens
    with it: a time-out quoting the last refusal is not counted twice)."""
    from mobius_fed.coordinator.grid import refused_sender
    from mobius_fed.coordinator.state import RunState

    why = "tensor rejected from mobius://worker/2 on edge worker-2 → worker-0: hidden state"
    assert refused_sender(why) == 2
    assert refused_sender("frame rejected from mobius://worker/11 on edge x: y") == 11
    assert refused_sender(f"timed out after 120s waiting …; last refused frame: {why}") is None
    assert refused_sender("worker-2 → worker-0 down") is None
    state = RunState(run_id="r", P=3, steps=4, strategy="fedavg", num_rounds=4)
    assert [state.record_refusal(2, why, suspect_after=2) for _ in range(3)] == [
        False, True, False,
    ]  # fmt: skip
    doc = state.status_doc()["bounds"]
    assert doc["frames_refused"] == {"worker-2": 3} and doc["suspects"] == ["worker-2"]
    assert doc["er_clipped"] == {} and doc["last"]["worker-2"] == why
