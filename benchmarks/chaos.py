"""Chaos: a coordinated run under a random fault every 15–30 s, ending with the reference
engine's losses.

A real coordinator and P worker processes on loopback (``mobius-fed up``'s LocalFederation,
supervised like ``up``: a killed process is started again, the coordinator with
``--resume auto``); every worker's ring address is a TCP proxy that can cut its incoming
edge. Faults, drawn at random:

- ``kill worker``: SIGKILL of a worker;
- ``kill coordinator``: SIGKILL of the coordinator (it resumes from its newest manifest);
- ``freeze``: SIGSTOP of a worker for 5–20 s, then SIGCONT;
- ``edge cut``: every connection of one ring edge dropped, new ones refused, for 2–10 s;
- sometimes two of them at once.

Printed at the end: the faults injected, incidents healed, steps redone, throughput
(steps per second) against an undisturbed run of the same config, and the largest
difference of any (step, origin) loss from the reference engine's (the run must equal it);
with audits on (``--audit-rate``, docs/audits.md) what they and the commitments found over
the coordinator's incarnations: every suspect in a run without a liar is a false accusation.

    python benchmarks/chaos.py                          # cpu-tiny, P = 4, 30 minutes
    python benchmarks/chaos.py --steps 60 --every 5 10  # a few minutes
    python benchmarks/chaos.py --steps 60 --every 4 8 --max-faults 4 --audit-rate 1 \
        --no-baseline --report benchmarks/results/poisoning/chaos-audits.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mobius_fed.config import AuditConfig, TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.engine.federated import train_with_strategy
from mobius_fed.engine.reference import ReferenceEngine
from mobius_fed.machines import ENDED_PHASES, IncidentState, Phase
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.strategies import RoundPlan, make_strategy
from mobius_fed.testbed.proxy import CuttableProxy

KINDS = ("kill worker", "kill coordinator", "freeze", "edge cut")


class ChaosFederation(LocalFederation):
    """Every worker's ring address is a proxy: its predecessor reaches it through it."""

    proxies: dict[int, CuttableProxy] | None = None

    def worker_cmd(self, i: int) -> list[str]:
        cmd = super().worker_cmd(i)
        if self.proxies:
            cmd += ["--advertise", f"127.0.0.1:{self.proxies[i].port}"]
        return cmd


@dataclass
class Tally:
    """What the chaos did and what the run made of it."""

    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    doubles: int = 0
    incidents: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    coordinator_redone: int = 0  # steps redone after a coordinator restart
    step_seen: int = 0
    killed_at: int | None = None  # the step a killed coordinator had reached
    frozen: set[int] = field(default_factory=set)
    epoch: int = 0  # coordinator incarnations seen (incident ids restart with each)

    audits: dict[int, dict[str, Any]] = field(default_factory=dict)  # epoch → its block
    commitments: dict[int, dict[str, Any]] = field(default_factory=dict)

    def observe(self, doc: dict[str, Any]) -> None:
        for inc in doc["incidents"]:
            self.incidents[(self.epoch, inc["id"])] = inc
        for block, seen in (("audits", self.audits), ("commitments", self.commitments)):
            if doc.get(block):  # each coordinator incarnation counts from zero
                seen[self.epoch] = doc[block]
        if doc["phase"] == Phase.WAITING:  # a restarted coordinator before its ring is back
            return
        if self.killed_at is not None:  # it resumed from its newest manifest
            self.coordinator_redone += max(0, self.killed_at - doc["step"])
            self.killed_at = None
        self.step_seen = doc["step"]

    def report(self) -> dict[str, Any]:
        incs = list(self.incidents.values())
        last = [i for (epoch, _), i in self.incidents.items() if epoch == self.epoch]
        return {
            "faults": {k: v for k, v in self.faults.items() if v},
            "two at once": self.doubles,
            "incidents": len(incs),
            "healed": sum(i["state"] == IncidentState.RECOVERED for i in incs),
            # open when their coordinator was killed: the next one restored the ring anew
            "cut short by a coordinator kill": sum(
                i["state"] == IncidentState.OPEN
                for (e, _), i in self.incidents.items()
                if e < self.epoch
            ),
            "unhealed at the end": sum(i["state"] != IncidentState.RECOVERED for i in last),
            "steps redone": sum(i["steps_redone"] or 0 for i in incs) + self.coordinator_redone,
            **self.audit_report(),
        }

    def audit_report(self) -> dict[str, Any]:
        """Audits and commitments over the coordinator's incarnations: a clean run's
        suspects and incidents are false accusations."""
        a, c = list(self.audits.values()), list(self.commitments.values())
        if not a and not c:
            return {}
        return {
            "audits asked": sum(b["asked"] for b in a),
            "audits passed": sum(b["passed"] for b in a),
            "audits skipped": sum(b.get("skipped", 0) for b in a),
            "audit incidents": [f"{i['kind']}: {i['what']}" for b in a for i in b["incidents"]],
            "audit suspects": sorted({n for b in a for n in b["suspects"]}),
            "commitment incidents": [
                f"{i['kind']}: {i['what']}" for b in c for i in b["incidents"]
            ],
        }


