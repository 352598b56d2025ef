"""Poisoning: what one lying site with a valid certificate does to the honest origins, with
the bounds off and on (docs/security.md, "Bounds on what a site sends").

A coordinator and P workers as processes on loopback over mTLS (``mobius-fed up``'s
LocalFederation); the last worker runs ``tests/evil_worker.py`` and, from step ``--from``
on, (a) scales the gradients it sends back ×10, (b) ×1000, (c) flips their sign, (d) sends
hidden states ×1e6, (e) scales its E/R update at every barrier ×1000, (f) reports its
losses ×0.1. Per attack and setting, against a clean run of the same seed and steps:

- Δ Eq. 8: the honest origins' mean held-out loss at the last evaluation the run reached,
  minus the clean run's at the same step (and the largest |Δ| over all evaluations);
- detected: the first step at which the liar was reported suspect, counted from the
  attack's first step (by a receiving worker for refused frames; in the coordinator's
  status for clipped E/R updates), or "no";
- the run's end: done, or failed (a refused frame fails its step; a coordinated run rolls
  back and retries, so a persistent liar fails the run after ``--max-incidents``);
- evicted: the step at which the liar's rank went to a standby, or "no".

Settings (``--bounds``): ``off``; ``on`` (the defaults, no standby); ``evict`` (the
defaults with ``bounds.suspect_after = 1``, a standby site waiting and the coordinator's
``--evict-suspects``: a liar caught once loses its rank, docs/security.md "Evicting a
suspect"). Under ``evict`` the honest origins' Δ Eq. 8 includes the standby's own data
training origin 2 from the handover on.

    python benchmarks/poisoning.py                 # cpu-tiny, P = 3, 30 steps, ~15 min
    python benchmarks/poisoning.py --attacks grad-x1000,states-x1e6 --steps 20
    python benchmarks/poisoning.py --bounds evict --out benchmarks/results/poisoning/evict.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mobius_fed.config import TrainConfig  # noqa: E402
from mobius_fed.ops.federation import LocalFederation  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "poisoning"
ATTACKS: dict[str, tuple[str, dict[str, str]]] = {
    "grad-x10": ("gradients ×10", {"EVIL_GRAD": "10"}),
    "grad-x1000": ("gradients ×1000", {"EVIL_GRAD": "1000"}),
    "grad-flip": ("gradients sign-flipped", {"EVIL_GRAD": "-1"}),
    "states-x1e6": ("hidden states ×1e6", {"EVIL_SCALE": "1e6"}),
    "er-x1000": ("E/R update ×1000", {"EVIL_ER": "1000"}),
    "loss-lie": ("losses reported ×0.1", {"EVIL_LOSS": "0.1"}),
}
OFF = {"frames": False, "er_clip_factor": 0}
SUSPECT = re.compile(r"worker-(\d+) is suspect: \d+ of its frames refused \(last: .*? step (\d+)")


class EvilFederation(LocalFederation):
    """A federation whose last worker lies (``tests/evil_worker.py``, ``EVIL_*`` in its env)."""

    evil_env: dict[str, str] = {}  # noqa: RUF012 (set per instance before start)

    def worker_cmd(self, i: int) -> list[str]:
        cmd = super().worker_cmd(i)
        if i == self.train.workers - 1 and self.evil_env:
            cmd[1:3] = ["-m", "tests.evil_worker"]
        return cmd

    def start(self, workers: bool = True) -> LocalFederation:
        saved = dict(os.environ)
        os.environ.update(self.evil_env)  # the honest workers' module ignores EVIL_*
        try:
            return super().start(workers)
        finally:
            os.environ.clear()
            os.environ.update(saved)


@dataclass
class Outcome:
    attack: str
    bounds: str
    phase: str
    last_step: int
    evals: list[tuple[int, list[float]]]
    incidents: int
    suspect_step: int | None = None  # the step of the frame or barrier that made it suspect
    er_clipped: int = 0
    error: str | None = None
    delta_last: float | None = None
    delta_max: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def train_config(args: argparse.Namespace, bounds: dict[str, Any]) -> TrainConfig:
    return TrainConfig(
        preset=args.preset, workers=args.workers, batch_size=4, steps=args.steps,
        sync_every=args.sync_every, eval_every=args.eval_every, seed=args.seed, bounds=bounds,
    )  # fmt: skip


def frame_suspect(fed: LocalFederation, evil: int) -> int | None:
    """The step of the frame that made ``evil`` a suspect in some worker's log (None: none)."""
    steps = []
    for log in fed.logs.glob("worker-*.log"):
        for m in SUSPECT.finditer(log.read_text(errors="replace")):
            if int(m.group(1)) == evil:
                steps.append(int(m.group(2)))
    return min(steps) if steps else None


