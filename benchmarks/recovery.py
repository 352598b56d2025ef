"""Recovery figures: what a crash, a freeze and a ring-edge cut cost a 4-worker run.

Each scenario is a real coordinator and P worker processes on loopback (``mobius-fed up``'s
LocalFederation, supervised like ``up``). Printed per scenario:

- detection s: fault → the coordinator's incident record (crash: SIGKILL; freeze:
  SIGSTOP, detected by the heartbeat timeout);
- resume s: the worker back (re-registered, or SIGCONT) → training resumed, i.e. the
  recovery without the worker's own process start;
- steps redone: steps trained again after the rollback;
- the run's final losses against an undisturbed run of the same config (max |Δ|).

A ring-edge cut (a TCP proxy in front of one worker drops every connection and refuses new
ones for a few seconds, shorter than the link grace) must not be an incident at all: the
link reconnects and resends. Printed: incidents and the stall it caused.

Then the steady-state cost of the barrier snapshots (an in-memory copy at every barrier plus
the background write to disk): wall seconds per step with them on and off, as a ratio from
the same run, and the in-memory copy's share of a step.

    python benchmarks/recovery.py                       # cpu-small, P = 4, ~10 min on 2 cores
    python benchmarks/recovery.py --preset cpu-tiny --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mobius_fed.config import TrainConfig
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.testbed.proxy import CuttableProxy


class ProxiedFederation(LocalFederation):
    """Worker ``via``'s ring address is a proxy: its predecessor reaches it through it."""

    proxy: CuttableProxy | None = None
    via: int = 2

    def worker_cmd(self, i: int) -> list[str]:
        cmd = super().worker_cmd(i)
        if i == self.via and self.proxy is not None:
            cmd += ["--advertise", f"127.0.0.1:{self.proxy.port}"]
        return cmd


def losses(fed: LocalFederation) -> dict:
    hist = fed.rest("/v1/history")
    return {(r["step"], s): v for r in hist["steps"] for s, v in enumerate(r["origin_losses"])}


def wait_step(fed: LocalFederation, step: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while (doc := fed.status()) is None or doc["step"] < step:
        if time.monotonic() > deadline:
            raise SystemExit(f"no progress: {fed.tail('coordinator')}")
        fed.supervise()
        time.sleep(0.05)


def scenario(
    name: str, root: Path, train: TrainConfig, args, baseline: dict | None
) -> tuple[dict, dict]:
    fed_cls = ProxiedFederation if name == "link cut" else LocalFederation
    fed = fed_cls(
        root / name.replace(" ", "-"),
        train,
        checkpoint_every=args.checkpoint_every,
        heartbeat_timeout=args.heartbeat_timeout,
        max_restarts=3,
        threads=1,
        on_event=lambda m: None,
    )
    fed.prepare()
    if name == "link cut":
        fed.proxy = CuttableProxy(fed.worker_ports[fed.via])
    env_extra = {} if name != "snapshots off" else {"MOBIUS_BARRIER_SNAPSHOTS": "false"}
    os.environ.update(env_extra)
    fed.start()
    for k in env_extra:
        del os.environ[k]
    row: dict = {"scenario": name}
    try:
        wait_step(fed, args.fault_at)
        t_fault = time.time()
        if name == "crash":
            os.kill(fed.procs["worker-2"].pid, signal.SIGKILL)
        elif name == "freeze":
            pid = fed.procs["worker-2"].pid
            os.kill(pid, signal.SIGSTOP)
            while fed.status()["workers"][2]["state"] != "lost":
                time.sleep(0.05)
            time.sleep(1.0)
            t_back = time.time()
            os.kill(pid, signal.SIGCONT)
        elif name == "link cut":
            step_before = fed.status()["step"]
            fed.proxy.cut(args.cut_seconds)  # type: ignore[union-attr]
        final = fed.wait(timeout=1800)
        got = losses(fed)
        rounds = fed.rest("/v1/history")["rounds"]
    finally:
        fed.stop()
    row["phase"] = final["phase"]
    row["seconds per step"] = sum(r["seconds"] for r in rounds) / max(1, len(rounds))
    row["snapshot share"] = sum(r.get("snapshot_s", 0.0) for r in rounds) / max(
        1e-9, sum(r.get("train_s", r["seconds"]) for r in rounds)
    )
    incidents = final["incidents"]
    row["incidents"] = len(incidents)
    if incidents and name in ("crash", "freeze"):
        inc = incidents[0]
        row["detection s"] = inc["detected_at"] - t_fault
        row["steps redone"] = inc["steps_redone"]
        if name == "crash":
            row["resume s"] = inc["rejoin_s"]
        else:
            row["resume s"] = inc["recovered_at"] - t_back
    if name == "link cut":
        row["stall s"] = args.cut_seconds
        row["steps at cut"] = step_before
    if baseline is not None:
        row["max |Δloss| vs undisturbed"] = max(abs(got[k] - baseline[k]) for k in baseline)
    return row, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fault-at", type=int, default=12, help="inject the fault after this step")
    ap.add_argument("--checkpoint-every", type=int, default=5, help="rounds between manifests")
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0)
    ap.add_argument("--cut-seconds", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    train = TrainConfig(preset=args.preset, workers=4, steps=args.steps, sync_every=1)
    root = args.out or Path(tempfile.mkdtemp(prefix="mobius-recovery-"))
    rows = []
    base_row, baseline = scenario("undisturbed", root, train, args, None)
    rows.append(base_row)
    print(json.dumps(base_row), flush=True)
    for name in ("snapshots off", "crash", "freeze", "link cut"):
        row, _ = scenario(name, root, train, args, baseline)
        rows.append(row)
        print(json.dumps(row), flush=True)
    # On and off again, interleaved: the wall-time ratio takes the faster run of each.
    on_again, _ = scenario("undisturbed", root / "again", train, args, None)
    off_again, _ = scenario("snapshots off", root / "again", train, args, None)
    on = min(rows[0]["seconds per step"], on_again["seconds per step"])
    off = min(rows[1]["seconds per step"], off_again["seconds per step"])
    print(
        f"\n{args.preset}, P = 4, {args.steps} steps, a barrier every step, heartbeat timeout "
        f"{args.heartbeat_timeout:.0f}s, manifests every {args.checkpoint_every} rounds\n"
    )
    cols = [
        "scenario",
        "phase",
        "incidents",
        "detection s",
        "resume s",
        "steps redone",
        "max |Δloss| vs undisturbed",
        "seconds per step",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "—")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")
    share = min(rows[0]["snapshot share"], on_again["snapshot share"])
    print(
        f"\nbarrier snapshots: in-memory copy + barrier file = {100 * share:.2f} % of the "
        f"workers' step time (measured inside each run); wall seconds per step on ÷ off = "
        f"{on / off:.3f} (best of two interleaved runs each; noisy on a shared machine)"
    )


if __name__ == "__main__":
    main()