def make_federation(root: Path, train: TrainConfig, args, proxied: bool) -> ChaosFederation:
    fed = ChaosFederation(
        root,
        train,
        checkpoint_every=args.checkpoint_every,
        heartbeat_timeout=args.heartbeat_timeout,
        max_restarts=100_000,  # chaos kills the same process many times
        max_incidents=100_000,
        threads=1,
        on_event=lambda m: None,
    )
    fed.prepare()
    fed.proxies = {i: CuttableProxy(fed.worker_ports[i]) for i in range(train.P)} if proxied else {}
    return fed


def inject(fed: ChaosFederation, kind: str, rng: random.Random, tally: Tally, args) -> None:
    """One fault of ``kind`` (a frozen worker is thawed by a timer, an edge by the proxy)."""
    live = [i for i in range(fed.train.P) if i not in tally.frozen]
    tally.faults[kind] += 1
    if kind == "kill coordinator":
        os.kill(fed.procs["coordinator"].pid, signal.SIGKILL)
        tally.epoch += 1
        if tally.killed_at is None:
            tally.killed_at = tally.step_seen
    elif kind == "edge cut":
        assert fed.proxies, "an edge cut needs the proxied federation"
        i = rng.randrange(fed.train.P)
        seconds = rng.uniform(*args.cut)
        threading.Thread(target=fed.proxies[i].cut, args=(seconds,), daemon=True).start()
    elif kind == "kill worker" and live:
        os.kill(fed.procs[f"worker-{rng.choice(live)}"].pid, signal.SIGKILL)
    elif kind == "freeze" and live:
        i = rng.choice(live)
        pid = fed.procs[f"worker-{i}"].pid
        os.kill(pid, signal.SIGSTOP)
        tally.frozen.add(i)

        def thaw() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            tally.frozen.discard(i)

        threading.Timer(rng.uniform(*args.freeze), thaw).start()


@dataclass
class Outcome:
    final: dict[str, Any]
    tally: Tally
    seconds: float
    losses: dict[tuple[int, int], float]


def drive(fed: ChaosFederation, args, chaos: bool) -> Outcome:
    """Run to the end, injecting faults if ``chaos``."""
    rng, tally = random.Random(args.seed), Tally()
    started = time.monotonic()
    fed.start()
    next_fault = started + rng.uniform(*args.every)
    stop_at = started + 60 * args.minutes
    try:
        while (doc := fed.status(timeout=1.0)) is None or doc["phase"] not in ENDED_PHASES:
            if doc is not None:
                tally.observe(doc)
            fed.supervise()
            now = time.monotonic()
            calm = now > stop_at or sum(tally.faults.values()) >= args.max_faults
            if tally.step_seen < args.after_step:  # the chaos starts once training runs
                next_fault = max(next_fault, now + args.every[0])
            elif chaos and now >= next_fault and not calm:
                kinds = next_faults(rng, args, sum(tally.faults.values()))
                tally.doubles += len(kinds) == 2
                for kind in kinds:
                    inject(fed, kind, rng, tally, args)
                print(f"[{now - started:6.1f}s] step {tally.step_seen}: {' + '.join(kinds)}",
                      flush=True)  # fmt: skip
                next_fault = now + rng.uniform(*args.every)
            time.sleep(0.1)
        tally.observe(doc)
        return Outcome(doc, tally, time.monotonic() - started, history_losses(fed))
    finally:
        for i in list(tally.frozen):
            os.kill(fed.procs[f"worker-{i}"].pid, signal.SIGCONT)
        fed.stop()


def next_faults(rng: random.Random, args, done: int) -> list[str]:
    """The next fault(s): from ``--sequence`` in order, else drawn (two, sometimes)."""
    if args.sequence:
        return [args.sequence[done % len(args.sequence)]]
    return rng.sample(KINDS, 2) if rng.random() < args.two_at_once else [rng.choice(KINDS)]