def er_suspect(
    status: dict[str, Any], evil: int, args: argparse.Namespace, suspect_after: int
) -> int | None:
    """The step of the barrier at which the coordinator named ``evil`` a suspect (after
    ``suspect_after`` clipped updates)."""
    b = status.get("bounds") or {}
    name = f"worker-{evil}"
    if name not in b.get("suspects", []) or not (b.get("er_clipped") or {}).get(name):
        return None
    first = -(-(args.start + 1) // args.sync_every)  # the first poisoned barrier's round
    return (first + suspect_after - 1) * args.sync_every - 1


def run(args: argparse.Namespace, root: Path, attack: str | None, bounds: str) -> Outcome:
    """One run: ``attack`` (None: clean) with the bounds ``on`` (defaults) or ``off``."""
    evict = bounds == "evict"
    cfg = train_config(args, OFF if bounds == "off" else {"suspect_after": 1} if evict else {})
    fed = EvilFederation(
        root, cfg, max_incidents=args.max_incidents, threads=1, standbys=int(evict),
        checkpoint_every=args.sync_every if evict else 0,
    )  # fmt: skip
    env = {"EVIL_FROM": str(args.start), "EVIL_ER_FROM": str(args.start)}
    fed.evil_env = {**env, **ATTACKS[attack][1]} if attack else {}
    if evict:
        fed.evil_env["MOBIUS_EVICT_SUSPECTS"] = "true"
    t0 = time.monotonic()
    fed.prepare().start()
    try:
        final = fed.wait(timeout=args.timeout)
        history = fed.rest("/v1/history")
    finally:
        fed.stop()
    evil = cfg.workers - 1
    seconds = round(time.monotonic() - t0, 1)
    out = Outcome(
        attack=attack or "clean", bounds=bounds, phase=final["phase"], last_step=final["step"],
        evals=[(e["step"], e["origin_losses"]) for e in history["evals"]],
        incidents=len(final.get("incidents") or []), error=final.get("error"),
    )  # fmt: skip
    out.extra["seconds"] = seconds
    b = final.get("bounds") or {}
    out.er_clipped = (b.get("er_clipped") or {}).get(f"worker-{evil}", 0)
    er_step = er_suspect(final, evil, args, cfg.bounds.suspect_after)
    steps = [s for s in (frame_suspect(fed, evil), er_step) if s is not None]
    out.suspect_step = min(steps) if steps else None
    handed = [h for h in final.get("handovers") or [] if h["rank"] == evil]
    if handed:  # the standby took the group from this round's end
        out.extra["evicted_step"] = fed.train.sync_every * (handed[0]["round"] or 0)
    return out


def honest_eq8(losses: list[float], evil: int) -> float:
    """Eq. 8 over the honest origins: the mean of their held-out losses."""
    honest = [v for s, v in enumerate(losses) if s != evil]
    return sum(honest) / len(honest)


def compare(out: Outcome, clean: Outcome, evil: int) -> None:
    """Fill ``out``'s Δ Eq. 8 against the clean run at the evaluations both reached."""
    ref = {step: honest_eq8(v, evil) for step, v in clean.evals}
    deltas = [(s, honest_eq8(v, evil) - ref[s]) for s, v in out.evals if s in ref]
    if deltas:
        out.delta_last = deltas[-1][1]
        out.delta_max = max(abs(d) for _, d in deltas)
        out.extra["last_eval_step"] = deltas[-1][0]


def cell(out: Outcome, args: argparse.Namespace) -> tuple[str, str, str]:
    """The table's Δ Eq. 8, detection and end columns for one run."""
    if out.delta_last is None:
        delta = "no evaluation"
    else:
        at = out.extra["last_eval_step"]
        short = "" if at == args.steps else f" (at step {at})"
        delta = f"{out.delta_last:+.3f}{short}"
    seen = "no" if out.suspect_step is None else f"step +{out.suspect_step - args.start}"
    end = "done" if out.phase == "done" else f"{out.phase} at step {out.last_step}"
    if out.incidents:
        end += f", {out.incidents} incidents"
    return delta, seen, end


def table(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    who = f"worker-{args.workers - 1}, from step {args.start}"
    rows = [
        f"| attack ({who}) | bounds | Δ Eq. 8, honest | detected (suspect) | run | evicted |",
        "|---|---|---|---|---|---|",
    ]
    for out in outcomes:
        if out.attack == "clean":
            continue
        delta, seen, end = cell(out, args)
        name = ATTACKS[out.attack][0]
        gone = out.extra.get("evicted_step")
        evicted = "no" if gone is None else f"yes (from step {gone})"
        rows.append(f"| {name} | {out.bounds} | {delta} | {seen} | {end} | {evicted} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-tiny")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sync-every", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=10)
    first = "the attack's first step (after the bounds' warmup of 8 frames)"
    ap.add_argument("--from", dest="start", type=int, default=10, help=first)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-incidents", type=int, default=3)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--bounds", default="off,on")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=RESULTS / "poisoning.json")
    ap.add_argument("--work", type=Path, help="keep the runs' directories here")
    args = ap.parse_args()
    if bad := set(args.bounds.split(",")) - {"off", "on", "evict"}:
        ap.error(f"--bounds: {', '.join(sorted(bad))} is not off, on or evict")
    os.chdir(ROOT)  # the lying worker is ``-m tests.evil_worker``
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="poisoning-") as scratch:
        tmp = args.work or scratch
        # the clean runs to compare with: P sites, and P + 1 (a standby's site splits the
        # corpus one way more, so the honest origins' data differ) for ``evict``
        cleans: dict[bool, Outcome] = {}
        outcomes = []
        for evict in dict.fromkeys(b == "evict" for b in args.bounds.split(",")):
            setting = "evict" if evict else "off"
            cleans[evict] = run(args, Path(tmp) / f"clean{'-standby' * evict}", None, setting)
            outcomes.append(cleans[evict])
        for attack in args.attacks.split(","):
            for bounds in args.bounds.split(","):
                out = run(args, Path(tmp) / f"{attack}-{bounds}", attack, bounds)
                compare(out, cleans[bounds == "evict"], args.workers - 1)
                outcomes.append(out)
                print(f"{attack} bounds {bounds}: {cell(out, args)}", file=sys.stderr, flush=True)
    text = table(outcomes, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": round(time.monotonic() - t0, 1),
        "runs": [asdict(o) for o in outcomes],
        "table": text,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} ({doc['seconds']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
