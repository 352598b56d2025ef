"""Handover to a standby (docs/recovery.md "Handover to a standby"): a worker that is lost
for good (SIGKILLed and never restarted, revoked, or replaced by the operator) is replaced
by a standby site with its own certificate and data; the run ends with the reference
engine's losses for the same handover, and the replaced identity is refused.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from rich.console import Console

from mobius_fed.cli.status import render_status
from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.cadence import CheckpointCadence
from mobius_fed.coordinator.control import ControlService
from mobius_fed.coordinator.grid import ControlGrid
from mobius_fed.coordinator.standby import StandbyPool
from mobius_fed.coordinator.state import RunState
from mobius_fed.data import SiteData
from mobius_fed.defences.er_dp import ErPrivacy
from mobius_fed.engine import ReferenceEngine
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.machines import WorkerState
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.ops.supervisor import Child
from mobius_fed.proto import control_pb2
from mobius_fed.strategies import RoundPlan, make_strategy
from mobius_fed.transport.certs import init_certs, load_layout
from mobius_fed.transport.revocation import revoke
from mobius_fed.transport.tls import (
    certificate_identity,
    identity_of_node_name,
    node_name_of,
    parse_identity,
    standby_identity,
    tls_target_name,
)
from tests.test_coordinator import BASE, max_diff, ring_history

REPO = Path(__file__).resolve().parents[1]
STANDBY_0 = standby_identity(0)


# --------------------------------------------------------------------------- identities
def test_a_standby_identity_names_no_rank(tmp_path: Path) -> None:
    assert STANDBY_0 == "mobius://standby/0"
    assert parse_identity(STANDBY_0) == ("standby", 0)
    assert node_name_of(STANDBY_0) == "standby-0"
    assert identity_of_node_name("standby-0") == STANDBY_0
    assert tls_target_name("standby-0") == "standby-0.id.mobius.invalid"
    layout = init_certs(tmp_path / "c", 2, standbys=1)
    assert "standby-0" in layout.names()
    assert certificate_identity(layout.bundle("standby-0").cert.read_bytes()) == STANDBY_0
    assert load_layout(layout.root).standbys == 1


def test_the_pool_hands_a_rank_over_and_refuses_the_replaced_identity() -> None:
    pool = StandbyPool()
    assert pool.rank_of("mobius://worker/2") == 2
    assert pool.rank_of(STANDBY_0) is None  # waiting: no rank
    assert pool.pick() is None
    pool.offer(STANDBY_0, ("gpt2", 50257))
    chosen = pool.pick("standby-0")
    assert chosen is not None and pool.pick("standby-1") is None
    assert pool.assign(2, chosen, "a test") == "mobius://worker/2"
    assert pool.rank_of(STANDBY_0) == 2 and pool.identity_of(2) == STANDBY_0
    assert pool.rank_of("mobius://worker/2") is None
    why = pool.refusal("mobius://worker/2")
    assert why is not None and "replaced by standby-0 as worker-2" in why
    assert pool.pick() is None  # it left the pool


def test_a_waiting_standby_brings_checkpoint_copies_every_few_steps() -> None:
    """While a standby waits, every 5th step's round checkpoints (each order decided once,
    so its manifest agrees); without one, only the plan's rounds; status states the bound."""
    plan = RoundPlan(steps=30, sync_every=1, eval_every=0, checkpoint_every=0)
    cadence = CheckpointCadence.of(plan, standby_rounds=5, copies=True)
    waiting = [False]
    cadence.standby_waiting = lambda: waiting[0]
    assert [r for r in range(1, 31) if cadence.order(r)] == [30]  # no standby: the end
    waiting[0] = True
    assert [r for r in range(1, 31) if cadence.order(r)] == [5, 10, 15, 20, 25, 30]
    assert cadence.order(20)
    waiting[0] = False  # the standby left (or took a rank) before round 20's manifest
    assert cadence.ordered(20) and not cadence.order(20)  # decided again only on a redo
    assert cadence.keep_checkpoints(0) == 2 and cadence.keep_checkpoints(7) == 7
    doc = cadence.status(["standby-0"])
    assert doc["redo_steps"] == 5 and doc["copy_step"] is None and doc["note"] is None
    cadence.written(10, {"0": {"copy": "worker-0.ckpt"}, "1": {"copy": "worker-1.ckpt"}})
    assert cadence.status([])["copy_step"] == 10
    cadence.written(15, {"0": {"copy": "worker-0.ckpt"}, "1": {}})  # over the copy limit
    doc = cadence.status([])
    assert doc["redo_steps"] is None and "no copy of worker-1's state" in doc["note"]
    # a plan that checkpoints at least as often: the plan's rounds alone
    tight = CheckpointCadence.of(RoundPlan(30, 1, 0, checkpoint_every=2), 5, copies=True)
    tight.standby_waiting = lambda: True
    assert [r for r in range(1, 11) if tight.order(r)] == [2, 4, 6, 8, 10]
    assert tight.status([])["redo_steps"] == 2 and tight.keep_checkpoints(0) == 0
    # rounds of 4 steps: every 2 rounds (8 steps); no copies at all: no bound
    coarse = CheckpointCadence.of(RoundPlan(32, 4, 0), 2, copies=False)
    assert coarse.status([])["checkpoint_every"] == 8
    assert coarse.status([])["redo_steps"] is None