def history_losses(fed: LocalFederation) -> dict[tuple[int, int], float]:
    hist = fed.rest("/v1/history")
    return {(r["step"], s): v for r in hist["steps"] for s, v in enumerate(r["origin_losses"])}


def reference_losses(fed: LocalFederation) -> dict[tuple[int, int], float]:
    """(step, origin) → loss of the single-process reference engine under the same Flower
    strategy: the oracle the run must equal."""
    cfg = fed.train
    sites = [SiteData(fed.sites / f"site-{i}", cfg.model().seq_len) for i in range(cfg.P)]
    grid = train_with_strategy(
        ReferenceEngine(cfg, sites), make_strategy(fed.strategy, cfg.P, RoundPlan.of(cfg), {})
    )
    return {(r.step, s): v for r in grid.steps for s, v in enumerate(r.origin_losses)}


def chaos(root: Path, train: TrainConfig, args, baseline: bool = True) -> dict[str, Any]:
    """An undisturbed run (if ``baseline``), then the chaos run; the report as one dict."""
    calm = None
    if baseline:
        calm = drive(make_federation(root / "undisturbed", train, args, proxied=True), args, False)
    fed = make_federation(root / "chaos", train, args, proxied=True)
    wild = drive(fed, args, chaos=True)
    ref, got = reference_losses(fed), wild.losses
    report = {
        "phase": wild.final["phase"],
        "error": wild.final.get("error"),
        **wild.tally.report(),
        "restarts": dict(fed.restarts),
        "steps per s": train.steps / wild.seconds,
    }
    if calm is not None and calm.final["phase"] == "done":
        report["undisturbed steps per s"] = train.steps / calm.seconds
        report["throughput vs undisturbed"] = calm.seconds / wild.seconds
    return {
        **report,
        "missing losses": len(set(ref) - set(got)),
        "max |Δloss| vs reference": max(
            (abs(got[k] - ref[k]) for k in ref if k in got), default=None
        ),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a ``--sequence`` kind that is not a fault is refused."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-tiny")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600, help="steps of the run")
    ap.add_argument("--minutes", type=float, default=30.0, help="inject faults this long at most")
    ap.add_argument("--every", type=float, nargs=2, default=(15.0, 30.0), metavar=("LO", "HI"),
                    help="seconds between faults, drawn uniformly")  # fmt: skip
    ap.add_argument("--two-at-once", type=float, default=0.2, help="chance of a double fault")
    ap.add_argument("--max-faults", type=int, default=1_000_000)
    ap.add_argument("--after-step", type=int, default=1, help="no fault before this step")
    ap.add_argument("--freeze", type=float, nargs=2, default=(5.0, 20.0), metavar=("LO", "HI"),
                    help="seconds a frozen worker stays stopped")  # fmt: skip
    ap.add_argument("--cut", type=float, nargs=2, default=(2.0, 10.0), metavar=("LO", "HI"),
                    help="seconds an edge stays cut")  # fmt: skip
    ap.add_argument("--sequence", type=lambda t: [k.strip() for k in t.split(",")],
                    help=f"faults in this order, comma-separated ({', '.join(KINDS)})")  # fmt: skip
    ap.add_argument("--checkpoint-every", type=int, default=2, help="rounds between manifests")
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    audits = "audit.rate (docs/audits.md); the report counts what the audits found"
    ap.add_argument("--audit-rate", type=float, default=AuditConfig().rate, help=audits)
    ap.add_argument("--no-baseline", action="store_true", help="skip the undisturbed run")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, help="also write the report here (JSON)")
    args = ap.parse_args(argv)
    bad = [k for k in args.sequence or () if k not in KINDS]
    if bad:
        ap.error(f"--sequence: unknown fault(s) {bad} (expected {', '.join(KINDS)})")
    return args


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        preset=args.preset,
        workers=args.workers,
        steps=args.steps,
        sync_every=1,
        batch_size=4,
        optimizer="adamw",
        eval_every=4,
        audit={"rate": args.audit_rate},
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="mobius-chaos-"))
    report = chaos(root, train_config(args), args, baseline=not args.no_baseline)
    print(json.dumps(report, indent=2))
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        argv_ = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.report.write_text(json.dumps({"config": argv_, **report}, indent=1) + "\n")
    ok = report["phase"] == "done" and not report["missing losses"]
    return 0 if ok and (report["max |Δloss| vs reference"] or 0.0) <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