def test_up_does_not_restart_a_replaced_site(tmp_path: Path) -> None:
    """The supervisor reads the replaced identities from status's handovers: a replaced or
    evicted site, refused for good, stays down; any other crashed worker comes back."""
    fed = LocalFederation(tmp_path, TrainConfig(**BASE, steps=4), max_restarts=5, standbys=1)
    fed._last = {"phase": "training", "handovers": [
        {"rank": 2, "replaced": "mobius://worker/2", "standby": STANDBY_0, "why": "evicted"}
    ]}  # fmt: skip
    said: list[str] = []
    fed.on_event = said.append
    assert fed._policy(Child("worker-2", [], returncode=2)) is None
    assert said == ["worker-2 exited with 2; not restarting: standby-0 holds its rank now"]
    assert fed._policy(Child("worker-1", [], returncode=-9)) == 0.0  # a crash: back at once


def _service(P: int = 3) -> ControlService:
    state = RunState(run_id="t", P=P, steps=4, strategy="fedavg")
    return ControlService(
        state,
        ControlGrid(P),
        fingerprint="f",
        run_spec=lambda rank: control_pb2.RunSpec(rank=rank),
    )


class Aborted(Exception):
    pass


class FakeContext:
    """Enough of a gRPC servicer context for the identity checks: a peer identity."""

    def __init__(self, identity: str) -> None:
        self._auth = {
            "transport_security_type": [b"ssl"],
            "ssl_tls_version": [b"TLSv1.3"],
            "peer_uri": [identity.encode()],
        }
        self.code: grpc.StatusCode | None = None

    def auth_context(self) -> dict:
        return self._auth

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def abort(self, code: grpc.StatusCode, msg: str) -> None:
        self.code = code
        raise Aborted(msg)


def _register(svc: ControlService, identity: str, **kw) -> control_pb2.RunSpec:
    request = control_pb2.RegisterRequest(listen_address="127.0.0.1:7001", **kw)
    return svc.Register(request, FakeContext(identity))


def test_bad_standby_input_is_refused_with_the_reason() -> None:
    svc = _service()
    _register(svc, "mobius://worker/0", data_tokenizer="gpt2", data_vocab=50257)
    # a standby certificate that claims a worker rank
    with pytest.raises(Aborted, match="names worker-1: a standby's certificate names a standby"):
        _register(svc, "mobius://worker/1", standby=True)
    # a standby whose data has another tokenizer
    with pytest.raises(Aborted, match="data mismatch: standby-0's site uses tokenizer byte"):
        _register(svc, STANDBY_0, standby=True, data_tokenizer="byte", data_vocab=256)
    spec = _register(svc, STANDBY_0, standby=True, data_tokenizer="gpt2", data_vocab=50257)
    assert spec.standby and spec.run_id == "t"
    # replace: a live worker without --force, an unknown standby, not a worker's name
    with pytest.raises(ValueError, match=r"worker-0 is alive .* pass --force"):
        svc.handovers.replace("worker-0", "standby-0", force=False)
    with pytest.raises(ValueError, match=r"standby-1 is not registered .* waiting: standby-0"):
        svc.handovers.replace("worker-1", "standby-1", force=False)
    with pytest.raises(ValueError, match="not a worker's name"):
        svc.handovers.replace("standby-0", "standby-0", force=False)
    with pytest.raises(ValueError, match="not a worker of this run"):
        svc.handovers.replace("worker-7", "standby-0", force=False)


def test_a_handed_over_rank_is_the_standbys_and_the_old_identity_is_refused() -> None:
    svc = _service()
    _register(svc, "mobius://worker/2")
    _register(svc, STANDBY_0, standby=True)
    svc.state.move_worker(2, WorkerState.LOST)
    done = svc.handovers.replace("worker-2", "standby-0", force=False)
    assert done == "worker-2 handed over to standby-0"
    spec = _register(svc, STANDBY_0, standby=True)  # the standby's next poll: its rank
    assert not spec.standby and spec.rank == 2
    assert svc.state.workers[2].identity == STANDBY_0
    assert svc.handovers.identities() == ["mobius://worker/0", "mobius://worker/1", STANDBY_0]
    with pytest.raises(Aborted, match=r"worker-2 .* was replaced by standby-0 .* refused from now"):
        _register(svc, "mobius://worker/2")
    (h,) = svc.state.status_doc()["handovers"]
    assert h["rank"] == 2 and h["standby"] == STANDBY_0 and h["replaced"] == "mobius://worker/2"
    svc.pool.offer(STANDBY_0, ("", 0))  # a poll that raced with its handover: not back
    assert svc.pool.pick() is None
    console = Console(record=True, width=200)
    render_status(svc.state.status_doc(), console)
    text = console.export_text()
    assert "handovers" in text and "mobius://standby/0" in text


def test_a_resumed_coordinator_keeps_the_handovers_it_recorded() -> None:
    """The handovers reach the coordinator's record at each change; a service restored from
    that record (a coordinator restarted with --resume) answers the standby's registration
    with the rank and refuses the replaced identity before anything else happens."""
    svc, saved = _service(), []
    svc.state.handover_sink = saved.append
    _register(svc, "mobius://worker/2")
    _register(svc, STANDBY_0, standby=True)
    svc.state.move_worker(2, WorkerState.LOST)
    svc.handovers.replace("worker-2", "standby-0", force=False)
    assert [h.round for h in saved[-1]] == [None]
    svc.state.handed_over(4, evaluates=False)
    (h,) = saved[-1]
    assert h.round == 4 and h.standby == STANDBY_0

    resumed = _service()
    resumed.handovers.restore(saved[-1])
    with pytest.raises(Aborted, match=r"worker-2 .* was replaced by standby-0 .* refused from now"):
        _register(resumed, "mobius://worker/2")
    spec = _register(resumed, STANDBY_0, standby=True)  # the standby process, rejoining
    assert not spec.standby and spec.rank == 2
    assert resumed.handovers.identities()[2] == STANDBY_0
    resumed.state.restore_handovers(saved[-1], 6)  # resumed at or after the handover's round
    assert resumed.state.handovers[0].round == 4
    resumed.state.restore_handovers(saved[-1], 2)  # from before it: the standby takes round 2
    assert resumed.state.handovers[0].round is None
    resumed.state.handed_over(2, evaluates=False)
    assert resumed.state.handovers[0].round == 2


def test_the_handovers_record_round_trips_and_a_broken_one_is_named(tmp_path: Path) -> None:
    from mobius_fed.coordinator.config import CoordinatorConfig
    from mobius_fed.coordinator.rounds import HANDOVERS_FILE, RoundStore
    from mobius_fed.coordinator.status_model import HandoverModel

    train = TrainConfig(**{**BASE, "workers": 3})
    cfg = CoordinatorConfig(ca="a", cert="b", key="c", out_dir=tmp_path, train=train)
    store = RoundStore(cfg, RoundPlan.of(train), RunState(run_id="t", P=3, steps=4, strategy="x"))
    h = HandoverModel(rank=2, replaced="mobius://worker/2", standby=STANDBY_0, why="w", at=1.0)
    store.save_handovers([h])
    assert store.saved_handovers() == []  # a fresh run (no manifest): nothing to resume
    store.manifests = [tmp_path / "round-000002" / "manifest.json"]  # as if resuming
    assert store.saved_handovers() == [h]
    (tmp_path / HANDOVERS_FILE).write_text('[{"rank": 2}]')
    with pytest.raises(ValueError, match=f"cannot read the run's handovers from {tmp_path}"):
        store.saved_handovers()


def test_a_standby_process_with_a_worker_certificate_refuses_to_start(tmp_path: Path) -> None:
    from mobius_fed.transport.tls import SecretsError
    from mobius_fed.worker.config import WorkerConfig
    from mobius_fed.worker.coordinated import WorkerNode

    layout = init_certs(tmp_path / "c", 2, standbys=1)

    def node(name: str) -> WorkerConfig:
        tls = layout.bundle(name)
        return WorkerConfig(
            coordinator="127.0.0.1:9",
            standby=True,
            data_dir=tmp_path,
            out_dir=tmp_path / "out",
            ca=tls.ca,
            cert=tls.cert,
            key=tls.key,
        )

    with pytest.raises(SecretsError, match="--standby needs a standby certificate"):
        WorkerNode(node("worker-1"))
    WorkerNode(node("standby-0")).channel.close()  # its own: accepted


# --------------------------------------------------------------------------- real runs
def federation(tmp_path: Path, steps: int = 14, **kw) -> LocalFederation:
    train = TrainConfig(**BASE, steps=steps, sync_every=1)
    opts = dict(checkpoint_every=2, heartbeat_timeout=3.0, threads=1, standbys=1)
    return LocalFederation(tmp_path, train, **{**opts, **kw})


def wait_for_step(fed: LocalFederation, step: int, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while (doc := fed.status()) is None or doc["step"] < step:
        assert time.monotonic() < deadline, fed.tail("coordinator")
        time.sleep(0.1)
    return doc


def handover_reference(
    fed: LocalFederation, rank: int, rnd: int, evaluated_round: bool = False
) -> tuple[dict, list]:
    """The reference engine under Flower with origin ``rank``'s data switched to
    standby-0's site from round ``rnd`` on (and for that round's evaluation when the
    standby made it)."""
    cfg = fed.train
    seq = cfg.model().seq_len
    sites = [SiteData(fed.sites / f"site-{i}", seq) for i in range(cfg.P)]
    engine = ReferenceEngine(cfg, sites)
    plan = RoundPlan.of(cfg)
    standby = SiteData(fed.sites / f"site-{cfg.P}", seq)
    engine.hand_over(rank, standby, plan.steps_of(rnd)[1], evaluated_round)
    grid = train_with_strategy(
        engine, make_strategy("fedavg", cfg.P, plan, {}, er_privacy=ErPrivacy.of(cfg))
    )
    losses = {(r.step, s): v for r in grid.steps for s, v in enumerate(r.origin_losses)}
    return losses, [(e.step, e.loss) for e in grid.evals]


def finish_with_standby(fed: LocalFederation, why: str, every: int = 2) -> dict:
    """Wait for the end; the run is done, standby-0 holds rank 2 (from a checkpoint round,
    a multiple of ``every``) and the losses (train and eval) are the reference engine's for
    that handover."""
    try:
        final = fed.wait(timeout=300)
        got, evals = ring_history(fed)
    finally:
        fed.stop()
    assert final["phase"] == "done", (final.get("error"), fed.tail("coordinator", 40))
    (h,) = final["handovers"]
    assert h["rank"] == 2 and h["standby"] == STANDBY_0 and h["replaced"] == "mobius://worker/2"
    assert why in h["why"] and h["round"] is not None and h["round"] % every == 0, h
    assert final["workers"][2]["identity"] == STANDBY_0
    ref, ref_evals = handover_reference(fed, 2, h["round"], h["evaluated_round"])
    assert max_diff(got, ref) <= 1e-5, "the ring must equal the reference's handover"
    plain, _ = handover_reference(fed, 2, fed.train.steps)  # no handover within the run
    assert max_diff(got, plain) > 1e-3, "origin 2 must have trained on the standby's data"
    assert [s for s, _ in evals] == [s for s, _ in ref_evals]
    assert max(abs(a - b) for (_, a), (_, b) in zip(evals, ref_evals)) <= 1e-5, (
        h,
        evals,
        ref_evals,
    )
    coordinator = (fed.logs / "coordinator.log").read_text()
    assert "handover: worker-2 goes to standby-0" in coordinator
    assert "the coordinator's copy" in (fed.logs / "standby-0.log").read_text()
    for i in (1, 3):  # the neighbours accept it because the coordinator assigned it
        text = (fed.logs / f"worker-{i}.log").read_text()
        assert f"accepts {STANDBY_0} as its" in text and "the coordinator assigned" in text
    return final


@pytest.mark.long  # the restart test below does the same handover, then more: -m long
def test_a_killed_worker_that_never_returns_is_replaced_by_a_standby(tmp_path: Path) -> None:
    fed = federation(tmp_path, rejoin_timeout=3.0).prepare().start()
    wait_for_step(fed, 5)
    os.kill(fed.procs["worker-2"].pid, signal.SIGKILL)  # never restarted (no supervision)
    final = finish_with_standby(fed, "did not rejoin within 3s")
    assert [i["rank"] for i in final["incidents"]] == [2]
    assert final["incidents"][0]["state"] == "recovered"


@pytest.mark.long  # the same handover as the killed and replaced runs, by a CRL: -m long
def test_a_revoked_worker_is_replaced_by_a_standby(tmp_path: Path) -> None:
    # rejoin timeout: 300 s, not waited for; long enough that the run still trains when
    # the revocation list reaches the coordinator (its poll: 1 s, warm workers are fast)
    fed = federation(tmp_path, steps=40).prepare().start()
    wait_for_step(fed, 5)
    revoke(fed.certs, ["worker-2"])
    finish_with_standby(fed, "its certificate was revoked")
    assert "certificate is revoked" in (fed.logs / "coordinator.log").read_text()


@pytest.mark.slow
def test_a_handover_outlives_a_coordinator_restart(tmp_path: Path) -> None:
    """worker-2 is killed and handed to standby-0; later the coordinator is killed and comes
    back with --resume auto: standby-0 still holds rank 2, the returning worker-2 process is
    refused, and the losses are the reference engine's for the one handover."""
    fed = federation(tmp_path, rejoin_timeout=3.0, max_restarts=1).prepare().start()
    wait_for_step(fed, 4)
    os.kill(fed.procs["worker-2"].pid, signal.SIGKILL)  # restarted only once the run resumed
    deadline = time.monotonic() + 180
    while (taken := _handover_round(doc := fed.status())) is None or doc["step"] < taken + 3:
        assert time.monotonic() < deadline, fed.tail("coordinator")  # a round is a step here
        time.sleep(0.1)
    os.kill(fed.procs["coordinator"].pid, signal.SIGKILL)  # after a checkpoint with standby-0
    finish_with_standby(fed, "did not rejoin within 3s")
    assert fed.restarts.get("coordinator") == 1 and fed.restarts.get("worker-2") == 1
    coordinator = (fed.logs / "coordinator.log").read_text()
    assert "resuming from" in coordinator
    assert "resumed handover: worker-2 is held by standby-0" in coordinator
    refused = (fed.logs / "worker-2.log").read_text()
    assert "replaced by standby-0 as worker-2" in refused, refused[-2000:]


def _handover_round(doc: dict | None) -> int | None:
    """The round the first handover took (None: none yet, or not yet taken)."""
    handovers = (doc or {}).get("handovers") or [{}]
    return handovers[0].get("round")


def wait_for_copy(fed: LocalFederation, timeout: float = 180) -> dict:
    """Status once a checkpoint holds every worker's copy and the ring trained 2 steps on."""
    deadline = time.monotonic() + timeout
    while True:
        doc = fed.status() or {}
        copied = (doc.get("standby") or {}).get("copy_step")
        if copied is not None and doc["step"] >= copied + 2:
            return doc
        assert time.monotonic() < deadline, fed.tail("coordinator")
        time.sleep(0.1)


@pytest.mark.slow(reason="a standby takes a live worker's rank mid-run; the run goes to its end")
def test_mobius_fed_replace_hands_a_live_worker_over_only_with_force(tmp_path: Path, cli) -> None:
    """As ``mobius-fed up --standbys 1`` runs it (checkpoints only at the end, supervised):
    with the standby waiting, copies come every 5 steps (status says so), so the forced
    replace redoes at most 5 steps; the refused worker-2 is not restarted, and the incident
    names worker-2, not the standby."""
    # 60 steps: still training after two replace commands (run in this process, `cli`: a
    # cold interpreter each took long enough on a loaded machine for the run to end first)
    fed = federation(tmp_path, steps=60, checkpoint_every=0, max_restarts=5).prepare().start()
    doc = wait_for_copy(fed)
    standby = doc["standby"]
    assert standby["waiting"] == ["standby-0"] and standby["redo_steps"] == 5, standby
    console = Console(record=True, width=200)
    render_status(doc, console)  # mobius-fed status says it too
    assert "standby-0 waiting; a handover redoes at most 5 steps" in console.export_text()
    where = ("--coordinator", f"127.0.0.1:{fed.coord_port}", "--certs", str(fed.certs))
    refused = cli("replace", "worker-2", "--with", "standby-0", *where)
    assert refused.returncode != 0 and "worker-2 is alive" in refused.stderr, refused
    assert "--force" in refused.stderr
    done = cli("replace", "worker-2", "--with", "standby-0", "--force", *where)
    assert done.returncode == 0, done.stderr
    assert "worker-2 handed over to standby-0" in done.stdout
    old = fed.procs["worker-2"]
    final = finish_with_standby(fed, "mobius-fed replace --force", every=5)
    (incident,) = final["incidents"]
    assert incident["site"] == "worker-2" and "(mobius://worker/2) lost" in incident["what"]
    assert incident["rollback_round"] == final["handovers"][0]["round"] > 0, incident
    assert incident["steps_redone"] <= standby["redo_steps"], (incident, standby)
    assert old.poll() not in (None, 0), "the replaced process is refused and ends"
    assert "worker-2" not in fed.restarts, fed.restarts  # refused for good: not restarted
    assert "replaced by standby-0 as worker-2" in (fed.logs / "worker-2.log").read_text()
